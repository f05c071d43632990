"""What the newer optimizers store, counted from the weights' shapes (the planner and engine/optim_packages.py)."""

from __future__ import annotations

import math

# GaLore and APOLLO (engine/optim_packages.py): the rank of the projection of each weight matrix whose
# two sides both exceed it; narrower tensors (the classifier, biases, norms) keep AdamW's full moments.
LOW_RANK = 8


def projected(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and min(shape) > LOW_RANK


def projected_state_bytes(name: str, shapes: list[tuple[int, ...]]) -> int:
    """galore-adamw and apollo-adamw, as their packages store it: the moments of the projected gradient
    (rank x the longer side, fp32, two of them) and the projection (rank x the shorter side); APOLLO
    also its norm-growth limiter's last norm (one fp32 scalar). Full moments for the rest; the step
    count and seeds are Python numbers."""
    total = 0
    for shape in shapes:
        if projected(shape):
            total += 8 * LOW_RANK * max(shape) + 4 * LOW_RANK * min(shape) + (4 if name == "apollo-adamw" else 0)
        else:
            total += 8 * math.prod(shape)
    return total


def muon_state_bytes(shapes: list[tuple[int, ...]], block_matrices: list[tuple[int, ...]]) -> int:
    """muon: one fp32 momentum for the 2-D weights inside the transformer blocks (`block_matrices`, a
    sub-list of `shapes`); fused AdamW for the others (two fp32 moments and a float32 step tensor)."""
    adamw = sum(8 * math.prod(s) + 4 for s in shapes)
    return adamw - sum(8 * math.prod(s) + 4 - 4 * math.prod(s) for s in block_matrices)


def schedule_free_state_bytes(shapes: list[tuple[int, ...]]) -> int:
    """schedule-free-adamw: the averaged point z and the second moment, fp32 (k is a Python number)."""
    return sum(8 * math.prod(s) for s in shapes)
