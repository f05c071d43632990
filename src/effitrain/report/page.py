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

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from effitrain.errors import UserError
from effitrain.outputs import files, run_folder
from effitrain.report import png, svg
from effitrain.report.runs import (
    GENERATOR,
    NOT_SETTINGS,
    PAGE,
    Distilled,
    ReportedRun,
    confusion_matrix,
    distilled_pairs,
    find_runs,
    finite,
    png_names,
    step_splits,
)


def summary_rows(run: ReportedRun) -> list[tuple[str, str]]:
    """What trained on what: the data and model summary of one run."""
    c, m = run.config, run.metrics
    examples, params = m.get("examples") or {}, m.get("parameters") or {}
    accum = (c.get("plan") or {}).get("grad_accum", c.get("grad_accum"))
    rows = [
        ("status", run.status), ("task", run.task), ("model", c.get("model")),
        ("architecture", architecture(run.model_config)),
        ("parameters", f"{svg.number(params.get('total'))} ({svg.number(params.get('trainable'))} trainable)"
         if params else None),
        ("online RL", rl_said(c) if c.get("rl") else None),
        ("data", c.get("data")),
        ("examples", " / ".join(f"{svg.number(examples.get(s))} {s}" for s in ("train", "validation", "test"))
         if examples else None),
        ("labels", ", ".join(map(str, m["labels"])) if m.get("labels") else None),
        ("batch", f"{c['batch_size']} per device x {accum} accumulated"
         + (f" x {m['world_size']} process(es)" if "world_size" in m else "") if c.get("batch_size") else None),
        ("precision, optimizer", ", ".join(str(v) for v in (m.get("precision"), m.get("optimizer")) if v)),
        ("steps", svg.number(run.final("steps")) + (f" ({svg.number(m['epochs'])} epochs)" if "epochs" in m else "")),
        ("device", m.get("device")), ("train seconds", svg.number(m.get("train_seconds"), 3)),
        ("wall seconds", svg.number(m.get("wall_seconds"), 3)),
        ("train reward (last window)", svg.number(run.final("train_reward")) if run.is_rl else None),
        ("generation / update", split_said(run) if run.is_rl else None),
        ("samples/s", svg.number(run.final("train_samples_per_second"))),
        ("tokens/s", svg.number(run.final("train_tokens_per_second"))),
        ("peak memory", svg.mib(run.final("peak_memory_bytes"))),
        ("skipped", f"{m.get('skipped_rows', 0)} rows, {m.get('skipped_steps', 0)} steps" if m else None),
    ]
    return [(key, str(value)) for key, value in rows if value not in (None, "", "-", "None")]


def rl_said(config: dict) -> str:
    """The model card's words for the same settings (train's defaults for any a config.yaml lacks)."""
    from effitrain.config import TrainConfig
    from effitrain.engine.model_card import rl_said as said

    return said({**TrainConfig().to_dict(), **config})


def split_said(run: ReportedRun) -> str | None:
    """Online RL: the seconds per step in generation and in the update, over the whole run."""
    splits = step_splits(run.steps)
    steps = sum(s.steps for s in splits)
    if not steps:
        return None
    generation, update = (sum(getattr(s, part) * s.steps for s in splits) / steps for part in ("generation", "update"))
    share = generation / (generation + update) if generation + update > 0 else 0.0
    return f"{svg.number(generation, 3)} s / {svg.number(update, 3)} s per step ({share:.0%} generating)"


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
    return header, [[r["split"], svg.number(r["step"])] + [svg.number(r.get(k)) for k in keys] for r in records]


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
        rows.append([f"test {metric}", *[svg.number(t.get(metric)) for t in tests]])
    for key, label, fmt, ratio in MEASURES:
        values = [run.final(key) for run in runs]
        if any(v is not None for v in values):
            first = values[0]
            rows.append([label, *[fmt(v) + (f" ({svg.times(v / first)})" if ratio and finite(v) and finite(first)
                                             and first and i else "") for i, v in enumerate(values)]])
    return header, rows


