"""The dropout mask from 16 random bits per element (speedups/dropout.py's keep_mask now) against 32 (its
version at PREVIOUS, read from git), alone and in the default job's training steps, in this one process.

1. keep_mask alone, for the default model's masks on a 16 x `width` batch: its hidden states' (16 x width
   x 384) and its attention probabilities' (16 x 12 x width x width), bf16 and fp32; PREVIOUS's, the
   current one in PREVIOUS's blocks of 16K values, and the current one; medians of alternating calls.
2. The default job's first `--job-batches` training batches (benchmarks/speedups/lora_step.py's job steps: the
   task's loss, clipping, AdamW), full fine-tuning and LoRA (dropout 0, the default), each with the
   model's masks drawn the previous way and the new way; per round and model an untimed pass first (the
   first pass after the other model's is slower), then both ways, each first in half the rounds.

Start it with tcmalloc in LD_PRELOAD to measure as the `effitrain` command runs (speedups/allocator.py).

    .venv/bin/python benchmarks/speedups/dropout_draws.py [--precision bf16|fp32] [--job-batches 60] [--rounds 3]
    .venv/bin/python benchmarks/speedups/dropout_draws.py --dry-run   # the masks at one width, a tiny model's steps
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

PREVIOUS = "f081200"  # the last commit whose keep_mask compared 32-bit draws
WIDTHS = (16, 48, 128, 256)


def median_seconds(calls: dict, rounds: int) -> dict:
    """Each callable `rounds` times, taking turns; the median seconds of each."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def masks_alone(previous, current, widths, rounds: int) -> None:
    """keep_mask's time: PREVIOUS's, the current one's with PREVIOUS's 16K blocks, and the current one."""
    blocks = current.BLOCK

    def small_blocks(x):
        current.BLOCK = previous.BLOCK
        try:
            current.keep_mask(x, 0.1)
        finally:
            current.BLOCK = blocks

    for width in widths:
        for shape in ((16, width, 384), (16, 12, width, width)):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.empty(shape, dtype=dtype)
                seconds = median_seconds({"32": lambda: previous.keep_mask(x, 0.1),
                                          "16, small": lambda: small_blocks(x),
                                          "16": lambda: current.keep_mask(x, 0.1)}, rounds)
                print(f"  mask {'x'.join(map(str, shape)):>14s} {str(dtype).removeprefix('torch.'):8s}: 32-bit "
                      f"{seconds['32'] * 1e6:7.0f} us, 16-bit in {previous.BLOCK >> 10}K blocks "
                      f"{seconds['16, small'] * 1e6:7.0f} us, in {blocks >> 10}K {seconds['16'] * 1e6:7.0f} us: "
                      f"{seconds['16'] / seconds['32']:.2f}x", flush=True)


def job_steps(previous, current, args) -> None:
    from speedups import lora_step
    from transformers import AutoModelForSequenceClassification

    from effitrain.models import loading

    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(str(loading.resolve("default")), num_labels=2,
                                                              attn_implementation="sdpa")
    batches = lora_step.job_batches(args.job_batches, 16)
    steps = {}
    for name in ("full", "p0"):
        model, optimizer = lora_step.build(name, base, 0.0, args.precision)
        steps[name] = lora_step.make_job_step(model, optimizer, batches, args.precision)

    def drawing(step, module):
        def run():
            current.keep_mask = module.keep_mask  # what _KeepMask and the attention's dropout call
            try:
                step()
            finally:
                current.keep_mask = kept
        return run

    kept = current.keep_mask
    times = {f"{name}, {bits}-bit": [] for name in steps for bits in (32, 16)}
    for turn in range(args.rounds):
        for name, step in steps.items():
            step()  # untimed: the first pass after the other model's runs slower (allocator, caches)
            for bits in (32, 16) if turn % 2 else (16, 32):  # each side first in half the rounds
                call = drawing(step, previous if bits == 32 else current)
                start = time.perf_counter()
                call()
                times[f"{name}, {bits}-bit"].append(time.perf_counter() - start)
    for name, measured in times.items():
        print(f"    {name}: " + ", ".join(f"{t:.2f}" for t in measured) + " s")
    seconds = {name: statistics.median(measured) for name, measured in times.items()}
    print(f"the default job's first {len(batches)} batches of 16, {args.precision}, seconds per pass "
          f"(median of {args.rounds}):")
    for name in steps:
        before, now = seconds[f"{name}, 32-bit"], seconds[f"{name}, 16-bit"]
        print(f"  {name:5s} 32-bit {before:7.2f} s, 16-bit {now:7.2f} s: {now / before:.3f}x")
    for bits in (32, 16):
        print(f"  LoRA / full with {bits}-bit masks: {seconds[f'p0, {bits}-bit'] / seconds[f'full, {bits}-bit']:.3f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--job-batches", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-only", action="store_true", help="the job's steps only, not the masks alone")
    parser.add_argument("--dry-run", action="store_true", help="one width, a tiny model, 2 batches, 1 round")
    args = parser.parse_args()
    _common.measure_as_the_command()
    if args.dry_run:
        _common.dry_run_model()
        _common.skipped("the default model, its job's batches and the other widths")
        args.job_batches, args.rounds = 2, 1
    from effitrain.speedups import allocator
    from effitrain.speedups import dropout as current

    previous = _common.module_at(PREVIOUS, "src/effitrain/speedups/dropout.py")
    if previous is None:
        print(f"keep_mask at {PREVIOUS} is not in this clone's history: the current one timed against itself")
        previous = current
    print(f"{_common.machine()}, malloc: {allocator.serving()[0]}")
    if not args.steps_only:
        masks_alone(previous, current, WIDTHS[1:2] if args.dry_run else WIDTHS, 5 if args.dry_run else 50)
    job_steps(previous, current, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
