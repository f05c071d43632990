"""Per-process peak memory of 2-process training, ddp against fsdp, measured and predicted.

For each configuration, 2 gloo processes (torchrun) train STEPS steps with effitrain's own pieces:
the task's model built from its config, `engine.sharding.shard` (fsdp: fully_shard per block, then
the root) or torch's DistributedDataParallel (ddp, as accelerate wraps it), `optimizers.build`, the task's
`loss_sum`, no gradient sync on all but a step's last micro-batch. Each process reports its peak
resident memory (VmHWM) minus its resident memory just before the model was built (the libraries
and the process group are not training memory); the larger of the two is the row's figure. The
prediction is `effitrain plan`'s (`plan.Planner` with world_size 2 and the strategy) for the same
setting, on the CPU overhead model of benchmarks/planner/memory_plan.py.

    python benchmarks/planner/fsdp_memory.py            # the table; exit 1 if a prediction is > 15% off
    python benchmarks/planner/fsdp_memory.py --json F   # also the rows as JSON
    python benchmarks/planner/fsdp_memory.py --dry-run  # a tiny GPT-2, ddp and fsdp; the 15% bar not applied
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

MiB = 2**20
STEPS = 6  # resident memory settles after 4-5 steps (benchmarks/planner/memory_plan.py)
WORLD = 2
STATES = "gpt2:n_layer=8,n_embd=1024,n_head=16,vocab_size=8192"  # 110M parameters, 92% in blocks: states dominate
DEFAULT = "default"

# model, task, micro-batch, length, optimizer, checkpointing, accumulation, strategy
CONFIGS = [
    (STATES, "causal-lm", 4, 128, "adamw", False, 1, "ddp"),
    (STATES, "causal-lm", 4, 128, "adamw", False, 1, "fsdp"),
    (STATES, "causal-lm", 4, 128, "adamw", True, 2, "fsdp"),
    (STATES, "causal-lm", 4, 128, "sgd", False, 1, "fsdp"),
    (DEFAULT, "sequence-classification", 16, 128, "adamw", False, 1, "ddp"),
    (DEFAULT, "sequence-classification", 16, 128, "adamw", False, 1, "fsdp"),
]
# --dry-run: the fsdp row alone (the ddp rows run the same code with another --strategy; the suite's time)
DRY_RUN = [("gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=1024", "causal-lm", 2, 16, "adamw", False, 1, "fsdp")]


_status = _common.status_bytes


def child(model_name, task, micro, length, optimizer, checkpointing, accumulation, strategy) -> None:
    """One of the torchrun processes: train, then process 0 prints the larger peak."""
    import contextlib

    import torch
    import torch.distributed as dist

    from effitrain import tasks
    from effitrain import optimizers as optim
    from effitrain.engine import sharding
    from effitrain.models import transforms
    from effitrain.planning import planner as plan
    from effitrain.planning import simulate
    from effitrain.runtime import libraries

    libraries.quiet_libraries(debug=False)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = plan.model_config(model_name, task)
    torch.manual_seed(rank)
    batch = simulate.example_batch(task, config, micro, length)
    batch["input_ids"] = torch.randint(0, config.vocab_size, batch["input_ids"].shape)
    if task == "causal-lm":
        batch["labels"] = batch["input_ids"].clone()
    baseline = _status("VmRSS")
    model = simulate.build(task, config)
    model.train()
    model, _ = transforms.apply_all(model, simulate.settings(task, checkpointing))  # the model the planner predicts
    if strategy == "fsdp":
        model = sharding.shard(model, torch.device("cpu"), WORLD, "no", reshard_after_forward=True)
        no_sync = lambda: sharding.no_sync(model)  # noqa: E731
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        no_sync = model.no_sync
    optimizer_ = optim.build(optimizer, model, 1e-4, 0.01)
    for _ in range(STEPS):
        for i in range(accumulation):
            with contextlib.nullcontext() if i == accumulation - 1 else no_sync():
                (tasks.get(task).loss_sum(model, batch) / micro).backward()
        optimizer_.step()
        optimizer_.zero_grad(set_to_none=True)
    peak = torch.tensor([_status("VmHWM") - baseline], dtype=torch.int64)
    peaks = [torch.zeros_like(peak) for _ in range(WORLD)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        print(json.dumps({"measured": max(int(p) for p in peaks), "per_process": [int(p) for p in peaks]}))
    # Both processes out of every collective before either tears gloo down: a process destroying its group
    # while the other still ran the gather aborted once in 8 dry runs ("terminate called without an active
    # exception").
    dist.barrier()
    dist.destroy_process_group()


def predict(model_name, task, micro, length, optimizer, checkpointing, accumulation, strategy):
    from effitrain.planning import planner as plan

    shapes = plan.model_shapes(task, model_name)
    planner = plan.Planner(shapes, length, "cpu", world_size=WORLD, strategy=strategy)
    return planner.estimate(plan.Setting("fp32", optimizer, checkpointing, micro, accumulation))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny GPT-2, ddp and fsdp (2 processes each), no --json; the 15%% bar is not applied")
    args = parser.parse_args()
    if args.dry_run:
        args.json = None  # the tiny GPT-2 is built from its config: no tiny BERT needed
        _common.skipped("the real configurations and the 15% bar")
    if args.child:
        child(*json.loads(args.child))
        return 0

    from effitrain.runtime.libraries import quiet_libraries

    quiet_libraries(debug=False)
    print(f"{'model':8} {'b x len':>9} {'optimizer':9} {'ckpt':4} {'acc':>3} {'strategy':8} {'predicted':>10} "
          f"{'measured':>10} {'error':>7}")
    rows = []
    for config in DRY_RUN if args.dry_run else CONFIGS:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={WORLD}", __file__, "--child", json.dumps(config)],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        estimate = predict(*config)
        error = estimate.total / measured["measured"] - 1
        rows.append({"config": config, "predicted": estimate.total, "breakdown": estimate.to_dict(), **measured,
                     "error": error})
        name = "default" if config[0] == DEFAULT else "gpt2-8x1k"
        print(f"{name:8} {config[2]:>3} x {config[3]:<4} {config[4]:9} {'yes' if config[5] else 'no':4} "
              f"{config[6]:>3} {config[7]:8} {estimate.total / MiB:>8.0f}Mi {measured['measured'] / MiB:>8.0f}Mi "
              f"{error:>+7.1%}", flush=True)
    for model in (STATES, DEFAULT):
        same = {r["config"][7]: r["measured"] for r in rows if r["config"][0] == model and not r["config"][5]
                and r["config"][4] == "adamw"}
        if {"ddp", "fsdp"} <= same.keys():
            print(f"{model}: fsdp per-process peak {same['fsdp'] / same['ddp']:.2f}x ddp's")
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} over {len(rows)} configurations (cpu, {WORLD} processes)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0 if worst <= 0.15 or args.dry_run else 1


if __name__ == "__main__":
    sys.exit(main())
