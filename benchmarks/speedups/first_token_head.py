"""What computing only the first token's row in the last layer (first_token_head.py) buys a sequence
classifier's training step and its evaluation.

The default model (all-MiniLM-L6-v2, BERT, 6 layers) with effitrain's dropout (speedups.dropout.apply, as
`effitrain train` runs it), in two copies from the same weights in this one process:

  whole        every layer computes every token's row
  first-token  first_token_head.apply: the last layer computes the first token's row only

For each `--length` (default: 30, about the width of the default job's length-grouped SMS batches, and
128, its max_length) and each `--precision`: the median time of a training step (random token batches of
`--batch-size`, all real tokens; forward, loss, backward, fused AdamW step, zero_grad) and of an
evaluation forward at batch `--eval-batch-size` under torch.inference_mode, the copies taking turns
(`--rounds` rounds of `--steps` each, after 2 warm-up steps each, each turn after one untimed step) so
that a busier moment of the machine hits both. The largest logit difference between the copies
(evaluation mode, fp32, before either trains) is printed too.

    .venv/bin/python benchmarks/speedups/first_token_head.py [--length 30 128] [--precision fp32 bf16]
    .venv/bin/python benchmarks/speedups/first_token_head.py --dry-run   # a tiny model, 1 call each: seconds
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from speedups.dropout import batch_of, make_step  # noqa: E402  speedups/dropout.py: the same step and batch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--length", nargs="+", type=int, default=[30, 128])
    copies_arguments(parser, steps="steps per copy per round (default 3)")
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny model (benchmarks/_common.py), length 16, batches 2 and 4, 1 round of 1 call")
    args = parser.parse_args(argv)
    if args.dry_run:
        small_copies(args)
    return args


def copies_arguments(parser, steps: str) -> None:
    """--batch-size, --eval-batch-size, --steps (`steps`: its help) and --rounds: the flags timed_copies reads
    (onednn_linear.py's too)."""
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help=steps)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of turns (default 5)")


def small_copies(args) -> None:
    """A dry run's --length and copies_arguments' flags: length 16, batches 2 and 4, 1 round of 1 call."""
    args.length, args.batch_size, args.eval_batch_size, args.steps, args.rounds = [16], 2, 4, 1, 1


def copies() -> dict:
    """name -> model, both from the same initial weights, with effitrain's dropout."""
    from transformers import AutoModelForSequenceClassification

    from effitrain import tasks
    from effitrain.models import loading, transforms

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(loading.resolve("default")), num_labels=2,
                                                               attn_implementation="sdpa")
    settings = transforms.Settings(tasks.get("sequence-classification"))
    base, _ = transforms.apply_all(copy.deepcopy(model), settings, skip={"first-token-head", "onednn-linear"})
    pruned, applied = transforms.apply_all(model, settings, skip={"onednn-linear"})
    assert "first-token-head" in applied and "forward" in vars(pruned.bert.encoder.layer[-1])
    return {"whole": base, "first-token": pruned}


def make_eval(model, batch: dict, precision: str):
    def forward() -> None:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return forward


def medians(runs: dict, rounds: int, steps: int) -> dict:
    """name -> median seconds of one call, the names taking turns."""
    times = _common.timed_turns(runs, rounds, steps)
    return {name: statistics.median(measured) for name, measured in times.items()}


def logit_differences(models_: dict, lengths) -> dict:
    """length -> the largest logit difference between the two copies (evaluation mode, fp32), taken
    before either trains: from then on their weights part."""
    differences = {}
    for length in lengths:
        probe = batch_of(16, length)["input_ids"]
        with torch.inference_mode():
            logits = [model.eval()(input_ids=probe).logits for model in models_.values()]
        differences[length] = (logits[0] - logits[1]).abs().max().item()
    return differences


def timed_copies(models_: dict, length: int, precision: str, args) -> tuple[dict, dict]:
    """name -> median seconds of a training step, and of an evaluation forward, the copies taking turns."""
    from effitrain.optimizers import classic as optim

    torch.manual_seed(1)
    train_batch, eval_batch = batch_of(args.batch_size, length), batch_of(args.eval_batch_size, length)
    for model in models_.values():
        model.train()
    steps = {name: make_step(model, optim.adamw(model, 1e-4, 0.01), train_batch, precision)
             for name, model in models_.items()}
    trained = medians(steps, args.rounds, args.steps)
    evals = {name: make_eval(model.eval(), eval_batch, precision) for name, model in models_.items()}
    return trained, medians(evals, args.rounds, 1)


def main(argv=None) -> None:
    args = parse_args(argv)
    _common.measure_as_the_command()
    if args.dry_run:
        _common.dry_run_model()
    models_ = copies()
    print(f"default model, training batch {args.batch_size}, evaluation batch {args.eval_batch_size}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} calls each, medians")
    differences = logit_differences(models_, args.length)
    for precision in args.precision:
        for length in args.length:
            trained, evaluated = timed_copies(models_, length, precision, args)
            step_gain = trained["whole"] / trained["first-token"]
            eval_gain = evaluated["whole"] / evaluated["first-token"]
            print(f"{precision} {length:4d} tokens: training step whole {trained['whole'] * 1000:7.1f} ms, "
                  f"first-token {trained['first-token'] * 1000:7.1f} ms ({step_gain:.2f}x); "
                  f"evaluation batch whole {evaluated['whole'] * 1000:7.1f} ms, first-token "
                  f"{evaluated['first-token'] * 1000:7.1f} ms ({eval_gain:.2f}x); "
                  f"largest fp32 logit difference before training {differences[length]:.1e}")

if __name__ == "__main__":
    main()
