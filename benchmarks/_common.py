"""What the benchmark scripts share (not a benchmark of its own): the machine's description, CPU and
memory readings, number formatting, tables, fresh-process runs where the sides take turns, and the
`--dry-run` set-up.

A script in a topic folder (speedups/, techniques/, planner/, peers/, gpu/) imports it with benchmarks/ put
first on sys.path, and a sibling script as `topic.module` (`from speedups.dropout import make_step`):

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
    import _common  # noqa: E402

Importing it takes the topic folders themselves off sys.path (Python puts a script's own folder first): a
script's name may not shadow a library (benchmarks/peft.py once shadowed peft, hence peft_vs_full.py).

Dry runs (`script.py --dry-run`, all of them through `pytest tests/integration/test_benchmarks.py`): `dry_run_model()`
writes a tiny BERT (2 layers, hidden 32, random weights, the packaged all-MiniLM tokenizer: the tests'
`tiny_model_dir`) to a temporary folder, or takes the one named by EFFITRAIN_BENCH_DRY_RUN_MODEL, and
makes effitrain's `default` model that folder, in this process and in every child process that imports
this module (the variable is inherited); a child that does not (`python -m effitrain train`) is given
`--model FOLDER`. Dry runs use one torch thread (OMP_NUM_THREADS=1 for the children).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, TypeVar

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve().parent != BENCHMARKS]  # see above
DRY_RUN_MODEL = "EFFITRAIN_BENCH_DRY_RUN_MODEL"  # the tiny model's folder, for the children of a dry run
MiB = 2**20
Side = TypeVar("Side")


# --- the machine -------------------------------------------------------------------------------------


def machine(torch_version: bool = False, gpu: bool = True) -> str:
    """`CPU name, N cores, torch threads T[, torch VERSION][, GPU NAME]`."""
    import torch

    from effitrain.runtime.devices import cpu_name

    text = f"{cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    if torch_version:
        text += f", torch {torch.__version__}"
    if gpu and torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name(0)}"
    return text


def cpu_snapshot(children: bool = False) -> tuple[float, float | None, float]:
    """(wall clock, CPU seconds all processes have used so far (/proc/stat), CPU seconds of this process,
    and with `children` of its finished children too)."""
    busy = None
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) if children else (resource.RUSAGE_SELF,)
    own = sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime for w in who)
    return time.perf_counter(), busy, own


def cpu_share(start, end) -> dict:
    """CPU use between two cpu_snapshot()s: this process's, and everyone else's (cores busy on average)."""
    seconds = end[0] - start[0]
    own = end[2] - start[2]
    other = None if start[1] is None or end[1] is None else max(end[1] - start[1] - own, 0.0)
    return {"seconds": seconds, "own_cpu_seconds": own, "own_cores": own / seconds,
            "other_cpu_seconds": other, "other_cores": None if other is None else other / seconds}


def cores(start, end) -> dict:
    """cpu_share's seconds, own_cores and other_cores only."""
    share = cpu_share(start, end)
    return {key: share[key] for key in ("seconds", "own_cores", "other_cores")}


# --- memory ------------------------------------------------------------------------------------------


def rss_peak_bytes() -> int:
    """This process's peak resident set (ru_maxrss; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def status_bytes(key: str) -> int:
    """A kB line of /proc/self/status in bytes: VmRSS (resident now), VmHWM (its peak), RssFile, ..."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


# --- numbers and tables ------------------------------------------------------------------------------


def mib(value, unit: str = " MiB") -> str:
    """Bytes as whole MiB, `-` for None."""
    return "-" if value is None else f"{value / MiB:.0f}{unit}"


def fmt(value, spec: str) -> str:
    """`-` for None, else the value through a format spec (`.2f`) or a template (`{:.0f} s`)."""
    if value is None:
        return "-"
    return spec.format(value) if "{" in spec else format(value, spec)


