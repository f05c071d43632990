"""--strategy fsdp: FSDP2's `fully_shard`, applied by effitrain on CPUs and GPUs alike (engine/sharding.py
holds the mechanics). accelerate prepares the loaders and the schedule only: the model and optimizer
stay as sharded here. Parameters, gradients and optimizer states stay sharded; model/ gathers them."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from effitrain.engine import sharding
from effitrain.engine.strategies.strategy import Strategy


class Fsdp(Strategy):
    name = "fsdp"
    replicates = False
    resplits_steps = False  # effitrain re-splits the steps of replicas (DDP) only
    evaluates_in_pieces = False  # every forward is a collective: the processes' pieces would not pair up

    def __init__(self, accelerator, reshard_after_forward: bool = True):
        super().__init__(accelerator)
        self.reshard_after_forward = reshard_after_forward

    @classmethod
    def from_config(cls, config, accelerator) -> Fsdp:
        return cls(accelerator, config.fsdp_reshard_after_forward)

    def setup_environment(self, cleanup: contextlib.ExitStack) -> None:
        sharding.check_supported(self.accelerator.mixed_precision)
        sharding.join_alone(self.accelerator, cleanup)
        sharding.import_libraries()

    def check_module(self, model: torch.nn.Module) -> None:
        sharding.check_shardable(model)

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        accelerator = self.accelerator
        return sharding.shard(model, accelerator.device, accelerator.num_processes, accelerator.mixed_precision,
                              self.reshard_after_forward)

    def prepare(self, model, optimizer, *others) -> tuple:
        """accelerate prepares `others` only: the model was sharded by setup_module, not by accelerate."""
        prepared = self.accelerator.prepare(*others)  # one object comes back alone, more as a tuple
        return model, optimizer, *(prepared if len(others) > 1 else (prepared,))

    def no_sync(self, model):
        return sharding.no_sync(model)

    def clip_gradients(self, parameters, max_norm: float) -> tuple[bool, torch.Tensor | None]:
        norm = sharding.clip_grad_norm_(parameters, max_norm)
        return bool(torch.isfinite(norm)), norm

    def save_checkpoint(self, folder: Path, model, optimizer) -> None:
        """accelerate's state (the schedule, RNG states), and beside it the weights and optimizer states
        as torch.distributed.checkpoint shards, which resume on another number of processes."""
        super().save_checkpoint(folder, model, optimizer)
        sharding.save(folder / sharding.SHARDED_FOLDER, model, optimizer)

    def load_checkpoint(self, folder: Path, model, optimizer) -> None:
        super().load_checkpoint(folder, model, optimizer)
        sharding.load(folder / sharding.SHARDED_FOLDER, model, optimizer)

    def module_state_dict(self, model: torch.nn.Module) -> dict:
        """A collective: every process gathers, process 0 keeps the whole weights."""
        return sharding.full_state_dict(model)

    def save_pretrained(self, model, folder: Path) -> None:
        model = self.accelerator.unwrap_model(model)
        state = self.module_state_dict(model)
        if self.accelerator.is_main_process:
            sharding.save_pretrained(model, folder, state)

    def load_full_state_dict(self, model: torch.nn.Module, state: dict) -> list[str]:
        """Each process copies in its own shard (names the model lacks are passed over)."""
        sharding.load_full_state_dict(model, state)
        return []

    def optimizer_state_bytes(self, local: int, reduce) -> int:
        return reduce(torch.tensor([local], device=self.accelerator.device)).item()

    def summary(self, wire) -> dict:
        """Not counted: the gathers and reduce-scatters are FSDP2's own."""
        return {"sync_allreduce_calls": None, "sync_allreduce_bytes": None}
