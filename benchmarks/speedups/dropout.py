"""What dropout costs in a training step, and what effitrain's speedups/dropout.py takes off, each change alone.

The default model (all-MiniLM-L6-v2, BERT, dropout 0.1 in 13 hidden-state layers and 6 attention
layers) trains on random token batches of `--batch-size` x `--length` (all real tokens), one full
training step each (forward, loss, backward, fused AdamW step, zero_grad), in five variants built from
the same weights, in this one process:

  torch      the model as transformers builds it: nn.Dropout (CPU `bernoulli_` masks), SDPA attention,
             which falls back to its math path (and `bernoulli_`) whenever dropout is on
  layers     dropout.apply(layers=True, attention=False): the nn.Dropout layers only
  attention  dropout.apply(layers=False, attention=True): the attention dropout only
  both       dropout.apply(): both
  effitrain  both, and first_token_head.apply(): the classifier's last layer computes the first token's
             row only (first_token_head.py), and onednn_linear.apply(): fp32 linear layers through oneDNN
             where effitrain prefers it (CPUs not Intel's), what `effitrain train` runs

`--keep-freed-memory` makes glibc keep freed memory for reuse in this process (speedups/allocator.py, as
`effitrain train` does on CPUs), for every variant.

The step (make_step), its random batch (batch_of), the flags that shape and time them and the start of the
process are also lora_step.py's, first_token_head.py's and allocator.py's: they import them from here.

Variants take turns (`--rounds` rounds of `--steps` steps each, after 2 warm-up steps each), so a
slower or busier moment of the machine hits all of them, each turn after one untimed step (the first
step after another variant's runs slower: `_common.timed_turns`); the median step time of each is
compared with torch's. `--profile` then profiles 3 steps of `torch`, `both` and `effitrain` with torch.profiler
and prints the share of step time in each kind of operator (matrix products: mm, addmm, bmm, baddbmm,
oneDNN's _linear_pointwise; dropout masks: bernoulli_, ge_, div_, and effitrain's _KeepMask, whose own
time holds numpy's draws).

    .venv/bin/python benchmarks/speedups/dropout.py [--precision fp32|bf16] [--batch-size 16] [--length 128] [--profile]
        [--keep-freed-memory]
    .venv/bin/python benchmarks/speedups/dropout.py --dry-run   # a tiny model, 1 step per variant, and --profile:
                                                                # seconds
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

VARIANTS = {"torch": None, "layers": (True, False), "attention": (False, True), "both": (True, True),
            "effitrain": (True, True)}  # both, and the classifier's last layer for the first token only
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise"}
# effitrain's mask is drawn inside its autograd function (_KeepMask), whose own time holds numpy's draws.
DROPOUT = {"aten::bernoulli_", "aten::uniform_", "aten::ge", "aten::ge_", "aten::div_", "aten::native_dropout",
           "aten::native_dropout_backward", "_KeepMask"}


def batch_arguments(parser) -> None:
    """--precision, --batch-size, --length: the random batch a step trains on (lora_step.py's too)."""
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)


def timing_arguments(parser, profile: str) -> None:
    """--steps, --rounds, --profile (`profile`: its help), --keep-freed-memory, --dry-run: how the variants'
    steps are timed, in turns (lora_step.py's too)."""
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of turns (default 5)")
    parser.add_argument("--profile", action="store_true", help=profile)
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="glibc keeps freed memory for reuse in this process, as `effitrain train` on CPUs")
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny model (benchmarks/_common.py), batch 2 x 16, 1 round of 1 step, and --profile")


def parsed(parser, argv):
    """batch_arguments' and timing_arguments' flags read; a dry run's: 2 x 16, 1 round of 1 step, --profile."""
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batch_size, args.length, args.steps, args.rounds, args.profile = 2, 16, 1, 1, True
    return args


def start(args) -> None:
    """The process set up as `effitrain train` sets its own (glibc keeping freed memory with
    --keep-freed-memory), on the tiny model for a dry run."""
    _common.measure_as_the_command()
    if args.dry_run:
        _common.dry_run_model()
    if args.keep_freed_memory:
        from effitrain.speedups import allocator

        assert allocator.keep_freed_memory()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    batch_arguments(parser)
    timing_arguments(parser, profile="also print the operator shares of torch, both and effitrain")
    return parsed(parser, argv)


def variants() -> dict:
    """name -> (model, optimizer), all from the same initial weights."""
    from transformers import AutoModelForSequenceClassification

    from effitrain import tasks
    from effitrain.optimizers import classic as optim
    from effitrain.models import loading, transforms
    from effitrain.speedups import dropout

    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(str(loading.resolve("default")), num_labels=2,
                                                              attn_implementation="sdpa")
    built = {}
    for name, switches in VARIANTS.items():
        model = copy.deepcopy(base)
        if name == "effitrain":  # what `effitrain train` applies: the whole pipeline
            model, _ = transforms.apply_all(model, transforms.Settings(tasks.get("sequence-classification")))
        elif switches is not None:  # a part of fast dropout alone
            dropout.apply(model, layers=switches[0], attention=switches[1])
        model.train()
        built[name] = (model, optim.adamw(model, 1e-4, 0.01))
    return built


def batch_of(rows: int, length: int) -> dict:
    """A random classification batch: token ids in the default model's common range, all real, labels 0 or 1."""
    return {"input_ids": torch.randint(1000, 20000, (rows, length)),
            "attention_mask": torch.ones(rows, length, dtype=torch.long),
            "labels": torch.randint(0, 2, (rows,))}


def make_step(model, optimizer, batch: dict, precision: str):
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> None:
        with autocast:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(logits.float(), batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def shares(step) -> tuple[dict, float]:
    """Share of self CPU time per operator group over 3 profiled steps, and the profiled time per step."""
    events = _common.profiled_events(step, 3)
    total = sum(e.self_cpu_time_total for e in events)
    groups = {"matrix products": 0.0, "dropout masks": 0.0, "other": 0.0}
    for e in events:
        group = "matrix products" if e.key in MATMUL else "dropout masks" if e.key in DROPOUT else "other"
        groups[group] += e.self_cpu_time_total / total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    groups["top"] = ", ".join(f"{e.key.removeprefix('aten::')} {e.self_cpu_time_total / total:.1%}" for e in top)
    return groups, total / 3 / 1e6


def main(argv=None) -> None:
    args = parse_args(argv)
    start(args)
    torch.manual_seed(1)
    batch = batch_of(args.batch_size, args.length)
    steps = {name: make_step(model, optimizer, batch, args.precision)
             for name, (model, optimizer) in variants().items()}
    times = _common.timed_turns(steps, args.rounds, args.steps)
    print(f"default model, {args.batch_size} x {args.length} tokens, {args.precision}, {torch.get_num_threads()} "
          f"threads, {args.rounds} rounds x {args.steps} steps each, median step time"
          f"{', glibc keeping freed memory' if args.keep_freed_memory else ''}")
    base = statistics.median(times["torch"])
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"  {name:10s} {median * 1000:8.1f} ms   {base / median:.2f}x torch's speed")
    if args.profile:
        for name in ("torch", "both", "effitrain"):
            groups, seconds = shares(steps[name])
            print(f"profile {name}: {seconds * 1000:.0f} ms/step; matrix products {groups['matrix products']:.1%}, "
                  f"dropout masks {groups['dropout masks']:.1%}, other {groups['other']:.1%}; top: {groups['top']}")


if __name__ == "__main__":
    main()
