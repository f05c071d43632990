"""Predicted vs measured peak training memory, for the default model and a GPT-2-shaped model.

For each configuration, `effitrain.planning` predicts the peak per device (before anything is
loaded), then a fresh Python process trains it for a few steps with effitrain's own pieces (the
task's model class from its config, optimizers.build, the task's loss_sum, gradient checkpointing, autocast)
and reports its peak:
- CPU: peak resident memory (VmHWM) minus the resident memory just before the model is built;
- CUDA: torch.cuda.max_memory_allocated (the overhead allowance is left out of the prediction there).

    python benchmarks/planner/memory_plan.py                    # the table and each error; exit 1 if one is > 15%
    python benchmarks/planner/memory_plan.py --calibrate        # also refit the CPU overhead constants
    python benchmarks/planner/memory_plan.py --json run1.json   # also save the rows (measured and simulated)
    python benchmarks/planner/memory_plan.py --rows run1.json run2.json  # refit from saved runs, measuring nothing
    python benchmarks/planner/memory_plan.py --only peft        # only the LoRA and QLoRA rows
    python benchmarks/planner/memory_plan.py --only sharded     # 2 processes, ddp and fsdp (fsdp_memory.py)
    python benchmarks/planner/memory_plan.py --dry-run          # 2 tiny configurations; the 15% bar not applied

The model is built from its config (random weights, same shapes as the checkpoint): loading the
checkpoint would add the file's page cache to the resident set, which is not training memory.
LoRA rows apply effitrain's adapters (adapters.apply) to it. QLoRA rows must load weights, since
bitsandbytes quantises them as they load: the packaged default model, or the GPT-2 config saved
with save_pretrained beforehand; the peak RSS is reset after loading (/proc/self/clear_refs), and
the checkpoint's file pages still mapped are subtracted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from planner import memory_plan_runs as runs  # noqa: E402

MiB = 2**20
DEFAULT = "default"
GPT2 = "gpt2:n_layer=4,n_embd=256,n_head=4"
STEPS = 6  # resident memory stops growing after 4-5 steps (glibc heaps settle)

# model, task, micro-batch, length, precision, optimizer, checkpointing, accumulation
CONFIGS = [
    (DEFAULT, "sequence-classification", 8, 128, "fp32", "adamw", False, 1),
    (DEFAULT, "sequence-classification", 32, 128, "fp32", "adamw", False, 1),
    (DEFAULT, "sequence-classification", 64, 128, "fp32", "adamw", False, 1),
    (DEFAULT, "sequence-classification", 16, 256, "fp32", "adamw", False, 1),
    (DEFAULT, "sequence-classification", 32, 128, "fp32", "adamw", True, 1),
    (DEFAULT, "sequence-classification", 32, 128, "fp32", "sgd", False, 1),
    (DEFAULT, "sequence-classification", 32, 128, "fp32", "adafactor", False, 1),
    (DEFAULT, "sequence-classification", 32, 128, "fp32", "adamw-8bit", False, 1),
    (DEFAULT, "sequence-classification", 16, 128, "fp32", "adamw", False, 2),
    (DEFAULT, "sequence-classification", 32, 128, "bf16", "adamw", False, 1),
    (GPT2, "causal-lm", 8, 128, "fp32", "adamw", False, 1),
    (GPT2, "causal-lm", 16, 256, "fp32", "adamw", False, 1),
    (GPT2, "causal-lm", 16, 256, "fp32", "adamw", True, 1),
    (GPT2, "causal-lm", 4, 512, "fp32", "sgd", False, 1),
    (GPT2, "causal-lm", 8, 256, "fp32", "adamw", False, 2),
    (GPT2, "causal-lm", 8, 256, "bf16", "adamw", False, 1),
    # with adapters (--peft, default rank 8, dropout 0.05, all-linear): a ninth field
    (DEFAULT, "sequence-classification", 32, 128, "fp32", "adamw", False, 1, "lora"),
    (DEFAULT, "sequence-classification", 32, 128, "fp32", "adamw", True, 1, "lora"),
    (DEFAULT, "sequence-classification", 16, 128, "fp32", "adamw", False, 1, "qlora"),
    (GPT2, "causal-lm", 16, 256, "fp32", "adamw", False, 1, "lora"),
    (GPT2, "causal-lm", 8, 256, "fp32", "adamw", False, 1, "qlora"),
]
DRY_RUN = [  # --dry-run: a tiny GPT-2 with bf16, checkpointing, accumulation, LoRA (one row: the suite's time)
    ("gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=1024", "causal-lm", 2, 16, "bf16", "adamw", True, 2, "lora"),
]


_status = _common.status_bytes


def measure(model_name, task, micro, length, precision, optimizer, checkpointing, accumulation, peft="none",
            saved=None) -> dict:
    """In this (fresh) process: train STEPS steps, return the peak above the pre-model baseline.
    `saved`: the folder QLoRA loads (a save_pretrained of the model)."""
    import torch

    from effitrain import tasks
    from effitrain import optimizers as optim
    from effitrain.models import adapters, transforms
    from effitrain.planning import planner, simulate
    from effitrain.runtime import libraries

    libraries.quiet_libraries(debug=False)
    config = planner.model_config(model_name, task)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    batch = {k: v.to(device) for k, v in simulate.example_batch(task, config, micro, length).items()}
    if "input_ids" in batch:
        batch["input_ids"] = torch.randint(0, config.vocab_size, batch["input_ids"].shape, device=device)
        if task == "causal-lm":
            batch["labels"] = batch["input_ids"].clone()
    if peft != "none":  # libraries are not training memory: imported before the baseline, as torch is
        import bitsandbytes  # noqa: F401
        import peft as _peft  # noqa: F401
    baseline = torch.cuda.memory_allocated() if cuda else _status("VmRSS")
    file_pages = 0 if cuda else _status("RssFile")
    if peft == "qlora":
        with torch.device("meta"):
            head = adapters.head_modules(simulate.build(task, config)) if tasks.get(task).has_labels else []
        model = tasks.get(task).auto_class.from_pretrained(
            saved, config=config, local_files_only=True, ignore_mismatched_sizes=True, device_map={"": device},
            quantization_config=adapters.quantization_config(precision, head))
        if not cuda:  # the peak from here on: loading is not training (its file pages even less)
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
    else:
        model = simulate.build(task, config).to(device)
    model.train()
    # The model the planner predicts: its transforms, adapters included.
    model, _ = transforms.apply_all(model, simulate.settings(task, checkpointing, planner.Peft(peft)))
    model.train()
    optimizer_ = optim.build(optimizer, model, 1e-4, 0.01)
    dtype = simulate.AUTOCAST_DTYPES.get(precision)
    started = time.perf_counter()
    for _ in range(STEPS):
        for _ in range(accumulation):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = tasks.get(task).loss_sum(model, batch) / micro
            loss.backward()
        optimizer_.step()
        optimizer_.zero_grad(set_to_none=True)
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM") - (_status("RssFile") - file_pages)) - baseline
    return {"measured": peak, "device": device.type, "seconds_per_step": (time.perf_counter() - started) / STEPS}


def predict(model_name, task, micro, length, precision, optimizer, checkpointing, accumulation, peft, device, cache):
    from effitrain.planning import planner

    key = (model_name, task, length, device, peft)
    if key not in cache:
        shapes = planner.model_shapes(task, model_name, peft=None if peft == "none" else planner.Peft(peft))
        cache[key] = planner.Planner(shapes, length, device)
    estimate = cache[key].estimate(planner.Setting(precision, optimizer, checkpointing, micro, accumulation))
    phases = cache[key].phases(precision, checkpointing, micro)
    return estimate, planner.heap_churn(phases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="refit CPU_OVERHEAD from these measurements")
    parser.add_argument("--rows", nargs="+", metavar="JSON",
                        help="refit CPU_OVERHEAD from rows saved by --json (one file a run) instead of measuring")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--only", choices=("peft", "sharded", "adafactor"),
                        help="peft: only the rows with LoRA or QLoRA adapters; sharded: the 2-process ddp and fsdp "
                             "rows (fsdp_memory.py; with --runs: the fsdp rows); adafactor: the Adafactor rows")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--runs", action="store_true",
                        help="measure effitrain's own training runs instead (memory_plan_runs.py: every family, fit "
                             "and held-out rows reported apart)")
    parser.add_argument("--child-run", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true",
                        help="1 tiny configuration (a tiny GPT-2 with LoRA); no --calibrate, "
                             "--json, --rows or --only; the 15%% bar is not applied")
    args = parser.parse_args()
    if args.dry_run and not args.runs:
        _common.dry_run_model()
        args.calibrate, args.json, args.rows, args.only = False, None, None, None
        _common.skipped("the real configurations (QLoRA among them), calibration and the 15% bar")
    if args.child:
        print(json.dumps(measure(*json.loads(args.child))))
        return 0
    if args.child_run or args.runs:
        return _runs(args)
    if args.only == "sharded":  # several processes per row: a script of its own
        from pathlib import Path

        return subprocess.run([sys.executable, str(Path(__file__).with_name("fsdp_memory.py")),
                               *(["--json", args.json] if args.json else [])]).returncode
    if args.rows:
        rows = []
        for path in args.rows:
            with open(path) as saved:
                rows += json.load(saved)
        _calibrate(rows)
        return 0

    from effitrain.runtime.libraries import quiet_libraries

    quiet_libraries(debug=False)
    rows, cache = [], {}
    header = f"{'model':8} {'b x len':>9} {'prec':4} {'optimizer':10} {'ckpt':4} {'acc':>3} {'peft':5} " \
             f"{'predicted':>10} {'measured':>10} {'error':>7}"
    print(header)
    configs = [(*c, "none")[:9] for c in (DRY_RUN if args.dry_run else CONFIGS)]
    if args.only == "peft":
        configs = [c for c in configs if c[8] != "none"]
    elif args.only == "adafactor":
        configs = [c for c in configs if c[5] == "adafactor"]
    saved = tempfile.TemporaryDirectory()
    for config in configs:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps([*config, _saved(config, saved.name)])],
                             capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        estimate, churn = predict(*config, measured["device"], cache)
        predicted = estimate.total - (estimate.overhead if measured["device"] == "cuda" else 0)
        error = predicted / measured["measured"] - 1
        rows.append({"config": config, "predicted": predicted, "measured": measured["measured"], "error": error,
                     "tensors": estimate.total - estimate.overhead, "heap_churn": churn,
                     "breakdown": estimate.to_dict(), "device": measured["device"]})
        name = "default" if config[0] == DEFAULT else "gpt2-4L"
        print(f"{name:8} {config[2]:>3} x {config[3]:<4} {config[4]:4} {config[5]:10} "
              f"{'yes' if config[6] else 'no':4} {config[7]:>3} {config[8]:5} {predicted / MiB:>8.0f}Mi {measured['measured'] / MiB:>8.0f}Mi "
              f"{error:>+7.1%}", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} over {len(rows)} configurations ({rows[0]['device']})")
    if args.calibrate and rows[0]["device"] == "cpu":
        _calibrate(rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0 if worst <= 0.15 or args.dry_run else 1


def _runs(args) -> int:
    """--runs: effitrain's own training runs, one fresh process (or torchrun pair) per row."""
    if args.child_run:
        runs.child(*json.loads(args.child_run))
        return 0
    if args.rows:
        results = []
        for path in args.rows:
            with open(path) as saved:
                results += json.load(saved)
    else:
        _common.run_under_effitrains_allocator()  # the rows run under the allocator `effitrain train` gets
        results = runs.run_all(__file__, runs.DRY_RUN if args.dry_run else runs.selected(args.only))
    failed = [r for r in results if "failed" in r]  # a row whose run stopped: no measurement, not a pass
    results = [r for r in results if "failed" not in r]
    ok = runs.verdict(results) and not failed
    if args.calibrate or args.rows:
        runs.calibrate(results)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0 if ok or args.dry_run else 1


