"""The learning-rate schedule: linear warm-up, then linear or cosine decay to 0, or none (--lr-schedule
constant, or an optimizer whose spec says it does not decay), the same lr at each optimizer step for any
number of processes."""

from __future__ import annotations

import math


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """transformers' ceil(total x ratio), short of every step: a warm-up starts at lr 0, so one that took every
    step of a 1-step run would train nothing, and one that took all steps of a longer run would never reach
    the peak lr."""
    return min(math.ceil(total_steps * warmup_ratio), max(total_steps - 1, 0))


def linear_schedule(optimizer, total_steps: int, warmup: int, num_processes: int,
                    decay: bool = True, shape: str = "linear"):
    """Linear warm-up to the peak lr, then `shape`'s decay to 0 at `total_steps` (linear or cosine; constant,
    or `decay` False: none).

    accelerate's prepared scheduler steps `num_processes` times per optimizer step (it assumes the
    schedule was written for one process seeing every batch), so the schedule is stretched by that
    factor: the lr at each optimizer step is then the same for any number of processes.
    transformers' get_linear_schedule_with_warmup, factor for factor (tested against it): importing
    transformers.optimization imports the Trainer's utilities, peft and bitsandbytes, ~1 s a run."""
    import functools

    from torch.optim.lr_scheduler import LambdaLR

    factors = {"linear": linear_factor, "cosine": cosine_factor, "constant": warmup_factor}
    factor = factors[shape] if decay else warmup_factor
    return LambdaLR(optimizer, functools.partial(factor, warmup=warmup * num_processes,
                                                 total=total_steps * num_processes))


def linear_factor(step: int, *, warmup: int, total: int) -> float:
    """The lr factor at scheduler step `step`: 0 -> 1 over `warmup`, then 1 -> 0 at `total`."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def cosine_factor(step: int, *, warmup: int, total: int) -> float:
    """0 -> 1 over `warmup`, then half a cosine from 1 to 0 at `total` (transformers'
    get_cosine_schedule_with_warmup with its default half cycle)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def warmup_factor(step: int, *, warmup: int, total: int) -> float:
    """0 -> 1 over `warmup`, then 1 (`total` unused: the same call as linear_factor); without warm-up, 1 from
    the first step (transformers' get_constant_schedule_with_warmup)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return 1.0


def continue_schedule(scheduler, step: int, num_processes: int) -> None:
    """A schedule resumed on another number of processes: its count (`num_processes` per optimizer step,
    see linear_schedule) continues at `step` on this run's scale. The lr of each step is unchanged."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps it
    inner.last_epoch = step * num_processes
    inner._last_lr = [base * rule(inner.last_epoch) for base, rule in zip(inner.base_lrs, inner.lr_lambdas)]
    for group, lr in zip(inner.optimizer.param_groups, inner._last_lr):
        group["lr"] = lr
