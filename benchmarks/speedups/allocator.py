"""What keeping freed memory in glibc's heap (speedups/allocator.py) buys a CPU training step and evaluation,
and what it costs in resident memory.

Each run is a fresh subprocess of this script (glibc's settings and heap are per process), in two
variants taking turns over `--rounds` rounds, for each `--precision`:

  glibc   glibc's own malloc settings (EFFITRAIN_KEEP_FREED_MEMORY=0)
  keep    allocator.keep_freed_memory(), as `effitrain train` sets it on CPUs

A run builds the default model as `effitrain train` does (effitrain's dropout, the first-token last
layer), trains 2 warm-up + 20 timed steps of batch 16 over five widths (20, 25, 30, 35, 40 tokens, about
the default job's length-grouped batches; forward, loss, backward, fused AdamW, zero_grad), then times
3 evaluation forwards at batch 128 for each of 128, 64 and 30 tokens (torch.inference_mode). It reports
the median step, the evaluation's total, and the peak resident set (ru_maxrss) after training and at
the end. The parent prints the medians over the rounds and keep's ratios.

    .venv/bin/python benchmarks/speedups/allocator.py [--rounds 3] [--precision fp32 bf16]
    .venv/bin/python benchmarks/speedups/allocator.py --dry-run   # a tiny model, 1 round, fp32: two short children
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

VARIANTS = {"glibc": "0", "keep": "1"}
WIDTHS = (20, 30, 40, 25, 35)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=("fp32", "bf16"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny model (benchmarks/_common.py), 1 round, fp32 only")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.rounds, args.precision = 1, ["fp32"]
    return args


def peak_mib() -> float:
    return _common.rss_peak_bytes() / _common.MiB


def child(precision: str) -> dict:
    import torch
    from speedups.dropout import batch_of, make_step  # benchmarks/speedups/dropout.py: the same step and batch
    from speedups.first_token_head import make_eval  # and its evaluation forward
    from transformers import AutoModelForSequenceClassification

    from effitrain import tasks
    from effitrain.optimizers import classic as optim
    from effitrain.models import loading, transforms
    from effitrain.speedups import allocator

    kept = allocator.keep_freed_memory()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(loading.resolve("default")), num_labels=2,
                                                               attn_implementation="sdpa")
    # effitrain's transforms but the oneDNN linear layers (this benchmark's measurements predate them).
    model, _ = transforms.apply_all(model, transforms.Settings(tasks.get("sequence-classification")),
                                    skip={"onednn-linear"})
    model.train()

    optimizer = optim.adamw(model, 1e-4, 0.01)
    steps = [make_step(model, optimizer, batch_of(16, width), precision) for width in WIDTHS]
    for step in steps[:2]:
        step()
    times = []
    for _ in range(4):
        for step in steps:
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    after_training = peak_mib()
    model.eval()
    evaluation = 0.0
    for width in (128, 64, 30):
        forward = make_eval(model, batch_of(128, width), precision)
        for _ in range(3):
            start = time.perf_counter()
            forward()
            evaluation += time.perf_counter() - start
    return {"kept": kept, "step_seconds": statistics.median(times), "evaluation_seconds": evaluation,
            "peak_mib_after_training": after_training, "peak_mib_at_end": peak_mib()}


def run(variant: str, precision: str) -> dict:
    env = {**os.environ, "EFFITRAIN_KEEP_FREED_MEMORY": VARIANTS[variant]}
    return _common.child_json([sys.executable, str(Path(__file__).resolve()), "--child", precision], env=env)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return
    if args.dry_run:
        _common.dry_run_model()
    import torch

    print(f"default model on {os.cpu_count()} cores, torch {torch.__version__}, {args.rounds} rounds, medians")
    for precision in args.precision:
        results = _common.take_turns(VARIANTS, args.rounds, lambda variant: run(variant, precision))
        assert not any(r["kept"] for r in results["glibc"]) and all(r["kept"] for r in results["keep"])
        median = {variant: {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "kept"}
                  for variant, runs in results.items()}
        for variant, m in median.items():
            each = " / ".join(f"{r['step_seconds'] * 1000:.0f}" for r in results[variant])
            print(f"{precision} {variant:5s}: step {m['step_seconds'] * 1000:6.1f} ms (each run: {each}), "
                  f"evaluation {m['evaluation_seconds']:5.2f} s, peak RSS after training "
                  f"{m['peak_mib_after_training']:5.0f} MiB, at the end {m['peak_mib_at_end']:5.0f} MiB")
        glibc, keep = median["glibc"], median["keep"]
        print(f"{precision} keep / glibc: step {glibc['step_seconds'] / keep['step_seconds']:.2f}x faster, "
              f"evaluation {glibc['evaluation_seconds'] / keep['evaluation_seconds']:.2f}x faster, peak RSS "
              f"after training {keep['peak_mib_after_training'] / glibc['peak_mib_after_training']:.3f}x, "
              f"at the end {keep['peak_mib_at_end'] / glibc['peak_mib_at_end']:.3f}x")


if __name__ == "__main__":
    main()
