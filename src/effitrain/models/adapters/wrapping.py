"""The model with LoRA adapters: which modules get them (refused with the names there are when unknown), the
rank checked, peft's get_peft_model; and what an adapted model is (peft's PeftModel, inside any wrapper)."""

from __future__ import annotations

import contextlib

from effitrain.config import ALL_LINEAR, lora_target_names
from effitrain.errors import UserError
from effitrain.models.adapters.four_bit_base import keep_4bit_layout
from effitrain.models.adapters.model_parts import head_modules, in_head, linear_modules, shape, tied
from effitrain.models.adapters.trained_tokens import keep_chunked_loss, token_rows


def targets(model, requested: str, head: list[str]) -> list[str]:
    """The full names of the modules that get adapters: every linear module of the body (`all-linear`,
    as peft and QLoRA define it: not the head, not the output embeddings), or those whose name (or
    last part of it) is in the comma list, the output embeddings (a causal LM's lm_head) included when
    they are not tied to the input embeddings. An unknown name is refused with the names there are."""
    linear = linear_modules(model)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    allowed = [name for name in linear if not in_head(name, head)]
    if requested.strip().lower() == ALL_LINEAR:
        return [name for name in allowed if linear[name] is not output]
    chosen, leaves = [], sorted({name.rsplit(".", 1)[-1] for name in allowed})
    for wanted in lora_target_names(requested):
        found = [name for name in allowed if name == wanted or name.endswith(f".{wanted}")]
        if any(linear[name] is output for name in found) and tied(model, output):
            raise UserError(f"--lora-target-modules: `{wanted}` shares its weight with the input embeddings "
                            "(tie_word_embeddings), so its adapter could not be merged into model/",
                            "leave it out, or train a model with untied embeddings")
        if not found:
            named_in_head = any(name == wanted or name.endswith(f".{wanted}") for name in linear)
            raise UserError(f"--lora-target-modules: `{wanted}` is "
                            + ("the task's head, which is trained in full" if named_in_head else
                               f"not a linear module of {type(model).__name__}"),
                            f"pass some of {', '.join(leaves)} (or all-linear)")
        chosen += [name for name in found if name not in chosen]
    return chosen


def peft_task_type(task) -> str | None:
    """peft's task type where it has one (its model classes know these tasks' heads and generation)."""
    return {"sequence-classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM"}.get(task.name)


def apply(model, task, config):
    """The model with LoRA adapters on its target modules, the head trained in full, everything else
    frozen: a peft PeftModel."""
    from peft import LoraConfig, get_peft_model

    head = head_modules(model) if task.has_labels else []
    keep_4bit_layout(model)
    names = targets(model, config.lora_target_modules, head)
    check_rank(model, names, config.lora_r)
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=names, modules_to_save=head or None, task_type=peft_task_type(task),
                      trainable_token_indices=token_rows(model, names))
    adapted = get_peft_model(model, lora)
    keep_chunked_loss(adapted)
    return adapted


def check_rank(model, names: list[str], rank: int) -> None:
    """A rank above a target's smaller side is refused: its update B @ A would be no lower-rank than the
    matrix itself, with more numbers to train (peft builds it without a word)."""
    modules = dict(model.named_modules())
    name, (inputs, outputs) = min(((name, shape(modules[name])) for name in names), key=lambda item: min(item[1]))
    if rank > min(inputs, outputs):
        raise UserError(f"--lora-r {rank} is above the smaller side of `{name}` ({inputs} inputs x {outputs} "
                        "outputs): its adapter would be no lower-rank than the layer itself",
                        f"pass --lora-r {min(inputs, outputs)} or less (LoRA's ranks are usually 4 to 64)")


def is_adapted(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def switched_off(model):
    """peft's disable_adapter context of the PeftModel inside whatever wraps it (DDP, FSDP): inside, the
    model computes as its base did before training (preference tuning's reference, with no second copy)."""
    inner = model
    while not is_adapted(inner) and hasattr(inner, "module"):
        inner = inner.module
    if not is_adapted(inner):
        raise ValueError("the model has no adapters to switch off")
    return inner.disable_adapter()


def as_its_base(model):
    """The model (unwrapped) computing as its base did before training: its adapters switched off where it
    has any, else as it is."""
    return switched_off(model) if is_adapted(model) else contextlib.nullcontext()


def counts(model) -> dict[str, int]:
    """Trainable and total parameters (4-bit weights counted as the values they hold, as peft does)."""
    if is_adapted(model):
        trainable, total = model.get_nb_trainable_parameters()
        return {"trainable": trainable, "total": total}
    from effitrain.models import loading

    every = loading.parameter_counts(model)
    return {"trainable": every["trainable"], "total": every["total"]}
