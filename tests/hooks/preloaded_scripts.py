"""Python scripts run as `python SCRIPT ARGS...` would run them, each in a process forked from this one after
torch, transformers and effitrain are imported once: the benchmarks' dry runs
(tests/integration/test_benchmarks.py) otherwise spend about half their CPU importing the same libraries in
every fresh interpreter (3-5 CPU s each on a busy 2-core machine). The processes a script starts itself
(`sys.executable ...`) are fresh interpreters as before.

    python tests/hooks/preloaded_scripts.py   # then one JSON request per line on stdin

A request `{"script", "args", "cwd", "stdout", "stderr"}` starts the script in a forked child (its own session,
so that its whole process group can be stopped), answers `{"pid": PID}`, then `{"code": EXIT CODE, "cpu":
user + system seconds of the child and the processes it waited for}` when it has ended. The child runs as
the script's own interpreter would: `__main__` from the file (runpy), sys.argv and sys.orig_argv the script's
(a re-execution under another allocator, `os.execve(sys.executable, sys.orig_argv[1:])`, starts the script
again), the script's folder first on sys.path, its working directory, its output in the named files, atexit
handlers run at its end. The environment is this process's: start it with the scripts' environment (libraries
read some variables when imported: OMP_NUM_THREADS, HF_HUB_OFFLINE)."""

from __future__ import annotations

import json
import os
import sys


def preload() -> None:
    """What nearly every benchmark imports first; imported here once, never run (no thread pool is started
    before a fork)."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer  # noqa: F401

    import effitrain.cli  # noqa: F401
    import effitrain.engine.run  # noqa: F401
    import effitrain.planning.planner  # noqa: F401


def child(request: dict) -> None:
    """In the forked process: become `python SCRIPT ARGS` and run; never returns."""
    import atexit
    import runpy

    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        for fd, name in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.close(0)
        os.open(os.devnull, os.O_RDONLY)  # fd 0 again: the script reads nothing of the requests
        script = os.path.abspath(request["script"])
        sys.argv = [script, *request["args"]]
        sys.orig_argv = [sys.executable, script, *request["args"]]
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> None:
    preload()
    answer({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        answer({"pid": pid})
        _, status, usage = os.wait4(pid, 0)
        answer({"code": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime})


if __name__ == "__main__":
    serve()
