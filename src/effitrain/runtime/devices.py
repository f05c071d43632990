"""What the hardware is and what it does fast: accelerators, CPU flags and native bf16, memory
sizes and peaks (the facts behind `effitrain env` and the precision choice)."""

from __future__ import annotations

import os
import platform
import resource
from pathlib import Path


def has_accelerator() -> bool:
    import torch

    if hasattr(torch, "accelerator"):  # torch >= 2.6
        return torch.accelerator.is_available()
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or bool(mps and mps.is_available()) or bool(xpu and xpu.is_available())


def accelerator_count() -> int:
    """This machine's accelerators (0 on a CPU-only one): one launched process each."""
    import torch

    if hasattr(torch, "accelerator"):
        return torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    return torch.cuda.device_count()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bf16_matmul_speedup(size: int = 384, repeats: int = 5) -> float:
    """fp32 time / bf16 time of a matmul on this CPU (> 1: bf16 is faster). About 0.1 s."""
    import time

    import torch

    def timed(dtype):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        return time.perf_counter() - start

    return timed(torch.float32) / timed(torch.bfloat16)


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are only fast on CPUs with native bf16 units (AVX-512 BF16 or AMX); on AVX2 they
    are emulated, 80-350x slower than fp32 on this project's machines."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def total_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def peak_memory_bytes(device) -> int:
    """Peak allocated accelerator memory, or the process's peak resident set on CPU."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resident_peak_bytes()


def resident_peak_bytes() -> int:
    """This process's peak resident set since it started its program: Linux's VmHWM. Not ru_maxrss, which keeps
    the peak from before exec, and a forked child starts with its parent's resident set as its own: effitrain
    started from a notebook or a test worker holding 1.7 GB reported 1.7 GB whatever it used."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: the kernel's KiB
