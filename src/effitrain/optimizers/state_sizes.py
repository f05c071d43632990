"""The bytes each optimizer's state takes for trainable parameters of given shapes, as its library
stores it: arithmetic only (no torch), so that the planner counts it before anything is loaded and
the specs in catalogue.py can name it."""

from __future__ import annotations

import math

Shapes = list[tuple[int, ...]]

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps fp32 states for smaller tensors
BNB_BLOCK = 256  # values per quantisation block (one fp32 absmax each)

# GaLore and APOLLO (packaged.py): the rank of the projection of each weight matrix whose two sides both
# exceed it; narrower tensors (the classifier, biases, norms) keep AdamW's full moments.
LOW_RANK = 8


def adamw(shapes: Shapes, block_matrices: Shapes = ()) -> int:
    """Fused AdamW: exp_avg, exp_avg_sq (fp32) and a float32 step tensor per parameter."""
    return sum(8 * math.prod(shape) + 4 for shape in shapes)


def sgd(shapes: Shapes, block_matrices: Shapes = ()) -> int:
    """The momentum buffer."""
    return sum(4 * math.prod(shape) for shape in shapes)


def adafactor(shapes: Shapes, block_matrices: Shapes = ()) -> int:
    """transformers' Adafactor without beta1: the factored second moment (row and column sums of a
    matrix, the whole one of a vector) and the RMS."""
    total = 0
    for shape in shapes:
        n = math.prod(shape)
        total += 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if len(shape) >= 2 else 4 * n
        total += 4
    return total


def eight_bit(shapes: Shapes, block_matrices: Shapes = ()) -> int:
    """bitsandbytes' blockwise 8-bit Adam(W): 2 x (1 byte + an fp32 absmax per block of 256) for tensors
    of 4096 values or more, fp32 moments for smaller ones, and the two quantisation maps (256 fp32
    values each) that all parameters share."""
    total = 2 * 256 * 4 if any(math.prod(s) >= BNB_MIN_8BIT_SIZE for s in shapes) else 0
    for shape in shapes:
        n = math.prod(shape)
        total += 2 * (n + 4 * math.ceil(n / BNB_BLOCK)) if n >= BNB_MIN_8BIT_SIZE else 8 * n
    return total


def projected(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and min(shape) > LOW_RANK


def low_rank(shapes: Shapes, limiter_bytes: int) -> int:
    """galore-adamw and apollo-adamw, as their packages store it: the moments of the projected gradient
    (rank x the longer side, fp32, two of them) and the projection (rank x the shorter side); APOLLO
    also its norm-growth limiter's last norm (`limiter_bytes`: one fp32 scalar). Full moments for the
    rest; the step count and seeds are Python numbers."""
    total = 0
    for shape in shapes:
        if projected(shape):
            total += 8 * LOW_RANK * max(shape) + 4 * LOW_RANK * min(shape) + limiter_bytes
        else:
            total += 8 * math.prod(shape)
    return total


def galore(shapes: Shapes, block_matrices: Shapes = ()) -> int:
    return low_rank(shapes, limiter_bytes=0)


def apollo(shapes: Shapes, block_matrices: Shapes = ()) -> int:
    return low_rank(shapes, limiter_bytes=4)


def muon(shapes: Shapes, block_matrices: Shapes = ()) -> int:
    """muon: one fp32 momentum for the 2-D weights inside the transformer blocks (`block_matrices`, a
    sub-list of `shapes`); fused AdamW for the others (two fp32 moments and a float32 step tensor)."""
    return adamw(shapes) - sum(8 * math.prod(s) + 4 - 4 * math.prod(s) for s in block_matrices)


def schedule_free(shapes: Shapes, block_matrices: Shapes = ()) -> int:
    """schedule-free-adamw: the averaged point z and the second moment, fp32 (k is a Python number)."""
    return sum(8 * math.prod(s) for s in shapes)


def no_temporaries(shapes: Shapes, weight_decay: bool = True) -> int:
    """Fused AdamW and bitsandbytes work in place."""
    return 0


def sgd_temporaries(shapes: Shapes, weight_decay: bool = True) -> int:
    """torch's foreach SGD copies the decayed gradients (the matrices': 1-D tensors have no decay)."""
    return 4 * sum(math.prod(s) for s in shapes if len(s) >= 2) if weight_decay else 0


def adafactor_temporaries(shapes: Shapes, weight_decay: bool = True) -> int:
    """Adafactor makes a few tensors per parameter in turn: the largest one's."""
    return 3 * 4 * max((math.prod(s) for s in shapes), default=0)
