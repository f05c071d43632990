"""The memory planner against effitrain's own training runs: one fresh process per row.

Each row is `effitrain train --memory-budget 64GiB` on bbc-news (every example longer than the rows'
lengths, so every micro-batch is full length) for STEPS steps: the run's set-up plans it (the budget
never binds, so the planner's estimate is that of the row's own settings) and records in metrics.json
the resident memory before the model is built (`in_use_bytes`) and the predicted peak; the run's peak
resident memory (`peak_memory_bytes`, the largest of its processes) minus `in_use_bytes` is the
measured training peak that the prediction is set against. fsdp rows are 2 gloo processes (torchrun)
with OMP_NUM_THREADS=1 each. Evaluation is kept small (4 examples, 4 at a time) so that the
training step, not the evaluation, makes the peak.

Rows marked `fit` are those CPU_OVERHEAD (planning/planner.py) is fitted on (`--calibrate`); the
`held-out` rows are never fitted on and are reported apart.

    python benchmarks/planner/memory_plan.py --runs                      # every row; exit 1 past the bars
    python benchmarks/planner/memory_plan.py --runs --calibrate --json F # also refit the constants on the fit rows
    python benchmarks/planner/memory_plan.py --rows F --runs             # refit from saved rows, measuring nothing
    python benchmarks/planner/memory_plan.py --runs --only sharded       # only the fsdp rows (peft, adafactor: those
                                                                         # rows)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2**20
STEPS = 6  # resident memory stops growing after 4-5 steps (glibc heaps settle)
DEFAULT = "default"
GPT2 = "gpt2:n_layer=4,n_embd=256,n_head=4"
LLAMA = "llama:hidden_size=256,intermediate_size=688,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2"
CLS, LM = "sequence-classification", "causal-lm"
BARS = {"within": 0.15, "under": 0.10}  # every row within 15%, none under by more than 10%

# role, model, task, micro-batch, length, precision, optimizer, checkpointing, peft, strategy (processes)
ROWS = [
    ("fit", DEFAULT, CLS, 24, 128, "fp32", "adamw", False, "none", "single"),
    ("fit", DEFAULT, CLS, 64, 128, "fp32", "adamw", False, "none", "single"),
    ("fit", DEFAULT, CLS, 16, 256, "fp32", "sgd", False, "none", "single"),
    ("fit", DEFAULT, CLS, 32, 128, "bf16", "adafactor", False, "none", "single"),
    ("fit", DEFAULT, CLS, 32, 128, "fp32", "adamw", True, "none", "single"),
    ("fit", DEFAULT, CLS, 32, 128, "fp32", "adamw", False, "lora", "single"),
    ("fit", DEFAULT, CLS, 16, 128, "fp32", "adamw", False, "qlora", "single"),
    ("fit", GPT2, LM, 8, 256, "fp32", "adamw", True, "none", "single"),
    ("fit", GPT2, LM, 16, 256, "fp32", "adamw", False, "none", "single"),
    ("fit", GPT2, LM, 8, 256, "bf16", "adamw", False, "none", "single"),
    ("fit", LLAMA, LM, 8, 256, "fp32", "adamw", False, "none", "single"),
    ("fit", LLAMA, LM, 8, 256, "fp32", "adamw", False, "lora", "single"),
    ("fit", GPT2, LM, 8, 256, "fp32", "adamw", False, "none", "fsdp"),
    ("held-out", DEFAULT, CLS, 32, 128, "bf16", "adamw", False, "none", "single"),
    ("held-out", DEFAULT, CLS, 16, 256, "fp32", "adamw", True, "none", "single"),
    ("held-out", DEFAULT, CLS, 32, 128, "fp32", "adamw", True, "lora", "single"),
    ("held-out", GPT2, LM, 16, 256, "fp32", "adamw", True, "none", "single"),
    ("held-out", GPT2, LM, 8, 256, "bf16", "adafactor", False, "none", "single"),
    ("held-out", GPT2, LM, 16, 256, "fp32", "adamw", False, "lora", "single"),
    ("held-out", GPT2, LM, 8, 256, "fp32", "adamw", False, "qlora", "single"),
    ("held-out", LLAMA, LM, 8, 256, "fp32", "adamw", True, "none", "single"),
    ("held-out", DEFAULT, CLS, 16, 128, "fp32", "adamw", False, "none", "fsdp"),
]
DRY_RUN = [("fit", "gpt2:n_layer=2,n_embd=64,n_head=2", LM, 2, 32, "fp32", "adamw", True, "none", "single")]
WORLD = 2  # fsdp rows' processes


def selected(only: str | None) -> list:
    """--only with --runs: peft, the rows with adapters; sharded, the fsdp rows; adafactor, the Adafactor rows;
    None, every row."""
    keep = {None: lambda row: True, "peft": lambda row: row[8] != "none", "sharded": lambda row: row[9] == "fsdp",
            "adafactor": lambda row: row[6] == "adafactor"}
    return [row for row in ROWS if keep[only](row)]


def train_config(row, output_dir: str, model: str | None = None) -> dict:
    _role, model_name, task, micro, length, precision, optimizer, checkpointing, peft, strategy = row
    return {"model": model or model_name, "task": task, "data": "bbc-news", "batch_size": micro, "max_length": length,
            "precision": precision, "optim": optimizer, "gradient_checkpointing": checkpointing, "peft": peft,
            "strategy": "fsdp" if strategy == "fsdp" else "ddp", "memory_budget": "64GiB", "max_steps": STEPS,
            "max_eval_samples": 4, "eval_batch_size": 4, "output_dir": output_dir, "overwrite": True}


def child(row, output_dir: str, model: str | None) -> None:
    """In this fresh process (or each torchrun process): the run, its planner's estimate captured where
    set-up asks for it (planner.fit), printed with the run's metrics by process 0."""
    import effitrain
    from effitrain.planning import planner as plan

    seen = {}
    fit = plan.fit

    def capturing_fit(planner, *args, **kwargs):
        estimate, changes = fit(planner, *args, **kwargs)
        phases = planner.phases(estimate.setting.precision, estimate.setting.checkpointing, estimate.setting.micro_batch)
        seen.update(breakdown=estimate.to_dict(), tensors=estimate.total - estimate.overhead,
                    heap_churn=plan.heap_churn(phases), changes=changes)
        return estimate, changes

    plan.fit = capturing_fit
    metrics = effitrain.train(train_config(row, output_dir, model))
    if int(os.environ.get("RANK", "0")) == 0:
        from effitrain.speedups import allocator

        memory = metrics["memory_plan"]
        print(json.dumps({**seen, "allocator": allocator.serving()[0], "peak": metrics["peak_memory_bytes"],
                          "in_use": memory["in_use_bytes"],
                          "predicted": memory["predicted_peak_bytes"], "transforms": metrics.get("transforms")}))


