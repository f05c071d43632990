"""The parts of a model that adapters are placed by: the task's head (trained in full), the linear layers
an adapter can wrap, an output layer tied to the input embeddings."""

from __future__ import annotations


def head_modules(model) -> list[str]:
    """The task's head: the top-level modules with weights outside the pretrained body
    (`base_model_prefix`): BERT's `classifier`, GPT-2's `score`, wav2vec2's `projector` and `classifier`."""
    body = getattr(model, "base_model_prefix", "")
    return [name for name, child in model.named_children()
            if name != body and any(True for _ in child.parameters())]


def linear_modules(model) -> dict[str, object]:
    """Every module a LoRA adapter can wrap (nn.Linear, bitsandbytes' 4-bit Linear, GPT-2's Conv1D)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return {name: module for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))}


def in_head(name: str, head: list[str]) -> bool:
    return any(name == top or name.startswith(f"{top}.") for top in head)


def tied(model, output) -> bool:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return embeddings is not None and getattr(output, "weight", None) is getattr(embeddings, "weight", False)


def module_name(model, module) -> str:
    return next(name for name, found in model.named_modules() if found is module)


def shape(module) -> tuple[int, int]:
    """(inputs, outputs) of a module an adapter wraps: nn.Linear's and bitsandbytes' (whose 4-bit weight
    is packed) from their attributes, GPT-2's Conv1D (weight: inputs x outputs) from its weight."""
    if hasattr(module, "in_features"):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)
