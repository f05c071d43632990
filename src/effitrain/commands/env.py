"""`effitrain env`: the devices and precisions Accelerator detects, the CPU, the process group
variables and the libraries' versions."""

from __future__ import annotations

import json
import os
import platform

from effitrain.runtime import devices, distributed, libraries
from effitrain.speedups import allocator


def report() -> dict:
    """Everything `effitrain env` prints, as data. It never joins a process group: with launcher
    variables for several processes set, it reports them and the device accelerate would take, instead
    of waiting for peers (which, with stray variables, never come)."""
    import torch

    info: dict = {
        **what_accelerate_detects(),
        "cpu": {"name": devices.cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                "memory_bytes": devices.total_memory_bytes(), "fast_bf16": devices.cpu_has_fast_bf16()},
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            capability = (props.major, props.minor)
            info["gpus"].append({
                "index": i, "name": props.name, "memory_bytes": props.total_memory,
                "compute_capability": f"{props.major}.{props.minor}",
                # Tensor cores: fp16 from Volta (7.0), bf16 from Ampere (8.0).
                "fp16": True, "fp16_fast": capability >= (7, 0),
                "bf16": capability >= (8, 0), "bf16_fast": capability >= (8, 0),
            })
    on_gpu = bool(info["gpus"])
    info["precision"] = {
        "bf16_supported": info["gpus"][0]["bf16"] if on_gpu else True,
        "bf16_fast": info["gpus"][0]["bf16_fast"] if on_gpu else devices.cpu_has_fast_bf16(),
        "fp16_supported": on_gpu,
        "fp16_fast": info["gpus"][0]["fp16_fast"] if on_gpu else False,
    }
    info["distributed_env"] = distributed.launcher_variables()
    info["started_by_torchrun"] = distributed.started_by_torchrun()
    kind, file = allocator.serving()
    info["allocator"] = {"kind": kind, "file": file, "requested": os.environ.get(allocator.ALLOCATOR, "auto")}
    info["python"] = platform.python_version()
    info["versions"] = libraries.versions()
    return info


def what_accelerate_detects() -> dict:
    """The Accelerator's device and mode; without building one when that would join a process group."""
    world = distributed.launcher_world_size()
    if world < 2:
        accelerator = distributed.make_accelerator()
        return {"device": str(accelerator.device), "device_type": accelerator.device.type,
                "distributed_type": str(accelerator.distributed_type).split(".")[-1],
                "num_processes": accelerator.num_processes}
    import torch

    device = torch.device("cpu")
    if devices.has_accelerator():
        kind = torch.accelerator.current_accelerator().type if hasattr(torch, "accelerator") else "cuda"
        device = torch.device(kind, int(os.environ.get("LOCAL_RANK", "0") or 0))
    return {"device": str(device), "device_type": device.type,
            "distributed_type": "NOT_JOINED", "num_processes": world}


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _allocator_line(memory: dict) -> str:
    if memory["kind"] in allocator.LIBRARIES:
        return f"{memory['kind']} ({memory['file']}); {allocator.ALLOCATOR}=system for the C library's"
    if memory["kind"] == "glibc":
        found = next((kind for kind in allocator.AUTO if allocator.find(kind)), None)
        if memory["requested"] == "system" or not found:
            why = (f"{allocator.ALLOCATOR}=system" if found else
                   "Debian: apt-get install libtcmalloc-minimal4 for a steadier memory peak")
        else:
            why = f"a program of its own: the `effitrain` command preloads {found}"
        return f"glibc's malloc, keeping freed memory ({why})"
    return f"{memory['file'] or 'the C library'}'s malloc"


def format_report(info: dict) -> str:
    yes = {True: "yes", False: "no"}
    cpu, precision = info["cpu"], info["precision"]
    lines = [
        f"device            {info['device']} ({info['distributed_type']}, {info['num_processes']} process(es))",
        f"cpu               {cpu['name']}, {cpu['cores']} cores, {_gib(cpu['memory_bytes'])}, "
        f"torch threads {cpu['torch_threads']}",
    ]
    if not info["gpus"]:
        lines.append("gpus              none (training runs on the CPU)")
    for gpu in info["gpus"]:
        lines.append(f"gpu {gpu['index']}             {gpu['name']}, {_gib(gpu['memory_bytes'])}, "
                     f"compute capability {gpu['compute_capability']}")
    lines += [
        f"bf16              supported {yes[precision['bf16_supported']]}, fast {yes[precision['bf16_fast']]}",
        f"fp16              supported {yes[precision['fp16_supported']]}, fast {yes[precision['fp16_fast']]}",
        "distributed env   " + (" ".join(f"{k}={v}" for k, v in info["distributed_env"].items()) or "none set"),
    ]
    if info["num_processes"] > 1 and not info["started_by_torchrun"]:
        lines.append(f"                  these make train and evaluate wait up to {distributed.JOIN_SECONDS} s for "
                     f"{info['num_processes'] - 1} other process(es), then stop; unset them to run one process, "
                     "or start all with `effitrain launch`")
    lines += [f"allocator         {_allocator_line(info['allocator'])}", f"python            {info['python']}"]
    lines += [f"{name:<18}{version or 'not installed'}" for name, version in info["versions"].items()]
    return "\n".join(lines)


def add_parser(commands) -> None:
    env = commands.add_parser("env", help="show the devices and precisions Accelerator detects")
    env.add_argument("--json", action="store_true")
    env.add_argument("--debug", action="store_true")


def main(args) -> int:
    info = report()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0
