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


def allreduce_gradients(model, world: int, counter: Counter, bucket_bytes: int = 25 * 2**20) -> None:
    """Average the gradients over the processes, as DDP's default does, in ~25 MB flat buckets (DDP's
    default size). Used when every micro-batch ran under no_sync, so that the processes could first
    agree that none of them ran out of memory (--memory-budget with several processes)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket, size = [], 0
    for i, grad in enumerate(grads):
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= bucket_bytes or i == len(grads) - 1:
            flat = _flatten_dense_tensors(bucket)
            flat.div_(world)  # before the sum, as DDP does
            dist.all_reduce(flat)
            for grad_, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad_.copy_(synced)
            counter.calls += 1
            counter.bytes += flat.numel() * flat.element_size()
            bucket, size = [], 0


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

    def __exit__(self, type, value, tb):
        """The final average on a normal exit; after an error the other processes may not be in the
        same place, so no collective is started (it would wait for them until the timeout)."""
        if type is not None:
            self.enabled = False
        return super().__exit__(type, value, tb)
