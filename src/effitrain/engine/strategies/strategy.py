"""The base of the data-parallel strategies (the pattern of Lightning Fabric's `strategies/strategy.py`):
one object owns how the model is wrapped, how gradients stay local during accumulation, clipping, the
whole weights for model/, checkpoints, and what metrics.json says about the strategy. The engine calls
these methods and never asks which strategy it runs.

This base does everything through accelerate; each subclass (one per file) overrides what differs."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


class Strategy:
    name = ""  # the --strategy value that chooses it, for messages
    # Every process holds the whole model (DDP's replicas); False: each holds a part of the weights or
    # optimizer states (FSDP, DeepSpeed ZeRO).
    replicates = True
    # A step may run again in smaller pieces after an out-of-memory error (memory_fit.halve).
    resplits_steps = True
    # An evaluation batch may run as pieces of their own lengths (evaluator.batch_outputs): the pieces of
    # the processes need not pair up, since no forward is a collective.
    evaluates_in_pieces = True

    def __init__(self, accelerator):
        self.accelerator = accelerator

    @classmethod
    def plugins(cls, config) -> dict:
        """accelerate's keyword arguments for this strategy (a plugin), before the Accelerator exists."""
        return {}

    @classmethod
    def from_config(cls, config, accelerator) -> Strategy:
        return cls(accelerator)

    def setup_environment(self, cleanup: contextlib.ExitStack) -> None:
        """What the strategy needs once the accelerator exists, before any data or model."""

    def check_module(self, model: torch.nn.Module) -> None:
        """Refuses a model the strategy cannot wrap, before the output folder is claimed."""

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the optimizer must hold it (the optimizer is built from this one)."""
        return model

    def prepare(self, model, optimizer, *others) -> tuple:
        """accelerate's prepare of the model, the optimizer and `others` (loaders, the scheduler), in order."""
        return self.accelerator.prepare(model, optimizer, *others)

    def count_traffic(self, model, wire) -> None:
        """Counts the gradient all-reduces of the strategy's own sync in `wire` (metrics.json)."""

    def no_sync(self, model):
        """A context in which backward passes keep gradients local (a step's micro-batches before its last)."""
        return self.accelerator.no_sync(model)

    def clip_gradients(self, parameters, max_norm: float) -> tuple[bool, torch.Tensor | None]:
        """(finite, the gradients' global norm), clipped to `max_norm`. The norm is how a non-finite loss
        or gradient is seen, the same on every process once gradients are synced; None where the
        strategy clips inside its own step (DeepSpeed's engine, through accelerate)."""
        norm = self.accelerator.clip_grad_norm_(parameters, max_norm)
        return norm is None or bool(torch.isfinite(norm)), norm

    def save_checkpoint(self, folder: Path, model, optimizer) -> None:
        """The training state into `folder`: accelerate's save_state (prepared objects, RNG states)."""
        self.accelerator.save_state(str(folder))

    def load_checkpoint(self, folder: Path, model, optimizer) -> None:
        self.accelerator.load_state(str(folder))

    def module_state_dict(self, model: torch.nn.Module) -> dict | None:
        """The whole weights of the (unwrapped) model for peft to save from, or None where each process
        holds them whole and peft reads the model itself."""
        return None

    def save_pretrained(self, model, folder: Path) -> None:
        """The whole (prepared) model as transformers' save_pretrained writes it, by the main process."""
        accelerator = self.accelerator
        accelerator.unwrap_model(model).save_pretrained(
            folder, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
            state_dict=accelerator.get_state_dict(model), safe_serialization=True)

    def load_full_state_dict(self, model: torch.nn.Module, state: dict) -> list[str]:
        """Whole weights (read by every process) into the unwrapped model; the names it does not have."""
        return model.load_state_dict(state, strict=False).unexpected_keys

    def optimizer_state_bytes(self, local: int, reduce) -> int:
        """The optimizer states' bytes over all processes, from this process's `local` ones (a collective
        where they are sharded: `reduce` sums over processes)."""
        return local

    def technique(self) -> str | None:
        """The strategy as model/README.md lists it among the techniques: sharding over processes;
        replicas are not a technique of their own."""
        return None if self.replicates or self.accelerator.num_processes == 1 else f"{self.name} sharding"

    def summary(self, wire) -> dict:
        """What metrics.json says of the run's communication: the all-reduces counted in `wire` (DDP's
        gradient buckets, or local SGD's parameter averaging)."""
        return {"sync_allreduce_calls": wire.calls, "sync_allreduce_bytes": wire.bytes}
