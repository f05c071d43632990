"""What batching costs on the SMS spam data with the real default model (all-MiniLM-L6-v2).

Four strategies on the same training split, micro-batch size and seed:

  fixed     every batch padded to max_length (128), plain seeded shuffle
  dynamic   batches padded to their longest example (multiple of 8), plain seeded shuffle
  grouped   dynamic padding + transformers' length-grouped shuffle (effitrain's default)
  packed    --packing: each micro-batch of the plain seeded shuffle packed into rows of at most 128
            tokens (first-fit decreasing), rows padded to the longest row (multiple of 8)

For each: the padding waste over a whole epoch (share of pad tokens among all tokens of the
batches, from attention_mask, no model), then the training speed over --steps real optimizer steps
(forward, loss_sum / n backward, fused AdamW step) on a fresh copy of the model, after warm-up steps
that are not timed. The timed steps are the first batches of that same epoch order, so the table also
gives their mean padded length next to the epoch's: when they differ, the timed window is not a
representative slice of the epoch (see benchmarks/README.md).

    .venv/bin/python benchmarks/techniques/padding.py [--batch-size 16] [--steps 30] [--seed 42] [--json PATH]
    .venv/bin/python benchmarks/techniques/padding.py --dry-run   # a tiny model, 1 timed step and no warm-up per
                                                                  # strategy

Speeds depend on the machine and on whatever else runs on it; compare the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from effitrain import tasks
from effitrain.config import TrainConfig
from effitrain.data import packing, text
from effitrain.optimizers import classic as optim
from effitrain.models import loading
from effitrain.runtime import libraries

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

TASK = "sequence-classification"

MAX_LENGTH = 128
WARMUP_STEPS = 3
LR, WEIGHT_DECAY = 1e-4, 0.01  # effitrain train's defaults

# key, description, collator (fixed | dynamic | packed), length grouping?
STRATEGIES = [
    ("fixed", "fixed padding (max_length 128), shuffle", "fixed", False),
    ("dynamic", "dynamic padding, shuffle", "dynamic", False),
    ("grouped", "dynamic padding, length-grouped", "dynamic", True),
    ("packed", "packed rows (first-fit decreasing), shuffle", "packed", False),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=16, help="micro-batch size (default 16)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per strategy (default 30)")
    parser.add_argument("--seed", type=int, default=42, help="split, head initialisation, data order (default 42)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures to PATH")
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny model (benchmarks/_common.py), 1 timed step, no warm-up, batch 64; no --json")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.steps < 1:
        parser.error("--batch-size and --steps must be at least 1")
    args.warmup = WARMUP_STEPS
    if args.dry_run:
        args.steps, args.warmup, args.batch_size, args.json = 1, 0, 64, None
    return args


def make_loader(dataset, tokenizer, batch_size: int, collator: str, group: bool, seed: int) -> DataLoader:
    """A fresh loader with a freshly seeded sampler: each one yields the same epoch order."""
    if collator == "fixed":
        from transformers import DataCollatorWithPadding

        collate = DataCollatorWithPadding(tokenizer, padding="max_length", max_length=MAX_LENGTH)
    elif collator == "packed":
        collate = packing.ClassificationPacker(tokenizer.pad_token_id, MAX_LENGTH, text.pad_multiple() or 1)
    else:
        collate = text.collator(tokenizer, text.pad_multiple())  # what effitrain train pads to on this machine
    sampler = text.train_sampler(dataset, batch_size, group, seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate)


def padding_stats(loader) -> dict:
    """Real and padded tokens over one epoch, and per batch (to describe any window of it later)."""
    real, padded, rows = [], [], []
    for batch in loader:
        mask = batch["attention_mask"]
        real.append(int(mask.sum()))
        padded.append(int(mask.numel()))
        rows.append(int(mask.shape[0]))  # packed: fewer rows than examples
    return {"real": real, "padded": padded, "rows": rows}


def window_summary(stats: dict, start: int, stop: int, batch_size: int, dataset_size: int) -> dict:
    real, padded = sum(stats["real"][start:stop]), sum(stats["padded"][start:stop])
    samples = min(stop * batch_size, dataset_size) - start * batch_size
    return {
        "batches": len(stats["real"][start:stop]),
        "samples": samples,
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_waste": 1 - real / padded,
        "mean_padded_length": padded / samples,
        "mean_real_length": real / samples,
        "rows_per_batch": sum(stats["rows"][start:stop]) / max(stop - start, 1),
    }


def train_speed(tokenizer, labels, loader, steps: int, seed: int, warmup: int = WARMUP_STEPS) -> dict:
    """Samples/s and real tokens/s over `steps` optimizer steps after `warmup` untimed ones."""
    task = tasks.get(TASK)
    torch.manual_seed(seed)
    model = task.build_model(loading.resolve_source("default"), labels, tokenizer)
    model.train()
    optimizer = optim.adamw(model, LR, WEIGHT_DECAY)
    batches = iter(loader)

    def one_step(model, optimizer):  # not a closure over them: they are deleted below
        batch = next(batches)  # fetching and collating count: the training loop pays for them too
        n = task.item_count(batch)
        loss = task.loss_sum(model, batch) / n
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int(n), int(batch["attention_mask"].sum()), float(loss.detach())

    for _ in range(warmup):
        one_step(model, optimizer)
    samples = tokens = 0
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        n, real, loss = one_step(model, optimizer)
        samples += n
        tokens += real
        losses.append(loss)
    seconds = time.perf_counter() - start
    del model, optimizer
    gc.collect()
    return {
        "seconds": seconds,
        "samples": samples,
        "real_tokens": tokens,
        "samples_per_second": samples / seconds,
        "tokens_per_second": tokens / seconds,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        _common.dry_run_model()
    libraries.quiet_libraries(False)
    import transformers

    tokenizer = loading.load_tokenizer(loading.resolve("default"))
    # effitrain train's split of the built-in data: stratified, test then validation held out, by seed.
    config = TrainConfig(data="sms-spam", validation_split=0.1, test_split=0.1, seed=args.seed)
    splits = tasks.get(config.task).load_data(config).splits
    labels = splits["train"].features["label"].names
    train = text.tokenize(splits, tokenizer, MAX_LENGTH)["train"]
    batches_per_epoch = -(-len(train) // args.batch_size)
    if args.warmup + args.steps > batches_per_epoch:
        raise SystemExit(f"--steps {args.steps} + {args.warmup} warm-up steps exceed the "
                         f"{batches_per_epoch} batches of one epoch; pass a smaller --steps")

    print(f"all-MiniLM-L6-v2 on sms-spam: {len(train)} train examples, batch {args.batch_size}, "
          f"{args.warmup} warm-up + {args.steps} timed steps per strategy, seed {args.seed}, "
          f"max_length {MAX_LENGTH}; {_common.machine(gpu=False)}, torch {torch.__version__}", flush=True)

    results = {}
    for key, description, collator, group in STRATEGIES:
        loader_args = (train, tokenizer, args.batch_size, collator, group, args.seed)
        stats = padding_stats(make_loader(*loader_args))
        epoch = window_summary(stats, 0, len(stats["real"]), args.batch_size, len(train))
        timed = window_summary(stats, args.warmup, args.warmup + args.steps, args.batch_size, len(train))
        speed = train_speed(tokenizer, labels, make_loader(*loader_args), args.steps, args.seed, args.warmup)
        if speed["samples"] != timed["samples"] or speed["real_tokens"] != timed["real_tokens"]:
            raise RuntimeError(f"{key}: the timed batches differ from the epoch order measured without the model")
        results[key] = {"description": description, "epoch": epoch, "timed_window": timed, "speed": speed}
        print(f"{description}: padding waste {epoch['padding_waste']:.1%} over the epoch, "
              f"{args.steps} timed step{'' if args.steps == 1 else 's'} in {speed['seconds']:.1f} s, "
              f"{speed['samples_per_second']:.1f} samples/s, "
              f"{speed['tokens_per_second']:.0f} tokens/s", flush=True)

    base = results["fixed"]["speed"]["samples_per_second"]
    for result in results.values():
        result["speed"]["samples_per_second_vs_fixed"] = result["speed"]["samples_per_second"] / base

    header = ("strategy", "pad waste", "padded len", "samples/s", "tokens/s", "vs fixed")
    rows = [(r["description"],
             f"{r['epoch']['padding_waste']:.1%}",
             f"{r['timed_window']['mean_padded_length']:.1f} / {r['epoch']['mean_padded_length']:.1f}",
             f"{r['speed']['samples_per_second']:.1f}",
             f"{r['speed']['tokens_per_second']:.0f}",
             f"{r['speed']['samples_per_second_vs_fixed']:.2f}x") for r in results.values()]
    print()
    _common.print_columns(header, rows)
    print("pad waste: pad tokens / all tokens over one epoch; padded len: mean padded tokens per sample, "
          "timed steps / whole epoch; tokens/s counts real (non-pad) tokens; packed: rows per batch "
          f"{results['packed']['epoch']['rows_per_batch']:.2f} over the epoch")

    if args.json is not None:
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": _common.machine(gpu=False),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "model": "all-MiniLM-L6-v2 (effitrain default)",
            "data": "sms-spam train split (validation 0.1, test 0.1)",
            "train_examples": len(train),
            "batch_size": args.batch_size,
            "max_length": MAX_LENGTH,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "seed": args.seed,
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            "strategies": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
