"""Optimizers and the learning-rate schedule. The trade-off between them is how many numbers each
stores per parameter, at what precision: reported from the optimizer's own state tensors."""

from __future__ import annotations

import importlib
import math

import torch

from effitrain.engine import optim_packages
from effitrain.errors import UserError


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and normalisation weights (1-d tensors), as BERT and GPT recipes do."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.999)) -> torch.optim.Optimizer:
    return adamw_of_groups(param_groups(model, weight_decay), lr, betas)


def adamw_of_groups(groups: list[dict], lr: float, betas) -> torch.optim.Optimizer:
    try:
        # One fused kernel for all parameters: measured 7x faster than the per-tensor loop on CPU.
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)


def build(name: str, model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.999)):
    """adamw: 2 fp32 states (8 bytes/param). adafactor: factored second moment, no first moment (well
    under 1 byte/param for matrices). 8-bit Adam(W): 2 states quantised to 8 bits (about 2 bytes/param),
    bitsandbytes, else torchao. sgd: momentum only (4 bytes/param). galore-adamw, apollo-adamw, muon,
    schedule-free-adamw: engine/optim_packages.py."""
    if name == "adamw":
        return adamw(model, lr, weight_decay, betas)
    if name in ("galore-adamw", "apollo-adamw"):
        return optim_packages.low_rank(name, model, lr, weight_decay, betas)
    if name == "muon":
        return optim_packages.muon(model, lr, weight_decay, betas, adamw_of_groups)
    if name == "schedule-free-adamw":
        return optim_packages.schedule_free(model, lr, weight_decay, betas)
    groups = param_groups(model, weight_decay)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # A fixed lr (the schedule drives it), not Adafactor's own relative step size.
        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False,
                         beta1=None)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=betas[0])
    return _eight_bit(name, groups, lr, betas)


def import_libraries(name: str) -> None:
    """Import what builds this optimizer now (transformers' Adafactor: transformers.optimization, which
    imports the Trainer's utilities, peft and bitsandbytes; 8-bit Adam: bitsandbytes, else torchao): the
    run's memory plan counts from what the process holds before it (memory_fit.in_use_bytes), and a
    library's code and tables are not training memory."""
    modules = {"adafactor": ["transformers.optimization"], "adamw-8bit": ["bitsandbytes.optim", "torchao.optim"],
               "adam-8bit": ["bitsandbytes.optim", "torchao.optim"]}.get(name, [])
    for module in modules:
        try:
            importlib.import_module(module)
            return
        except ImportError:  # the next one, or none: build() says so in one line
            continue


def _eight_bit(name: str, groups, lr: float, betas):
    cls = {"adamw-8bit": "AdamW8bit", "adam-8bit": "Adam8bit"}[name]
    try:
        import bitsandbytes.optim as bnb

        return getattr(bnb, cls)(groups, lr=lr, betas=betas)
    except ImportError:
        pass
    try:
        import torchao.optim as tao

        return getattr(tao, cls)(groups, lr=lr, betas=betas)
    except ImportError:
        raise UserError(f"--optim {name} needs bitsandbytes or torchao, and neither is installed",
                        "pip install bitsandbytes (or torchao)")


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


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """transformers' ceil(total x ratio), short of every step: a warm-up starts at lr 0, so one that took every
    step of a 1-step run would train nothing, and one that took all steps of a longer run would never reach
    the peak lr."""
    return min(math.ceil(total_steps * warmup_ratio), max(total_steps - 1, 0))


def decays(name: str) -> bool:
    """Schedule-free AdamW replaces the decay by its averaging: its lr stays at the peak after warm-up."""
    return name != "schedule-free-adamw"


def linear_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup: int, num_processes: int,
                    decay: bool = True):
    """Linear warm-up to the peak lr, then linear decay to 0 at `total_steps`.

    accelerate's prepared scheduler steps `num_processes` times per optimizer step (it assumes the
    schedule was written for one process seeing every batch), so the schedule is stretched by that
    factor: the lr at each optimizer step is then the same for any number of processes.
    transformers' get_linear_schedule_with_warmup, factor for factor (tested against it): importing
    transformers.optimization imports the Trainer's utilities, peft and bitsandbytes, ~1 s a run."""
    import functools

    from torch.optim.lr_scheduler import LambdaLR

    factor = linear_factor if decay else warmup_factor
    return LambdaLR(optimizer, functools.partial(factor, warmup=warmup * num_processes,
                                                 total=total_steps * num_processes))


def linear_factor(step: int, *, warmup: int, total: int) -> float:
    """The lr factor at scheduler step `step`: 0 -> 1 over `warmup`, then 1 -> 0 at `total`."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def warmup_factor(step: int, *, warmup: int, total: int) -> float:
    """0 -> 1 over `warmup`, then 1 (`total` unused: the same call as linear_factor)."""
    return min(1.0, float(step) / float(max(1, warmup)))


def continue_schedule(scheduler, step: int, num_processes: int) -> None:
    """A schedule resumed on another number of processes: its count (`num_processes` per optimizer step,
    see linear_schedule) continues at `step` on this run's scale. The lr of each step is unchanged."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps it
    inner.last_epoch = step * num_processes
    inner._last_lr = [base * rule(inner.last_epoch) for base, rule in zip(inner.base_lrs, inner.lr_lambdas)]
    for group, lr in zip(inner.optimizer.param_groups, inner._last_lr):
        group["lr"] = lr
