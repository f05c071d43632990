"""The online-RL step's plan (planning/rl_step.py) against effitrain's own `--rl grpo` runs: one fresh process per
row, as memory_plan_runs.py does for training steps.

Each row is `effitrain train --rl grpo --memory-budget 64GiB` on `addition` (a Llama-shaped model from a config,
the default tokenizer: untrained, so every completion runs to --max-new-tokens) for STEPS steps; the run plans
itself (the budget never binds) and records the resident memory before the model (`in_use_bytes`) and the
predicted peak; its peak resident memory less `in_use_bytes` is the measured step peak. The script also prints
the two phases of the plan (generation, update) for the same settings, as `effitrain plan --rl grpo` shows them.

The plan counts every row of the update (every group with a spread in its rewards: the worst case), while the
update leaves out the rows without a gradient (grpo.py's `_contributing`), which the task's exact-match makes
of nearly every row of an untrained model. So each row is scored by spread_reward.py, under which every row is
kept, as with --kl-beta (a KL term in the loss keeps them all); `--reward task` keeps the task's exact-match
(few rows kept: the measured peak falls below the plan, an upper bound, and the bars are not applied).

    python benchmarks/planner/rl_plan_runs.py [--only LABEL ...] [--json FILE] [--reward spread|task]
    python benchmarks/planner/rl_plan_runs.py --dry-run  # one tiny row, one step; the bars not applied
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2**20
STEPS = 4
BARS = {"within": 0.15, "under": 0.10}


def llama(hidden: int, layers: int) -> str:
    return (f"llama:hidden_size={hidden},num_hidden_layers={layers},num_attention_heads=4,num_key_value_heads=4,"
            f"intermediate_size={2 * hidden},max_position_embeddings=128")


# label, model, prompts per micro-batch, accumulation, G, max new tokens, precision, other flags
ROWS = [
    ("gen-fp32", llama(128, 2), 4, 8, 8, 32, "fp32", ()),
    ("gen-bf16", llama(128, 2), 4, 8, 8, 32, "bf16", ()),
    ("upd-fp32", llama(256, 4), 16, 1, 8, 16, "fp32", ()),
    ("upd-bf16", llama(256, 4), 16, 1, 8, 16, "bf16", ()),
    ("kl-copy", llama(256, 4), 8, 2, 4, 16, "fp32", ("--kl-beta", "0.04")),  # a frozen reference copy
    ("lora-kl", llama(256, 4), 16, 1, 8, 16, "bf16", ("--peft", "lora", "--kl-beta", "0.04")),  # adapters off
]
DRY_RUN = [("dry-fp32", llama(32, 2), 2, 1, 2, 4, "fp32", ())]


SPREAD_REWARD = f"{Path(__file__).with_name('spread_reward.py')}:distinct"


def run_row(row, out: Path, steps: int, reward: str = "spread") -> dict:
    label, model, micro, accumulation, generations, new_tokens, precision, flags = row
    if reward == "spread":
        flags = (*flags, "--reward", SPREAD_REWARD)
    cmd = [sys.executable, "-m", "effitrain", "train", "--task", "causal-lm", "--data", "addition", "--model", model,
           "--rl", "grpo", "--batch-size", str(micro), "--grad-accum", str(accumulation), "--num-generations",
           str(generations), "--max-new-tokens", str(new_tokens), "--precision", precision,
           "--max-steps", str(steps), "--max-eval-samples", "4", "--eval-batch-size", "4",
           "--memory-budget", "64GiB", "--output-dir", str(out), "--overwrite", *flags]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = json.loads((out / "metrics.json").read_text())
    plan = metrics["memory_plan"]
    measured = metrics["peak_memory_bytes"] - plan["in_use_bytes"]
    phases = plan_phases(row, out / "model")
    return {"label": label, "measured": measured, "predicted": plan["predicted_peak_bytes"], **phases,
            "error": plan["predicted_peak_bytes"] / measured - 1}


def plan_phases(row, model_dir: Path) -> dict:
    """The plan of the row's settings, phase by phase, with the run's tokenizer (its vocabulary, the longest
    prompt) as the run planned it."""
    from transformers import AutoTokenizer

    from effitrain.data import builtins, prompt_batches
    from effitrain.planning import planner as plan
    from effitrain.planning import rl_step

    label, model, micro, accumulation, generations, new_tokens, precision, flags = row
    options = dict(zip(flags[::2], flags[1::2]))
    kl_beta = float(options.get("--kl-beta", 0.0))
    peft = plan.Peft(options["--peft"]) if "--peft" in options else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_len = max(map(len, prompt_batches.prompt_ids(tokenizer, list(builtins.addition()["all"]["prompt"]))))
    shapes = plan.model_shapes("causal-lm", model, vocab_size=len(tokenizer), peft=peft)
    shapes = rl_step.for_rl(shapes, generations, new_tokens, kl_beta)
    planner = plan.Planner(shapes, prompt_len + new_tokens)
    step = rl_step.rl_step(planner, plan.Setting(precision, "adamw", False, micro, accumulation),
                           micro * accumulation, prompt_len, new_tokens)
    return {"prompt_len": prompt_len, "generation": step.generation_total, "update": step.update.total,
            "peak_phase": step.peak_phase, "overhead": step.update.overhead}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append")
    parser.add_argument("--json")
    parser.add_argument("--dry-run", action="store_true", help="one tiny row for one step (the bars not applied)")
    parser.add_argument("--reward", choices=("spread", "task"), default="spread",
                        help="spread: every row kept (what the plan counts); task: exact-match (the bars not applied)")
    args = parser.parse_args()
    results = []
    if args.dry_run:
        print("dry run: one tiny Llama (width 32, 2 layers), 2 prompts x G 2, one step; the bars not applied")
    with tempfile.TemporaryDirectory() as tmp:
        for row in DRY_RUN if args.dry_run else ROWS:
            if args.only and row[0] not in args.only:
                continue
            result = run_row(row, Path(tmp) / row[0], 1 if args.dry_run else STEPS, args.reward)
            results.append(result)
            print(f"{result['label']:9} measured {result['measured'] / MiB:7.1f} MiB  planned "
                  f"{result['predicted'] / MiB:7.1f} MiB ({result['error']:+.1%}); generation "
                  f"{result['generation'] / MiB:.1f}, update {result['update'] / MiB:.1f}: {result['peak_phase']}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    bad = [r for r in results if abs(r["error"]) > BARS["within"] or r["error"] < -BARS["under"]]
    return 1 if bad and not args.dry_run and args.reward == "spread" else 0


if __name__ == "__main__":
    sys.exit(main())
