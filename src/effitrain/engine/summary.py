"""The end of a run: metrics.json and the summary printed for the user."""

from __future__ import annotations

import torch

from effitrain.models import adapters
from effitrain.optimizers import measured_state
from effitrain.outputs import console, files
from effitrain.runtime.devices import peak_memory_bytes


def metrics(run, state, test: dict, stopped_early: bool, confusion: dict | None = None) -> dict:
    """What metrics.json holds (DESIGN.md's contract, and more). `confusion`: the test split's
    confusion matrix (classification), kept out of `test`, whose values are all numbers."""
    samples, tokens = run.reduce(state.totals).tolist()
    config, plan, accelerator = run.config, run.plan, run.accelerator
    # Measured from the optimizer's own state tensors (this process's shard under FSDP/ZeRO).
    optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
    state_size = measured_state.state_bytes(optimizer)
    # Per parameter: what the optimizer keeps for each, over the shards of all processes.
    state_all = run.strategy.optimizer_state_bytes(state_size, run.reduce)
    model = accelerator.unwrap_model(run.model)
    parameters = adapters.counts(model)
    trainable = max(1, parameters["trainable"])
    peak = torch.tensor([peak_memory_bytes(accelerator.device)], device=accelerator.device)
    return {
        "task": run.task.name,
        "validation": state.validation,
        "test": test,
        **({"test_confusion_matrix": confusion} if confusion is not None else {}),
        "examples": {split: len(rows) for split, rows in run.data.encoded.items()},  # after any skipped rows
        "best": {"metric": config.metric_for_best or "loss", "value": state.best_value, "step": state.best_step,
                 "kept_in_model": config.keep == "best"},
        "stopped_early": stopped_early,
        "train_samples_per_second": samples / state.train_seconds,
        "train_tokens_per_second": tokens / state.train_seconds if run.task.is_text else None,
        "peak_memory_bytes": int(accelerator.gather(peak).max()),
        "train_seconds": state.train_seconds,
        "steps": state.step,
        "epochs": round(state.step / run.steps_per_epoch, 4),
        "world_size": run.world,
        "device": accelerator.device.type,
        "labels": run.data.label_names,
        "skipped_rows": run.data.loaded.skipped_rows,
        "train_loss": state.last_loss,  # mean over the last logged window
        # The task's own means over that window (preference: rewards, accuracy; online RL: reward, lengths).
        **({"train_metrics": state.last_task_metrics} if state.last_task_metrics else {}),
        "skipped_steps": state.skipped_steps,  # non-finite loss or gradient
        "precision": {"no": "fp32"}.get(plan.precision, plan.precision),
        "optimizer": plan.optim,
        "strategy": config.strategy,
        "optimizer_state_bytes": state_size,  # held by process 0 (its shard under fsdp)
        "optimizer_state_bytes_per_param": state_all / trainable,  # per trainable parameter
        "parameters": parameters,  # trainable and total (4-bit weights count as the values they hold)
        "trainable_share": parameters["trainable"] / max(1, parameters["total"]),
        "peft": config.peft,  # adapter_bytes: the LoRA matrices and trained head, as adapter/ stores them
        "adapter_bytes": run.form.adapter_bytes(model),
        "gradient_checkpointing": plan.gradient_checkpointing,
        "transforms": run.transforms, "student": run.student,  # transforms applied; --student-layers' N of L
        # --compile: blocks, graphs and compile seconds of process 0 in this invocation (not in train_seconds).
        "compile": run.compiled.summary() if run.compiled else None,
        "grad_accum": plan.grad_accum,
        # --memory-budget: each loaded micro-batch ran as this many pieces (1: as loaded).
        "pieces_per_micro_batch": plan.pieces,
        # --memory-budget: what the planner predicted before the run (budget_bytes, predicted_peak_bytes
        # and in_use_bytes, the memory held before the model), to set against peak_memory_bytes.
        "memory_plan": {**plan.memory, "note": plan.note} if plan.memory else None,
        # Gradient all-reduces (DDP buckets) or parameter averagings (local SGD) of process 0; not
        # counted under fsdp (its gathers and reduce-scatters are FSDP2's own).
        **run.strategy.summary(run.wire),
    }


def write(run, result: dict) -> None:
    if not run.accelerator.is_main_process:
        return
    files.write_json(run.out_dir / "metrics.json", result)
    tokens_per_s = (f"{result['train_tokens_per_second']:.0f} tokens/s, "
                    if result["train_tokens_per_second"] is not None else "")
    best = result["best"]
    kept = (f"best validation {best['metric']} {best['value']:.4f} at step {best['step']}"
            + (" (in model/)" if best["kept_in_model"] else "") + "\n") if run.keeps_best and best["step"] else ""
    compiled = result.get("compile")
    compiled = (f" (compiling {compiled['graphs']} graph(s) took {compiled['seconds']:.1f} s more)"
                if compiled else "")
    run.accelerator.print(f"test: {console.short(result['test'])}\n{kept}"
                          f"{result['train_samples_per_second']:.1f} samples/s{compiled}, {tokens_per_s}"
                          f"peak memory {result['peak_memory_bytes'] / 2**20:.0f} MiB, "
                          f"{result['wall_seconds']:.1f} s in all\nsaved to {run.out_dir}")