def distillation_table(pair: Distilled) -> tuple[list[str], list[list[str]]]:
    """The teacher, its distilled student and the same student trained alone, side by side: test metrics, then
    what the student is for (size, layers, parameters, speed), each with its ratio to the teacher."""
    runs = [pair.teacher, pair.student, *pair.alone]
    header = ["", *[f"{role}: {run.name}" for role, run in zip(
        ["teacher", "distilled student"] + ["student alone"] * len(pair.alone), runs)]]
    tests = [run.metrics.get("test") or {} for run in runs]
    rows = [[f"test {metric}", *[svg.number(t.get(metric)) for t in tests]]
            for metric in ("accuracy", "f1_macro") if any(metric in t for t in tests)]
    measures = (("layers", lambda run: run.model_config.get("num_hidden_layers", run.model_config.get("n_layer")),
                 svg.number), ("parameters", lambda run: (run.metrics.get("parameters") or {}).get("total"), svg.number),
                ("model/ size", ReportedRun.model_bytes, svg.mib),
                ("training samples/s", lambda run: run.final("train_samples_per_second"), svg.number),
                ("training peak memory", lambda run: run.final("peak_memory_bytes"), svg.mib))
    for label, value_of, fmt in measures:
        values = [value_of(run) for run in runs]
        teacher = values[0]
        rows.append([label, *[fmt(v) + (f" ({svg.times(v / teacher)})" if i and finite(v) and finite(teacher) and
                                        teacher else "") for i, v in enumerate(values)]])
    settings = pair.student.config
    rows.append(["distillation", "-", f"alpha {settings.get('distill_alpha')}, T {settings.get('distill_temperature')}"
                 + (f", {settings['student_layers']} layers kept" if settings.get("student_layers") else ""),
                 *["-"] * len(pair.alone)])
    return header, rows


def distillation_html(runs: list[ReportedRun]) -> str:
    """Each distilled student beside its teacher (deliverable 5 of docs/distillation.md); predict's speed is not
    measured by a run, so the sizes stand for it."""
    return "".join("<h3>Teacher and distilled student</h3>" + table(*distillation_table(pair))
                   for pair in distilled_pairs(runs))


MEASURES = (  # (key of ReportedRun.final, row, cell format, show the ratio to the first run)
    ("train_loss", "train loss (last window)", svg.number, False),
    ("train_reward", "train reward (last window)", svg.number, False),
    ("train_samples_per_second", "samples/s", svg.number, True),
    ("train_tokens_per_second", "tokens/s", svg.number, True),
    ("peak_memory_bytes", "peak memory", svg.mib, True),
    ("optimizer_state_bytes", "optimizer state", svg.mib, True),
    ("train_seconds", "train seconds", lambda v: svg.number(v, 3), True),
    ("wall_seconds", "wall seconds", lambda v: svg.number(v, 3), True),
    ("steps", "steps", svg.number, False),
)


def flatten(config: dict) -> dict[str, str]:
    flat = {key: show(value) for key, value in config.items() if key != "plan"}
    flat.update({f"plan.{key}": show(value) for key, value in (config.get("plan") or {}).items()})
    return flat


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


