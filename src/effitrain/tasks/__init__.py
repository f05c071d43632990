"""The kinds of task effitrain trains, and the one registry of their names.

Everything that depends on what the model learns (the Auto class, the processor, preprocessing,
collators, the loss as a sum over items, counts, metrics, example batches for the planner,
prediction) is a method of the task object that `get(name)` returns. No other module compares task
names. This module stays light (no torch): the config and the CLI read NAMES from it."""

from __future__ import annotations

# name -> (module, class, keyword arguments); the classes are imported on first use.
_REGISTRY = {
    "sequence-classification": ("classification", "Classification", {"modality": "text"}),
    "image-classification": ("classification", "Classification", {"modality": "image"}),
    "audio-classification": ("classification", "Classification", {"modality": "audio"}),
    "causal-lm": ("causal_lm", "CausalLM", {}),
}
NAMES = tuple(_REGISTRY)
_INSTANCES: dict = {}


def get(name: str):
    """The task object for a registered name (a UserError for any other)."""
    if name not in _REGISTRY:
        from effitrain.errors import UserError

        raise UserError(f"unknown task `{name}`", f"pass --task {' or '.join(NAMES)}")
    if name not in _INSTANCES:
        import importlib

        module, cls, kwargs = _REGISTRY[name]
        _INSTANCES[name] = getattr(importlib.import_module(f"effitrain.tasks.{module}"), cls)(name, **kwargs)
    return _INSTANCES[name]
