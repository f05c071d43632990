"""The process tuned for training, in one home: each setting switched on at the moment it needs (the
allocator itself is chosen earlier, before torch is loaded: allocator.preloading, first in `__main__`).

    setting_up(cleanup)               around a run's set-up (engine/run.py): oneDNN's kernel cache bounded,
                                      the cyclic garbage collector paused, then what the set-up built frozen
    keep_freed_memory(device, ...)    once the run's device is known (engine/setup.py): glibc keeps freed
                                      memory on CPUs, its own settings back when the run ends
    give_back(device)                 after an out-of-memory error (engine/step.py): cached memory returned
    ending_process()                  as the `effitrain` command's process ends (`__main__`)

Why each one pays, with the figures: benchmarks/results/training_loop_epyc2c_2026-12-04.md (the garbage
collector), benchmarks/results/allocator_epyc2c_2026-12-04.md (kept memory, oneDNN's cache)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys

from effitrain.speedups import allocator


@contextlib.contextmanager
def setting_up(cleanup: contextlib.ExitStack):
    """oneDNN's kernel cache bounded before the set-up's first bf16 matmul (precision.choose may time one).
    Python's cyclic garbage collector off while the run sets up, then everything it holds frozen until the
    run ends: the imports and the model's load create objects enough to set off several full collections,
    each walking all of them, and frozen they are skipped by the collections of the training loop and the
    evaluation (which free almost nothing cyclic: tensors go by reference count). The collector's state is
    put back as the run ends, also when it raises: the caller's program continues with its objects
    collectable again."""
    allocator.bound_primitive_cache()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        cleanup.callback(gc.unfreeze)
        if was_enabled:
            gc.enable()


def keep_freed_memory(device, cleanup: contextlib.ExitStack) -> None:
    """On a CPU, each step reuses the last one's pages (allocator.keep_freed_memory); glibc's own settings
    come back when `cleanup` closes."""
    if device.type == "cpu" and allocator.keep_freed_memory():
        cleanup.callback(allocator.restore)


def give_back(device) -> None:
    """After an out-of-memory error: the failed step's tensors are gone; give their cached blocks back
    (CUDA's caching allocator, or what the C allocator kept for reuse)."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    else:
        allocator.give_back()


def ending_process(code: int = 0) -> None:
    """The command is done and the process ends: the interpreter's teardown would run full garbage
    collections over every object the imports made (torch, transformers, datasets), only to free memory
    the system takes back anyway. Frozen objects are skipped; the teardown still joins threads, runs
    atexit handlers and closes files (ours are closed by then).

    A worker of a launched job (torchrun's WORLD_SIZE > 1) ends here with `code`, after flushing its output:
    its process group is destroyed by then, but a C++ thread of the distributed libraries could still be torn
    down by the static destructors after Python, and under load a 2-process fsdp run aborted there ("terminate
    called without an active exception", exit -6) after writing every file. os._exit skips those destructors
    (and atexit handlers: the run's files, trackers and logs are closed before this point)."""
    gc.freeze()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