def saved(row, folder: str) -> str:
    """QLoRA quantises pretrained weights as they load, so a QLoRA row of a model built from a config trains a
    copy saved first (here, not in the measured process), with the default tokenizer beside it and its
    vocabulary (what `train` gives a model built from a config)."""
    from transformers import AutoTokenizer

    from effitrain.models import loading
    from effitrain.planning import planner as plan
    from effitrain.planning import simulate

    path = Path(folder) / "saved"
    tokenizer = AutoTokenizer.from_pretrained(str(loading.default_model_dir()))
    simulate.build(row[2], plan.model_config(row[1], row[2], 5, len(tokenizer))).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def measure(row, script: str, model: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        if model is None and row[8] == "qlora" and row[1] != DEFAULT:
            model = saved(row, folder)
        args = ["--child-run", json.dumps([list(row), str(Path(folder) / "run"), model])]
        if row[-1] == "fsdp":
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                       script, *args]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
        else:
            command, env = [sys.executable, script, *args], None
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder)
    if out.returncode:
        raise RuntimeError(f"row {row} failed:\n{out.stderr[-3000:]}")
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    measured["measured"] = measured["peak"] - measured["in_use"]
    measured["error"] = measured["predicted"] / measured["measured"] - 1
    return measured


def name(row) -> str:
    return {DEFAULT: "default", GPT2: "gpt2-4L", LLAMA: "llama-4L"}.get(row[1], row[1].split(":")[0])


def line(row, measured) -> str:
    _role, _model, _task, micro, length, precision, optimizer, ckpt, peft, strategy = row
    return (f"| {row[0]} | {name(row)} | {micro} x {length} | {precision} | {optimizer} | {'yes' if ckpt else 'no'} | "
            f"{peft} | {strategy} | {measured['predicted'] / MiB:.0f} | {measured['measured'] / MiB:.0f} | "
            f"{measured['error']:+.1%} |")


HEADER = ("| rows | model | b x len | precision | optimizer | ckpt | peft | processes | predicted MiB | measured MiB "
          "| error |\n|---|---|---|---|---|---|---|---|---:|---:|---:|")


