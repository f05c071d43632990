"""Every optimizer of `--optim` on the same job: optimizer-state bytes (the optimizer's own tensors,
metrics.json `optimizer_state_bytes`) against the memory planner's arithmetic, step time and test
accuracy, over several seeds, each as a ratio to AdamW's.

For each data set (the default job: sms-spam; bbc-news) and seed, one `effitrain train` run per
optimizer with effitrain's defaults otherwise (the default model all-MiniLM-L6-v2, micro-batch 16, fp32,
lr 1e-4, warm-up 0.1, the linear decay; schedule-free keeps the peak lr after the warm-up), `--steps`
optimizer steps. Runs are fresh subprocesses, one after the other. AdamW's seed-to-seed spread of test
accuracy (max - min) is printed beside each optimizer's mean difference to AdamW's mean.

    .venv/bin/python benchmarks/techniques/optimizers.py                          # 2 data sets x 3 seeds x 9 optimizers
    .venv/bin/python benchmarks/techniques/optimizers.py --steps 60 --seeds 1 --data sms-spam   # a quicker check
    .venv/bin/python benchmarks/techniques/optimizers.py --markdown benchmarks/results/optimizers_xeon2c_2026-12-05.md
    .venv/bin/python benchmarks/techniques/optimizers.py --dry-run    # a tiny model, 2 steps, adamw and muon

Planned bytes: planning/planner.py's `model_states` for the run's model and labels (states only).
Step time: metrics.json `train_seconds` / `steps` (the training loop, first step included). Nothing
here asserts a figure; the issue's bars (state within 5% of the plan; GaLore and APOLLO at most 0.35x
AdamW's) are printed as pass/fail.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

OPTIMIZERS = ("adamw", "sgd", "adafactor", "adamw-8bit", "adam-8bit", "galore-adamw", "apollo-adamw", "muon",
              "schedule-free-adamw")
LABELS = {"sms-spam": 2, "bbc-news": 5}


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", action="append", choices=sorted(LABELS), help="repeatable (default: both)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1 "
                        "(to share the seeds among processes: --rows merges their --json files)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--optim", action="append", choices=OPTIMIZERS, help="repeatable (default: all)")
    parser.add_argument("--rows", nargs="+", type=Path, metavar="JSON",
                        help="summarise the runs of these --json files (merged) instead of training")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    return parser.parse_args(argv)


def train(folder: Path, data: str, optim: str, seed: int, steps: int, dry_run: bool) -> dict:
    out = folder / f"{data}-{optim}-{seed}"
    command = [sys.executable, __file__, "--child", "train", "--data", data, "--optim", optim, "--seed", str(seed),
               "--max-steps", str(steps), "--output-dir", str(out), "--log-every", str(steps)]
    if dry_run:
        command += ["--max-train-samples", "32", "--max-eval-samples", "16", "--batch-size", "4"]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    metrics = json.loads((out / "metrics.json").read_text())
    return {"state": metrics["optimizer_state_bytes"], "step_s": metrics["train_seconds"] / metrics["steps"],
            "accuracy": metrics["test"]["accuracy"]}


def planned(data: str, optim: str) -> int:
    from effitrain.planning import planner as plan

    shapes = plan.model_shapes("sequence-classification", "default", LABELS[data])
    return plan.Planner(shapes, 128).model_states(optim)[2]


def summarise(data: str, runs: dict[str, list[dict]]) -> list[list]:
    base = [r for r in runs["adamw"] if "error" not in r]
    base_state = base[0]["state"] if base else None
    base_step = statistics.mean(r["step_s"] for r in base) if base else None
    base_acc = [r["accuracy"] for r in base]
    spread = max(base_acc) - min(base_acc) if base_acc else None
    rows = []
    for optim, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            rows.append([data, optim, "failed: " + results[0]["error"]] + [""] * 7)
            continue
        state, plan_bytes = ok[0]["state"], planned(data, optim)
        step = statistics.mean(r["step_s"] for r in ok)
        accs = [r["accuracy"] for r in ok]
        diff = statistics.mean(accs) - statistics.mean(base_acc) if base_acc else None
        rows.append([data, optim, f"{state / 2**20:.1f}", f"{state / plan_bytes:.4f}",
                     _common.fmt(state / base_state if base_state else None, ".3f") + "x",
                     f"{1000 * step:.0f}", _common.fmt(step / base_step if base_step else None, ".2f") + "x",
                     f"{statistics.mean(accs):.4f} ({min(accs):.4f}-{max(accs):.4f})",
                     _common.fmt(diff, "+.4f"), _common.fmt(spread, ".4f")])
    return rows


HEADER = ["data", "optimizer", "state MiB", "state / plan", "state vs AdamW", "step ms", "step vs AdamW",
          "test acc mean (min-max)", "acc - AdamW", "AdamW spread"]


def measure(datas, optims, seeds, steps: int, dry_run: bool) -> dict:
    """{data: {optimizer: [one result per seed]}}, each run a fresh process."""
    raw = {}
    with tempfile.TemporaryDirectory(prefix="bench-optimizers-") as folder:
        for data in datas:
            runs = {optim: [] for optim in optims}
            for seed in seeds:  # the optimizers take turns within a seed: a busy minute hits them alike
                for optim in optims:
                    runs[optim].append(train(Path(folder), data, optim, seed, steps, dry_run))
                    print(f"{data} seed {seed} {optim}: {runs[optim][-1]}", flush=True)
            raw[data] = runs
    return raw


def merged(paths: list[Path]) -> dict:
    """The runs of several --json files (other seeds of the same runs) as one."""
    raw: dict = {}
    for path in paths:
        for data, runs in json.loads(path.read_text()).items():
            for optim, results in runs.items():
                raw.setdefault(data, {}).setdefault(optim, []).extend(results)
    return raw


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # `effitrain ...` in this process (a dry run's model applied by _common)
        from effitrain.cli import main as cli

        return cli(argv[1:])
    args = parse(argv)
    datas, optims = args.data or list(LABELS), args.optim or list(OPTIMIZERS)
    seeds, steps = range(args.first_seed, args.first_seed + args.seeds), args.steps
    if args.dry_run:
        _common.dry_run_model()
        datas, optims, seeds, steps = ["sms-spam"], ["adamw", "muon"], range(1), 2
        _common.skipped("bbc-news, the other optimizers and seeds, and the files (--markdown, --json)")
    raw = merged(args.rows) if args.rows else measure(datas, optims, seeds, steps, args.dry_run)
    rows = [row for data, runs in raw.items() for row in summarise(data, runs)]
    _common.print_columns(tuple(HEADER), [tuple(r) for r in rows])
    text = (f"# Optimizers: state bytes, step time, test accuracy\n\n{_common.machine(torch_version=True)}; "
            f"{steps} steps, seeds {list(seeds)}, `{' '.join(['benchmarks/techniques/optimizers.py', *argv])}`\n\n"
            + _common.md_table(HEADER, rows) + "\n")
    if args.dry_run:
        return 0
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
