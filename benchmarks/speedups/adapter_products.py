"""What each matrix product of a LoRA layer's training step costs, alone, in fp32 and bf16: the frozen base's
two (forward, input gradient) against the adapter's six rank-8 ones, in the orientations
speedups/adapter_step.py's `_AdaptedLinear` calls them, at the default job's shapes.

For `rows` tokens (batch x width) through a layer of `k` inputs and `n` outputs (the default model's
384 -> 384, 384 -> 1536 and 1536 -> 384), per call:

  base       x W^T + b                         (rows x k) (k x n), the frozen base's forward
  base_grad  g W                               its input gradient
  a          x A^T                             the adapter's down-projection (rank 8)
  up         out += a B^T                      its up-projection, added into the base's output
  g_b        g B                               the gradient of a
  down_grad  grad_x += g_a A                   the adapter's input gradient, added into the base's
  grad_a     g_a^T x                           A's gradient
  grad_b     (a^T g)^T                         B's gradient

and the same call on 4 rows: what a call costs whatever its size (torch's dispatch, and for bf16 the
oneDNN matmul's set-up in torch). `GB/s` is the bytes a product must read and write once (its operands
and result) over its time: a rank-8 product does 2 x rows x k x 8 flops for rows x k values read, so it
is bound by memory or by its call, never by arithmetic. Medians of `--calls` alternating calls, each after
an untimed one of the same product, so its data is in cache (in a training step the activations come from
further away: slower there). The figures in the results file were taken before that untimed call.

    .venv/bin/python benchmarks/speedups/adapter_products.py [--rows 192,512,2048] [--calls 200]
    .venv/bin/python benchmarks/speedups/adapter_products.py --dry-run   # one small shape, few calls
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

LAYERS = ((384, 384), (384, 1536), (1536, 384))  # the default model's adapted linears: (inputs, outputs)
RANK = 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="192,512,2048", help="tokens per batch, comma list (default 192,512,2048)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per product (default 200)")
    parser.add_argument("--dry-run", action="store_true", help="rows 8, 5 calls, the 384 -> 384 layer only")
    args = parser.parse_args(argv)
    args.rows = [int(rows) for rows in args.rows.split(",")]
    args.layers = LAYERS
    if args.dry_run:
        args.rows, args.calls, args.layers = [8], 5, LAYERS[:1]
        print("dry run: one small shape, 5 calls each; nothing is written to benchmarks/results")
    return args


def products(rows: int, k: int, n: int, dtype: torch.dtype) -> dict:
    """name -> (call, bytes it reads and writes once, flops)."""
    torch.manual_seed(0)
    x, g = torch.randn(rows, k, dtype=dtype), torch.randn(rows, n, dtype=dtype)
    weight, bias = torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
    weight_a, weight_b = torch.randn(RANK, k, dtype=dtype), torch.randn(n, RANK, dtype=dtype)
    a, g_a = torch.randn(rows, RANK, dtype=dtype), torch.randn(rows, RANK, dtype=dtype)
    out, grad_x = torch.randn(rows, n, dtype=dtype), torch.randn(rows, k, dtype=dtype)
    size = dtype.itemsize
    big = rows * k * n * 2
    thin_in, thin_out = rows * k * RANK * 2, rows * n * RANK * 2
    return {
        "base": (lambda: torch.addmm(bias, x, weight.t()), (rows * k + n * k + rows * n) * size, big),
        "base_grad": (lambda: g.mm(weight), (rows * n + n * k + rows * k) * size, big),
        "a": (lambda: x.mm(weight_a.t()), (rows * k + rows * RANK) * size, thin_in),
        "up": (lambda: out.addmm_(a, weight_b.t()), (2 * rows * n + rows * RANK) * size, thin_out),
        "g_b": (lambda: g.mm(weight_b), (rows * n + rows * RANK) * size, thin_out),
        "down_grad": (lambda: grad_x.addmm_(g_a, weight_a), (2 * rows * k + rows * RANK) * size, thin_in),
        "grad_a": (lambda: g_a.t().mm(x), (rows * k + RANK * k) * size, thin_in),
        "grad_b": (lambda: a.t().mm(g).t(), (rows * n + RANK * n) * size, thin_out),
    }


def median_microseconds(calls: dict, count: int) -> dict:
    """name -> median microseconds of one call: `count` turns of the calls, each after 10 warm-up calls and,
    at each turn, one untimed (`_common.timed_turns`)."""
    times = _common.timed_turns(calls, count, 1, warmup=10)
    return {name: statistics.median(measured) * 1e6 for name, measured in times.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"{_common.machine(torch_version=True)}; medians of {args.calls} calls, microseconds (GB/s: bytes read "
          "and written once over the time; GFLOP/s for the base's products)")
    for dtype in (torch.float32, torch.bfloat16):
        floor = products(4, 384, 384, dtype)
        per_call = median_microseconds({name: call for name, (call, _, _) in floor.items()}, args.calls)
        print(f"\n{str(dtype).removeprefix('torch.')}, any call on 4 rows (its fixed cost): "
              + ", ".join(f"{name} {us:.1f}" for name, us in per_call.items()))
        for k, n in args.layers:
            for rows in args.rows:
                measured = products(rows, k, n, dtype)
                micro = median_microseconds({name: call for name, (call, _, _) in measured.items()}, args.calls)
                adapter = sum(us for name, us in micro.items() if not name.startswith("base"))
                base = micro["base"] + micro["base_grad"]
                cells = []
                for name, (_, moved, flops) in measured.items():
                    rate = f"{flops / micro[name] / 1e3:.0f} GFLOP/s" if name.startswith("base") \
                        else f"{moved / micro[name] / 1e3:.0f} GB/s"
                    cells.append(f"{name} {micro[name]:.1f} ({rate})")
                print(f"  {rows} x {k} -> {n}: adapter's six / base's two = {adapter:.0f} / {base:.0f} us "
                      f"= {adapter / base:.2f}x; " + ", ".join(cells))


if __name__ == "__main__":
    main()
