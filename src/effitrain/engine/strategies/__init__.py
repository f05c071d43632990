"""The data-parallel strategies, one class per file: Single (one process), Ddp, Fsdp, DeepSpeed. This is
the one place that reads --strategy and the number of processes to choose one; the rest of the engine
calls the chosen object's methods (strategy.py lists them)."""

from __future__ import annotations

from effitrain.engine.strategies.ddp import Ddp
from effitrain.engine.strategies.deepspeed import DeepSpeed
from effitrain.engine.strategies.fsdp import Fsdp
from effitrain.engine.strategies.single import Single
from effitrain.engine.strategies.strategy import Strategy

__all__ = ["Ddp", "DeepSpeed", "Fsdp", "Single", "Strategy", "accelerator_plugins", "for_config"]


def _named(config) -> type[Strategy]:
    return {"fsdp": Fsdp, "deepspeed": DeepSpeed}.get(config.strategy, Ddp)


def accelerator_plugins(config) -> dict:
    """accelerate's keyword arguments for --strategy (DeepSpeed's plugin), to make the Accelerator with."""
    return _named(config).plugins(config)


def for_config(config, accelerator) -> Strategy:
    """The strategy --strategy names; --strategy ddp on one process is Single (accelerate wraps nothing)."""
    chosen = _named(config)
    if chosen is Ddp and accelerator.num_processes == 1:
        chosen = Single
    return chosen.from_config(config, accelerator)
