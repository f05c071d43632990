"""PNGs of the report's main charts (for READMEs and papers), on matplotlib's Agg canvas: two figures at most."""

from __future__ import annotations

from pathlib import Path

from effitrain.outputs import files
from effitrain.report import svg
from effitrain.report.runs import GENERATOR, ReportedRun, confusion_matrix, finite

PNG_PANELS = ("loss", "metrics", "throughput", "memory")  # online RL: its reward curve in the loss's place


def write_pngs(runs: list[ReportedRun], page: Path, earlier: set[Path] | None = None) -> list[Path]:
    """<stem>-curves.png (loss, or online RL's reward; validation metrics, throughput, memory) and, for one
    classification run, <stem>-confusion.png; an older one of a chart that has nothing to show is removed.
    `earlier`: the files an earlier report wrote (replaced); any other is created new and never replaces a file."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []
    made = {chart.key: chart for chart in svg.charts(runs) if chart.key in PNG_PANELS + ("reward",)}
    confusion = confusion_matrix(runs[0].metrics) if len(runs) == 1 else None
    for name, draw, wanted in (("curves", draw_curves, made), ("confusion", draw_confusion, confusion)):
        path = page.with_name(f"{page.stem}-{name}.png")
        if not wanted:
            path.unlink(missing_ok=True)
            continue
        fig = Figure(figsize=(11, 7) if name == "curves" else (6, 5), dpi=90)
        FigureCanvasAgg(fig)
        draw(fig, wanted)
        files.place(path, lambda temporary: fig.savefig(temporary, format="png", metadata={"Software": GENERATOR}),
                    replace=earlier is None or path in earlier)
        written.append(path)
    return written


def draw_curves(fig, made: dict[str, svg.Chart]) -> None:
    axes_list = fig.subplots(2, 2).flat
    panels = (("reward",) if "reward" in made else ("loss",)) + PNG_PANELS[1:]
    for ax, key in zip(axes_list, panels):
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
