"""Peak tensor memory of one training step: full fine-tuning against LoRA and QLoRA, with and without
gradient checkpointing, on the default model (all-MiniLM-L6-v2, 2 labels) at micro-batch 16 x 128.

Why this and not the resident set: on a CPU the process's peak RSS also counts what the C allocator
keeps of freed memory, and that depends on the allocator, not on the method. Measured on the default job
(`peft_vs_full.py --quick --methods full,lora`, training peak RSS, same machine, 2026-12-03):

    allocator             full       LoRA     LoRA / full
    glibc (default)     1640 MiB   1803 MiB     1.10
    jemalloc (preload)  1449 MiB   1275 MiB     0.88
    tcmalloc (preload)  1454 MiB   1305 MiB     0.90

LoRA makes many more short-lived full-size tensors than full fine-tuning (each adapted layer's
delta, scaled, added); glibc's heap fragments around the long-lived saved activations and keeps the
holes. A GPU's caching allocator reports what tensors hold (`torch.cuda.max_memory_allocated`): this
script measures the same on a CPU, from the profiler's allocation events (each op's own allocations
and frees, in order), on top of what lives between steps (weights, optimizer state). Step 1 creates
the optimizer state; step 2 is measured.

    .venv/bin/python benchmarks/techniques/peft_memory.py [--methods full,lora,qlora] [--batch 16] [--length 128]
    .venv/bin/python benchmarks/techniques/peft_memory.py --dry-run   # a tiny model, 2 x 16 tokens: seconds

Check of the method: the "between steps" column must equal weights + optimizer state counted from
the tensors themselves (it is computed that way), and the profiler's events over a step must sum to
about zero (printed as "leak": what the step left allocated; the gradients are freed by zero_grad).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

METHODS = ("full", "lora", "qlora")


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        if tensor.data_ptr() not in seen:  # tied weights count once
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def live_between_steps(model, optimizer) -> int:
    state = [value for values in optimizer.state.values() for value in values.values() if torch.is_tensor(value)]
    return tensor_bytes(list(model.parameters()) + list(model.buffers()) + state)


def build(method: str, checkpointing: bool):
    from transformers import AutoModelForSequenceClassification

    from effitrain import tasks
    from effitrain.models import adapters, transforms
    from effitrain.models.loading import default_model_dir

    task = tasks.get("sequence-classification")
    options = {}
    if method == "qlora":
        options = {"quantization_config": adapters.quantization_config("fp32", ["classifier"]),
                   "device_map": {"": "cpu"}}
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(default_model_dir()), num_labels=2, **options)
    # Checkpointing and adapters as effitrain applies them, on transformers' own layers (no CPU speed-ups).
    settings = transforms.Settings(task, gradient_checkpointing=checkpointing,
                                   peft=None if method == "full" else adapters.Peft(method), speed_ups=False)
    model, _ = transforms.apply_all(model, settings)
    return model.train()


def measure(method: str, checkpointing: bool, batch: int, length: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    model = build(method, checkpointing)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (batch, length), generator=generator)
    labels = torch.randint(0, 2, (batch,), generator=generator)

    def step():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    between = live_between_steps(model, optimizer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # Each op's own allocations (+) and frees (-), in the order the ops started.
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"between": between, "peak": between + peak, "leak": running, "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model (benchmarks/_common.py), batch 2 x 16")
    args = parser.parse_args()
    if args.dry_run:
        _common.dry_run_model()
        args.batch, args.length = 2, 16
    from effitrain.runtime.libraries import quiet_import_warnings

    quiet_import_warnings()
    rows, full = [], {}
    for checkpointing in (False, True):
        for method in args.methods.split(","):
            figures = measure(method, checkpointing, args.batch, args.length)
            full.setdefault(checkpointing, figures if method == "full" else None)
            rows.append((method + (" + checkpointing" if checkpointing else ""), figures,
                         full[checkpointing]))
    mib = 2**20
    print(f"\ndefault model, micro-batch {args.batch} x {args.length}, AdamW, fp32, one training step\n")
    print("| method | trainable | between steps | peak in a step | peak / full's | leak |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, figures, reference in rows:
        ratio = f"{figures['peak'] / reference['peak']:.2f}" if reference else "-"
        print(f"| {name} | {figures['trainable']:,} | {figures['between'] / mib:.1f} MiB | "
              f"{figures['peak'] / mib:.1f} MiB | {ratio} | {figures['leak'] / mib:.1f} MiB |")


if __name__ == "__main__":
    main()
