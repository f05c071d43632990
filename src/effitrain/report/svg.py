"""The report's charts as data (curves from log.jsonl) and as inline SVG (line charts, the
confusion matrix): drawing a few polylines costs milliseconds where matplotlib costs most of a second."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any

from effitrain.report.runs import ReportedRun, StepSplit, finite, merged_splits

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")


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


MiB = 2**20


def esc(text: Any) -> str:
    return html.escape(str(text), quote=False)


def attr(text: Any) -> str:
    return html.escape(str(text), quote=True)


W, H, LEFT, RIGHT, TOP, BOTTOM = 400, 240, 58, 14, 12, 34


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


def plan_lines(run: ReportedRun, label, color: str) -> list[tuple[str, float, str]]:
    peak = run.predicted_peak()
    return [(label("predicted peak (memory plan)"), peak / MiB, color)] if peak is not None else []


def reward_series(run: ReportedRun, validation: list[dict], label, color: str, several: bool) -> list[Series]:
    """Online RL: the weighted reward of each step's sampled completions, the validation's (greedy) as
    points; one run's reward functions each in a color of its own when there are several."""
    made = [Series(label("train reward"), curve(run.steps, "reward"), color),
            Series(label("validation reward"), curve(validation, "reward"), color, True, True)]
    functions = run.reward_functions()
    if not several and len(functions) > 1:
        made += [Series(f"train {name}", curve(run.steps, name), COLORS[(k + 1) % len(COLORS)], dashed=True)
                 for k, name in enumerate(functions)]
    return made


def charts(runs: list[ReportedRun]) -> list[Chart]:
    """The line charts of these runs: each run's series in its color (overlaid when several)."""
    several = len(runs) > 1
    made = {key: Chart(key, title, [], unit=unit) for key, title, unit in (
        ("loss", "Loss (train: solid, validation: dashed)", "loss"),
        ("reward", "Reward (train: sampled, weighted; validation: greedy)", "reward"),
        ("metrics", "Validation metrics", ""),
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
        if run.is_rl:
            made["reward"].series += reward_series(run, validation, label, color, several)
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


GENERATION_COLOR, UPDATE_COLOR = COLORS[1], COLORS[0]
MAX_BARS = 100


def svg_step_split(splits: list[StepSplit]) -> str:
    """Online RL: seconds per step as stacked bars, generation below and the update above, one bar per log
    window (consecutive windows merged beyond MAX_BARS); each bar's values in its title."""
    bars = merged_splits(splits, MAX_BARS)
    if not bars:
        return ""
    first = bars[0].step - bars[0].steps
    xt, yt = nice_ticks(first, bars[-1].step, 6), nice_ticks(0, max(bar.total for bar in bars), 5)
    sx = lambda x: LEFT + (x - xt[0]) / (xt[-1] - xt[0]) * (W - LEFT - RIGHT)  # noqa: E731
    sy = lambda y: H - BOTTOM - (y - yt[0]) / (yt[-1] - yt[0]) * (H - TOP - BOTTOM)  # noqa: E731
    out = [f'<svg class="split" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
           'aria-label="seconds per step: generation and update">']
    out += axes(xt, yt, sx, sy, "s/step")
    for bar in bars:
        left, right = sx(bar.step - bar.steps), sx(bar.step)
        width = max(right - left - (1 if right - left > 3 else 0), 0.5)  # a hairline between neighbours
        steps = f"step {bar.step}" if bar.steps == 1 else f"steps {bar.step - bar.steps + 1}-{bar.step}"
        out.append(f'<g data-step="{bar.step}" data-steps="{bar.steps}" data-generation="{bar.generation!r}" '
                   f'data-update="{bar.update!r}"><title>{steps}: generation {number(bar.generation)} s, update '
                   f'{number(bar.update)} s per step</title>')
        for bottom, top, color in ((0.0, bar.generation, GENERATION_COLOR), (bar.generation, bar.total, UPDATE_COLOR)):
            out.append(f'<rect x="{left:.1f}" y="{sy(top):.1f}" width="{width:.1f}" '
                       f'height="{max(sy(bottom) - sy(top), 0):.1f}" fill="{color}"/>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)
