"""The chunked causal-LM loss with one reused buffer per call (speedups/chunked_lm_loss.py now) against the
same loss allocating fresh blocks per chunk (its version at PREVIOUS, read from git): training (loss_sum,
forward and backward) and evaluation (per_position), fp32 and bf16 autocast, two vocabularies; medians of
`--rounds` alternating calls, in this process, with effitrain's glibc settings applied (start it with
jemalloc in LD_PRELOAD to measure under jemalloc).

    .venv/bin/python benchmarks/speedups/chunked_loss_buffers.py [--rounds 5]
    .venv/bin/python benchmarks/speedups/chunked_loss_buffers.py --dry-run   # vocabulary 1,000, 64 rows: seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from effitrain.speedups import allocator
from effitrain.speedups import chunked_lm_loss as current

PREVIOUS = "d515a17~1"  # the last commit whose chunked loss made fresh logits blocks per chunk
SHAPES = [(30522, 2048, 256), (151936, 2048, 512)]  # vocabulary, rows (positions with a loss), hidden


def call(module, hidden, weight, targets, precision: str, training: bool) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        if training:
            module.loss_sum(hidden, weight, None, targets).backward()
        else:
            module.per_position(hidden, weight, None, targets)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="vocabulary 1,000, 64 rows, 1 round")
    args = parser.parse_args()
    shapes, rounds = ([(1000, 64, 32)], 1) if args.dry_run else (SHAPES, args.rounds)
    if args.dry_run:
        _common.skipped("the real vocabularies and widths, and repeats")
    previous = _common.module_at(PREVIOUS, "src/effitrain/speedups/chunked_lm_loss.py")
    if previous is None:
        print(f"the loss at {PREVIOUS} is not in this clone's history: the current one timed against itself")
    sides = {"fresh blocks (before)": previous or current, "reused buffer (now)": current}
    print(f"glibc settings applied: {allocator.keep_freed_memory()}; malloc: {allocator.serving()[0]}; "
          f"torch threads {torch.get_num_threads()}")
    torch.manual_seed(0)
    for vocabulary, rows, width in shapes:
        for precision in ("fp32", "bf16"):
            for training in (True, False):
                hidden = torch.randn(rows, width, requires_grad=training)
                weight = (torch.randn(vocabulary, width) * 0.02).requires_grad_(training)
                targets = torch.randint(0, vocabulary, (rows,))
                times = {name: [] for name in sides}
                for _ in range(rounds):
                    for name, module in sides.items():
                        start = time.perf_counter()
                        call(module, hidden, weight, targets, precision, training)
                        times[name].append(time.perf_counter() - start)
                        hidden.grad = weight.grad = None
                before, now = (statistics.median(t) for t in times.values())
                print(f"vocabulary {vocabulary:>6}, {rows} x {width}, {precision}, "
                      f"{'training  ' if training else 'evaluation'}: before {before * 1000:6.0f} ms, "
                      f"now {now * 1000:6.0f} ms: {now / before:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
