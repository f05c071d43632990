"""The dtype a layer's matrix products run in: the speed-ups that do their own products (the chunked LM
loss, the LoRA step) make them in the dtype the layer they replace would have used."""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Autocast's dtype where it is on for x's device (and x is floating point), else x's own."""
    device = x.device.type
    if x.dtype.is_floating_point and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype
