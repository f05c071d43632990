"""glibc's malloc, on CPU runs: keep freed memory for the next step instead of handing it to the kernel.

glibc maps every block above its mmap threshold (adapting from 128 KiB up to 32 MiB on 64-bit) with its
own mmap and unmaps it when freed. A training step frees and allocates the same large tensors every
step: the word embeddings' gradient (the default model's: 30522 x 384 fp32, 45 MiB, always above the
threshold), autocast's bf16 copies of the weights, an evaluation batch's activations. Each time the
kernel faults their pages in and zeroes them anew: 10-25% of the default model's CPU step.

`keep_freed_memory` makes glibc serve every block from its heap (M_MMAP_MAX 0) and keep up to
KEEP bytes freed at the heap's top (M_TRIM_THRESHOLD), so a step reuses the pages of the one before.
benchmarks/allocator.py measures it: the training step's time, evaluation's, and peak resident memory.
`restore` puts glibc's defaults back when a run ends (effitrain.train may run inside a longer program).
Other C libraries, and allocators preloaded in glibc's place (jemalloc, tcmalloc), are left alone.

`bound_primitive_cache` caps oneDNN's cache of compiled kernels ("primitives"), through which CPU bf16
matmuls run: one primitive per operand shape, kept up to 1024 by default, each holding its own buffers.
Batches padded to their longest example come in many widths, and a bf16 run grew ~280 MiB of resident
memory over 60 steps of the default job (fp32, on MKL, did not); at PRIMITIVES (every matmul shape of a
step, so the layers of one step still share theirs) it stays flat at the same speed."""

from __future__ import annotations

import ctypes
import functools
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
KEEP = 256 * 1024 * 1024
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536
SWITCH = "EFFITRAIN_KEEP_FREED_MEMORY"  # 0: leave glibc as it is (to measure, or to compare)
PRIMITIVES = 64
PRIMITIVE_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"  # oneDNN reads it once, at its first primitive


def bound_primitive_cache() -> None:
    """oneDNN's primitive cache held to PRIMITIVES, unless the environment sets it: call before the
    process's first oneDNN kernel (its first bf16 matmul), or it has no effect."""
    os.environ.setdefault(PRIMITIVE_CACHE, str(PRIMITIVES))


@functools.cache  # platform.libc_ver reads the interpreter's binary
def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)  # this process's own C library
    except OSError:
        return None


def keeps_freed_memory() -> bool:
    """Whether a CPU run in this environment will keep freed memory (what `keep_freed_memory` would do),
    without changing anything: the memory planner's CPU overhead model depends on it."""
    return _glibc() is not None and os.environ.get(SWITCH, "1") != "0"


def keep_freed_memory() -> bool:
    """glibc keeps freed blocks for reuse; whether it applied (glibc only, and unless SWITCH is 0)."""
    libc = _glibc()
    if not keeps_freed_memory():
        return False
    if libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, KEEP):
        return True
    restore()  # not half set: the caller registers no restore when this returns False
    return False


def give_back() -> None:
    """Return the free memory at the heap's top to the kernel (after an out-of-memory error)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def restore() -> None:
    """glibc's own settings again (its thresholds then stay fixed: glibc adapts them only until set)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
