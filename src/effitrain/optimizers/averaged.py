"""The weights an optimizer that keeps an averaged point (schedule-free AdamW: its eval()/train()
switch) evaluates and saves, while it trains on another: its spec's `averaged_weights`."""

from __future__ import annotations

import contextlib

import torch


def _switching(optimizer):
    """The optimizer itself (accelerate wraps it) when it holds train and evaluation weights, else None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if callable(getattr(inner, "eval", None)) and callable(getattr(inner, "train", None)) else None


@contextlib.contextmanager
def evaluated_weights(optimizer):
    """Schedule-free: the averaged weights x while the block runs (validation, best/), then exactly the
    training point y again (copied back: x -> y by interpolation would round, and the run would drift
    from one that evaluated at other steps). Other optimizers: nothing."""
    inner = _switching(optimizer)
    if inner is None:
        yield
        return
    params = [p for group in inner.param_groups for p in group["params"]]
    kept = [p.detach().clone() for p in params]
    inner.eval()
    try:
        yield
    finally:
        inner.train()
        with torch.no_grad():
            for param, value in zip(params, kept):
                param.copy_(value)


def use_evaluated_weights(optimizer) -> None:
    """After the last step: the weights to test and save are schedule-free's averaged ones."""
    inner = _switching(optimizer)
    if inner is not None:
        inner.eval()
