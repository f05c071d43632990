"""What the chunked output layer + cross-entropy (speedups/chunked_lm_loss.py) buys a causal LM's training
step at a large vocabulary: peak memory and speed, against the plain full-logits loss.

A Llama-shaped model from a config (default: hidden 256, 2 layers, vocabulary 151,936 as Qwen's, untied
output layer), random token batches of `--batch-size` x `--length` (default 4 x 1,024, every position
counted), effitrain's causal-lm loss with and without the `chunked-lm-loss` transform, effitrain's fused
AdamW. Each side runs in a fresh process (its own peak resident set, `ru_maxrss`), the sides taking turns
for `--rounds` rounds of `--steps` steps. Reported per side: the loss of the first step (same weights and
batch: the two must agree), the median step time after the first, samples/s, the peak resident set and
what training added to the resident set of the built model and batch.

    .venv/bin/python benchmarks/speedups/chunked_lm_loss.py [--precision fp32] [--rounds 2] [--steps 3]
    .venv/bin/python benchmarks/speedups/chunked_lm_loss.py --dry-run   # vocabulary 1,000, 2 x 64 tokens: seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

SIDES = ("plain", "chunked")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabulary", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=3, help="steps per side per round (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of turns (default 2)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="vocabulary 1,000, hidden 32, 2 x 64 tokens, 1 round")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.vocabulary, args.hidden, args.batch_size, args.length, args.steps, args.rounds = 1000, 32, 2, 64, 2, 1
    return args


def child(args) -> dict:
    """One side's training steps in this process: what `main` reads from its last line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from effitrain import tasks
    from effitrain.optimizers import classic as optim
    from effitrain.models import transforms

    if args.dry_run:
        torch.set_num_threads(1)
    task = tasks.get("causal-lm")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                         vocab_size=args.vocabulary, max_position_embeddings=args.length,
                                         tie_word_embeddings=False))
    skip = () if args.child == "chunked" else ("chunked-lm-loss",)
    model, applied = transforms.apply_all(model, transforms.Settings(task), skip=skip)
    assert ("chunked-lm-loss" in applied) == (args.child == "chunked"), applied
    model.train()
    optimizer = optim.adamw(model, 1e-4, 0.0)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocabulary, (args.batch_size, args.length), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    items = task.item_count(batch)
    rss_before = _common.rss_peak_bytes()
    losses, times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = task.loss_sum(model, batch) / items
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"first_loss": losses[0], "step_s": statistics.median(times[1:] or times),
            "rss_before": rss_before, "rss_peak": _common.rss_peak_bytes()}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.dry_run:
        _common.dry_run_model()
    shape = (f"Llama-shaped, hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocabulary:,}; "
             f"{args.batch_size} x {args.length} tokens, {args.precision}, AdamW")
    print(f"{shape}; {args.rounds} round(s) of {args.steps} steps per side, each side in a fresh process", flush=True)
    base = [sys.executable, __file__, "--vocabulary", str(args.vocabulary), "--hidden", str(args.hidden),
            "--layers", str(args.layers), "--batch-size", str(args.batch_size), "--length", str(args.length),
            "--precision", args.precision, "--steps", str(args.steps)] + (["--dry-run"] if args.dry_run else [])
    results = _common.take_turns(SIDES, args.rounds, lambda side: _common.child_json(base + ["--child", side]))
    rows, summary = [], {}
    for side, runs in results.items():
        step = statistics.median(run["step_s"] for run in runs)
        peak = max(run["rss_peak"] for run in runs)
        added = max(run["rss_peak"] - run["rss_before"] for run in runs)
        summary[side] = {"step": step, "peak": peak, "added": added, "loss": runs[0]["first_loss"]}
        rows.append((side, f"{runs[0]['first_loss']:.6f}", f"{step:.3f}", f"{args.batch_size / step:.2f}",
                     _common.mib(peak), _common.mib(added)))
    _common.print_columns(("side", "first loss", "step s", "samples/s", "peak RSS", "training added"), rows)
    plain, chunked = summary["plain"], summary["chunked"]
    print(f"chunked / plain: peak RSS {chunked['peak'] / plain['peak']:.2f}x, what training added "
          f"{chunked['added'] / max(plain['added'], 1):.2f}x, samples/s {plain['step'] / chunked['step']:.2f}x; "
          f"first-step losses differ by {abs(chunked['loss'] - plain['loss']):.2e}")
    print(f"machine: {_common.machine(torch_version=True)}")


if __name__ == "__main__":
    main()
