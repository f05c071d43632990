"""The effitrain CLI with faults injected, for tests that need a process (or torchrun workers) to
fail in a controlled place; production code has no test hooks.

    python tests/hooks/patched_cli.py [--oom-above N [--oom-rank R]] [--save-pause S] [--store-hang DIR] -- ...

With `-- launch ... -- train ...`, the launched workers run this file with the same hooks.

--oom-above N: a forward of more than N examples raises an out-of-memory error (on rank R only, if
given), as a device too small for the micro-batch would. --save-pause S: a checkpoint save holds
S seconds after writing its files and before its rename, so that a test can kill the run mid-save.
--store-hang DIR: a launched worker, once it follows its launcher, writes DIR/<pid> and connects to a
store nobody serves (inside torch's C++ connect loop, where no Python signal handler runs) for 300 s."""

from __future__ import annotations

import argparse
import os
import sys
import time


def inject_out_of_memory(limit: int, rank: str | None = None, patch=setattr) -> None:
    """The training steps' forwards only (not the planner's simulation on fake tensors); `patch`:
    setattr, or a test's monkeypatch.setattr so that the patch is undone."""
    from effitrain.engine import memory_fit
    from effitrain.engine.step import StepRunner

    if rank is not None and os.environ.get("RANK", "0") != rank:
        return
    real_init = StepRunner.__init__

    def init(self, accelerator, task, *args, **kwargs):
        real_init(self, accelerator, SmallDevice(task, limit, memory_fit.OutOfMemoryError), *args, **kwargs)

    patch(StepRunner, "__init__", init)


class SmallDevice:
    """A task whose forwards of more than `limit` examples run out of memory."""

    def __init__(self, task, limit: int, error: type):
        self.task, self.limit, self.error = task, limit, error

    def __getattr__(self, name):
        return getattr(self.task, name)

    def train_loss(self, model, batch):
        if len(next(iter(batch.values()))) > self.limit:
            raise self.error(f"test hook: more than {self.limit} examples do not fit")
        return self.task.train_loss(model, batch)


def pause_saves(seconds: float) -> None:
    from effitrain.engine import checkpoint

    real = checkpoint._fsync_tree

    def fsync_then_wait(path):
        real(path)
        time.sleep(seconds)

    checkpoint._fsync_tree = fsync_then_wait


def hang_in_store_connect(folder: str) -> None:
    from datetime import timedelta
    from pathlib import Path

    from effitrain.runtime import launcher

    follow = launcher.end_with_launcher

    def follow_then_hang(*args):
        follow(*args)
        import socket

        import torch.distributed as dist

        with socket.socket() as unserved:  # bound, never listening: every connect is refused, then retried
            unserved.bind(("127.0.0.1", 0))
            (Path(folder) / str(os.getpid())).touch()
            dist.TCPStore("127.0.0.1", unserved.getsockname()[1], 2, False, timedelta(seconds=300))

    launcher.end_with_launcher = follow_then_hang


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--oom-above", type=int)
    parser.add_argument("--oom-rank")
    parser.add_argument("--save-pause", type=float)
    parser.add_argument("--store-hang")
    hooks = parser.parse_args(argv[:split])
    if hooks.oom_above is not None:
        inject_out_of_memory(hooks.oom_above, hooks.oom_rank)
    if hooks.save_pause:
        pause_saves(hooks.save_pause)
    if hooks.store_hang and os.environ.get("TORCHELASTIC_RUN_ID"):  # the workers, not the launcher
        hang_in_store_connect(hooks.store_hang)
    from effitrain.commands import launch

    launch.WORKER_PROGRAM = [__file__, *argv[:split], "--"]
    from effitrain.cli import main as cli_main

    return cli_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
