"""A student made from its teacher, DistilBERT's way (--student-layers N): the teacher's architecture with N of
its transformer layers, taken at evenly spaced depths, everything else (embeddings, final norm, pooler, head)
kept as loaded. The layers are the teacher's own modules, moved into a shorter list, not copies: the teacher's
other layers are freed, and the student starts from exactly the teacher's tensors.

A step of the model pipeline (models/transforms.py, its first entry); the planner and `inspect` build from
`student_config`, whose model has the student's shapes."""

from __future__ import annotations

import copy

import torch

from effitrain.errors import UserError
from effitrain.models import loading
from effitrain.models.blocks import blocks

FLAG = "--student-layers"


def kept_layers(teacher_layers: int, student_layers: int) -> list[int]:
    """The teacher layers the student keeps: layer i is the teacher's round(i * L / N), halves rounded up, for i
    in 0..N-1 (6 -> 3: 0, 2, 4; 12 -> 6: 0, 2, ..., 10; 6 -> 4: 0, 2, 3, 5). Integer arithmetic, so no float
    lands a hair under a half. Distinct and increasing, as L / N >= 1; the first layer is always kept."""
    if not 0 < student_layers <= teacher_layers:
        raise ValueError(f"a student of {student_layers} layers from {teacher_layers}")
    return [(2 * i * teacher_layers + student_layers) // (2 * student_layers) for i in range(student_layers)]


def layer_count(model_config) -> int | None:
    """The config's number of transformer layers (num_hidden_layers, which transformers maps to GPT-2's n_layer
    and DistilBERT's n_layers)."""
    count = getattr(model_config, "num_hidden_layers", None)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def check(model_config, student_layers: int, where: str) -> None:
    """What the config alone refuses: more layers than the teacher has, a config that names no layer count, or
    layers whose arithmetic depends on their depth (GPT-2's scale_attn_by_inverse_layer_idx: a kept layer would
    compute otherwise once the saved student is loaded back with its new index)."""
    teacher = layer_count(model_config)
    if teacher is None:
        raise UserError(f"{FLAG}: the config of {where} ({model_config.model_type}) names no number of layers "
                        "(num_hidden_layers) to take a student's from", f"drop {FLAG}, or pass a model with one")
    if student_layers > teacher:
        raise UserError(f"{FLAG} {student_layers} is more than the {teacher} layers of {where}",
                        f"pass {FLAG} {teacher} or fewer")
    if getattr(model_config, "scale_attn_by_inverse_layer_idx", False):
        raise UserError(f"{FLAG}: {where} scales each layer's attention by its depth "
                        "(scale_attn_by_inverse_layer_idx), which a layer moved to another depth would change",
                        f"drop {FLAG}")


def check_source(source, student_layers: int | None, build_on_meta) -> dict | None:
    """--student-layers against --model (a loading.ModelSource) before anything heavy loads: its config, and its
    model built on the meta device (`build_on_meta`: the task's) to find the layers. A model built from a config
    is refused: its weights are random, so there is nothing to take (its own layer count makes the same model).
    Returns `summary` of the student (metrics.json's `student`), None without --student-layers."""
    if student_layers is None:
        return None
    if not source.pretrained:
        raise UserError(f"{FLAG} takes the layers of a pretrained model, and --model builds one from a config "
                        "(random weights: nothing to take)", "set the layer count in the config instead "
                        f"(e.g. --model bert:num_hidden_layers={student_layers}), or pass a pretrained --model")
    model_config = loading.load_config(source.path)
    check(model_config, student_layers, f"--model {source.path}")
    layer_list(build_on_meta(copy.deepcopy(model_config)))
    return summary(layer_count(model_config), student_layers)


def summary(teacher_layers: int, student_layers: int) -> dict:
    """What metrics.json, the model card and the report say of the student: N layers of L, which ones."""
    return {"layers": student_layers, "of": teacher_layers, "kept": kept_layers(teacher_layers, student_layers)}


def layer_list(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.ModuleList]:
    """(its parent, its attribute name, the list): the one ModuleList that holds the model's transformer blocks
    (models/blocks.py: what FSDP shards and --compile compiles), all of them and nothing else."""
    found = blocks(model)
    ids = {id(block) for block in found}
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) == len(found) > 0 \
                    and all(id(layer) in ids for layer in child):
                return parent, name, child
    raise UserError(f"{FLAG}: the transformer layers of {type(model).__name__} are not one list of blocks "
                    f"({len(found)} blocks found), so there are none to take evenly", f"drop {FLAG}")


def student_config(model_config, student_layers: int):
    """A copy of the teacher's config with the student's layers: what the planner and `inspect` build."""
    config = copy.deepcopy(model_config)
    _shorten(config, kept_layers(layer_count(config), student_layers))
    return config


def _shorten(config, kept: list[int]) -> None:
    """The config of the kept layers, in place: their count, and per-layer lists (Llama's `layer_types`) for
    them, so that save_pretrained writes what plain transformers builds the student from."""
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and len(types) == layer_count(config):
        config.layer_types = [types[index] for index in kept]
    config.num_hidden_layers = len(kept)


def make_student(model: torch.nn.Module, student_layers: int) -> torch.nn.Module:
    """The model cut to `student_layers` of its transformer layers (`kept_layers`), in place; its config (one
    object the base model and the head share) says so. Each kept layer is renumbered (`layer_idx`, which the
    KV cache indexes) to its new depth."""
    check(model.config, student_layers, type(model).__name__)
    parent, name, layers = layer_list(model)
    if len(layers) != layer_count(model.config):
        raise UserError(f"{FLAG}: {type(model).__name__} has {len(layers)} transformer layers where its config "
                        f"says {layer_count(model.config)}", f"drop {FLAG}")
    kept = kept_layers(len(layers), student_layers)
    setattr(parent, name, torch.nn.ModuleList([layers[index] for index in kept]))
    for depth, layer in enumerate(getattr(parent, name)):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = depth
    _shorten(model.config, kept)
    return model
