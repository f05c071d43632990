"""--strategy fsdp: PyTorch's FSDP2 (`fully_shard`), one code path for CPUs (gloo) and GPUs (NCCL).

accelerate shards only on accelerators (on a CPU it ignores its FSDP plugin and trains DDP), so
effitrain applies `fully_shard` itself, as torchtitan does: each transformer block is one unit
(its parameters gathered for its forward and backward, then freed), the root holds the rest
(embeddings, head). accelerate still does what it does well around it: the process group, the
data loaders, the schedule, RNG states, trackers. Parameters, gradients and optimizer states stay
sharded (DTensors); what leaves the run whole is model/ (a full state dict) only.

The arithmetic is the same as DDP's: FSDP2 reduce-scatters the mean of the gradients, as DDP
all-reduces it; accumulation skips that on all but the last micro-batch of a step.

These are the mechanics; engine/strategies/fsdp.py, the only engine module that imports them, decides
when each is used."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from effitrain.errors import UserError
from effitrain.models.blocks import blocks

# The checkpoint's sharded part: torch.distributed.checkpoint's folder (one file per process + metadata).
SHARDED_FOLDER = "sharded"


def _fsdp():
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    return FSDPModule, MixedPrecisionPolicy, fully_shard


def import_libraries() -> None:
    """What sharding runs with (fully_shard, the device mesh, DTensor, distributed checkpointing), imported as
    the strategy sets up: before the memory plan's baseline (memory_fit.in_use_bytes), since a library's
    code and tables are not training memory."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    _fsdp()


def check_shardable(model: torch.nn.Module) -> None:
    if not blocks(model):
        raise UserError(f"--strategy fsdp shards a model by its transformer blocks, and {type(model).__name__} "
                        "has none (no repeated layers, none named in transformers' _no_split_modules)",
                        "use --strategy ddp for this model")


def shard(model: torch.nn.Module, device: torch.device, world: int, mixed_precision: str,
          reshard_after_forward: bool) -> torch.nn.Module:
    """`fully_shard` each block, then the root, over all processes. bf16: parameters gathered and
    computed in bf16, gradients reduced in fp32, the sharded master weights kept in fp32."""
    from torch.distributed.device_mesh import init_device_mesh

    _, MixedPrecisionPolicy, fully_shard = _fsdp()
    check_shardable(model)
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision == "bf16" else MixedPrecisionPolicy()
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root's parameters (embeddings, head) are needed at the start and at the end of the forward:
    # resharding them in between would only gather them again for the backward.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


@contextlib.contextmanager
def no_sync(model: torch.nn.Module):
    """Gradients kept unreduced (accumulated whole, locally) for the micro-batches before a step's last."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """The global norm of the sharded gradients (each process's shard norm, combined), then clipping:
    torch's clip_grad_norm_ over DTensors returns a DTensor, which torchtitan makes whole the same way."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters], 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole weights, on the CPU of process 0 (empty elsewhere); a collective: every process calls it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(folder: Path, model: torch.nn.Module, optimizer) -> None:
    """Weights and optimizer states as torch.distributed.checkpoint shards: each process writes its own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, states = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "optimizer": states}, checkpoint_id=str(folder))


def load(folder: Path, model: torch.nn.Module, optimizer) -> None:
    """The shards back, resharded to this run's processes (DCP reads whichever parts each needs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    weights, states = get_state_dict(model, optimizer)
    state = {"model": weights, "optimizer": states}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def check_supported(mixed_precision: str) -> None:
    """torch >= 2.6 (fully_shard, get_total_norm and local DTensor cuts are public there); bf16 or fp32."""
    if not hasattr(torch.nn.utils, "get_total_norm"):
        raise UserError(f"--strategy fsdp needs torch >= 2.6 (this is {torch.__version__})",
                        "upgrade torch, or use --strategy ddp")
    if mixed_precision == "fp16":
        raise UserError("--strategy fsdp trains in bf16 or fp32 (fp16 needs a sharded gradient scaler, which "
                        "effitrain does not have)", "pass --precision bf16 (or fp32)")


def join_alone(accelerator, cleanup: contextlib.ExitStack) -> None:
    """One process: FSDP2 still needs a process group (of one). Nothing is sharded then, but the code
    path is the same, and its checkpoints resume on more processes."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    accelerator.print("--strategy fsdp on one process: nothing to shard (same code path and checkpoints, which "
                      "resume on more processes)")
    backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    cleanup.callback(dist.destroy_process_group)


def unsharded_class(model: torch.nn.Module) -> type:
    """The model's own class: fully_shard makes it an `FSDP<Class>` subclass."""
    FSDPModule = _fsdp()[0]
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def save_pretrained(model: torch.nn.Module, folder: Path, state: dict) -> None:
    """save_pretrained of the full weights, under the model's own class name (config.json's
    architectures would otherwise name the FSDP subclass, which no one can load). A tied weight (GPT-2's
    output layer is its input embedding) comes out of the gather as a copy of its own: left out, as
    save_pretrained leaves it out of an unsharded model's file."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        (tied.add(name) if id(param) in seen else seen.add(id(param)))
    state = {name: tensor for name, tensor in state.items() if name not in tied}
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    model.config.architectures = [unsharded_class(model).__name__]
    model.config.save_pretrained(folder)


def load_full_state_dict(model: torch.nn.Module, state: dict) -> None:
    """Whole weights (read by every process) into the sharded model: each process copies in its own
    shard, cut locally (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, target in model.state_dict().items():
            if name not in state:
                continue
            whole = state[name].to(device=target.device, dtype=target.dtype)
            if isinstance(target, DTensor):
                whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
                target = target.to_local()
            target.copy_(whole)
