"""`effitrain report`: one self-contained HTML page of one run or several, from the files runs write
(config.yaml, log.jsonl, metrics.json), and PNGs of its main charts beside it.

Per run: what trained on what (config, data, model), loss, learning rate, grad norm, throughput and
memory over the steps, the evaluations, the test confusion matrix (classification) and the memory
plan against the measured peak (--memory-budget). Several runs: the curves overlaid and a table of
what differs (settings, final metrics, speed, memory). A run still training, or stopped before
metrics.json, is reported as far as it got, and the page says what is missing.

The page's charts are inline SVG drawn here, and it loads nothing (no script, no URL): `effitrain
train` writes a report after every run, and drawing a few polylines costs milliseconds where
matplotlib's import and layout cost most of a second. The PNGs (for READMEs and papers) are
matplotlib's, on its Agg canvas: two figures at most.
"""

from __future__ import annotations

import html
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effitrain import outputs
from effitrain.errors import UserError

GENERATOR = "effitrain report"  # in the page's <meta name="generator"> and the PNGs' Software chunk
PAGE = "report.html"  # what train and bench write into their folder
PNG_CHARTS = ("curves", "confusion")  # <page stem>-<chart>.png
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
# Settings that differ between any two runs without saying anything about the training.
NOT_SETTINGS = {"output_dir", "overwrite", "resume", "debug"}
MiB = 2**20


def png_names(page: str = PAGE) -> set[str]:
    stem = Path(page).stem
    return {f"{stem}-{chart}.png" for chart in PNG_CHARTS}


# --- reading runs -----------------------------------------------------------------------------------

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
                  "peak_memory_bytes": "peak_memory_bytes", "train_loss": "loss", "steps": "step"}.get(key)
        return self.steps[-1].get(logged) if logged and self.steps else None

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


PLAN_BYTES = ("budget_bytes", "predicted_peak_bytes", "in_use_bytes")


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
            raise UserError(f"the bench in {path} holds no variant runs (yet)", "wait for its first variant, or "
                            "pass run folders")
        return variants
    if not is_run(path):
        inside = next((p for p in path.parents if is_run(p)), None)
        held = [p for p in sorted(path.iterdir()) if p.is_dir() and (is_run(p) or is_bench(p))]
        fix = (f"pass the run's folder: effitrain report {inside}" if inside else
               f"pass the runs in it: effitrain report {' '.join(str(p) for p in held[:3])}"
               + (" ..." if len(held) > 3 else "") if held else RUN_HINT)
        raise UserError(f"RUN {path} is not an effitrain run (no config.yaml, log.jsonl or metrics.json)", fix)
    return [path]


def is_run(path: Path) -> bool:
    written = ("config.yaml", "log.jsonl", "metrics.json", outputs.MARKER, outputs.LOCK)  # a lock: a run starting
    return any((path / name).is_file() for name in written) and not is_bench(path)


def is_bench(path: Path) -> bool:
    return (path / "bench.json").is_file() or outputs.read_json(path / outputs.MARKER).get("kind") == "bench"


def bench_variants(path: Path) -> list[Path]:
    """A bench's variant folders in its own order: bench.json's, else the order they started in."""
    variants = outputs.read_json(path / "bench.json").get("variants", [])
    listed = [v.get("name") for v in variants if isinstance(v, dict)]
    found = [p for p in path.iterdir() if p.is_dir() and (p / outputs.MARKER).is_file() and is_run(p)]
    return sorted(found, key=lambda p: (listed.index(p.name) if p.name in listed else len(listed),
                                        (p / outputs.MARKER).stat().st_mtime, p.name))


def read_run(path: Path) -> ReportedRun:
    run = ReportedRun(path)
    run.config = read_yaml(path / "config.yaml", run.notes)
    run.metrics = outputs.read_json(path / "metrics.json", run.notes)
    run.model_config = outputs.read_json(path / "model" / "config.json")
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
    owner = outputs.read_json(path / outputs.LOCK)
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


# --- numbers --------------------------------------------------------------------------------------

