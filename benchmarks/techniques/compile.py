"""What `effitrain train --compile` buys and costs on the default model (all-MiniLM-L6-v2) and sms-spam.

Runs: `effitrain train --max-steps N` eager and with --compile, in fp32 and in bf16 autocast
(--precision bf16), each in a fresh process with an empty inductor cache of its own (the compile
a first run pays; --warm-cache shares one cache, as later runs of the same model do). From each
metrics.json: training samples/s (compiling left out), the graphs compiled and their seconds, the
wall time, the test loss. Printed as ratios against the eager run of the same precision.

--shapes: how to shape the batches for the compiled blocks, on a plain loop (forward, backward,
AdamW) over the same length-grouped batches: dynamo's automatic dynamic shapes with batches padded to
a multiple of 8 (what --compile does), or static graphs with batches padded to powers of two from 16
(16, 32, 64, 128); graphs, compile seconds, samples/s; then the validation split in inference mode
through the compiled blocks against eager (the question of compiling evaluation too).

    .venv/bin/python benchmarks/techniques/compile.py [--steps 40] [--batch-size 16] [--warm-cache] [--shapes]
        [--json PATH]
    .venv/bin/python benchmarks/techniques/compile.py --dry-run   # the eager fp32 run only, tiny model, 2 steps: no
                                                                  # compiling

Speeds depend on the machine and on whatever else runs on it; compare the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

RUNS = [("eager", "fp32", []), ("compile", "fp32", ["--compile"]), ("eager", "bf16", []),
        ("compile", "bf16", ["--compile"])]
SHAPES = ("eager", "dynamic-8", "static-pow2")


def run_train(name: str, precision: str, extra: list, args, root: Path) -> dict:
    """One `effitrain train` in a fresh process; its metrics.json."""
    out = root / f"{name}-{precision}"
    env = dict(os.environ)
    if not args.warm_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(root / f"inductor-{name}-{precision}")
    command = [sys.executable, "-m", "effitrain", "train", "--max-steps", str(args.steps), "--batch-size",
               str(args.batch_size), "--precision", precision, "--max-eval-samples", str(args.eval_samples),
               "--log-every", str(args.steps), "--output-dir", str(out), *extra]
    if args.dry_run:  # `effitrain train` in its own process: the tiny model by path
        command += ["--model", str(args.dry_run)]
    start = time.perf_counter()
    _common.run_checked(command, env=env)
    metrics = json.loads((out / "metrics.json").read_text())
    return {"name": name, "precision": precision, "process_seconds": time.perf_counter() - start,
            "samples_per_second": metrics["train_samples_per_second"], "train_seconds": metrics["train_seconds"],
            "wall_seconds": metrics["wall_seconds"], "compile": metrics["compile"], "test_loss": metrics["test"]["loss"],
            "test_accuracy": metrics["test"]["accuracy"]}


def print_runs(runs: list[dict]) -> None:
    eager = {run["precision"]: run["samples_per_second"] for run in runs if run["name"] == "eager"}
    print(f"\n{'run':<16}{'samples/s':>10}{'vs eager':>10}{'vs fp32 eager':>15}{'graphs':>8}{'compile s':>11}"
          f"{'wall s':>8}{'test loss':>11}")
    for run in runs:
        compiled = run["compile"] or {"graphs": 0, "seconds": 0.0}
        speed = run["samples_per_second"]
        print(f"{run['name'] + ' ' + run['precision']:<16}{speed:>10.1f}{speed / eager[run['precision']]:>9.2f}x"
              f"{speed / eager['fp32']:>14.2f}x{compiled['graphs']:>8}{compiled['seconds']:>11.1f}"
              f"{run['wall_seconds']:>8.1f}{run['test_loss']:>11.4f}")


def shape_worker(policy: str, precision: str, steps: int, batch_size: int) -> dict:
    """A plain loop over the first `steps` length-grouped batches, blocks compiled per `policy`."""
    import torch
    from torch.utils.data import DataLoader

    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.data import text
    from effitrain import optimizers as optim
    from effitrain.engine import compilation
    from effitrain.models import loading
    from effitrain.models.blocks import blocks
    from effitrain.runtime import libraries

    libraries.quiet_libraries(False)
    task, config, source = tasks.get("sequence-classification"), TrainConfig(), loading.resolve_source("default")
    tokenizer = task.load_processor(source)
    loaded = task.load_data(config)
    encoded = task.preprocess(loaded.splits, tokenizer, config, loaded.base_dir)
    collate = text.collator(tokenizer) if policy != "static-pow2" else power_of_two_collator(tokenizer, 128)
    train = DataLoader(encoded["train"], batch_size=batch_size, collate_fn=collate,
                       sampler=text.train_sampler(encoded["train"], batch_size, True, 42))
    torch.manual_seed(42)
    model = task.build_model(source, loaded.splits["train"].features["label"].names, tokenizer, {}).train()
    if policy != "eager":
        for block in blocks(model):
            block.compile(dynamic=False if policy == "static-pow2" else None)
    optimizer = optim.build("adamw", model, 1e-4, 0.01, (0.9, 0.999))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    result = {"policy": policy, "precision": precision, "train_seconds": 0.0, "samples": 0, "shapes": set()}
    with compilation.no_silent_fallback():
        for _, batch in zip(range(steps), train):
            start, compiling = time.perf_counter(), compilation.totals()[1]
            with autocast:
                loss = task.loss_sum(model, batch) / task.item_count(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result["train_seconds"] += time.perf_counter() - start - (compilation.totals()[1] - compiling)
            result["samples"] += len(batch["labels"])
            result["shapes"].add(tuple(batch["input_ids"].shape))
        graphs, compile_seconds = compilation.totals()
        result.update(train_graphs=graphs, train_compile_seconds=compile_seconds, shapes=len(result["shapes"]),
                      samples_per_second=result["samples"] / result["train_seconds"])
        result.update(evaluation(model, task, encoded["validation"], collate, autocast))
    return result


def evaluation(model, task, split, collate, autocast) -> dict:
    """The validation split in inference mode twice: the first pass compiles, the second is timed."""
    import torch
    from torch.utils.data import DataLoader

    from effitrain.engine import compilation

    model.eval()
    loader = DataLoader(split, batch_size=128, collate_fn=collate)
    seconds, compiling = [], compilation.totals()[1]
    for _ in range(2):
        start = time.perf_counter()
        with torch.inference_mode(), autocast:
            for batch in loader:
                task.eval_outputs(model, batch)
        seconds.append(time.perf_counter() - start)
    return {"eval_compile_seconds": compilation.totals()[1] - compiling, "eval_seconds": seconds[1],
            "graphs": compilation.totals()[0]}


def power_of_two_collator(tokenizer, max_length: int):
    """Batches padded to the next power of two from 16 (at most max_length): 4 lengths up to 128."""
    def collate(features):
        longest, bucket = max(len(f["input_ids"]) for f in features), 16
        while bucket < longest:
            bucket *= 2
        return tokenizer.pad(features, padding="max_length", max_length=min(bucket, max_length), return_tensors="pt")
    return collate


def run_shapes(args, root: Path) -> list[dict]:
    results = []
    for precision in ("fp32", "bf16"):
        for policy in SHAPES:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / f"inductor-shapes-{policy}-{precision}")}
            results.append(_common.child_json([sys.executable, __file__, "--worker", policy, precision, "--steps",
                                               str(args.steps), "--batch-size", str(args.batch_size)], env=env))
            print(json.dumps(results[-1]), flush=True)
    print(f"\n{'policy':<24}{'shapes':>7}{'graphs':>7}{'compile s':>10}{'samples/s':>10}{'vs eager':>9}"
          f"{'eval s':>8}{'eval compile s':>15}")
    for r in results:
        eager = next(e for e in results if e["policy"] == "eager" and e["precision"] == r["precision"])
        print(f"{r['policy'] + ' ' + r['precision']:<24}{r['shapes']:>7}{r['graphs']:>7}{r['train_compile_seconds']:>10.1f}"
              f"{r['samples_per_second']:>10.1f}{r['samples_per_second'] / eager['samples_per_second']:>8.2f}x"
              f"{r['eval_seconds']:>8.1f}{r['eval_compile_seconds']:>15.1f}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-samples", type=int, default=256, help="validation and test examples per run")
    parser.add_argument("--warm-cache", action="store_true", help="one inductor cache for all runs")
    parser.add_argument("--shapes", action="store_true", help="also compare the shape policies (plain loop)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true",
                        help="the eager fp32 run only, of a tiny model (benchmarks/_common.py), 2 steps of 4, 8 "
                             "evaluation examples; no compiling (minutes on a CPU), no --shapes, no --json")
    args = parser.parse_args()
    if args.dry_run:
        args.dry_run = _common.dry_run_model()
        args.steps, args.batch_size, args.eval_samples, args.shapes, args.json = 2, 4, 8, False, None
        _common.skipped("the --compile runs and bf16 (inductor compiles a tiny model's step for over a minute "
                        "here), --shapes and --json")
    if args.worker:
        print(json.dumps(shape_worker(*args.worker, args.steps, args.batch_size)))
        return
    import torch

    print(f"all-MiniLM-L6-v2 on sms-spam, {args.steps} steps of {args.batch_size}; torch {torch.__version__}, "
          f"{os.cpu_count()} cores, {'warm' if args.warm_cache else 'empty'} inductor cache per run", flush=True)
    report = {"steps": args.steps, "batch_size": args.batch_size, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for name, precision, extra in RUNS[:1] if args.dry_run else RUNS:
            runs.append(run_train(name, precision, extra, args, Path(tmp)))
            print(json.dumps(runs[-1]), flush=True)
        print_runs(runs)
        report["runs"] = runs
        if args.shapes:
            report["shapes"] = run_shapes(args, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
