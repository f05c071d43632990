"""A worker of `effitrain launch` and its launcher: the variables the launcher leaves in its workers'
environment, and a worker that ends with its launcher however the launcher dies, instead of training on
alone and holding the output folder's lock."""

from __future__ import annotations

import os
import signal
import sys

from effitrain.runtime import distributed

# Set in the workers' environment: they leave the one line to this launcher.
LAUNCHED = "EFFITRAIN_LAUNCHED"
# The launcher's process id, in the workers' environment: a worker ends when that process dies.
LAUNCHER_PID = "EFFITRAIN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def is_launched_worker() -> bool:
    """A worker of `effitrain launch`: the launcher prints the job's one line (user error, signal)."""
    return distributed.started_by_torchrun() and os.environ.get(LAUNCHED) == "1"


# A worker inside a C++ call (a store connect, retried for its whole timeout; a collective) runs no Python
# signal handler until the call returns: after its launcher's death it gets this long to start unwinding
# on its SIGTERM, and that long to finish (torchrun's shutdown timeout), then it ends outright.
START_UNWIND_SECONDS, FINISH_UNWIND_SECONDS = 5.0, 30.0


def end_with_launcher(unwinding: list | None = None) -> None:
    """In a worker of `effitrain launch`: SIGTERM when the launcher dies, however it dies (SIGKILL, the
    out-of-memory killer), so the worker unwinds as on any SIGTERM (its latest complete checkpoint kept, a
    save in progress removed, the output folder released) instead of training on alone and holding the
    folder's lock: torch's agent starts each worker in a session of its own, out of reach of a signal to
    the launcher's process group, and no agent is left to forward one. Linux's PR_SET_PDEATHSIG, which
    fires when the thread that started the worker ends: torch's agent starts them from its main thread.
    A launcher already gone is noticed here; a live process of that id that is not the parent means the
    variables were copied from a worker's environment (nothing to follow). `unwinding`: the signals the
    command's handler has received (cli.py); given, a thread ends the worker if it is stuck in C++."""
    try:
        launcher = int(os.environ.get(LAUNCHER_PID, ""))
    except ValueError:
        return
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    if os.getppid() == launcher:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() == launcher:  # still alive after the call: the signal will come when it dies
            if unwinding is not None:
                _watch_launcher(launcher, unwinding)
            return
    elif _alive(launcher):
        return
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher died before this worker could follow it


def _watch_launcher(launcher: int, unwinding: list) -> None:
    import threading
    import time

    def watch():
        while os.getppid() == launcher:
            time.sleep(0.5)
        deadline = time.monotonic() + START_UNWIND_SECONDS
        while not unwinding and time.monotonic() < deadline:
            time.sleep(0.1)
        if unwinding:  # the handler runs: it unwinds the run (removes a save in progress, releases the folder)
            time.sleep(FINISH_UNWIND_SECONDS)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="effitrain-follows-launcher", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
