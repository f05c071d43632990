"""What `effitrain report` reads: the run folders given (train runs, bench variants), their
config.yaml, log.jsonl and metrics.json, and what is missing from a run still training or stopped."""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effitrain.errors import UserError
from effitrain.outputs import files, run_folder

GENERATOR = "effitrain report"  # in the page's <meta name="generator"> and the PNGs' Software chunk
PAGE = "report.html"  # what train and bench write into their folder


PNG_CHARTS = ("curves", "confusion")  # <page stem>-<chart>.png


# Settings that differ between any two runs without saying anything about the training.
NOT_SETTINGS = {"output_dir", "overwrite", "resume", "debug"}


def png_names(page: str = PAGE) -> set[str]:
    stem = Path(page).stem
    return {f"{stem}-{chart}.png" for chart in PNG_CHARTS}


@dataclass
class ReportedRun:
    """What one run folder holds, as far as the run got."""

    path: Path
    name: str = ""
    config: dict = field(default_factory=dict)  # config.yaml (the resolved config, with `plan`)
    metrics: dict = field(default_factory=dict)  # metrics.json (only once the run has finished)
    model_config: dict = field(default_factory=dict)  # model/config.json
    steps: list[dict] = field(default_factory=list)  # log.jsonl's training windows, one per step
    evals: list[dict] = field(default_factory=list)  # log.jsonl's evaluations (split validation | test)
    events: list[dict] = field(default_factory=list)  # memory plan, out-of-memory retries, skipped steps
    status: str = "finished"  # finished | training | stopped
    notes: list[str] = field(default_factory=list)  # what is missing or odd, said at the top of its section

    @property
    def task(self) -> str | None:
        return self.config.get("task") or self.metrics.get("task")

    def final(self, key: str) -> Any:
        """A measure of the run: metrics.json's, else the last logged step's (a run not finished)."""
        if key in self.metrics:
            return self.metrics[key]
        logged = {"train_samples_per_second": "samples_per_second", "train_tokens_per_second": "tokens_per_second",
                  "peak_memory_bytes": "peak_memory_bytes", "train_loss": "loss", "steps": "step",
                  "train_reward": "reward"}.get(key)
        return self.steps[-1].get(logged) if logged and self.steps else None

    @property
    def is_rl(self) -> bool:
        """Online RL (--rl): its steps log rewards of sampled completions and the seconds generation took."""
        return bool(self.config.get("rl")) or any("generation_seconds" in record for record in self.steps[:1])

    def reward_functions(self) -> list[str]:
        """The reward functions' own columns of the log (reward_<name>), in the log's order."""
        if not self.is_rl or not self.steps:
            return []
        return [key for key in self.steps[-1] if key.startswith("reward_")]

    def memory_plan(self) -> dict | None:
        """What --memory-budget predicted: metrics.json's, else the log's (a run not finished)."""
        if self.metrics.get("memory_plan"):
            return self.metrics["memory_plan"]
        logged = next((e for e in reversed(self.events) if "memory_plan" in e), None)  # resumed: the last
        if logged is None:
            return None
        return {"note": logged["memory_plan"], **{key: logged.get(key) for key in PLAN_BYTES}}

    def predicted_peak(self) -> float | None:
        """The plan's peak of the whole process: what was in use before the model plus the prediction
        (the planner counts the model, its training and the allocator's overhead, not what came before)."""
        plan = self.memory_plan() or {}
        predicted, before = plan.get("predicted_peak_bytes"), plan.get("in_use_bytes") or 0
        return predicted + before if finite(predicted) and finite(before) else None


    def model_bytes(self) -> int | None:
        """The size of model/ on disk (weights, config, tokenizer): what a user ships."""
        folder = self.path / "model"
        sizes = [p.stat().st_size for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
        return sum(sizes) if sizes else None


PLAN_BYTES = ("budget_bytes", "predicted_peak_bytes", "in_use_bytes")


@dataclass
class Distilled:
    """A student given with its teacher's run (--distill-from named that run's model/ or best/), and the runs of
    the same student trained without a teacher (the same --model and --student-layers)."""

    teacher: ReportedRun
    student: ReportedRun
    alone: list[ReportedRun]


def distilled_pairs(runs: list[ReportedRun]) -> list[Distilled]:
    """Each distilled student among `runs` whose teacher is among them too."""
    def folder(value) -> Path | None:
        return Path(str(value)).expanduser().resolve() if value else None

    pairs = []
    for student in runs:
        teacher_folder = folder(student.config.get("distill_from"))
        teacher = next((run for run in runs if run is not student and teacher_folder in
                        (run.path.resolve() / "model", run.path.resolve() / "best", run.path.resolve())), None)
        if teacher is None:
            continue
        alone = [run for run in runs if run not in (student, teacher) and not run.config.get("distill_from")
                 and run.config.get("model") == student.config.get("model")
                 and run.config.get("student_layers") == student.config.get("student_layers")]
        pairs.append(Distilled(teacher, student, alone))
    return pairs


@dataclass
class StepSplit:
    """Online RL: where a log window's steps spent their time, in seconds per step (means over the window)."""

    step: int  # the window's last step
    steps: int  # the steps it holds
    generation: float  # sampling the completions (the objective's rollout, scoring included)
    update: float  # the rest of the step: the forwards and backwards of the update, the optimizer

    @property
    def total(self) -> float:
        return self.generation + self.update


def step_splits(steps: list[dict]) -> list[StepSplit]:
    """Each window's split from log.jsonl: generation_seconds (a mean per step) against the training seconds
    the window took (elapsed_seconds counts training alone: no evaluation, saving or compiling; a resumed
    run's goes on from its checkpoint's), per step."""
    out: list[StepSplit] = []
    previous_step, previous_seconds = 0, 0.0
    for record in steps:
        step, elapsed, generation = record["step"], record.get("elapsed_seconds"), record.get("generation_seconds")
        if not finite(elapsed):
            continue
        if finite(generation) and step > previous_step and elapsed >= previous_seconds:
            per_step = (elapsed - previous_seconds) / (step - previous_step)
            generation = min(generation, per_step)  # elapsed_seconds is rounded to milliseconds
            out.append(StepSplit(int(step), int(step - previous_step), generation, per_step - generation))
        previous_step, previous_seconds = step, elapsed
    return out


def merged_splits(splits: list[StepSplit], most: int) -> list[StepSplit]:
    """At most `most` bars: runs of consecutive windows merged, their means weighted by their steps."""
    size = -(-len(splits) // most) if splits else 1
    out = []
    for start in range(0, len(splits), size):
        part = splits[start:start + size]
        steps = sum(s.steps for s in part)
        out.append(StepSplit(part[-1].step, steps, sum(s.generation * s.steps for s in part) / steps,
                             sum(s.update * s.steps for s in part) / steps))
    return out


RUN_HINT = "pass the --output-dir of an `effitrain train` run (or of an `effitrain bench`)"


def find_runs(given: list[str]) -> list[ReportedRun]:
    """The runs named on the command line (a bench folder stands for its variants), each once, all of
    one task."""
    runs: list[ReportedRun] = []
    seen: set[Path] = set()
    for name in given:
        for folder in run_folders(Path(name)):
            if folder.resolve() in seen:
                print(f"{folder} is given more than once: reported once")
                continue
            seen.add(folder.resolve())
            runs.append(read_run(folder))
    tasks = {run.task for run in runs if run.task}
    if len(tasks) > 1:
        which = "; ".join(f"{run.path}: {run.task}" for run in runs if run.task)
        raise UserError(f"the runs are of different tasks ({which}), whose losses and metrics do not compare",
                        "report runs of one task together (or each on its own)")
    for run, label in zip(runs, short_names([run.path for run in runs])):
        run.name = label
    return runs


def run_folders(path: Path) -> list[Path]:
    """`path` as run folders: itself, or a bench's variants; a one-line error for anything else."""
    if not path.exists():
        where = next((p for p in path.parents if p.exists()), None)
        raise UserError(f"RUN {path} does not exist" + (f" (the folder {where} does)" if where and
                                                         str(where) != "." else ""), RUN_HINT)
    if not path.is_dir():
        fix = f"pass its folder: effitrain report {path.parent}" if is_run(path.parent) else RUN_HINT
        raise UserError(f"RUN {path} is a file, not a run folder", fix)
    if is_bench(path):
        variants = bench_variants(path)
        if not variants:
            raise no_variants(path)
        return variants
    if not any(path.iterdir()):
        raise UserError(f"RUN {path} is not an effitrain run: the folder is empty", RUN_HINT)
    if not is_run(path):
        inside = next((p for p in path.parents if is_run(p)), None)
        held = [p for p in sorted(path.iterdir()) if p.is_dir() and (is_run(p) or is_bench(p))]
        fix = (f"pass the run's folder: effitrain report {inside}" if inside else
               f"pass the runs in it: effitrain report {' '.join(str(p) for p in held[:3])}"
               + (" ..." if len(held) > 3 else "") if held else RUN_HINT)
        raise UserError(f"RUN {path} is not an effitrain run (no config.yaml, log.jsonl or metrics.json)", fix)
    return [path]


def no_variants(path: Path) -> UserError:
    """What a bench folder without a variant run is: still starting, stopped before its first variant
    (killed or failed: no bench.json), or done with every variant failed or skipped (bench.json says why)."""
    rerun = f"correct the bench command and rerun it with --output-dir {path} --overwrite (or another folder)"
    if run_status(path, {}) == "training":
        return UserError(f"RUN {path} is a bench still starting: no variant has run yet",
                         f"report it once its first variant has started: effitrain report {path}")
    listed = [v for v in files.read_json(path / "bench.json").get("variants", []) if isinstance(v, dict)]
    if not listed:
        return UserError(f"RUN {path} is an unfinished bench folder: it stopped (killed or failed) before its first "
                         "variant ran, and holds no bench.json", rerun)
    failed = [v for v in listed if v.get("status") == "failed"]
    counts = f"{len(failed)} failed, {len(listed) - len(failed)} skipped"
    if not failed:
        return UserError(f"RUN {path} is a bench folder in which no variant ran ({counts})", rerun)
    first, error = failed[0], str(failed[0].get("error") or "no message")
    error = error.removeprefix("effitrain: error: ").split("; fix: ")[0]
    return UserError(f"RUN {path} is a bench folder in which no variant ran ({counts}; {first.get('name')}: "
                     f"{error[:160]})", f"see {path / (str(first.get('name')) + '.log')}, then {rerun}")


def is_run(path: Path) -> bool:
    written = ("config.yaml", "log.jsonl", "metrics.json", run_folder.MARKER, run_folder.LOCK)  # a lock: a run starting
    return any((path / name).is_file() for name in written) and not is_bench(path)


def is_bench(path: Path) -> bool:
    return (path / "bench.json").is_file() or files.read_json(path / run_folder.MARKER).get("kind") == "bench"


def bench_variants(path: Path) -> list[Path]:
    """A bench's variant folders in its own order: bench.json's, else the order they started in."""
    variants = files.read_json(path / "bench.json").get("variants", [])
    listed = [v.get("name") for v in variants if isinstance(v, dict)]
    found = [p for p in path.iterdir() if p.is_dir() and (p / run_folder.MARKER).is_file() and is_run(p)]
    return sorted(found, key=lambda p: (listed.index(p.name) if p.name in listed else len(listed),
                                        (p / run_folder.MARKER).stat().st_mtime, p.name))


def read_run(path: Path) -> ReportedRun:
    run = ReportedRun(path)
    run.config = read_yaml(path / "config.yaml", run.notes)
    run.metrics = files.read_json(path / "metrics.json", run.notes)
    run.model_config = files.read_json(path / "model" / "config.json")
    read_log(path / "log.jsonl", run)
    run.status = run_status(path, run.metrics)
    say_missing(run)
    return run


def read_yaml(path: Path, notes: list[str]) -> dict:
    if not path.is_file():
        return {}
    import yaml

    try:
        value = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # C: 10x faster
    except (OSError, ValueError, yaml.YAMLError) as err:
        notes.append(f"{path.name} cannot be read ({str(err).splitlines()[0]})")
        return {}
    return value if isinstance(value, dict) else {}


def read_log(path: Path, run: ReportedRun) -> None:
    """Training windows by step and evaluations by (split, step): a resumed run logs again the steps
    after its checkpoint, and the later record is the one its weights come from."""
    if not path.is_file():
        return
    steps: dict[int, dict] = {}
    evals: dict[tuple[str, int], dict] = {}
    bad = 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            bad += bool(line.strip())  # a run killed while writing leaves half a line
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            bad += 1
        elif "split" in record:
            evals[(str(record["split"]), int(record["step"]))] = record
        elif "lr" in record:
            steps[int(record["step"])] = record
        else:
            run.events.append(record)
    run.steps = [steps[s] for s in sorted(steps)]
    run.evals = sorted(evals.values(), key=lambda r: (r["split"] == "test", r["step"]))
    if bad:
        run.notes.append(f"{bad} line(s) of log.jsonl could not be read (a run killed while writing?)")


def run_status(path: Path, metrics: dict) -> str:
    """finished (metrics.json), training (its lock is held by a live process), or stopped."""
    if metrics:
        return "finished"
    owner = files.read_json(path / run_folder.LOCK)
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return "stopped"
    if owner.get("host") != socket.gethostname():
        return "training"  # another machine's process: assume it runs (the lock file is removed at its end)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "stopped"
    except OSError:
        pass  # another user's live process
    return "training"


def say_missing(run: ReportedRun) -> None:
    if run.status == "training":
        run.notes.append("still training: what it logged so far (no metrics.json yet)")
    elif run.status == "stopped":
        run.notes.append("no metrics.json: the run stopped before it ended (killed, failed, or interrupted); "
                         "what it logged until then")
    if not run.config:
        run.notes.append("no config.yaml: its settings are unknown")
    if not run.steps:
        run.notes.append("no training step logged (log.jsonl holds none)")
    if not run.evals and not run.metrics.get("test"):
        run.notes.append("no evaluation logged yet (validation runs every --eval-every steps, or at each epoch's "
                         "end)" if run.status == "training" else "no evaluation was logged")
    if run.metrics.get("labels") and not confusion_matrix(run.metrics):
        run.notes.append("no confusion matrix: metrics.json has no test_confusion_matrix of its labels (a run of "
                         "an earlier effitrain?)")


def short_names(paths: list[Path]) -> list[str]:
    """The shortest trailing parts of the paths that tell them apart (bench/x/bf16 -> bf16)."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def confusion_matrix(metrics: dict) -> dict | None:
    """metrics.json's test_confusion_matrix if it is one: n labels, n rows of n counts."""
    matrix = metrics.get("test_confusion_matrix")
    if not isinstance(matrix, dict) or not isinstance(matrix.get("labels"), list) or not matrix["labels"]:
        return None
    n, counts = len(matrix["labels"]), matrix.get("counts")
    square = isinstance(counts, list) and len(counts) == n and all(
        isinstance(row, list) and len(row) == n and all(isinstance(c, int) and c >= 0 for c in row) for row in counts)
    return matrix if square else None
