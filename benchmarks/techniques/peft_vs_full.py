"""Full fine-tuning against LoRA and QLoRA (`effitrain train --peft lora|qlora`) on the same job.

For each data set (the default job, sms-spam, and bbc-news), three `effitrain train` runs with the
same model (the default, all-MiniLM-L6-v2), split, seed, micro-batch, epochs (1), warm-up, weight
decay, clipping and precision (effitrain's defaults), differing only in what each method needs:

    full    effitrain's defaults (every weight trained; lr 1e-4, effitrain's default without --peft)
    lora    --peft lora  (r 8, alpha 16, dropout 0.05, all-linear: effitrain's defaults)
    qlora   --peft qlora (the same adapters over the frozen base in 4-bit NF4)

LoRA trains far fewer weights from a small start and needs a higher learning rate than full
fine-tuning; effitrain's default --lr with --peft is 1e-3 (1e-4 without), so by default this script
passes no --lr. `--peft-lr X` passes --lr X to the lora and qlora runs. The learning rate each run
really used is read back from its config.yaml and shown in the table.

Each run is a fresh subprocess, one after the other (never in parallel), so that each one's peak memory
and threads are its own. The subprocess is the `effitrain train` command itself (`effitrain.__main__`)
started through this script (`--child`), which only observes: it wraps
`effitrain.engine.run.announce` (called right before the first step) and
`effitrain.engine.evaluator.evaluate` (first called right after the last step, for validation) to take
the resident set and the CPU use of all processes at the start and the end of training. Everything
else comes from the run's metrics.json and its output folders.

    .venv/bin/python benchmarks/techniques/peft_vs_full.py                      # sms-spam and bbc-news, 1 epoch each (6
                                                                                # runs)
    .venv/bin/python benchmarks/techniques/peft_vs_full.py --data sms-spam --quick   # 60 steps, 200 eval examples: a
                                                                                     # fast check
    .venv/bin/python benchmarks/techniques/peft_vs_full.py --markdown benchmarks/results/peft_vs_full_epyc2c_2026-12-05.md
    .venv/bin/python benchmarks/techniques/peft_vs_full.py --dry-run   # full and lora, a tiny model, 2 steps: two
                                                                       # children

The tables are printed; `--markdown PATH` also writes them to PATH (by convention a dated file
benchmarks/results/peft_vs_full_<machine>_<date>.md), `--json PATH` every figure.

What each figure is:

- test accuracy, spam F1 (sms-spam) or macro F1 (other data): metrics.json `test`;
- samples/s: metrics.json `train_samples_per_second` (the training loop only);
- peak RSS, training: the process's peak resident set (`ru_maxrss`) at the end of training, before
  any evaluation: libraries, data, model, gradients, optimizer state and activations. On a GPU the
  table uses `torch.cuda.max_memory_allocated` at that moment instead. metrics.json's own
  `peak_memory_bytes` is taken later (after the test evaluation at batch 128) and is printed beside it;
- optimizer state: metrics.json `optimizer_state_bytes` (the optimizer's own state tensors);
- trainable: metrics.json `trainable_share` (4-bit weights counted as the values they hold);
- model/, adapter/: bytes on disk of the run's output folders (model/ is the merged model for LoRA
  and QLoRA); adapter weights: metrics.json `adapter_bytes`;
- other cores: the CPU that other processes used during this run's training (/proc/stat minus this
  process's getrusage), in cores. Above 0.1 the speeds measure the contention as much as the method.

Ratios are against the full fine-tuning run of the same data set. Speeds depend on the machine and on
whatever else runs on it; compare the ratios, not the absolutes, and only between runs whose other
cores are near 0. Nothing here asserts a time or a score: the issue's bars are printed as pass/fail.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

METHODS = ("full", "lora", "qlora")
QUICK = ["--max-steps", "60", "--max-eval-samples", "200"]
DRY_RUN = ["--max-steps", "2", "--batch-size", "4", "--max-train-samples", "64", "--max-eval-samples", "8"]
# The bars (issue 13), on the default job (sms-spam).
BARS = (
    ("lora", "test accuracy >= 0.98", lambda r, full: r["accuracy"] >= 0.98),
    ("lora", "spam F1 >= 0.92", lambda r, full: r["f1"] >= 0.92),
    ("lora", "trainable <= 2.5%", lambda r, full: r["trainable_share"] <= 0.025),
    ("lora", "optimizer state <= 3% of full's", lambda r, full: r["optimizer_state_bytes"] <= 0.03 * full["optimizer_state_bytes"]),
    ("lora", "peak training memory < full's", lambda r, full: r["train_peak_bytes"] < full["train_peak_bytes"]),
    ("qlora", "test accuracy >= 0.97", lambda r, full: r["accuracy"] >= 0.97),
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", action="append", default=None,
                        help="data set (repeatable; default: sms-spam and bbc-news)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma list of full, lora, qlora (default all)")
    parser.add_argument("--peft-lr", default="default",
                        help="--lr of the lora and qlora runs (default: none passed, effitrain's default for --peft)")
    parser.add_argument("--quick", action="store_true", help=f"a fast check: adds {' '.join(QUICK)} to every run")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where the runs go (default: a temporary folder, deleted at the end)")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH",
                        help="also write the tables to PATH, e.g. benchmarks/results/peft_vs_full_<machine>_<date>.md "
                             "(default: printed only)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --output-dir: read the runs already there (metrics.json and the observer's "
                             "file) instead of running them again; run only the missing ones")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write every figure to PATH")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"sms-spam, full and lora, a tiny model (benchmarks/_common.py), {' '.join(DRY_RUN)}; "
                             "the runs in a temporary folder, no --markdown, --json or --reuse")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.data, args.methods, args.output_dir, args.markdown, args.json, args.reuse = (
            ["sms-spam"], "full,lora", None, None, None, False)
    if args.reuse and args.output_dir is None:
        parser.error("--reuse needs --output-dir")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or set(methods) - set(METHODS):
        parser.error(f"--methods: pick from {', '.join(METHODS)}")
    args.methods = [m for m in METHODS if m in methods]
    args.data = args.data or ["sms-spam", "bbc-news"]
    return args


# --- the child: `effitrain train`, observed -------------------------------------------------------------


def current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_now() -> dict:
    import torch

    found = {"max_rss_bytes": _common.rss_peak_bytes(),
             "rss_bytes": current_rss_bytes()}
    if torch.cuda.is_available():
        found["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return found


def run_child(result: Path, train_argv: list[str]) -> int:
    """`effitrain train ARGS` in this process, with the two observers; writes what they saw to `result`."""
    from effitrain.engine import evaluator as evaluation
    from effitrain.engine import run as engine_run

    seen: dict = {}
    announce, evaluate = engine_run.announce, evaluation.evaluate

    def observed_announce(job):
        seen["start"] = {"cpu": _common.cpu_snapshot(), **memory_now()}
        return announce(job)

    def observed_evaluate(*args, **kwargs):
        if "end" not in seen:
            seen["end"] = {"cpu": _common.cpu_snapshot(), **memory_now()}
        return evaluate(*args, **kwargs)

    engine_run.announce, evaluation.evaluate = observed_announce, observed_evaluate
    from effitrain.__main__ import run

    sys.argv = ["effitrain", "train", *train_argv]
    code = run()
    if "start" in seen and "end" in seen:
        seen["cpu"] = _common.cores(seen["start"]["cpu"], seen["end"]["cpu"])
    result.write_text(json.dumps(seen))
    return code


# --- the parent --------------------------------------------------------------------------------------


def folder_bytes(path: Path) -> int | None:
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def train_args(method: str, data: str, args, out: Path) -> list[str]:
    argv = ["--data", data, "--output-dir", str(out), "--overwrite"]
    if method != "full":
        argv += ["--peft", method]
        if args.peft_lr != "default":
            argv += ["--lr", args.peft_lr]
    return argv + (QUICK if args.quick else []) + (DRY_RUN if args.dry_run else [])


def run_one(method: str, data: str, args, root: Path) -> dict:
    out = root / f"{data}-{method}"
    observed = root / f"{data}-{method}.observed.json"
    argv = train_args(method, data, args, out)
    if args.reuse and (out / "metrics.json").is_file() and observed.is_file():
        print(f"reusing {method} on {data}: {out} (effitrain train {' '.join(argv)})", flush=True)
        wall = None
    else:
        print(f"running {method} on {data}: effitrain train {' '.join(argv)}", flush=True)
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", str(observed), *argv],
                              capture_output=True, text=True)
        wall = time.perf_counter() - started
    if wall is not None and (proc.returncode != 0 or not (out / "metrics.json").is_file()):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        print(f"  {method} on {data} failed (exit {proc.returncode}):\n{tail}", flush=True)
        return {"method": method, "data": data, "failed": True, "exit": proc.returncode, "output_tail": tail,
                "argv": argv}
    metrics = json.loads((out / "metrics.json").read_text())
    seen = json.loads(observed.read_text()) if observed.is_file() else {}
    config_lr = None
    try:
        import yaml

        config_lr = yaml.safe_load((out / "config.yaml").read_text()).get("lr")
    except Exception:  # the table then shows the lr passed (or "-")
        pass
    end = seen.get("end", {})
    test = metrics["test"]
    labels = metrics.get("labels") or []
    f1_key = "f1_spam" if "spam" in labels else "f1_macro"
    row = {
        "method": method, "data": data, "argv": argv, "lr": config_lr,
        "accuracy": test["accuracy"], "f1": test[f1_key], "f1_key": f1_key, "test": test,
        "samples_per_second": metrics["train_samples_per_second"],
        "train_seconds": metrics["train_seconds"], "steps": metrics["steps"],
        # End of training: CUDA's allocator peak on a GPU, the process's peak resident set on CPU.
        "train_peak_bytes": end.get("cuda_max_allocated_bytes", end.get("max_rss_bytes")),
        "rss_before_training_bytes": seen.get("start", {}).get("rss_bytes"),
        "metrics_peak_memory_bytes": metrics["peak_memory_bytes"],
        "optimizer_state_bytes": metrics["optimizer_state_bytes"],
        "parameters": metrics.get("parameters"), "trainable_share": metrics.get("trainable_share"),
        "adapter_bytes": metrics.get("adapter_bytes"),
        "model_dir_bytes": folder_bytes(out / "model"), "adapter_dir_bytes": folder_bytes(out / "adapter"),
        "precision": metrics.get("precision"), "device": metrics.get("device"), "train_loss": metrics.get("train_loss"),
        "other_cores": seen.get("cpu", {}).get("other_cores"), "own_cores": seen.get("cpu", {}).get("own_cores"),
        "wall_seconds": wall,
        "finished": datetime.datetime.fromtimestamp((out / "metrics.json").stat().st_mtime,
                                                    datetime.timezone.utc).isoformat(timespec="minutes"),
    }
    print(f"  test accuracy {row['accuracy']:.4f}, {f1_key} {row['f1']:.4f}, {row['samples_per_second']:.1f} samples/s, "
          f"training peak {mib(row['train_peak_bytes'])} MiB, other cores {fmt(row['other_cores'], '{:.2f}')}, "
          f"{fmt(wall, '{:.0f} s')}", flush=True)
    return row


mib = functools.partial(_common.mib, unit="")  # the tables add the unit
fmt = _common.fmt


def ratio(value, base) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x" if value / base >= 0.1 else f"{value / base:.3f}x"


def size(value) -> str:
    if value is None:
        return "-"
    return f"{value / 2**20:.1f} MiB" if value >= 2**20 else f"{value / 2**10:.0f} KiB"


def lr_cell(row) -> str:
    if row["lr"] is None:
        return "-"
    passed = "--lr" in row["argv"]
    return f"{row['lr']:g}" + (" (--lr)" if passed else " (default)")


def table(rows: list[dict]) -> list[str]:
    full = next((r for r in rows if r["method"] == "full" and not r.get("failed")), None)
    ok = [r for r in rows if not r.get("failed")]
    f1_name = {"f1_spam": "spam F1", "f1_macro": "macro F1"}.get(ok[0]["f1_key"] if ok else "", "F1")
    lines = [
        f"| method | lr | test acc | {f1_name} | samples/s | vs full | training peak RSS | vs full "
        "| RSS before training | metrics.json peak | optimizer state | vs full | trainable | model/ | adapter/ "
        "| other cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['method']} | failed (exit {r['exit']}) |" + " |" * 14)
            continue
        base = full or {}
        p = r["parameters"] or {}
        trainable = (f"{r['trainable_share'] * 100:.2f}% ({p.get('trainable', 0):,} / {p.get('total', 0):,})"
                     if r["trainable_share"] is not None else "-")
        lines.append(
            f"| {r['method']} | {lr_cell(r)} | {r['accuracy']:.4f} | {r['f1']:.4f} "
            f"| {r['samples_per_second']:.1f} | {ratio(r['samples_per_second'], base.get('samples_per_second'))} "
            f"| {mib(r['train_peak_bytes'])} MiB | {ratio(r['train_peak_bytes'], base.get('train_peak_bytes'))} "
            f"| {mib(r['rss_before_training_bytes'])} MiB | {mib(r['metrics_peak_memory_bytes'])} MiB "
            f"| {size(r['optimizer_state_bytes'])} | {ratio(r['optimizer_state_bytes'], base.get('optimizer_state_bytes'))} "
            f"| {trainable} | {size(r['model_dir_bytes'])} | {size(r['adapter_dir_bytes'])} "
            f"| {fmt(r['other_cores'], '{:.2f}')} |")
    return lines


def bars(rows: list[dict]) -> list[str]:
    """The issue's bars on the default job, pass or fail (reported, not asserted)."""
    by = {r["method"]: r for r in rows if r["data"] == "sms-spam" and not r.get("failed")}
    full, out = by.get("full"), []
    for method, text, check in BARS:
        if method not in by or (full is None and "full" in text):
            continue
        out.append(f"- {method}: {text}: {'pass' if check(by[method], full) else 'FAIL'}")
    return out