def print_columns(header: tuple, rows: list[tuple]) -> None:
    """The first column left-aligned, the others right-aligned, each as wide as its widest cell."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table; None is an empty cell, `|` in a cell is escaped."""
    cell = lambda v: "" if v is None else str(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


# --- fresh processes, taking turns -------------------------------------------------------------------


def take_turns(sides: Iterable[Side], rounds: int, run: Callable[[Side], dict]) -> dict[Side, list[dict]]:
    """side -> its `rounds` results, the sides taking turns (side 1, side 2, ..., then again), so that a
    busier moment of the machine hits every side rather than one."""
    results: dict = {side: [] for side in sides}
    for _ in range(rounds):
        for side in results:
            results[side].append(run(side))
    return results


def measure_as_the_command() -> None:
    """What `effitrain train` sets in its own process before its first step, set in this one (for scripts
    that train in-process): oneDNN's kernel cache bounded (speedups/allocator.py), which moves bf16 speed
    and memory both ways (a BERT-base-shaped LoRA pass under jemalloc grew 2 GiB a pass and ran 2x slower
    unbounded; the default job's full fine-tuning passes ran 16% slower bounded: lora_step results)."""
    from effitrain.speedups import allocator

    allocator.bound_primitive_cache()


def timed_turns(calls: dict[str, Callable[[], object]], rounds: int, steps: int,
                warmup: int = 2) -> dict[str, list[float]]:
    """name -> the seconds of each of its timed calls. Each call runs `warmup` times first; then the names take
    turns, `rounds` times, each turn one untimed call and `steps` timed ones. The untimed call: the first call
    after another name's runs slower (caches, the allocator's free blocks: a full fine-tuning pass of the
    default job in bf16 1.2-1.7 s slower in 8.5, benchmarks/results/lora_step_xeon2c_2026-12-05.md)."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            if len(calls) > 1:
                call()
            for _ in range(steps):
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    return times


def child_json(command: list[str], env: dict | None = None) -> dict:
    """Run `command` in a fresh process (its own peak memory, heap and threads) and return the JSON object
    on the last line of its stdout. A failed child stops the script with the end of its output."""
    done = run_checked(command, env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_checked(command: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `command` in a fresh process, its output captured; a failure stops the script with the end of
    that output."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        raise SystemExit(f"{' '.join(command[1:4])} ... failed (exit code {done.returncode})")
    return done


# --- dry runs ----------------------------------------------------------------------------------------


def _one_thread() -> None:
    """Dry runs use one thread: two torch threads on two cores that other processes keep busy wait on
    each other (a tiny model's step measured 10x slower with two)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # the children
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _use_model(folder: Path) -> None:
    """effitrain's `default` model is `folder` in this process."""
    from effitrain.models import loading

    loading.default_model_dir = lambda: folder


def dry_run_model() -> Path:
    """A tiny BERT classifier saved to a temporary folder (removed at exit), made effitrain's `default`
    model here and in the child processes started from here (DRY_RUN_MODEL in the environment)."""
    _one_thread()
    if os.environ.get(DRY_RUN_MODEL):  # made already (tests/integration/test_benchmarks.py makes one for all scripts)
        folder = Path(os.environ[DRY_RUN_MODEL])
    else:
        folder = _tiny_model()
    _use_model(folder)
    print(f"dry run: the `default` model is a tiny BERT (2 layers, hidden 32, random weights) in {folder}, one "
          "thread; nothing is written to benchmarks/results", flush=True)
    return folder


def _tiny_model() -> Path:
    """tests/conftest.py's tiny_model_dir, in a temporary folder removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="bench-dry-run-")) / "tiny-bert"
    atexit.register(shutil.rmtree, folder.parent, True)
    save_tiny_bert(folder, one_thread=True)
    os.environ[DRY_RUN_MODEL] = str(folder)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return folder


def save_tiny_bert(folder: Path, one_thread: bool = False) -> Path:
    """tests/conftest.py's tiny_model_dir written to `folder` (the dry runs' model, gpu/gpu_equivalence.py's):
    a 2-layer, hidden-32 BERT classifier, random weights from seed 0 (torch's generator left as it was),
    dropout off so that runs which see the same examples compute the same arithmetic, the packaged
    all-MiniLM tokenizer. `one_thread`: torch set to one thread first (a dry run)."""
    from effitrain.models.loading import default_model_dir
    from effitrain.runtime.libraries import quiet_import_warnings, quiet_libraries

    quiet_import_warnings()
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    quiet_libraries(debug=False)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if one_thread:
        torch.set_num_threads(1)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    torch.random.set_rng_state(state)
    tokenizer.save_pretrained(folder)
    return folder


def profiled_events(step: Callable[[], None], steps: int = 3) -> list:
    """torch.profiler's per-operator averages (self CPU time over all `steps`) of `steps` calls of `step`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]


def run_under_effitrains_allocator() -> None:
    """Re-execute this script once under the allocator the `effitrain` command preloads (tcmalloc where
    installed; EFFITRAIN_ALLOCATOR chooses), so that the runs it starts get it too; say which."""
    from effitrain.speedups import allocator

    allocator.preload()
    print(f"allocator: {' '.join(allocator.serving())}", flush=True)


def module_at(revision: str, path: str):
    """The Python module at `path` (from the repository root) as it was at git `revision`, loaded under a
    name of its own; None where git cannot show it (no history: a shallow clone)."""
    import importlib.util

    shown = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True,
                           cwd=BENCHMARKS)
    if shown.returncode:
        return None
    name = "previous_" + Path(path).stem
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / f"{name}.py"
        file.write_text(shown.stdout)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def skipped(what: str) -> None:
    """One line saying what a dry run leaves out."""
    print(f"dry run: skipped {what}", flush=True)


if os.environ.get(DRY_RUN_MODEL):  # a child process of a dry run
    _use_model(Path(os.environ[DRY_RUN_MODEL]))