def number(value: Any, digits: int = 4) -> str:
    """A cell: '-' for missing, ints with thousands separators, floats to `digits` significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
        return f"{value:.{max(1, digits - 1)}e}"
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.{digits}g}"


def mib(value: Any) -> str:
    if not finite(value):
        return "-"
    return f"{value / MiB:,.0f} MiB" if value >= 10 * MiB or value == 0 else f"{value / MiB:.2g} MiB"


def times(ratio: float) -> str:
    """A ratio to the first run: 0.92x; small ones with two significant digits (adafactor's state)."""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def tick_text(value: float, step: float) -> str:
    """A tick label with as many digits as the ticks' spacing needs (tiny values, as learning rates, in
    scientific notation)."""
    power = math.floor(math.log10(step) + 1e-9)  # the step is a difference of two ticks: 9.99...e-05
    if value == 0:
        return "0"
    if abs(value) < 1e-3:
        return f"{value:.{max(0, math.floor(math.log10(abs(value))) - power)}e}"
    if abs(value) >= 1e4:
        return f"{value / 1000:g}k"
    return f"{value:.{max(0, -power + (1 if math.isclose(step / 10**power, 2.5) else 0))}f}"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 2.5 or 5 times a power of ten apart)."""
    if not hi > lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw * 0.999)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


# --- SVG charts -----------------------------------------------------------------------------------

@dataclass
class Series:
    label: str
    points: list[tuple[float, float | None]]  # (step, value); None breaks the line
    color: str
    dashed: bool = False
    markers: bool = False  # evaluations: few points, each shown


@dataclass
class Chart:
    key: str
    title: str
    series: list[Series]
    lines: list[tuple[str, float, str]] = field(default_factory=list)  # (label, y, color): memory plan, budget
    unit: str = ""


W, H, LEFT, RIGHT, TOP, BOTTOM = 400, 240, 58, 14, 12, 34


def svg_chart(chart: Chart) -> str:
    """A line chart: axes with round ticks, one path per series (gaps where values are missing),
    dashed horizontal reference lines; the legend is the figure's HTML."""
    points = [(x, y) for s in chart.series for x, y in s.points if finite(y)]
    if not points:
        return ""
    xs, ys = [x for x, _ in points], [y for _, y in points] + [y for _, y, _ in chart.lines]
    xt, yt = nice_ticks(min(xs), max(xs), 6), nice_ticks(min(ys), max(ys), 5)
    sx = lambda x: LEFT + (x - xt[0]) / (xt[-1] - xt[0]) * (W - LEFT - RIGHT)  # noqa: E731
    sy = lambda y: H - BOTTOM - (y - yt[0]) / (yt[-1] - yt[0]) * (H - TOP - BOTTOM)  # noqa: E731
    out = [f'<svg class="chart" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
           f'aria-label="{attr(chart.title)}">']
    out += axes(xt, yt, sx, sy, chart.unit)
    for label, y, color in chart.lines:
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="{color}" '
                   f'stroke-dasharray="6 3" stroke-width="1.5"><title>{esc(label)}</title></line>')
    for s in chart.series:
        out += series_marks(s, sx, sy)
    out.append("</svg>")
    return "".join(out)


def axes(xt: list[float], yt: list[float], sx, sy, unit: str) -> list[str]:
    out = [f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" fill="#fff" '
           'stroke="#999"/>']
    for y in yt:
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#e5e5e5"/>'
                   f'<text x="{LEFT - 5}" y="{sy(y) + 4:.1f}" text-anchor="end">{tick_text(y, yt[1] - yt[0])}</text>')
    for x in xt:
        out.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{H - BOTTOM}" y2="{H - BOTTOM + 4}" stroke="#999"/>'
                   f'<text x="{sx(x):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">'
                   f'{tick_text(x, xt[1] - xt[0])}</text>')
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2:.0f}" y="{H - 4}" text-anchor="middle">step</text>')
    if unit:
        out.append(f'<text x="12" y="{(TOP + H - BOTTOM) / 2:.0f}" text-anchor="middle" '
                   f'transform="rotate(-90 12 {(TOP + H - BOTTOM) / 2:.0f})">{esc(unit)}</text>')
    return out