def run_all(script: str, rows, model: str | None = None) -> list[dict]:
    print(HEADER, flush=True)
    results = []
    for row in rows:
        try:
            measured = measure(row, script, model)
        except RuntimeError as err:  # a run that stops (a bug outside the planner): reported, the others measured
            results.append({"row": list(row), "failed": str(err).splitlines()[-1]})
            print(f"| {row[0]} | {name(row)} | not measured: {results[-1]['failed']} |", flush=True)
            continue
        results.append({"row": list(row), **measured})
        print(line(row, measured), flush=True)
    return results


def verdict(results: list[dict]) -> bool:
    ok = True
    for role in ("fit", "held-out"):
        errors = [r["error"] for r in results if r["row"][0] == role]
        if errors:
            print(f"{role}: {len(errors)} rows, worst over {max(errors):+.1%}, worst under {min(errors):+.1%}")
            ok &= max(abs(e) for e in errors) <= BARS["within"] and min(errors) >= -BARS["under"]
    return ok


def calibrate(results: list[dict]) -> dict:
    """Least squares over the fit rows: measured - tensors = constant + churn_share x the micro-step's heap
    churn (planner.heap_churn) under glibc, the constant alone under a preloaded allocator (rows saved before
    the allocator was recorded ran glibc); the held-out rows then predicted with it."""
    import numpy as np

    from effitrain.planning import planner as plan

    kinds = {r.get("allocator", "glibc") for r in results}
    if len(kinds) != 1:
        raise SystemExit(f"rows of several allocators ({', '.join(sorted(kinds))}): calibrate each apart")
    kind = kinds.pop()
    glibc = kind not in plan.PRELOADED_OVERHEAD

    def features(r):
        return [1.0, r["heap_churn"]] if glibc else [1.0, 0.0]

    fit = [r for r in results if r["row"][0] == "fit"]
    x = np.array([features(r) for r in fit])
    y = np.array([r["measured"] - r["tensors"] for r in fit], dtype=float)
    constant, share = np.linalg.lstsq(x, y, rcond=None)[0]
    for r in results:
        r["refit_predicted"] = round(r["tensors"] + np.dot([constant, share], features(r)))
        r["refit_error"] = r["refit_predicted"] / r["measured"] - 1
    if glibc:
        print(f"CPU_OVERHEAD = {{'constant': {constant / MiB:.0f} * MiB, 'churn_share': {share:.3f}}}")
    else:
        print(f"PRELOADED_OVERHEAD['{kind}'] = {constant / MiB:.0f} * MiB")
    for role in ("fit", "held-out"):
        errors = [r["refit_error"] for r in results if r["row"][0] == role]
        if errors:
            print(f"refit, {role}: worst over {max(errors):+.1%}, worst under {min(errors):+.1%}")
    return {"constant": constant, "churn_share": share}


def planned(row):
    """The planner's estimate for a row, as the run's set-up makes it (memory_fit.plan_run): bbc-news's 5
    labels, the default tokenizer's vocabulary for a model built from a config; for refits from measured
    peaks without measuring again (the measured peak does not depend on the planner)."""
    from effitrain.planning import planner as plan

    _role, model, task, micro, length, precision, optimizer, ckpt, peft, strategy = row
    vocab = None if model == DEFAULT else 30522
    shapes = plan.model_shapes(task, model, 5, vocab, plan.Peft(peft) if peft != "none" else None)
    world = WORLD if strategy == "fsdp" else 1
    planner = plan.Planner(shapes, length, "cpu", world, "fsdp" if strategy == "fsdp" else "ddp")
    estimate = planner.estimate(plan.Setting(precision, optimizer, ckpt, micro, 1))
    phases = planner.phases(precision, ckpt, micro)
    return {"breakdown": estimate.to_dict(), "tensors": estimate.total - estimate.overhead,
            "heap_churn": plan.heap_churn(phases), "predicted": estimate.total}


def from_table(path: str) -> list[dict]:
    """Rows of a printed table (this script's output): the measured MiB, the planner's features now."""
    results = []
    for text in Path(path).read_text().splitlines():
        cells = [c.strip() for c in text.strip("|").split("|")]
        if len(cells) != 11 or cells[0] not in ("fit", "held-out"):
            continue
        row = next(r for r in ROWS if r[0] == cells[0] and name(r) == cells[1] and f"{r[3]} x {r[4]}" == cells[2]
                   and list(r[5:7]) == cells[3:5] and ("yes" if r[7] else "no") == cells[5] and r[8] == cells[6]
                   and r[9] == cells[7])
        results.append({"row": list(row), "measured": float(cells[9]) * MiB, **planned(row)})
    return results
