"""What gradient checkpointing buys and costs on the default model (all-MiniLM-L6-v2): peak memory,
speed and the loss of each step, at micro-batch 32 and length 128 (every batch padded to 128).

Each variant runs in a fresh process, so that its peak resident memory is its own (CPU; on a GPU,
torch.cuda.max_memory_allocated). Printed as ratios to the run without checkpointing.

    .venv/bin/python benchmarks/techniques/checkpointing.py [--batch-size 32] [--length 128] [--steps 6] [--json PATH]
    .venv/bin/python benchmarks/techniques/checkpointing.py --dry-run   # a tiny model, 2 x 16 tokens, 2 steps
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402


def one_run(batch_size: int, length: int, steps: int, checkpointing: bool) -> dict:
    """Fixed random token batches, fixed seed: the same arithmetic with and without checkpointing."""
    import torch

    from effitrain import tasks
    from effitrain.optimizers import classic as optim
    from effitrain.models import loading, transforms
    from effitrain.runtime import libraries

    libraries.quiet_libraries(False)
    torch.manual_seed(0)
    task = tasks.get("sequence-classification")
    model = task.build_model(loading.ModelSource(loading.resolve("default")), ["ham", "spam"], None)
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    # Checkpointing alone: transformers' own layers, without effitrain's CPU speed-ups.
    model, _ = transforms.apply_all(model, transforms.Settings(task, gradient_checkpointing=checkpointing,
                                                               speed_ups=False))
    model.train()
    optimizer = optim.adamw(model, 1e-5, 0.01)
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(1000, 29000, (batch_size, length), generator=generator),
                "attention_mask": torch.ones(batch_size, length, dtype=torch.long),
                "labels": torch.randint(0, 2, (batch_size,), generator=generator)} for _ in range(steps)]
    cuda = torch.cuda.is_available()
    if cuda:
        model.cuda()
        batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    losses, start = [], time.perf_counter()
    for batch in batches:
        loss = tasks.get("sequence-classification").loss_sum(model, batch) / batch_size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"checkpointing": checkpointing, "losses": losses, "seconds": seconds,
            "samples_per_second": steps * batch_size / seconds, "peak_memory_bytes": peak,
            # CPU: the training steps' own peak, above what the process held before them.
            "training_peak_bytes": peak if cuda else peak - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", choices=("plain", "checkpointing"), help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny model (benchmarks/_common.py), batch 2 x 16 tokens, 2 steps; no --json")
    args = parser.parse_args()
    if args.dry_run:
        _common.dry_run_model()
        args.batch_size, args.length, args.steps, args.json = 2, 16, 2, None
    if args.only:
        print(json.dumps(one_run(args.batch_size, args.length, args.steps, args.only == "checkpointing")))
        return
    runs = {}
    for variant in ("plain", "checkpointing"):
        print(f"running {variant} in a fresh process ...", flush=True)
        runs[variant] = _common.child_json([sys.executable, __file__, "--only", variant, "--batch-size",
                                            str(args.batch_size), "--length", str(args.length), "--steps",
                                            str(args.steps)])
    plain, ckpt = runs["plain"], runs["checkpointing"]
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain["losses"], ckpt["losses"]))
    print(f"\nmicro-batch {args.batch_size}, length {args.length}, {args.steps} steps, default model")
    print(f"{'variant':<16}{'peak memory':>14}{'training peak':>16}{'samples/s':>12}")
    for name, run in runs.items():
        print(f"{name:<16}{run['peak_memory_bytes'] / 2**20:>11.0f} MiB{run['training_peak_bytes'] / 2**20:>13.0f} MiB"
              f"{run['samples_per_second']:>12.2f}")
    print(f"checkpointing / plain: peak memory {ckpt['peak_memory_bytes'] / plain['peak_memory_bytes']:.2f}x, "
          f"training peak {ckpt['training_peak_bytes'] / plain['training_peak_bytes']:.2f}x, "
          f"speed {ckpt['samples_per_second'] / plain['samples_per_second']:.2f}x; "
          f"largest relative difference of a step's loss {worst:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