def _saved(config, folder: str) -> str | None:
    """QLoRA loads weights: the packaged default model, or the config saved once with save_pretrained
    (here, not in the measured process: building it there would raise the baseline)."""
    from pathlib import Path

    from effitrain.models import loading
    from effitrain.planning import planner, simulate

    if config[8] != "qlora":
        return None
    if config[0] == DEFAULT:
        return str(loading.default_model_dir())
    path = Path(folder) / config[0].replace(":", "_").replace(",", "_").replace("=", "-")
    if not path.exists():
        simulate.build(config[1], planner.model_config(config[0], config[1])).save_pretrained(str(path))
    return str(path)


def _calibrate(rows) -> None:
    """Least squares over the CPU rows: measured - tensors = constant + churn_share x the micro-step's heap
    churn (planner.heap_churn; rows saved before it was recorded carry the forward's only). Held out: each configuration (all its measurements) predicted by
    the fit on the others; the default-model rows by the fit on the GPT-2 ones, and the other way round."""
    import numpy as np

    rows = [r for r in rows if r["device"] == "cpu"]
    x = np.array([[1.0, r.get("heap_churn", r["forward_heap_churn"])] for r in rows])
    tensors = np.array([r["tensors"] for r in rows], dtype=float)
    measured = np.array([r["measured"] for r in rows], dtype=float)
    configs = [json.dumps(r["config"]) for r in rows]

    def fitted(keep):
        return np.linalg.lstsq(x[keep], (measured - tensors)[keep], rcond=None)[0]

    def worst(held_out: list[np.ndarray]) -> float:  # the largest error where each mask is predicted unseen
        return max(np.abs((tensors[m] + x[m] @ fitted(~m)) / measured[m] - 1).max() for m in held_out if m.any())

    everything = np.ones(len(rows), bool)
    constant, share = fitted(everything)
    one_out = worst([np.array([c == config for c in configs]) for config in set(configs)])
    gpt2 = np.array([r["config"][0] == GPT2 for r in rows])
    print(f"calibration over {len(rows)} measurements ({len(set(configs))} configurations): CPU_OVERHEAD = "
          f"{{'constant': {constant / MiB:.0f} * MiB, 'churn_share': {share:.3f}}}, "
          f"worst {np.abs((tensors + x @ fitted(everything)) / measured - 1).max():.1%}; held out: "
          f"leave-one-configuration-out worst {one_out:.1%}, default model from GPT-2 rows {worst([~gpt2]):.1%}, "
          f"GPT-2 from default-model rows {worst([gpt2]):.1%}")


if __name__ == "__main__":
    sys.exit(main())
