"""How the peer comparisons report: medians over the runs, the TRL comparisons' tokens/s tables and ratios, the
warning when other processes shared the machine, and the `--json` file. Written once so that the comparisons'
figures read alike and a fix reaches all of them."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

from _common import fmt, mib, print_columns  # benchmarks/ is on sys.path: this module is imported as peers._report

BUSY = 0.1  # cores other processes may keep busy before a run's speed measures the contention
TOKEN_MEDIANS = ("tokens_per_second", "peak_rss_bytes", "saved_seconds", "tokens_per_step")


def median(runs: list[dict], key: str):
    """The median of `key` over the runs that have it; None if none has."""
    values = [run[key] for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None


def token_row(label: str, runs: list[dict], counted: list[dict] | None = None) -> tuple[tuple, dict]:
    """A side's row of the tokens/s table (each run's tokens/s, `*` on a run left out of `counted`; the medians
    of `counted`, all runs by default) and those medians."""
    counted = runs if counted is None else counted
    medians = {key: median(counted, key) for key in TOKEN_MEDIANS}
    other = max((run["cpu"] or {}).get("other_cores") or 0 for run in runs)
    row = (label, " / ".join(f"{run['tokens_per_second']:.0f}" + ("" if run in counted else "*") for run in runs),
           fmt(medians["tokens_per_second"], ".0f"), fmt(medians["tokens_per_step"], ".0f"),
           mib(medians["peak_rss_bytes"]), fmt(medians["saved_seconds"], ".1f"), f"{other:.2f}")
    return row, medians


def ratio_row(label: str, ours: dict, theirs: dict) -> tuple:
    """effitrain's medians over the peer's: tokens/s and peak RSS ours / theirs, time to the saved model theirs /
    ours (above 1: ours is faster)."""
    return (label, f"{ours['tokens_per_second'] / theirs['tokens_per_second']:.2f}x",
            f"{ours['peak_rss_bytes'] / theirs['peak_rss_bytes']:.2f}x",
            f"{theirs['saved_seconds'] / ours['saved_seconds']:.2f}x")


def print_token_tables(rows: list[tuple], ratios: list[tuple]) -> None:
    """The tokens/s table and the ratio table, each followed by an empty line."""
    print_columns(("", "tokens/s of each run", "median tokens/s", "tokens/step", "peak RSS", "s to saved model",
                   "other cores"), rows)
    print()
    print_columns(("effitrain / TRL", "tokens/s", "peak RSS", "time to saved model (TRL's / ours)"), ratios)
    print()


def versions_text(results: dict) -> str:
    """`torch X, transformers Y, trl Z` as the runs recorded them (`-` where no TRL side ran)."""
    one = next(iter(results.values()))[0]
    trl = next((runs[0]["versions"]["trl"] for runs in results.values() if "trl" in runs[0]["versions"]), "-")
    return f"torch {one['versions']['torch']}, transformers {one['versions']['transformers']}, trl {trl}"


def loss_verdict(difference: float) -> str:
    """Whether two sides' losses on the same batch agree to fp32's bar."""
    return "within 1e-5" if difference <= 1e-5 else "NOT within 1e-5"


def warn_if_busy(results: dict, before: str = "", after: str = "") -> None:
    """A WARNING when other processes kept more than BUSY cores busy during a run."""
    busy = [(run.get("cpu") or {}).get("other_cores") for runs in results.values() for run in runs]
    if any(b is not None and b > BUSY for b in busy):
        print(f"{before}WARNING: other processes kept up to {max(b for b in busy if b is not None):.2f} cores busy "
              f"during some runs: these speeds measure the contention as much as the code{after}")


def utc_now() -> str:
    """The report's date: now, UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, report: dict, before: str = "") -> None:
    """`--json`: every run's figures, indented, and one line saying where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{before}figures written to {path}")
