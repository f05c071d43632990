"""`effitrain bench`: the same short training job under several efficiency settings, side by side.

Each variant is one `effitrain train` run of `--steps` optimizer steps in a fresh process (so one
variant's memory peak, allocator state or thread settings cannot leak into the next), written to
`<output-dir>/<variant>/`. The bench then reads each run's metrics.json and prints a table of
samples/s, tokens/s, peak memory, optimizer state bytes per parameter and the training loss, each
also as a ratio to the baseline, and writes `bench.json` and `bench.png` next to the runs.

Every variant is the baseline (`--precision fp32 --optim adamw`, micro-batch `--batch-size`) with
one change, so a ratio measures that change alone:

    baseline                 --precision fp32 --optim adamw
    grad-accum               micro-batch halved, --grad-accum 2 (the same effective batch)
    gradient-checkpointing   --gradient-checkpointing
    bf16                     --precision bf16
    adafactor                --optim adafactor
    adamw-8bit               --optim adamw-8bit
    recommended              --precision auto --optim adamw, plus --gradient-checkpointing when the
                             baseline needed more than 80% of the machine's memory (see `needs_checkpointing`)

`--optimizers` runs the baseline and one variant per other optimizer of `--optim` instead (named as
the optimizer: sgd, adafactor, adamw-8bit, adam-8bit, galore-adamw, apollo-adamw, muon,
schedule-free-adamw; a variant whose package is missing is skipped, naming the install); the table
then reads optimizer-state MiB, step time and test accuracy against AdamW's.

Variants run in this order whatever the order of `--variants`: recommended needs the baseline's
measurement, so it runs after it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from effitrain import config as cfg
from effitrain import optimizers
from effitrain.errors import UserError
from effitrain.report.svg import times

BASELINE = "baseline"
BASE_SETTINGS = {"precision": "fp32", "optim": "adamw"}
VARIANTS = ("baseline", "grad-accum", "gradient-checkpointing", "bf16", "adafactor", "adamw-8bit", "recommended")
# --optimizers: the baseline (AdamW) against every other optimizer, each variant named as its --optim.
OPTIMIZER_VARIANTS = tuple(name for name in optimizers.NAMES if name != BASE_SETTINGS["optim"])
ORDER = VARIANTS[:-1] + tuple(n for n in OPTIMIZER_VARIANTS if n not in VARIANTS) + VARIANTS[-1:]
# recommended turns gradient checkpointing on when the baseline's peak memory is above this share.
CHECKPOINTING_THRESHOLD = 0.8
# Flags the bench sets on every run itself, and the bench flag to use instead. From --extra they would
# break its layout (--output-dir), its measure (--log-every sets what train_loss averages), or make
# the variants alike (a --batch-size there would undo grad-accum's halving, --optim every optimizer).
RESERVED_FLAGS = {
    "--output-dir": "--output-dir", "--max-steps": "--steps", "--epochs": "--steps", "--log-every": "--steps",
    "--model": "--model", "--task": "--task", "--data": "--data", "--max-length": "--max-length",
    "--seed": "--seed", "--batch-size": "--batch-size", "--grad-accum": "--variants",
    "--effective-batch-size": "--batch-size", "--precision": "--variants", "--optim": "--variants",
    "--gradient-checkpointing": "--variants", "--debug": "--debug",
}

# (metrics.json key, table column, cell format). Any of them may be missing or null (image and audio
# runs have no tokens/s; older runs lack the optimizer and loss keys): the table shows "-".
MEASURES = (
    ("train_samples_per_second", "samples/s", lambda v: f"{v:.1f}"),
    ("train_tokens_per_second", "tokens/s", lambda v: f"{v:.0f}"),
    ("peak_memory_bytes", "peak MiB", lambda v: f"{v / 2**20:.0f}"),
    ("optimizer_state_bytes_per_param", "optim B/param", lambda v: f"{v:.2f}" if v >= 0.1 else f"{v:.2g}"),
    ("optimizer_state_bytes", "optim MiB", lambda v: f"{v / 2**20:.1f}"),
    ("step_seconds", "step ms", lambda v: f"{1000 * v:.0f}"),
    ("train_loss", "loss", lambda v: f"{v:.4f}"),
    ("test_accuracy", "test acc", lambda v: f"{v:.4f}"),
)
CHART_MEASURES = ("train_samples_per_second", "peak_memory_bytes", "optimizer_state_bytes_per_param", "train_loss",
                  "step_seconds", "test_accuracy")
# What bench.json keeps of each run's metrics.json (step_seconds and test_accuracy derived from it).
KEPT_METRICS = tuple(key for key, _, _ in MEASURES) + ("train_seconds", "steps", "precision", "device")


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="measure each efficiency technique against a baseline")
    cfg.add_flags(parser, ("model", "task", "data"), defaults=True)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per variant (default: 20)")
    cfg.add_flags(parser, ("batch_size", "max_length", "seed"), defaults=True, default_notes={
        "batch_size": " of the baseline; grad-accum halves it (default: 16)",
        "seed": ", the same for every variant (default: 42)"})
    # Not train's --output-dir: the folder of all the variants' runs.
    parser.add_argument("--output-dir", default=None,
                        help="where the runs, bench.json and bench.png go (default: bench/<timestamp>)")
    cfg.add_flags(parser, ["overwrite"], defaults=True)
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated subset of: {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--optimizers", action="store_true",
                        help="compare the optimizers instead: the baseline (adamw) and one variant per other --optim "
                             f"({', '.join(OPTIMIZER_VARIANTS)}): state bytes, step time, test accuracy")
    parser.add_argument("--extra", default="",
                        help='more `effitrain train` flags for every variant, one quoted string, e.g. '
                             '--extra="--max-train-samples 500"')
    parser.add_argument("--debug", action="store_true",
                        help="pass --debug to the runs and show all their output")


def main(args: argparse.Namespace) -> int:
    """Run the matrix, print the table, write bench.json and bench.png. 0 when every variant ran, else 1."""
    from effitrain.outputs import files, run_folder

    check_flags(args)  # the CLI checked them already; bench.main is also called directly
    extra = parse_extra(args.extra)
    explicit = args.variants is not None
    if getattr(args, "optimizers", False) and explicit:
        raise UserError("--optimizers and --variants both choose the variants", "pass only one of them")
    names = ["baseline", *OPTIMIZER_VARIANTS] if getattr(args, "optimizers", False) else select_variants(args.variants)
    missing = missing_packages(names)
    # a setting that cannot work fails now, not after the other variants ran
    check_train_flags(args, [variant_settings(name, args.batch_size) for name in names if name not in missing], extra)
    inputs = (args.model, args.data, *(flag for flag in extra if not flag.startswith("-")))
    held = run_folder.RunDir(args.output_dir, args.overwrite, inputs=inputs, kind="bench").acquire()
    bench_dir = held.path
    try:
        skipped = {**({} if explicit else default_skips(names)), **missing}
        held.start()
        results = run_matrix(args, names, skipped, extra, bench_dir)
        add_ratios(results)
        print()
        print(format_table(results))
        files.write_json(bench_dir / "bench.json", report(args, extra, results))
        chart = write_chart(bench_dir / "bench.png", results)
        from effitrain.report import page
        from effitrain.report.runs import PAGE

        if any(r["status"] == "ok" for r in results):  # report.html: the variants compared; never raises
            page.write_for_run(bench_dir, pngs=True)
    except BaseException as err:
        held.fail(user_mistake=isinstance(err, UserError))
        raise
    if not any(r["status"] == "ok" for r in results) and held.replacing:
        held.fail(user_mistake=False)  # nothing measured: the bench it was to replace comes back
        print(f"\nno variant ran; {bench_dir} holds the earlier bench again")
        return 1
    held.succeed()
    print(f"\nwrote {bench_dir / 'bench.json'}" + (f", {chart}" if chart else "")
          + (f" and {bench_dir / PAGE}" if (bench_dir / PAGE).is_file() else ""))
    return 0 if all(r["status"] != "failed" for r in results) else 1


# --- choosing and building the matrix -----------------------------------------------------------

def check_flags(args: argparse.Namespace) -> None:
    """The flags shared with train by train's rules, and --extra's split (a mistake answers before any run
    starts)."""
    cfg.check_value("steps", args.steps, {"positive": True})
    for name in ("batch_size", "max_length", "seed", "output_dir", "data", "model"):
        cfg.check_value(name, getattr(args, name))
    parse_extra(args.extra)


def parse_extra(extra: str | None) -> list[str]:
    try:
        flags = shlex.split(extra or "")
    except ValueError as err:
        raise UserError(f"--extra {extra!r} cannot be split into flags: {err}", "close the quotes in --extra")
    for flag in flags:
        name = flag.split("=", 1)[0]
        if name in RESERVED_FLAGS:
            raise UserError(f"--extra sets {name}, which the bench sets on every run itself",
                            f"use `effitrain bench {RESERVED_FLAGS[name]}` instead")
    return flags


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str):  # what bench itself passes is valid: the mistake is --extra's
        raise UserError(f"--extra: {message}", "see `effitrain train --help`")


def check_train_flags(args: argparse.Namespace, variants: list[dict[str, Any]], extra: list[str]) -> None:
    """Each variant's `effitrain train` flags (--extra with them) parsed and validated here as train
    would, so that a mistake in --extra is one line before any run starts or anything is written."""
    from effitrain.commands import train

    parser = _Refusing(prog="effitrain")
    train.add_parser(parser.add_subparsers(dest="command", parser_class=_Refusing))
    for settings in variants:
        values = vars(parser.parse_args(train_command(args, settings, Path("."), extra)[3:]))
        values.pop("command")
        config_file = values.pop("config", None)
        try:
            cfg.build(cfg.load_yaml(config_file) if config_file else None, values)
        except UserError as err:
            raise UserError(f"--extra: {err.problem}" if extra else err.problem, err.fix) from None


def select_variants(spec: str | None) -> list[str]:
    """The named variants in the matrix order (baseline first, recommended last); None means all."""
    if spec is None:
        return list(VARIANTS)
    wanted = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in ORDER]
    if unknown or not wanted:
        what = f"unknown variant(s) {', '.join(unknown)}" if unknown else "--variants names no variant"
        raise UserError(what, f"pass a comma-separated subset of: {', '.join(ORDER)}")
    return [name for name in ORDER if name in wanted]


def missing_packages(names: list[str]) -> dict[str, str]:
    """Optimizer variants whose package (the `optimizers` extra) is not installed: skipped, saying so."""
    import importlib.util

    packages = {spec.name: spec.package for spec in optimizers.specs() if spec.package is not None}
    return {name: f"needs {packages[name][1]}: pip install 'effitrain[optimizers]'" for name in names
            if name in packages and importlib.util.find_spec(packages[name][0]) is None}


def default_skips(names: list[str]) -> dict[str, str]:
    """Variants left out of the default matrix because they would run for ages here. Only bf16 on a CPU
    without bf16 units: emulated bf16 is 80-350x slower than fp32 (devices.cpu_has_fast_bf16). Naming it
    in --variants runs it anyway."""
    from effitrain.runtime import devices

    if "bf16" in names and not devices.has_accelerator() and not devices.cpu_has_fast_bf16():
        return {"bf16": "this CPU emulates bf16 (no AVX-512 BF16 or AMX), many times slower; "
                        "--variants bf16 runs it anyway"}
    return {}


def variant_settings(name: str, batch_size: int, checkpointing: bool = False) -> dict[str, Any]:
    """`effitrain train` settings of a variant: the baseline's, with that variant's one change.
    `checkpointing` is the recommended variant's decision, taken from the baseline run."""
    if name == "grad-accum" and (batch_size < 2 or batch_size % 2):
        raise UserError(f"the grad-accum variant halves the micro-batch, and --batch-size {batch_size} is odd "
                        "or 1, so the effective batch would differ from the baseline's",
                        "pass an even --batch-size, or leave grad-accum out of --variants")
    change = {
        "baseline": {},
        "grad-accum": {"batch_size": batch_size // 2, "grad_accum": 2},
        "gradient-checkpointing": {"gradient_checkpointing": True},
        "bf16": {"precision": "bf16"},
        "adafactor": {"optim": "adafactor"},
        "adamw-8bit": {"optim": "adamw-8bit"},
        "recommended": {"precision": "auto", "optim": "adamw", "gradient_checkpointing": checkpointing},
        **{optimizer: {"optim": optimizer} for optimizer in OPTIMIZER_VARIANTS if optimizer not in VARIANTS},
    }[name]
    return {"batch_size": batch_size, **BASE_SETTINGS, **change}


def settings_flags(settings: dict[str, Any]) -> list[str]:
    """True is a bare switch, False leaves it out (the train default is off)."""
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def train_command(args: argparse.Namespace, settings: dict[str, Any], run_dir: Path, extra: list[str]) -> list[str]:
    """The child's argv. Logging once, at the last step, makes train_loss the mean over all the steps."""
    command = [sys.executable, "-m", "effitrain", "train", "--model", str(args.model), "--task", args.task,
               "--data", str(args.data), "--max-length", str(args.max_length), "--seed", str(args.seed)]
    command += settings_flags(settings)
    command += ["--max-steps", str(args.steps), "--log-every", str(args.steps), "--output-dir", str(run_dir)]
    command += ["--debug"] if args.debug else []
    return command + extra


def needs_checkpointing(baseline: dict | None, memory_bytes: int | None) -> tuple[bool, str]:
    """The recommended variant's rule: gradient checkpointing (trading about a third more compute for
    activation memory) only when the baseline's peak memory was above 80% of the machine's memory,
    i.e. when memory, not speed, is what limits this job. Without a baseline measurement (not run,
    failed, or no peak reported) or a known memory size it stays off."""
    peak = (baseline or {}).get("peak_memory_bytes")
    if not peak or not memory_bytes:
        return False, "gradient checkpointing off: no baseline peak memory to decide from"
    share = peak / memory_bytes
    on = share > CHECKPOINTING_THRESHOLD
    return on, (f"gradient checkpointing {'on' if on else 'off'}: baseline peak {peak / 2**30:.2f} GiB is "
                f"{share:.0%} of {memory_bytes / 2**30:.1f} GiB ({'>' if on else '<='} "
                f"{CHECKPOINTING_THRESHOLD:.0%})")


def machine_memory_bytes(device_type: str | None) -> int | None:
    """What the baseline's peak is measured against: the GPU's memory when it trained on CUDA (its peak
    is torch.cuda's peak allocation), else the RAM (its peak is the process's resident set)."""
    from effitrain.runtime import devices

    if device_type == "cuda":
        # Asked in a throwaway process: CUDA set up here would hold GPU memory through the next variant.
        probe = subprocess.run([sys.executable, "-c", "import torch; "
                                "print(torch.cuda.get_device_properties(0).total_memory)"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip().isdigit():
            return int(probe.stdout.strip())
        return None
    return devices.total_memory_bytes()


# --- running ------------------------------------------------------------------------------------

def run_matrix(args: argparse.Namespace, names: list[str], skipped: dict[str, str], extra: list[str],
               bench_dir: Path) -> list[dict]:
    results: list[dict] = []
    todo = [name for name in names if name not in skipped]
    for index, name in enumerate(todo, 1):
        note = None
        checkpointing = False
        if name == "recommended":
            baseline = next((r["metrics"] for r in results if r["name"] == BASELINE and r["status"] == "ok"), None)
            device = (baseline or {}).get("device")
            checkpointing, note = needs_checkpointing(baseline, machine_memory_bytes(device) if baseline else None)
        settings = variant_settings(name, args.batch_size, checkpointing)
        command = train_command(args, settings, bench_dir / name, extra)
        print(f"[{index}/{len(todo)}] {name}: {display(command)}", flush=True)
        result = run_variant(name, command, bench_dir / f"{name}.log", stream=args.debug)
        result.update(settings=settings, note=note)
        print(f"[{index}/{len(todo)}] {name}: {outcome_line(result)}", flush=True)
        if index == 1 and result["returncode"] == UserError.exit_code:
            raise refused(result)  # a mistake every variant shares (--model, --data, --extra): say it once, stop
        results.append(result)
    for name, reason in skipped.items():
        results.append({"name": name, "status": "skipped", "error": reason, "metrics": {}, "note": None})
    # Keep the matrix order in the table, skipped ones included.
    return sorted(results, key=lambda r: ORDER.index(r["name"]))


def display(command: list[str]) -> str:
    """The command as a user would type it: `effitrain ...` instead of `<python> -m effitrain ...`."""
    return "effitrain " + shlex.join(command[3:])


def run_variant(name: str, command: list[str], log_path: Path, stream: bool = False) -> dict:
    """Run one child to the end; its output goes to `log_path` (or straight through with `stream`). A
    failure is recorded, with the child's last stderr line, rather than raised: the other variants
    still run."""
    start = time.perf_counter()
    if stream:
        proc = subprocess.run(command)
        stdout, stderr = "", ""
    else:
        proc = subprocess.run(command, capture_output=True, text=True)
        stdout, stderr = proc.stdout, proc.stderr
        log_path.write_text(f"$ {display(command)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    seconds = time.perf_counter() - start
    result = {"name": name, "command": command, "returncode": proc.returncode, "seconds": round(seconds, 3),
              "status": "ok", "error": None, "metrics": {}}
    if proc.returncode != 0:
        where = "its output above" if stream else log_path
        result.update(status="failed", error=last_line(stderr) or f"exit code {proc.returncode}, see {where}")
        return result
    run_dir = Path(command[command.index("--output-dir") + 1])
    try:
        result["metrics"] = read_metrics(run_dir / "metrics.json")
    except (OSError, ValueError) as err:
        result.update(status="failed", error=f"cannot read {run_dir / 'metrics.json'}: {err}")
    return result


def refused(result: dict) -> UserError:
    """The first run's own one-line refusal (`effitrain: error: PROBLEM; fix: FIX`) as the bench's."""
    line = (result["error"] or "").removeprefix("effitrain: error: ")
    problem, _, fix = line.partition("; fix: ")
    return UserError(f"the {result['name']} run refused its settings: {problem}",
                     fix or "correct --model, --data or --extra and run the bench again")


def last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def read_metrics(path: Path) -> dict[str, Any]:
    """The measures of one run; keys a run does not write (yet) are None."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    kept = {key: data.get(key) for key in KEPT_METRICS}
    seconds, steps = data.get("train_seconds"), data.get("steps")
    kept["step_seconds"] = seconds / steps if isinstance(seconds, (int, float)) and steps else None
    kept["test_accuracy"] = (data.get("test") or {}).get("accuracy") if isinstance(data.get("test"), dict) else None
    return kept


def outcome_line(result: dict) -> str:
    if result["status"] != "ok":
        return f"FAILED (exit {result['returncode']}) after {result['seconds']:.1f} s: {result['error']}"
    speed = result["metrics"].get("train_samples_per_second")
    return f"done in {result['seconds']:.1f} s, " + (f"{speed:.1f} samples/s" if speed is not None else "- samples/s")


# --- ratios, table, JSON, chart -----------------------------------------------------------------

def ratio(value: Any, base: Any) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def add_ratios(results: list[dict]) -> None:
    """Each ok result gets `ratios`: its measure / the baseline's; None where either is missing."""
    baseline = next((r["metrics"] for r in results if r["name"] == BASELINE and r["status"] == "ok"), None)
    for result in results:
        ok = result["status"] == "ok" and baseline is not None
        result["ratios"] = {key: ratio(result["metrics"].get(key), baseline.get(key)) if ok else None
                            for key, _, _ in MEASURES}


def cell(value: Any, rel: float | None, fmt) -> str:
    if value is None:
        return "-"
    return fmt(value) + (f" ({times(rel)})" if rel is not None else "")


def table_rows(results: list[dict]) -> list[list[str]]:
    header = ["variant", "status"] + [title for _, title, _ in MEASURES] + ["seconds"]
    rows = [header]
    for r in results:
        ratios = r.get("ratios") or {}
        cells = [cell(r["metrics"].get(key), ratios.get(key), fmt) for key, _, fmt in MEASURES]
        seconds = f"{r['seconds']:.1f}" if r.get("seconds") is not None else "-"
        rows.append([r["name"], r["status"]] + cells + [seconds])
    return rows


def format_table(results: list[dict]) -> str:
    """Aligned columns, value (ratio to baseline) per measure; failures and notes listed below it."""
    rows = table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(text.ljust(width) if i < 2 else text.rjust(width)
                       for i, (text, width) in enumerate(zip(row, widths))).rstrip() for row in rows]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"{r['name']} {r['status']}: {r['error']}")
        if r.get("note"):
            lines.append(f"{r['name']}: {r['note']}")
    if not any(r["name"] == BASELINE and r["status"] == "ok" for r in results):
        lines.append("no ratios: the baseline did not run, or failed")
    return "\n".join(lines)


def report(args: argparse.Namespace, extra: list[str], results: list[dict]) -> dict:
    """bench.json: the bench's settings and, per variant, its flags, outcome, measures and ratios."""
    settings = {key: getattr(args, key) for key in ("model", "task", "data", "steps", "batch_size", "max_length",
                                                     "seed")}
    variants = [{key: r.get(key) for key in ("name", "status", "error", "note", "settings", "command",
                                              "returncode", "seconds", "metrics", "ratios")} for r in results]
    return {**settings, "extra": extra, "baseline": BASELINE, "variants": variants}


def chart_series(results: list[dict], key: str) -> tuple[list[str], list[float | None], bool]:
    """Names and bar heights for one measure: ratios to the baseline, or the raw values without one."""
    names = [r["name"] for r in results]
    use_ratios = any((r.get("ratios") or {}).get(key) is not None for r in results)
    if use_ratios:
        return names, [(r.get("ratios") or {}).get(key) for r in results], True
    return names, [r["metrics"].get(key) for r in results], False


def write_chart(path: Path, results: list[dict]) -> Path | None:
    """bench.png: one bar subplot per measure. None (and a note) when matplotlib is not installed: the
    table and bench.json already hold every figure, so a long bench must not fail on its last step."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("no bench.png: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    titles = {key: title for key, title, _ in MEASURES}
    # A bare Figure on the Agg canvas: no pyplot, so no global backend switch and no display needed.
    fig = Figure(figsize=(4 * len(CHART_MEASURES), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, key in zip(fig.subplots(1, len(CHART_MEASURES)), CHART_MEASURES):
        plot_measure(ax, results, key, titles[key])
    fig.suptitle("effitrain bench: each variant / baseline")
    fig.savefig(path, dpi=100)
    return path


def plot_measure(ax, results: list[dict], key: str, title: str) -> None:
    names, values, is_ratio = chart_series(results, key)
    xs = range(len(names))
    ax.bar(xs, [0 if v is None else v for v in values], color="tab:blue")
    for x, value, r in zip(xs, values, results):
        # A missing bar must not read as zero: say why it is missing.
        label = (times(value) if is_ratio else f"{value:.3g}") if value is not None else (
            r["status"] if r["status"] != "ok" else "-")
        ax.annotate(label, (x, value or 0), ha="center", va="bottom", fontsize=8)
    if is_ratio:
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_title(f"{title} (x baseline)" if is_ratio else title)
    ax.set_xticks(list(xs), names, rotation=45, ha="right")