def table(header: list[str] | None, rows: list[list[str]] | list[tuple[str, str]], cls: str = "") -> str:
    head = "<tr>" + "".join(f"<th>{svg.esc(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{svg.esc(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{cls}">{head}{body}</table>'


def figure(chart: svg.Chart) -> str:
    drawn = svg.svg_chart(chart)
    legend = "".join(f'<span><i class="{"dashed" if s.dashed else ""}" style="border-color:{s.color}"></i>'
                     f"{svg.esc(s.label)}</span>" for s in chart.series if any(finite(y) for _, y in s.points))
    legend += "".join(f'<span><i class="dashed" style="border-color:{color}"></i>{svg.esc(label)} '
                      f"({svg.number(y)} MiB)</span>" for label, y, color in chart.lines)
    return (f'<figure data-chart="{chart.key}"><figcaption>{svg.esc(chart.title)}</figcaption>{drawn}'
            f'<div class="legend">{legend}</div></figure>')


def charts_html(runs: list[ReportedRun]) -> str:
    made = svg.charts(runs)
    if not made:
        return '<p class="meta">no curves: nothing was logged yet</p>'
    return '<div class="charts">' + "".join(figure(chart) for chart in made) + "</div>"


def run_section(run: ReportedRun, with_curves: bool) -> str:
    parts = [f'<section class="run"><h2>{svg.esc(run.name)} <small class="status-{run.status}">({run.status})</small>'
             f'</h2><p class="meta">{svg.esc(run.path)}</p>']
    if run.notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{svg.esc(n)}</li>" for n in run.notes) + "</ul>")
    results = []  # beside the summary, one below the other
    if run.evals or run.metrics.get("test"):
        results.append(f"<h3>Evaluations</h3>{table(*eval_table(run))}")
    if confusion_matrix(run.metrics):
        results.append('<h3>Confusion matrix (test split)</h3><figure data-chart="confusion">'
                       + svg.svg_confusion(confusion_matrix(run.metrics)) + "</figure>")
    results.append(memory_plan_html(run))
    results.append(step_split_html(run))
    parts.append(f'<div class="cards"><div><h3>Summary</h3>{table(None, summary_rows(run), "kv")}</div>'
                 f'<div>{"".join(results)}</div></div>')
    if with_curves:
        parts.append("<h3>Curves</h3>" + charts_html([run]))
    if run.config:
        parts.append("<h3>Settings (other than train's defaults)</h3>" + table(None, settings_rows(run.config), "kv")
                     + "<details><summary>full config.yaml</summary>"
                     + table(None, [(k, show(v)) for k, v in run.config.items()], "kv") + "</details>")
    return "".join(parts) + "</section>"


def step_split_html(run: ReportedRun) -> str:
    """Online RL: each window's seconds per step in generation and in the update, as stacked bars, and the
    whole run's in a table."""
    splits = step_splits(run.steps) if run.is_rl else []
    if not splits:
        return ""
    steps = sum(s.steps for s in splits)
    generation, update = (sum(getattr(s, part) * s.steps for s in splits) for part in ("generation", "update"))
    total = generation + update
    rows = [["generation", svg.number(generation / steps, 3), svg.number(generation, 3),
             f"{generation / total:.1%}" if total else "-"],
            ["update", svg.number(update / steps, 3), svg.number(update, 3), f"{update / total:.1%}" if total else "-"]]
    legend = "".join(f'<span><i style="border-color:{color}"></i>{name}</span>' for name, color in (
        ("generation", svg.GENERATION_COLOR), ("update (the rest of the step)", svg.UPDATE_COLOR)))
    return ("<h3>Step time: generation vs update</h3>" + table(["", "s per step", f"s in {steps} steps", "share"], rows)
            + '<figure data-chart="step-split"><figcaption>Seconds per step</figcaption>'
            + svg.svg_step_split(splits) + f'<div class="legend">{legend}</div></figure>')


def memory_plan_html(run: ReportedRun) -> str:
    plan = run.memory_plan()
    if not plan:
        return ""
    measured, predicted = run.final("peak_memory_bytes"), run.predicted_peak()
    error = f"{(measured - predicted) / predicted:+.1%}" if finite(measured) and predicted else "-"
    rows = [("budget (model and training)", svg.mib(plan.get("budget_bytes"))),
            ("in use before the model", svg.mib(plan.get("in_use_bytes"))),
            ("predicted (model and training)", svg.mib(plan.get("predicted_peak_bytes"))),
            ("predicted peak", svg.mib(predicted)), ("measured peak", svg.mib(measured)),
            ("measured vs predicted", error), ("the plan", plan.get("note") or "-")]
    return "<h3>Memory plan (--memory-budget)</h3>" + table(None, rows, "kv")


def render(runs: list[ReportedRun], pngs_hint: bool = False) -> str:
    """The page; `pngs_hint`: say how to get the PNGs (train writes the page alone)."""
    several = len(runs) > 1
    title = f"effitrain report: {runs[0].name}" if not several else f"effitrain report: {len(runs)} runs"
    body = [f"<h1>{svg.esc(title)}</h1><p class=\"meta\">made {time.strftime('%Y-%m-%d %H:%M:%S')} from "
            + ", ".join(svg.esc(run.path) for run in runs) + "</p>"]
    if several:
        body.append('<section><h2>Compared</h2><div class="cards"><div><h3>What differs</h3>'
                    + table(*differences(runs)) + distillation_html(runs)
                    + '</div><div class="curves"><h3>Curves</h3>' + charts_html(runs)
                    + "</div></div></section>")
    body += [run_section(run, with_curves=not several) for run in runs]
    if pngs_hint:
        body.append(f'<p class="meta">PNGs of the main charts: <code>effitrain report {svg.esc(runs[0].path)}</code></p>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="generator" '
            f'content="{GENERATOR}"><meta name="viewport" content="width=device-width,initial-scale=1">'
            f'<link rel="icon" href="data:,"><title>{svg.esc(title)}</title><style>{STYLE}</style></head><body>'
            + "".join(body) + "</body></html>\n")


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
        example = f", e.g. --out {page / PAGE}" if not any((p / run_folder.MARKER).is_file() for p in
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
    holder = next((p for p in (folder, *folder.parents) if (p / run_folder.MARKER).is_file()), None)
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
    earlier = {path for path in (page, *(page.with_name(name) for name in png_names(page.name))) if path.exists()}
    try:
        text = render(runs)
        files.place(page, lambda temporary: temporary.write_text(text), replace=page in earlier)
        return page, png.write_pngs(runs, page, earlier)
    except FileExistsError as err:
        raise UserError(f"--out: {err.filename or page} appeared while the report was made; it was left as it is",
                        "pass another --out (effitrain never replaces a file it did not write)") from None
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
            png.write_pngs(runs, page)
        else:  # PNGs an earlier `effitrain report` wrote here would no longer match the page
            for name in png_names(PAGE):
                (folder / name).unlink(missing_ok=True)
    except Exception as err:  # noqa: BLE001 - a report must never fail the run it reports
        line = " ".join(str(err).split()) or type(err).__name__
        print(f"effitrain: warning: no report in {folder} ({line[:300]}); the run itself succeeded",
              file=sys.stderr)