def environment() -> str:
    import platform

    import torch

    from effitrain.runtime.devices import cpu_name

    names = ("torch", "transformers", "peft", "bitsandbytes", "accelerate")
    from importlib import metadata

    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    device = f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "CPU"
    return (f"{cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, {device}; "
            f"{', '.join(found)}; Python {platform.python_version()}")


NOTES = [
    "- lr: `(--lr)` passed by this script, `(default)` effitrain's default; read back from each run's config.yaml.",
    "- training peak RSS: the process's peak resident set (`ru_maxrss`) at the end of training, before any "
    "evaluation: it includes the Python libraries, the data and the weights (see RSS before training), not only "
    "what training adds. On a GPU it is `torch.cuda.max_memory_allocated` instead. metrics.json peak: "
    "`peak_memory_bytes`, the same resident set after the validation and test evaluations at batch 128.",
    "- optimizer state: the optimizer's own state tensors (AdamW: two fp32 moments per trainable parameter); "
    "trainable: trainable / all parameters (4-bit weights counted as the values they hold).",
    "- model/: merged model (LoRA: adapters added to the fp32 base; QLoRA: added to the dequantised 4-bit base, "
    "saved at fp32); adapter/: peft's folder (LoRA matrices + the classifier head, trained in full).",
    "- other cores: CPU other processes used during this run's training; above ~0.1 the samples/s and its ratio "
    "measure the contention as much as the method. Compare ratios, not absolutes.",
]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # a subprocess of the parent: --child RESULT TRAIN-ARGS...
        return run_child(Path(argv[1]), argv[2:])
    args = parse_args(argv)
    if args.dry_run:
        _common.dry_run_model()
        _common.skipped("qlora and bbc-news (more children) and the files (--markdown, --json)")
    if args.output_dir is not None:
        root, temporary = args.output_dir, False
        root.mkdir(parents=True, exist_ok=True)
    else:
        root, temporary = Path(tempfile.mkdtemp(prefix="peft_bench_")), True
    started = datetime.datetime.now(datetime.timezone.utc)
    rows: list[dict] = []
    try:
        for data in args.data:
            for method in args.methods:
                row = run_one(method, data, args, root)
                rows.append(row)
                if temporary and not row.get("failed"):  # the next run's disk and page cache
                    shutil.rmtree(root / f"{data}-{method}", ignore_errors=True)
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)

    env = environment()
    steps = "; ".join(f"{data}: {next((r['steps'] for r in rows if r['data'] == data and not r.get('failed')), '-')} "
                      f"steps" for data in args.data)
    finished = sorted(r["finished"][:16].replace("T", " ") for r in rows if not r.get("failed"))
    when = f"runs finished {finished[0]} to {finished[-1]} UTC" if finished else f"{started:%Y-%m-%d %H:%M} UTC"
    header = (f"{when}, default model (all-MiniLM-L6-v2), "
              f"{'--quick (' + ' '.join(QUICK) + ')' if args.quick else '1 epoch'}, micro-batch 16, seed 42, "
              f"effitrain's defaults otherwise ({steps}); {env}")
    out = [f"`.venv/bin/python benchmarks/techniques/peft_vs_full.py{' --quick' if args.quick else ''}"
           f"{''.join(' --data ' + d for d in args.data) if args.data != ['sms-spam', 'bbc-news'] else ''}`", "",
           header, ""]
    for data in args.data:
        out += [f"**{data}**", "", *table([r for r in rows if r["data"] == data]), ""]
    out += NOTES
    checks = bars(rows)
    if checks:
        out += ["", "Issue 13's bars (default job, sms-spam" + (", but --quick: not the real job" if args.quick else "")
                + (", but --dry-run: a tiny model, not the real job" if args.dry_run else "")
                + "):", *checks]
    text = "\n".join(out) + "\n"
    print("\n" + text)
    if args.markdown is not None:
        args.markdown.write_text(text)
        print(f"table written to {args.markdown}")
    if args.json is not None:
        args.json.write_text(json.dumps({"started": started.isoformat(), "environment": env, "quick": args.quick,
                                         "rows": rows}, indent=2))
        print(f"figures written to {args.json}")
    return 1 if any(r.get("failed") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
