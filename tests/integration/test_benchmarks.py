"""benchmarks/ as a suite: every script (benchmarks/<topic>/<name>.py) runs with --dry-run (a tiny model, 1-2
steps, a few examples, one thread; nothing written to benchmarks/) in a fresh process and exits 0, so that a
rename in the engine breaks this test rather than a benchmark weeks later. The list of scripts is read from
the folders: a new script without --dry-run fails here. Nothing here checks a figure: the dry runs measure a
tiny model on a busy machine.

The dry runs take 1 to 60 s each on a busy 2-core machine (mostly starting Python processes and importing
torch: several scripts measure in fresh processes), minutes in all: marked slow. Each script runs as `python
SCRIPT --dry-run` would, but forked from a process of this module that imported torch, transformers and
effitrain once (tests/hooks/preloaded_scripts.py): those imports were half the dry runs' CPU. The processes a
script starts are fresh interpreters. EFFITRAIN_DRY_RUNS_FRESH=1 runs each script in a fresh interpreter."""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
TOPICS = {"speedups", "techniques", "planner", "peers", "gpu"}
# Imported by the scripts, not run: memory_plan.py --runs's rows; rl_plan_runs.py's reward file; the peer comparisons' set-up and result writer.
HELPERS = {"planner/memory_plan_runs", "planner/spread_reward", "peers/_sides", "peers/_report"}
PRELOADED = ROOT / "tests" / "hooks" / "preloaded_scripts.py"
TIMEOUT = 300  # seconds a dry run may take


def modules() -> list[str]:
    """benchmarks/<topic>/*.py as `topic/name`, the packages' __init__ and the helpers left out."""
    found = (path.relative_to(BENCHMARKS).with_suffix("").as_posix() for path in BENCHMARKS.glob("*/*.py"))
    return sorted(name for name in found if not name.endswith("/__init__") and name not in HELPERS)


def scripts() -> list[str]:
    """The modules that run as scripts (an `if __name__ == "__main__":` block)."""
    return [name for name in modules() if '\nif __name__ == "__main__":' in (BENCHMARKS / f"{name}.py").read_text()]


def written(folder: Path) -> tuple[set[str], dict[str, float]]:
    """The files under `folder` (but __pycache__), and when each results/ file was last written."""
    files = {p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    return ({str(p.relative_to(folder)) for p in files},
            {str(p): p.stat().st_mtime for p in files if p.parent.name == "results"})


def test_every_script_sits_in_a_topic_folder():
    """benchmarks/ holds the shared helpers, the GPU entry point, the README and results/; scripts live in
    the topic packages (importable as `topic.module` by their siblings)."""
    assert {p.name for p in BENCHMARKS.iterdir() if p.is_file()} >= {"_common.py", "gpu_check.sh", "README.md"}
    assert {p.name for p in BENCHMARKS.glob("*.py")} == {"_common.py"}
    folders = {p.name for p in BENCHMARKS.iterdir() if p.is_dir() and p.name != "__pycache__"
               and not p.name.startswith(".")}
    assert folders == TOPICS | {"results"}
    assert all((BENCHMARKS / topic / "__init__.py").is_file() for topic in TOPICS)


def test_every_script_is_listed_and_has_a_dry_run():
    found = scripts()
    assert len(found) >= 17 and "peers/vs_trainer" in found and "gpu/_gpu_check" in found
    assert "peers/vs_trl_grpo" in found  # its dry run without TRL: the effitrain side alone
    assert found == modules(), f"not scripts (no __main__ block): {sorted(set(modules()) - set(found))}"
    missing = [name for name in found if "--dry-run" not in (BENCHMARKS / f"{name}.py").read_text()]
    assert not missing, f"scripts without --dry-run: {missing}"


def dry_run_environment(tiny_model_dir: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
            "EFFITRAIN_BENCH_DRY_RUN_MODEL": str(tiny_model_dir)}  # _common.dry_run_model: built once here


class Preloaded:
    """tests/hooks/preloaded_scripts.py, started once: runs a script in a process forked from it."""

    def __init__(self, env: dict):
        self.server = subprocess.Popen([sys.executable, str(PRELOADED)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env)
        self.pending = b""  # read but not yet answered: both of a quick script's answers can come in one read
        assert self.answer(TIMEOUT).get("ready"), "the preloading process did not start"

    def answer(self, timeout: float) -> dict:
        """The server's next answer; {} after `timeout` seconds or once it has stopped."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.server.stdout], [], [], left)[0]:
                return {}
            chunk = os.read(self.server.stdout.fileno(), 65536)
            if not chunk:
                return {}
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, script: Path, args: list[str], cwd: Path) -> tuple[int | None, str, str, float | None]:
        """(exit code, None after TIMEOUT; stdout; stderr; CPU seconds of its processes)."""
        out, err = cwd / "dry-run.stdout", cwd / "dry-run.stderr"
        request = {"script": str(script), "args": args, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.server.stdin.write(json.dumps(request).encode() + b"\n")
        self.server.stdin.flush()
        started = self.answer(TIMEOUT)
        assert "pid" in started, f"the preloading process stopped (exit code {self.server.poll()})"
        pid = started["pid"]
        ended = self.answer(TIMEOUT)
        if not ended:  # its process group stopped; the server then answers
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self.answer(TIMEOUT)
        texts = [path.read_text() if path.is_file() else "" for path in (out, err)]
        for path in (out, err):
            path.unlink(missing_ok=True)
        return ended.get("code"), *texts, ended.get("cpu")

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


@pytest.fixture(scope="module")
def preloaded(tiny_model_dir):
    if os.environ.get("EFFITRAIN_DRY_RUNS_FRESH") == "1":
        yield None
        return
    runner = Preloaded(dry_run_environment(tiny_model_dir))
    yield runner
    runner.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", scripts())
def test_the_dry_run_exits_0_and_writes_nothing_to_benchmarks(name, tiny_model_dir, preloaded, tmp_path):
    before = written(BENCHMARKS)
    started = time.perf_counter()
    script = BENCHMARKS / f"{name}.py"
    if preloaded is None:
        done = subprocess.run([sys.executable, str(script), "--dry-run"], capture_output=True, text=True,
                              cwd=tmp_path, env=dry_run_environment(tiny_model_dir), timeout=TIMEOUT)
        code, stdout, stderr, cpu = done.returncode, done.stdout, done.stderr, None
    else:
        code, stdout, stderr, cpu = preloaded.run(script, ["--dry-run"], tmp_path)
    seconds = time.perf_counter() - started
    assert code == 0, f"exit code {code}\n" + stdout[-3000:] + stderr[-5000:]
    assert written(BENCHMARKS) == before
    assert "dry run" in stdout.lower(), stdout[-2000:]
    print(f"{name}: {seconds:.1f} s" + ("" if cpu is None else f", {cpu:.1f} CPU s"))
