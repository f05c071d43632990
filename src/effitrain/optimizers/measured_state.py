"""The bytes an optimizer's state really holds, read from its own tensors: what metrics.json reports
and what the planner's arithmetic (state_sizes.py) is tested against."""

from __future__ import annotations

import torch


def _leaf_tensors(tensor: torch.Tensor):
    """The tensors really stored: tensor subclasses (torchao's 8-bit states) hold inner tensors; an FSDP
    DTensor, this process's shard."""
    if hasattr(tensor, "to_local"):
        yield from _leaf_tensors(tensor.to_local())
    elif hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _leaf_tensors(getattr(tensor, name))
    else:
        yield tensor


def _state_tensors(value):
    """The tensors of a state value: itself, or those a projector object holds (GaLore, APOLLO)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif hasattr(value, "ortho_matrix"):
        yield from (v for v in vars(value).values() if isinstance(v, torch.Tensor))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Every tensor in the optimizer's state (moments, quantisation scales, step counters, projections),
    each storage once: bitsandbytes gives every parameter's state the same quantisation maps."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            for tensor in _state_tensors(value):
                for leaf in _leaf_tensors(tensor):
                    key = (leaf.untyped_storage().data_ptr(), leaf.storage_offset(), leaf.numel())
                    if key not in seen:
                        seen.add(key)
                        total += leaf.numel() * leaf.element_size()
    return total
