"""Counting what crosses the wire: DDP's gradient all-reduces, and local SGD's parameter averaging."""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.local_sgd import LocalSGD


class Counter:
    def __init__(self):
        self.calls = 0
        self.bytes = 0


def count_gradient_allreduces(ddp_model, counter: Counter) -> None:
    """DDP all-reduces gradients bucket by bucket; a comm hook sees each bucket, then does what DDP's
    default does (average over processes)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        counter.calls += 1
        counter.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(None, bucket)

    ddp_model.register_comm_hook(None, hook)


class AveragingLocalSGD(LocalSGD):
    """accelerate's LocalSGD (no gradient sync inside the context, parameters averaged every K steps),
    averaging all parameters in one flattened all-reduce instead of one call per tensor and a barrier:
    on a slow link the per-call latency is what local SGD is meant to save."""

    def __init__(self, accelerator, model, local_sgd_steps: int, counter: Counter):
        super().__init__(accelerator, model, local_sgd_steps, enabled=True)
        self.counter = counter

    def _sync_and_avg_model_params(self):
        if not self.enabled:
            return
        params = [p.data for p in self.model.parameters()]
        flat = torch._utils._flatten_dense_tensors(params)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for param, averaged in zip(params, torch._utils._unflatten_dense_tensors(flat, params)):
            param.copy_(averaged)
        self.counter.calls += 1
        self.counter.bytes += flat.numel() * flat.element_size()
