"""What routing fp32 linear layers through oneDNN instead of MKL (onednn_linear.py) buys on this CPU.

Two parts, in this one process, fp32, torch's threads:

1. The default model's matrix products alone: for each of its linear shapes (384 -> 384, 384 -> 1536,
   1536 -> 384) at `--tokens` rows, GFLOP/s of MKL (torch.addmm / mm) and oneDNN
   (torch.ops.mkldnn._linear_pointwise) for the forward product, the input's gradient and the weight's
   gradient (the one onednn_linear leaves on MKL).
2. The default model (all-MiniLM-L6-v2) as `effitrain train` builds it on a CPU (effitrain's dropout, the
   first-token last layer), in two copies from the same weights: `mkl` (torch's linear) and `onednn`
   (onednn_linear.apply): the median time of a training step at batch `--batch-size` and of an evaluation
   forward at batch `--eval-batch-size` (inference mode), for each `--length`, the copies taking turns
   (`--rounds` rounds of `--steps` calls after 2 warm-up calls each). The largest logit difference between
   the copies before training is printed: the same arithmetic in another order.

    .venv/bin/python benchmarks/speedups/onednn_linear.py [--length 30 128] [--tokens 160 480 2048]
    .venv/bin/python benchmarks/speedups/onednn_linear.py --dry-run   # a tiny model, 16 rows, 1 call each: seconds
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from speedups.first_token_head import (  # noqa: E402  the same copies' measurements and flags
    copies_arguments,
    logit_differences,
    small_copies,
    timed_copies,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", nargs="+", type=int, default=[30, 128])
    parser.add_argument("--tokens", nargs="+", type=int, default=[160, 480, 2048])
    copies_arguments(parser, steps="calls per copy per round (default 3)")
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny model (benchmarks/_common.py), 16 rows, length 16, batches 2 and 4, 1 call")
    args = parser.parse_args(argv)
    if args.dry_run:
        small_copies(args)
        args.tokens = [16]
    return args


def gflops(function, flops: int) -> float:
    function()
    return flops / (min(timeit.repeat(function, number=10, repeat=5)) / 10) / 1e9


def products(tokens: int) -> None:
    onednn = torch.ops.mkldnn._linear_pointwise
    for inputs, outputs in ((384, 384), (384, 1536), (1536, 384)):
        torch.manual_seed(0)
        x, weight, bias = torch.randn(tokens, inputs), torch.randn(outputs, inputs), torch.randn(outputs)
        grad = torch.randn(tokens, outputs)
        flops = 2 * tokens * inputs * outputs
        rates = {
            "forward": (gflops(lambda: torch.addmm(bias, x, weight.t()), flops),
                        gflops(lambda: onednn(x, weight, bias, "none", [], ""), flops)),
            "input grad": (gflops(lambda: grad.mm(weight), flops),
                           gflops(lambda: onednn(grad, weight.t(), None, "none", [], ""), flops)),
            "weight grad": (gflops(lambda: grad.t().mm(x), flops),
                            gflops(lambda: onednn(grad.t(), x.t(), None, "none", [], ""), flops)),
        }
        print(f"  {tokens:5d} x {inputs:4d} -> {outputs:4d}: " + "; ".join(
            f"{name} MKL {mkl:4.0f} oneDNN {dnn:4.0f} GFLOP/s ({dnn / mkl:.2f}x)" for name, (mkl, dnn) in rates.items()))


def copies() -> dict:
    from transformers import AutoModelForSequenceClassification

    from effitrain import tasks
    from effitrain.models import loading, transforms
    from effitrain.speedups import onednn_linear

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(loading.resolve("default")), num_labels=2,
                                                               attn_implementation="sdpa")
    settings = transforms.Settings(tasks.get("sequence-classification"))
    base, _ = transforms.apply_all(model, settings, skip={"onednn-linear"})
    routed = copy.deepcopy(base)
    by_itself = onednn_linear.preferred()
    os.environ[onednn_linear.SWITCH] = "onednn"  # measured whatever this CPU's maker
    onednn_linear.preferred.cache_clear()
    assert onednn_linear.apply(routed)
    return {"mkl": base, "onednn": routed}, by_itself


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        _common.dry_run_model()
    print(f"fp32 matrix products, {torch.get_num_threads()} threads, best of 5 x 10 calls")
    for tokens in args.tokens:
        products(tokens)
    models_, by_itself = copies()
    print(f"default model as effitrain train builds it on a CPU, training batch {args.batch_size}, evaluation "
          f"batch {args.eval_batch_size}, fp32, {args.rounds} rounds x {args.steps} calls each, medians "
          f"(effitrain train routes through oneDNN on this CPU: {'yes' if by_itself else 'no'})")
    differences = logit_differences(models_, args.length)
    for length in args.length:
        difference = differences[length]
        trained, evaluated = timed_copies(models_, length, "fp32", args)
        print(f"  {length:4d} tokens: training step MKL {trained['mkl'] * 1000:7.1f} ms, oneDNN "
              f"{trained['onednn'] * 1000:7.1f} ms ({trained['mkl'] / trained['onednn']:.2f}x); evaluation batch "
              f"MKL {evaluated['mkl'] * 1000:7.1f} ms, oneDNN {evaluated['onednn'] * 1000:7.1f} ms "
              f"({evaluated['mkl'] / evaluated['onednn']:.2f}x); largest logit difference before training "
              f"{difference:.1e}")


if __name__ == "__main__":
    main()
