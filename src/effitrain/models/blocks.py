"""A model's transformer blocks: the units FSDP shards (engine/sharding.py) and --compile compiles
(models/transforms.compile_blocks)."""

from __future__ import annotations

import torch


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the repeated layers (members of a ModuleList) of a class the model names
    in `_no_split_modules` (what transformers keeps whole across devices, and accelerate wraps for FSDP),
    or, for models that name none (DistilBERT, wav2vec 2.0), the members of every ModuleList of two or
    more layers of one class. Other modules (BERT's embeddings) stay with the root: an embedding may be
    tied to the head."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    names = set(getattr(inner, "_no_split_modules", None) or [])
    lists = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList)]
    found = [layer for layers in lists for layer in layers if type(layer).__name__ in names]
    if not found:
        found = [layer for layers in lists if len(layers) > 1 and len({type(layer) for layer in layers}) == 1
                 for layer in layers]
    # A block inside another block would be sharded twice: keep the outermost ones.
    inside = {id(sub) for block in found for sub in block.modules() if sub is not block}
    return [block for block in found if id(block) not in inside]