def series_marks(s: Series, sx, sy) -> list[str]:
    runs, current = [], []  # stretches of finite values
    for x, y in s.points:
        if finite(y):
            current.append((x, y))
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    dash = ' stroke-dasharray="5 3"' if s.dashed else ""
    out = []
    for stretch in runs:
        d = "M" + " L".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in stretch)
        out.append(f'<path d="{d}" fill="none" stroke="{s.color}" stroke-width="1.8"{dash}/>')
    if s.markers or all(len(stretch) == 1 for stretch in runs):
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{s.color}"><title>{esc(s.label)}, step '
                f'{x:g}: {number(y)}</title></circle>' for stretch in runs for x, y in stretch]
    return out


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def svg_confusion(matrix: dict) -> str:
    """Counts by true label (rows) and predicted label (columns); each cell shaded by its share of the row."""
    labels, counts = [str(label) for label in matrix["labels"]], matrix["counts"]
    cell = max(12, min(64, 360 // max(len(labels), 1)))
    longest = max(len(label) for label in labels)
    left, top, size = min(150, 12 + 7 * longest) + 18, 24, cell * len(labels)
    width, height = left + size + 10, top + size + min(110, 12 + 6 * longest) + 18
    out = [f'<svg class="confusion" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="confusion matrix"><text x="{left + size / 2:.0f}" y="14" text-anchor="middle">predicted</text>'
           f'<text x="10" y="{top + size / 2:.0f}" text-anchor="middle" transform="rotate(-90 10 {top + size / 2:.0f})">'
           "true</text>"]
    for i, row in enumerate(counts):
        out += [confusion_cell(labels[i], labels[j], count, sum(row), left + j * cell, top + i * cell, cell)
                for j, count in enumerate(row)]
        out.append(f'<text x="{left - 4}" y="{top + i * cell + cell / 2 + 4:.1f}" text-anchor="end">'
                   f'{esc(labels[i][:20])}</text>')
    for j, label in enumerate(labels):
        x, y = left + j * cell + cell / 2 + 4, top + size + 8
        out.append(f'<text x="{x:.1f}" y="{y}" text-anchor="end" transform="rotate(-45 {x:.1f} {y})">'
                   f'{esc(label[:20])}</text>')
    return "".join(out) + "</svg>"


def confusion_cell(true: str, predicted: str, count: int, row_total: int, x: int, y: int, cell: int) -> str:
    share = count / (row_total or 1)
    shade = tuple(round(255 - share * (255 - c)) for c in (31, 119, 180))  # white to matplotlib's blue
    drawn = (f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" fill="rgb{shade}" stroke="#fff"><title>true '
             f"{esc(true)}, predicted {esc(predicted)}: {count} ({share:.1%} of {esc(true)})</title></rect>")
    if cell >= 22:  # room for the count
        drawn += (f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 4:.1f}" text-anchor="middle" '
                  f'fill="{"#fff" if share > 0.6 else "#222"}">{count}</text>')
    return drawn


def confusion_matrix(metrics: dict) -> dict | None:
    """metrics.json's test_confusion_matrix if it is one: n labels, n rows of n counts."""
    matrix = metrics.get("test_confusion_matrix")
    if not isinstance(matrix, dict) or not isinstance(matrix.get("labels"), list) or not matrix["labels"]:
        return None
    n, counts = len(matrix["labels"]), matrix.get("counts")
    square = isinstance(counts, list) and len(counts) == n and all(
        isinstance(row, list) and len(row) == n and all(isinstance(c, int) and c >= 0 for c in row) for row in counts)
    return matrix if square else None


# --- what the charts show -------------------------------------------------------------------------

MAX_POINTS = 1000  # per series: a long run logged every step would make a page of megabytes


def curve(records: list[dict], key: str, scale: float = 1.0) -> list[tuple[float, float | None]]:
    points = [(r["step"], r[key] / scale if finite(r.get(key)) else None) for r in records if key in r]
    stride = max(1, -(-len(points) // MAX_POINTS))
    return points if stride == 1 else points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def eval_metric_names(runs: list[ReportedRun]) -> list[str]:
    """Validation metrics between 0 and 1 (accuracy, f1_macro, token_accuracy) that share one chart;
    per-label F1 stays in the tables."""
    names: list[str] = []
    for run in runs:
        for record in run.evals:
            for key, value in record.items():
                if (key not in ("step", "epoch", "split", "loss", "samples", "tokens") and key not in names
                        and not (key.startswith("f1_") and key != "f1_macro") and finite(value) and 0 <= value <= 1):
                    names.append(key)
    return names


def charts(runs: list[ReportedRun]) -> list[Chart]:
    """The line charts of these runs: each run's series in its color (overlaid when several)."""
    several = len(runs) > 1
    made = {key: Chart(key, title, [], unit=unit) for key, title, unit in (
        ("loss", "Loss (train: solid, validation: dashed)", "loss"), ("metrics", "Validation metrics", ""),
        ("lr", "Learning rate", "lr"), ("grad_norm", "Gradient norm (before clipping)", "norm"),
        ("throughput", "Throughput", "samples/s"), ("tokens", "Token throughput", "tokens/s"),
        ("memory", "Peak memory so far", "MiB"))}
    names = eval_metric_names(runs)
    for index, run in enumerate(runs):
        color = COLORS[index % len(COLORS)]
        label = (lambda what: f"{run.name} {what}" if several else what)  # noqa: E731
        validation = [r for r in run.evals if r["split"] == "validation"]
        made["loss"].series += [Series(label("train"), curve(run.steps, "loss"), color),
                                Series(label("validation"), curve(validation, "loss"), color, True, True)]
        for k, name in enumerate(names):
            metric_color = color if several else COLORS[k % len(COLORS)]
            made["metrics"].series.append(Series(label(name), curve(validation, name), metric_color,
                                                 dashed=several and k > 0, markers=True))
        made["lr"].series.append(Series(label("lr"), curve(run.steps, "lr"), color))
        made["grad_norm"].series.append(Series(label("grad norm"), curve(run.steps, "grad_norm"), color))
        made["throughput"].series.append(Series(label("samples/s"), curve(run.steps, "samples_per_second"), color))
        made["tokens"].series.append(Series(label("tokens/s"), curve(run.steps, "tokens_per_second"), color))
        made["memory"].series.append(Series(label("peak"), curve(run.steps, "peak_memory_bytes", MiB), color))
        made["memory"].lines += plan_lines(run, label, color)
    return [chart for chart in made.values() if any(finite(y) for s in chart.series for _, y in s.points)]


def plan_lines(run: ReportedRun, label, color: str) -> list[tuple[str, float, str]]:
    peak = run.predicted_peak()
    return [(label("predicted peak (memory plan)"), peak / MiB, color)] if peak is not None else []


# --- tables ---------------------------------------------------------------------------------------

def summary_rows(run: ReportedRun) -> list[tuple[str, str]]:
    """What trained on what: the data and model summary of one run."""
    c, m = run.config, run.metrics
    examples, params = m.get("examples") or {}, m.get("parameters") or {}
    accum = (c.get("plan") or {}).get("grad_accum", c.get("grad_accum"))
    rows = [
        ("status", run.status), ("task", run.task), ("model", c.get("model")),
        ("architecture", architecture(run.model_config)),
        ("parameters", f"{number(params.get('total'))} ({number(params.get('trainable'))} trainable)"
         if params else None),
        ("data", c.get("data")),
        ("examples", " / ".join(f"{number(examples.get(s))} {s}" for s in ("train", "validation", "test"))
         if examples else None),
        ("labels", ", ".join(map(str, m["labels"])) if m.get("labels") else None),
        ("batch", f"{c['batch_size']} per device x {accum} accumulated"
         + (f" x {m['world_size']} process(es)" if "world_size" in m else "") if c.get("batch_size") else None),
        ("precision, optimizer", ", ".join(str(v) for v in (m.get("precision"), m.get("optimizer")) if v)),
        ("steps", number(run.final("steps")) + (f" ({number(m['epochs'])} epochs)" if "epochs" in m else "")),
        ("device", m.get("device")), ("train seconds", number(m.get("train_seconds"), 3)),
        ("wall seconds", number(m.get("wall_seconds"), 3)),
        ("samples/s", number(run.final("train_samples_per_second"))),
        ("tokens/s", number(run.final("train_tokens_per_second"))),
        ("peak memory", mib(run.final("peak_memory_bytes"))),
        ("skipped", f"{m.get('skipped_rows', 0)} rows, {m.get('skipped_steps', 0)} steps" if m else None),
    ]
    return [(key, str(value)) for key, value in rows if value not in (None, "", "-", "None")]


def architecture(model_config: dict) -> str | None:
    """model/config.json in a few words: BertForSequenceClassification, 6 layers, hidden 384."""
    arch = (model_config.get("architectures") or [None])[0]
    layers = model_config.get("num_hidden_layers", model_config.get("n_layer"))
    hidden = model_config.get("hidden_size", model_config.get("n_embd"))
    words = (arch, f"{layers} layers" if layers else None, f"hidden {hidden}" if hidden else None)
    return ", ".join(str(word) for word in words if word) or None


def settings_rows(config: dict) -> list[tuple[str, str]]:
    """The settings that are not train's defaults (the full config is in a <details> below)."""
    from effitrain.config import TrainConfig

    defaults = TrainConfig().to_dict()
    rows = [(key, show(value)) for key, value in config.items()
            if key != "plan" and key not in NOT_SETTINGS and (key not in defaults or defaults[key] != value)]
    return rows + [(f"plan.{key}", show(value)) for key, value in (config.get("plan") or {}).items()]


def show(value: Any) -> str:
    return "-" if value is None else json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def eval_table(run: ReportedRun) -> tuple[list[str], list[list[str]]]:
    """One row per evaluation (validation by step, then test), one column per metric."""
    records = list(run.evals)
    if not any(r["split"] == "test" for r in records) and run.metrics.get("test"):
        records.append({"step": run.metrics.get("steps"), "split": "test", **run.metrics["test"]})
    keys: list[str] = []
    for record in records:
        keys += [k for k in record if k not in ("step", "epoch", "split") and k not in keys]
    keys.sort(key=lambda k: (k in ("samples", "tokens"), k != "loss"))
    header = ["split", "step"] + keys
    return header, [[r["split"], number(r["step"])] + [number(r.get(k)) for k in keys] for r in records]


def differences(runs: list[ReportedRun]) -> tuple[list[str], list[list[str]]]:
    """The comparison table: settings that differ between the runs, then final metrics, speed, memory
    (speed and memory also as a ratio to the first run)."""
    header = ["", *[run.name for run in runs]]
    rows = []
    settings = [flatten(run.config) for run in runs]
    keys = sorted({key for s in settings for key in s} - NOT_SETTINGS, key=lambda k: (k.startswith("plan."), k))
    for key in keys:
        values = [s.get(key, "-") if s else "-" for s in settings]
        if len(set(values)) > 1:
            rows.append([key, *values])
    tests = [run.metrics.get("test") or {} for run in runs]
    for metric in dict.fromkeys(k for t in tests for k in t if k not in ("samples", "tokens")):
        rows.append([f"test {metric}", *[number(t.get(metric)) for t in tests]])
    for key, label, fmt, ratio in MEASURES:
        values = [run.final(key) for run in runs]
        if any(v is not None for v in values):
            first = values[0]
            rows.append([label, *[fmt(v) + (f" ({times(v / first)})" if ratio and finite(v) and finite(first)
                                             and first and i else "") for i, v in enumerate(values)]])
    return header, rows


MEASURES = (  # (key of ReportedRun.final, row, cell format, show the ratio to the first run)
    ("train_loss", "train loss (last window)", number, False),
    ("train_samples_per_second", "samples/s", number, True),
    ("train_tokens_per_second", "tokens/s", number, True),
    ("peak_memory_bytes", "peak memory", mib, True),
    ("optimizer_state_bytes", "optimizer state", mib, True),
    ("train_seconds", "train seconds", lambda v: number(v, 3), True),
    ("wall_seconds", "wall seconds", lambda v: number(v, 3), True),
    ("steps", "steps", number, False),
)


def flatten(config: dict) -> dict[str, str]:
    flat = {key: show(value) for key, value in config.items() if key != "plan"}
    flat.update({f"plan.{key}": show(value) for key, value in (config.get("plan") or {}).items()})
    return flat


# --- the page -------------------------------------------------------------------------------------

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Arial,sans-serif;margin:24px auto;max-width:1400px;
padding:0 16px;color:#222;background:#fafafa}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}.meta{color:#666;margin:0 0 8px}
.notes{background:#fff7e0;border:1px solid #f0d48a;padding:6px 12px;margin:8px 0}.notes li{margin:2px 0}
table{border-collapse:collapse;background:#fff;margin:4px 0 8px}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:right;font-variant-numeric:tabular-nums}td:first-child,th:first-child{text-align:left}
th{background:#f0f0f0}table.kv td:last-child{text-align:left;max-width:420px}
.charts,.cards{display:flex;flex-wrap:wrap;gap:12px}.cards{gap:8px 28px;align-items:flex-start}
.curves{flex:1 1 860px}figure{margin:0;background:#fff;border:1px solid #ddd;padding:8px;width:fit-content}
figcaption{font-weight:600;margin-bottom:2px}.legend{font-size:12px;color:#444;max-width:400px}
.legend span{display:inline-block;margin-right:10px}.legend i{display:inline-block;width:18px;height:0;
border-top:2px solid;vertical-align:middle;margin-right:4px}.legend i.dashed{border-top-style:dashed}
svg text{font:11px system-ui,Arial,sans-serif;fill:#333}details{margin:6px 0}summary{cursor:pointer}
.status-finished{color:#2a7d2a}.status-training{color:#b36b00}.status-stopped{color:#b00020}
"""


def esc(text: Any) -> str:
    return html.escape(str(text), quote=False)


def attr(text: Any) -> str:
    return html.escape(str(text), quote=True)


def table(header: list[str] | None, rows: list[list[str]] | list[tuple[str, str]], cls: str = "") -> str:
    head = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{cls}">{head}{body}</table>'


def figure(chart: Chart) -> str:
    svg = svg_chart(chart)
    legend = "".join(f'<span><i class="{"dashed" if s.dashed else ""}" style="border-color:{s.color}"></i>'
                     f"{esc(s.label)}</span>" for s in chart.series if any(finite(y) for _, y in s.points))
    legend += "".join(f'<span><i class="dashed" style="border-color:{color}"></i>{esc(label)} '
                      f"({number(y)} MiB)</span>" for label, y, color in chart.lines)
    return (f'<figure data-chart="{chart.key}"><figcaption>{esc(chart.title)}</figcaption>{svg}'
            f'<div class="legend">{legend}</div></figure>')


def charts_html(runs: list[ReportedRun]) -> str:
    made = charts(runs)
    if not made:
        return '<p class="meta">no curves: nothing was logged yet</p>'
    return '<div class="charts">' + "".join(figure(chart) for chart in made) + "</div>"


def run_section(run: ReportedRun, with_curves: bool) -> str:
    parts = [f'<section class="run"><h2>{esc(run.name)} <small class="status-{run.status}">({run.status})</small>'
             f'</h2><p class="meta">{esc(run.path)}</p>']
    if run.notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in run.notes) + "</ul>")
    results = []  # beside the summary, one below the other
    if run.evals or run.metrics.get("test"):
        results.append(f"<h3>Evaluations</h3>{table(*eval_table(run))}")
    if confusion_matrix(run.metrics):
        results.append('<h3>Confusion matrix (test split)</h3><figure data-chart="confusion">'
                       + svg_confusion(confusion_matrix(run.metrics)) + "</figure>")
    results.append(memory_plan_html(run))
    parts.append(f'<div class="cards"><div><h3>Summary</h3>{table(None, summary_rows(run), "kv")}</div>'
                 f'<div>{"".join(results)}</div></div>')
    if with_curves:
        parts.append("<h3>Curves</h3>" + charts_html([run]))
    if run.config:
        parts.append("<h3>Settings (other than train's defaults)</h3>" + table(None, settings_rows(run.config), "kv")
                     + "<details><summary>full config.yaml</summary>"
                     + table(None, [(k, show(v)) for k, v in run.config.items()], "kv") + "</details>")
    return "".join(parts) + "</section>"


def memory_plan_html(run: ReportedRun) -> str:
    plan = run.memory_plan()
    if not plan:
        return ""
    measured, predicted = run.final("peak_memory_bytes"), run.predicted_peak()
    error = f"{(measured - predicted) / predicted:+.1%}" if finite(measured) and predicted else "-"
    rows = [("budget (model and training)", mib(plan.get("budget_bytes"))),
            ("in use before the model", mib(plan.get("in_use_bytes"))),
            ("predicted (model and training)", mib(plan.get("predicted_peak_bytes"))),
            ("predicted peak", mib(predicted)), ("measured peak", mib(measured)),
            ("measured vs predicted", error), ("the plan", plan.get("note") or "-")]
    return "<h3>Memory plan (--memory-budget)</h3>" + table(None, rows, "kv")


def render(runs: list[ReportedRun], pngs_hint: bool = False) -> str:
    """The page; `pngs_hint`: say how to get the PNGs (train writes the page alone)."""
    several = len(runs) > 1
    title = f"effitrain report: {runs[0].name}" if not several else f"effitrain report: {len(runs)} runs"
    body = [f"<h1>{esc(title)}</h1><p class=\"meta\">made {time.strftime('%Y-%m-%d %H:%M:%S')} from "
            + ", ".join(esc(run.path) for run in runs) + "</p>"]
    if several:
        body.append('<section><h2>Compared</h2><div class="cards"><div><h3>What differs</h3>'
                    + table(*differences(runs)) + '</div><div class="curves"><h3>Curves</h3>' + charts_html(runs)
                    + "</div></div></section>")
    body += [run_section(run, with_curves=not several) for run in runs]
    if pngs_hint:
        body.append(f'<p class="meta">PNGs of the main charts: <code>effitrain report {esc(runs[0].path)}</code></p>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="generator" '
            f'content="{GENERATOR}"><meta name="viewport" content="width=device-width,initial-scale=1">'
            f'<link rel="icon" href="data:,"><title>{esc(title)}</title><style>{STYLE}</style></head><body>'
            + "".join(body) + "</body></html>\n")


# --- PNGs (matplotlib) ----------------------------------------------------------------------------

PNG_PANELS = ("loss", "metrics", "throughput", "memory")


def write_pngs(runs: list[ReportedRun], page: Path) -> list[Path]:
    """<stem>-curves.png (loss, validation metrics, throughput, memory) and, for one classification run,
    <stem>-confusion.png; an older one of a chart that has nothing to show is removed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []
    made = {chart.key: chart for chart in charts(runs) if chart.key in PNG_PANELS}
    confusion = confusion_matrix(runs[0].metrics) if len(runs) == 1 else None
    for name, draw, wanted in (("curves", draw_curves, made), ("confusion", draw_confusion, confusion)):
        path = page.with_name(f"{page.stem}-{name}.png")
        if not wanted:
            path.unlink(missing_ok=True)
            continue
        fig = Figure(figsize=(11, 7) if name == "curves" else (6, 5), dpi=90)
        FigureCanvasAgg(fig)
        draw(fig, wanted)
        fig.savefig(path, metadata={"Software": GENERATOR})
        written.append(path)
    return written


def draw_curves(fig, made: dict[str, Chart]) -> None:
    axes_list = fig.subplots(2, 2).flat
    for ax, key in zip(axes_list, PNG_PANELS):
        chart = made.get(key)
        if chart is None:
            ax.set_axis_off()
            continue
        for s in chart.series:
            xs = [x for x, _ in s.points]
            ys = [y if finite(y) else float("nan") for _, y in s.points]
            ax.plot(xs, ys, color=s.color, linestyle="--" if s.dashed else "-", marker="o" if s.markers else None,
                    markersize=3, label=s.label)
        for label, y, color in chart.lines:
            ax.axhline(y, color=color, linestyle=":", label=label)
        ax.set_title(chart.title, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.set_ylabel(chart.unit, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.95, wspace=0.2, hspace=0.3)


def draw_confusion(fig, matrix: dict) -> None:
    labels, counts = matrix["labels"], matrix["counts"]
    shares = [[c / (sum(row) or 1) for c in row] for row in counts]
    ax = fig.subplots()
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    ticks = range(len(labels))
    ax.set_xticks(ticks, [str(label)[:20] for label in labels], rotation=45, ha="right", fontsize=8)
    ax.set_yticks(ticks, [str(label)[:20] for label in labels], fontsize=8)
    if len(labels) <= 15:
        for i, row in enumerate(counts):
            for j, count in enumerate(row):
                ax.text(j, i, str(count), ha="center", va="center", fontsize=8,
                        color="white" if shares[i][j] > 0.6 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("confusion matrix (test split)")
    fig.subplots_adjust(left=0.2, bottom=0.2, right=0.97, top=0.92)


# --- writing --------------------------------------------------------------------------------------

def home(given: list[str]) -> Path | None:
    """The one folder given (a run or a bench, perhaps named twice), whose own report.html the page is."""
    return Path(given[0]) if len({Path(g).resolve() for g in given}) == 1 else None


def default_page(given: list[str]) -> Path:
    """RUN/report.html for one run or bench folder; report.html here for several."""
    return home(given) / PAGE if home(given) else Path(PAGE)


def check_page(page: Path, given: list[str]) -> None:
    """--out: an .html file in an existing, writable folder, not another run's folder, replacing only
    a report effitrain wrote (the page and its PNGs)."""
    if page.is_dir():
        example = f", e.g. --out {page / PAGE}" if not any((p / outputs.MARKER).is_file() for p in
                                                            (page, *page.parents)) else ""
        raise UserError(f"--out {page} is a folder", "pass a file path ending in .html" + example)
    if page.suffix.lower() not in (".html", ".htm"):
        raise UserError(f"--out {page} does not end in .html", "pass a file path ending in .html")
    folder = page.parent
    if not folder.is_dir():
        raise UserError(f"--out {page}: no folder {folder}", "pass a file path in an existing folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"--out {page}: the folder {folder} is not writable", "pass a file path in a folder you "
                        "can write")
    holder = next((p for p in (folder, *folder.parents) if (p / outputs.MARKER).is_file()), None)
    own = home(given) is not None and holder is not None and holder.resolve() == home(given).resolve()
    if holder is not None and not (own and folder.resolve() == holder.resolve() and page.name == PAGE):
        raise UserError(f"--out {page} is inside the effitrain run {holder}, whose files effitrain manages",
                        "pass a path outside it" + (f" (or leave --out out to write {default_page(given)})"
                                                    if home(given) else ""))
    for path in [page, *(page.with_name(name) for name in sorted(png_names(page.name)))]:
        if (path.exists() or path.is_symlink()) and not written_by_report(path):
            raise UserError(f"--out: {path} already exists and is not an effitrain report", "pass another --out "
                            "(effitrain never replaces a file it did not write)")


def written_by_report(path: Path) -> bool:
    if not path.is_file() or path.is_symlink():
        return False
    try:
        with open(path, "rb") as file:
            head = file.read(4096)
    except OSError:
        return False
    mark = b"Software\x00" + GENERATOR.encode() if path.suffix == ".png" else f'content="{GENERATOR}"'.encode()
    return mark in head


def write(given: list[str], out: str | None = None) -> tuple[Path, list[Path]]:
    """The command: read the runs, check --out, write the page and its PNGs."""
    runs = find_runs(given)
    page = Path(out) if out else default_page(given)
    check_page(page, given)
    try:
        page.write_text(render(runs))
        return page, write_pngs(runs, page)
    except OSError as err:
        raise UserError(f"--out {page} cannot be written ({err.strerror or err})", "pass a path you can write") \
            from err


def write_for_run(folder: Path, pngs: bool = False) -> None:
    """The end of `effitrain train` (the page only: matplotlib's import alone would cost each run about
    half a second) and of `effitrain bench` (with `pngs`), on the main process. The run has succeeded
    whatever happens here: a failure is one warning line, not an error."""
    try:
        runs = find_runs([str(folder)])
        page = folder / PAGE
        page.write_text(render(runs, pngs_hint=not pngs))
        if pngs:
            write_pngs(runs, page)
        else:  # PNGs an earlier `effitrain report` wrote here would no longer match the page
            for name in png_names(PAGE):
                (folder / name).unlink(missing_ok=True)
    except Exception as err:  # noqa: BLE001 - a report must never fail the run it reports
        line = " ".join(str(err).split()) or type(err).__name__
        print(f"effitrain: warning: no report in {folder} ({line[:300]}); the run itself succeeded",
              file=sys.stderr)
