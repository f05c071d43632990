"""What effitrain knows of one optimizer: the fields `train`, `plan` and `bench` read, and how to build it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import effitrain.optimizers.state_sizes as state_sizes


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer: what `train`, `plan` and `bench` need to know of it, and how it is built."""

    name: str
    help: str  # its words in `--optim`'s help
    # (model, lr, weight_decay, betas, blocks) -> the torch optimizer; `blocks`: the model's transformer
    # blocks (models/blocks.py), for an optimizer that treats their matrices apart (Muon)
    build: Callable
    # trainable shapes, the 2-D ones inside the blocks -> bytes of state, as its library stores it
    state_bytes: Callable[..., int]
    # trainable shapes, weight decay on? -> transient bytes inside optimizer.step()
    step_temporary_bytes: Callable[..., int] = state_sizes.no_temporaries
    package: tuple[str, str] | None = None  # (import name, pip name): the `optimizers` extra
    libraries: tuple[str, ...] = ()  # imported before the memory plan's baseline: the first that imports
    whole_weights: bool = False  # projections, orthogonalisation, two points: each weight matrix whole
    plain_tensor_states: bool = False  # its step mixes plain-tensor states with FSDP2's sharded DTensors
    low_rank: bool = False  # every weight trained through a low-rank projection: an alternative to adapters
    decays: bool = True  # the lr decays linearly after warm-up (schedule-free's averaging replaces it)
    averaged_weights: bool = False  # evaluation and saving use averaged weights (its eval()/train() switch)
    cpu_speed: float = 1.0  # a training step's speed vs fused AdamW on CPUs (on GPUs: taken as equal)
    lighter: tuple[str, ...] = ()  # what --memory-budget may switch to, in order, when it does not fit
    plan_rank: int | None = None  # its place in `plan`'s default table; None: planned when asked for

    def speed(self, device: str) -> float:
        return self.cpu_speed if device == "cpu" else 1.0

    def evaluated_weights(self, optimizer):
        """A block during which the model holds the weights to evaluate (averaged.py), then the training
        weights again exactly; for most optimizers nothing changes."""
        if not self.averaged_weights:
            return contextlib.nullcontext()
        import effitrain.optimizers.averaged as averaged

        return averaged.evaluated_weights(optimizer)

    def use_evaluated_weights(self, optimizer) -> None:
        """After the last step: the model holds the weights to test and save."""
        if self.averaged_weights:
            import effitrain.optimizers.averaged as averaged

            averaged.use_evaluated_weights(optimizer)
