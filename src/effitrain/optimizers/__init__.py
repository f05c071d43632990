"""The optimizers effitrain trains with, and the one registry of their names.

Everything that depends on which optimizer runs (the package it needs, its state bytes, its step's
temporaries, whether it needs each weight whole, whether the lr decays, its CPU speed, the weights
evaluation and saving use) is a field of its `OptimizerSpec`; `build` makes any of them. config,
the engine, the planner, `plan` and `bench` read the specs: no other module compares optimizer
names. This module stays light (no torch): the config and the CLI read NAMES from it."""

from __future__ import annotations

from effitrain.catalog.live_names import LiveNames
from effitrain.optimizers import catalogue
from effitrain.optimizers.spec import OptimizerSpec


_SPECS: dict[str, OptimizerSpec] = {}
NAMES = LiveNames(_SPECS)  # --optim's choices: a spec registered later is one too


def register(spec: OptimizerSpec) -> OptimizerSpec:
    if spec.name in _SPECS:
        raise ValueError(f"optimizer {spec.name} is registered already")
    _SPECS[spec.name] = spec
    return spec


def get(name: str) -> OptimizerSpec:
    """The spec of a registered name (a UserError for any other)."""
    if name not in _SPECS:
        from effitrain.errors import UserError

        raise UserError(f"unknown --optim `{name}`", f"pass --optim {' or '.join(NAMES)}")
    return _SPECS[name]


def specs() -> list[OptimizerSpec]:
    return list(_SPECS.values())


def build(name: str, model, lr: float, weight_decay: float, betas=(0.9, 0.999), blocks=()):
    """The torch optimizer `name` over the model's trainable parameters; `blocks`: the model's transformer
    blocks (models/blocks.py), which Muon takes its matrices from."""
    return get(name).build(model, lr, weight_decay, betas, list(blocks))


def import_libraries(name: str) -> None:
    """Import what builds this optimizer now (transformers' Adafactor: transformers.optimization, which
    imports the Trainer's utilities, peft and bitsandbytes; 8-bit Adam: bitsandbytes, else torchao): the
    run's memory plan counts from what the process holds before it (memory_fit.in_use_bytes), and a
    library's code and tables are not training memory."""
    import importlib

    for module in get(name).libraries:
        try:
            importlib.import_module(module)
            return
        except ImportError:  # the next one, or none: the builder says so in one line
            continue


def help_text() -> str:
    """`--optim`'s help: each optimizer's words, those of the `optimizers` extra after its install line."""
    built_in = [spec.help for spec in specs() if spec.package is None]
    extra = [spec.help for spec in specs() if spec.package is not None]
    return ", ".join(built_in) + ("; with `pip install 'effitrain[optimizers]'`: " + ", ".join(extra) if extra else "")


def everyday() -> list[str]:
    """`plan`'s default optimizers, in their table's order."""
    return [spec.name for spec in sorted((s for s in specs() if s.plan_rank is not None), key=lambda s: s.plan_rank)]


for _spec in catalogue.BUILT_IN:
    register(_spec)
