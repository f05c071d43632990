"""One process with the whole batch against N processes with --strategy ddp and N with --strategy fsdp:
the same final weights and loss, fp32, to 1e-5 (gpu_check.sh's step 3; the GPU twin of
tests/integration/test_distributed.py's CPU test).

    python benchmarks/gpu/gpu_equivalence.py --nproc 2 --work-dir runs/equivalence --json equivalence.json
    python benchmarks/gpu/gpu_equivalence.py --nproc 2 --dry-run   # validate the 3 commands, train nothing
                                                               # (--nproc 2 unless given)

The model is the tests' tiny BERT (2 layers, hidden 32, random weights from seed 0, dropout off, the packaged
all-MiniLM tokenizer), so that runs which see the same examples compute the same arithmetic. Each run is
`effitrain train` on the default data (sms-spam), micro-batch B per process, N x B x STEPS training examples,
1 epoch, lr 1e-3 without warm-up, --precision fp32; the single process takes the whole batch N x B. The
comparison is elementwise (torch.testing.assert_close's rule |a - b| <= atol + rtol |b|), never a per-tensor
norm, which is ill-conditioned (DESIGN.md). Exit codes: 0 all equal, 1 a difference or a failed run, 2 bad
arguments or a command effitrain refuses.

Never run on GPUs yet: no GPU has been lent to this project (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

RUNS = ("single", "ddp", "fsdp")


def commands(nproc: int, micro: int, steps: int, model: Path, work: Path) -> dict[str, list[str]]:
    """name -> the effitrain command line (after `effitrain`)."""
    common = ["--model", str(model), "--max-train-samples", str(nproc * micro * steps), "--max-eval-samples", "32",
              "--epochs", "1", "--lr", "1e-3", "--warmup-ratio", "0", "--log-every", "1", "--eval-batch-size", "16",
              "--precision", "fp32"]
    launched = ["launch", "--nproc", str(nproc), "--", "train", *common, "--batch-size", str(micro)]
    return {"single": ["train", *common, "--batch-size", str(nproc * micro), "--output-dir", str(work / "single")],
            "ddp": [*launched, "--strategy", "ddp", "--output-dir", str(work / "ddp")],
            "fsdp": [*launched, "--strategy", "fsdp", "--output-dir", str(work / "fsdp")]}


def differences(reference: dict, other: dict, rtol: float, atol: float) -> dict:
    """The largest elementwise difference of `other` from `reference` (name -> tensor), and the largest
    ratio of a difference to its tolerance atol + rtol |reference| (<= 1: within it; a plain relative
    difference would be huge on elements that are nearly 0). Tensors missing or of another shape fail."""
    names = sorted(set(reference) | set(other))
    mismatched = [n for n in names if n not in reference or n not in other or reference[n].shape != other[n].shape]
    max_abs = max_ratio = 0.0
    for name in names:
        if name in mismatched or not reference[name].numel():
            continue
        a, b = other[name].double(), reference[name].double()
        diff = (a - b).abs()
        max_abs = max(max_abs, float(diff.max()))
        max_ratio = max(max_ratio, float((diff / (atol + rtol * b.abs())).max()))
    return {"max_abs_diff": max_abs, "max_tolerance_ratio": max_ratio, "mismatched": mismatched[:10],
            "close": not mismatched and max_ratio <= 1}


def run_one(name: str, argv: list[str], work: Path, timeout: float) -> tuple[int, float]:
    started = time.time()
    with open(work / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run([sys.executable, "-m", "effitrain", *argv], stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.time() - started


def compare(runs: dict, work: Path, nproc: int, micro: int, rtol: float, atol: float) -> list[dict]:
    from safetensors.torch import load_file

    rows, reference, reference_loss, reference_steps = [], None, None, None
    for name in RUNS:
        row = {"name": name, "world_size": 1 if name == "single" else nproc,
               "batch": nproc * micro if name == "single" else micro, **runs[name]}
        metrics_path, weights_path = work / name / "metrics.json", work / name / "model" / "model.safetensors"
        if row["exit_code"] != 0 or not metrics_path.is_file() or not weights_path.is_file():
            row["close"] = False
            rows.append(row)
            continue
        metrics = json.loads(metrics_path.read_text())
        weights = load_file(str(weights_path))
        row.update(train_loss=metrics.get("train_loss"), test_loss=metrics.get("test", {}).get("loss"),
                   steps=metrics.get("steps"), measured_world_size=metrics.get("world_size"))
        if name == "single":
            reference, reference_loss, reference_steps = weights, row["train_loss"], row["steps"]
            row["close"] = True
        elif reference is not None:
            row.update(differences(reference, weights, rtol, atol))
            if row["train_loss"] is not None and reference_loss is not None:
                row["loss_rel_diff"] = abs(row["train_loss"] - reference_loss) / max(abs(reference_loss), 1e-12)
                row["close"] = row["close"] and row["loss_rel_diff"] <= rtol
            row["close"] = row["close"] and row["steps"] == reference_steps and row["measured_world_size"] == nproc
        else:
            row["close"] = False
        rows.append(row)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes (GPUs) of the ddp and fsdp runs, >= 2 (required; 2 with --dry-run)")
    parser.add_argument("--micro-batch", type=int, default=4, help="per process (default: 4)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (default: 6)")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per run (default: 150)")
    parser.add_argument("--work-dir", type=Path, default=None, help="the runs' folders (default: a new temporary one)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--dry-run", action="store_true", help="validate the three commands with effitrain's own "
                        "parser and config validation; build and train nothing")
    args = parser.parse_args(argv)
    if args.nproc is None:
        if not args.dry_run:
            parser.error("the following arguments are required: --nproc")
        args.nproc = 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("nproc", "micro_batch", "steps"):
        if getattr(args, name) < (2 if name == "nproc" else 1):
            print(f"gpu_equivalence.py: error: --{name.replace('_', '-')} must be >= {2 if name == 'nproc' else 1}, "
                  f"got {getattr(args, name)}; fix: pass a larger value", file=sys.stderr)
            return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu-equivalence-"))
    if args.dry_run and args.work_dir is None:
        atexit.register(shutil.rmtree, work, True)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-bert"  # built for a real run only: validating the commands does not read it
    planned = commands(args.nproc, args.micro_batch, args.steps, model, work)
    shown = [f"{sys.executable} -m effitrain {' '.join(argv)}" for argv in planned.values()]
    if args.dry_run:
        from gpu._gpu_check import validate_effitrain

        from effitrain.errors import UserError

        for line, argv in zip(shown, planned.values()):
            print(f"$ {line}")
            try:
                validate_effitrain(argv)
            except UserError as err:
                print(f"  invalid: effitrain: error: {err}", file=sys.stderr)
                return 2
            print("  valid (effitrain's parser and config validation; not run)")
        _common.skipped(f"the three runs ({args.nproc} GPUs) and the comparison of their weights")
        return 0
    _common.save_tiny_bert(model)
    runs = {}
    for (name, argv), line in zip(planned.items(), shown):
        print(f"$ {line}", flush=True)
        rc, seconds = run_one(name, argv, work, args.timeout)
        runs[name] = {"exit_code": rc, "seconds": round(seconds, 1), "command": line}
        print(f"  exit {rc} after {seconds:.0f} s (log: {work / name}.log)", flush=True)
    rows = compare(runs, work, args.nproc, args.micro_batch, args.rtol, args.atol)
    for r in rows:
        print(f"{r['name']:6} x{r['world_size']} exit {r['exit_code']} train loss {r.get('train_loss')} "
              f"max abs diff {r.get('max_abs_diff')} diff / tolerance {r.get('max_tolerance_ratio')} "
              f"{'reference' if r['name'] == 'single' else ('PASS' if r['close'] else 'FAIL')}")
    if args.json:
        args.json.write_text(json.dumps({"rtol": args.rtol, "atol": args.atol, "steps": args.steps, "nproc": args.nproc,
                                         "commands": shown, "runs": rows}, indent=1))
    return 0 if all(r["close"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
