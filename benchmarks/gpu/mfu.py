"""Model FLOPs utilisation (MFU) of a Llama-shaped model of about 1B parameters on one GPU, training
with bf16 autocast, fused AdamW and random tokens, with and without gradient checkpointing.

    python benchmarks/gpu/mfu.py                      # hidden 2048, 16 layers, 32 heads, seq 2048, batch 4
    python benchmarks/gpu/mfu.py --batch 8 --json mfu.json
    python benchmarks/gpu/mfu.py --peak-flops 756e12  # a GPU the table below does not know (H100 PCIe, ...)
    python benchmarks/gpu/mfu.py --dry-run            # any machine: check the arguments, build the full model on
                                                  # the meta device (its parameter count), run 1 step of a tiny one

The model comes from a transformers LlamaConfig (random weights, nothing downloaded); the training step
uses effitrain's own pieces: the causal-LM task's loss (tasks.get("causal-lm").loss_sum, the float
logits included), optimizers.classic.adamw (fused AdamW, no decay on norms) and models/transforms.py's gradient-checkpointing entry
(non-reentrant). Exit codes: 0 measured, 2 bad arguments or no GPU (one line, with the fix), 1 otherwise.

Never run on a GPU yet: no GPU has been lent to this project (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time


# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets, matched against
# torch.cuda.get_device_name(). H100 PCIe (756e12) and NVL differ from SXM: they are left out on purpose,
# so that an unlisted GPU needs --peak-flops rather than a wrong guess.
PEAK_BF16_FLOPS = [
    (r"H200", 989e12),
    (r"H100.*(SXM|HBM3)", 989e12),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"A100", 312e12),
    (r"\bL4\b", 121e12),  # not L40 / L40S
]
FULL = dict(hidden=2048, layers=16, heads=32, intermediate=5632, vocab=32000, seq=2048, batch=4)
TINY = dict(hidden=64, layers=2, heads=4, intermediate=160, vocab=256, seq=32, batch=2)  # the dry run's model


class BadArguments(Exception):
    """One line for the user, exit 2."""


def peak_flops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak from the table, or None for a GPU it does not list."""
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name):
            return flops
    return None


def flops_per_token(matmul_params: int, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs per trained token, the formula of PaLM (Chowdhery et al. 2022, "PaLM: Scaling Language
    Modeling with Pathways", Appendix B, arXiv:2204.02311): 6N + 12 L H Q T, where N is the number of
    parameters in matmuls (2 FLOPs per multiply-add, x3 for the forward and the two backward matmuls),
    and 12 L H Q T the attention scores and the weighted sum of the values (H heads x Q head size = hidden,
    T the sequence length), counted in full although the mask is causal, as PaLM does. N leaves out the
    input embedding (a look-up, no matmul) but counts the untied output layer, as torchtitan's
    get_nparams_and_flops does. These are model FLOPs: recomputation under checkpointing is not counted."""
    return 6 * matmul_params + 12 * layers * hidden * seq


def build_model(dims: dict, device):
    import torch
    from transformers import LlamaConfig

    from effitrain import tasks

    config = LlamaConfig(vocab_size=dims["vocab"], hidden_size=dims["hidden"], num_hidden_layers=dims["layers"],
                         num_attention_heads=dims["heads"], num_key_value_heads=dims["heads"],
                         intermediate_size=dims["intermediate"], max_position_embeddings=dims["seq"],
                         tie_word_embeddings=False, use_cache=False)
    with torch.device(device):  # initialised where it trains: a 1B model initialised on the CPU takes long
        model = tasks.get("causal-lm").auto_class.from_config(config, attn_implementation="sdpa")
    return model.float()


def parameter_counts(model) -> tuple[int, int]:
    """(all parameters, those in matmuls: all but the input embedding)."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.get_input_embeddings().weight.numel()


def train_steps(model, optimizer, batch, steps: int, device) -> tuple[float, float]:
    """`steps` optimizer steps on the same batch; (seconds, last loss). The loss is effitrain's causal-LM
    loss (a sum over predicted tokens) divided by their count, as a run's step computes it."""
    import torch

    from effitrain import tasks

    task = tasks.get("causal-lm")
    items = task.item_count(batch)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    started, loss = time.perf_counter(), torch.zeros(())
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = task.loss_sum(model, batch) / items
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize()
    return time.perf_counter() - started, float(loss.detach())


def measure(model, dims: dict, device, checkpointing: bool, warmup: int, steps: int, peak: float | None) -> dict:
    import torch

    from effitrain import tasks
    from effitrain.optimizers import classic as optim
    from effitrain.models import transforms

    # Checkpointing, on transformers' own layers (effitrain's speed-ups are for CPUs).
    settings = transforms.Settings(tasks.get("causal-lm"), device.type, checkpointing, speed_ups=False)
    model, _ = transforms.apply_all(model, settings)
    model.train()
    optimizer = optim.adamw(model, lr=1e-4, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, dims["vocab"], (dims["batch"], dims["seq"]), generator=generator).to(device)
    batch = {"input_ids": tokens, "labels": tokens}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"checkpointing": checkpointing, "batch": dims["batch"], "seq": dims["seq"]}
    try:
        train_steps(model, optimizer, batch, warmup, device)
        seconds, loss = train_steps(model, optimizer, batch, steps, device)
    except torch.cuda.OutOfMemoryError:
        return {**row, "error": f"out of memory at batch {dims['batch']} x {dims['seq']} (lower --batch)"}
    finally:
        del optimizer
    total, matmul = parameter_counts(model)
    per_token = flops_per_token(matmul, dims["layers"], dims["hidden"], dims["seq"])
    tokens_per_second = dims["batch"] * dims["seq"] * steps / seconds
    model_flops = per_token * tokens_per_second
    # Hardware FLOPs: checkpointing recomputes the forward (2 of the 6 per parameter), so 8/6 = 4/3 of them.
    hardware_flops = model_flops * (4 / 3 if checkpointing else 1)
    return {**row, "params": total, "matmul_params": matmul, "flops_per_token": per_token, "loss": loss,
            "step_seconds": seconds / steps, "tokens_per_second": tokens_per_second,
            "model_flops_per_second": model_flops, "hardware_flops_per_second": hardware_flops,
            "mfu": model_flops / peak if peak else None, "hfu": hardware_flops / peak if peak else None,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None}


def check(args) -> None:
    for name in ("hidden", "layers", "heads", "intermediate", "vocab", "seq", "batch", "steps"):
        if getattr(args, name) < 1:
            raise BadArguments(f"--{name} must be >= 1, got {getattr(args, name)}; fix: pass a positive --{name}")
    if args.warmup < 0:
        raise BadArguments(f"--warmup must be >= 0, got {args.warmup}; fix: pass --warmup 3")
    if args.hidden % args.heads:
        raise BadArguments(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}; fix: pass e.g. "
                           "--hidden 2048 --heads 32")
    if args.peak_flops is not None and not 0 < args.peak_flops < float("inf"):
        raise BadArguments(f"--peak-flops must be > 0, got {args.peak_flops}; fix: pass e.g. --peak-flops 989e12")


def table(rows: list[dict]) -> str:
    lines = [f"{'checkpointing':13} {'batch x seq':>11} {'s/step':>7} {'tokens/s':>9} {'model TFLOP/s':>13} "
             f"{'MFU':>6} {'HFU':>6} {'peak mem':>9} {'loss':>7}"]
    for r in rows:
        name = "yes" if r["checkpointing"] else "no"
        if "error" in r:
            lines.append(f"{name:13} {r['error']}")
            continue
        pct = lambda v: f"{v:6.1%}" if v is not None else f"{'n/a':>6}"  # noqa: E731
        mem = f"{r['peak_memory_bytes'] / 2**30:7.1f}Gi" if r["peak_memory_bytes"] is not None else f"{'n/a':>9}"
        lines.append(f"{name:13} {r['batch']:>4} x {r['seq']:<4} {r['step_seconds']:7.3f} "
                     f"{r['tokens_per_second']:9.0f} {r['model_flops_per_second'] / 1e12:13.1f} "
                     f"{pct(r['mfu'])} {pct(r['hfu'])} {mem} {r['loss']:7.3f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in FULL.items():
        parser.add_argument(f"--{name}", type=int, default=value, help=f"(default: {value})")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    parser.add_argument("--checkpointing", choices=("both", "off", "on"), default="both",
                        help="gradient checkpointing: measure without it, with it, or both (default)")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="the GPU's dense bf16 peak in FLOP/s (default: from the table of known GPUs)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, count the full model's "
                        "parameters on the meta device, train 1 step of a tiny model on the CPU (seconds)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check(args)
        return run(args)
    except BadArguments as err:
        print(f"mfu.py: error: {err}", file=sys.stderr)
        return 2


def run(args) -> int:
    from effitrain.runtime.libraries import quiet_import_warnings, quiet_libraries

    quiet_import_warnings()
    import torch

    quiet_libraries(debug=False)
    dims = {name: getattr(args, name) for name in FULL}
    variants = {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]
    if args.dry_run:
        full_params, full_matmul = parameter_counts(build_model(dims, "meta"))
        per_token = flops_per_token(full_matmul, dims["layers"], dims["hidden"], dims["seq"])
        print(f"dry run: the full model ({dims['hidden']} x {dims['layers']} layers) has {full_params / 1e9:.3f}B "
              f"parameters ({full_matmul / 1e9:.3f}B in matmuls), {per_token / 1e9:.2f} GFLOP per token at seq "
              f"{dims['seq']}; now 1 step of a tiny one on the CPU")
        dims, device, warmup, steps, name = TINY, torch.device("cpu"), 0, 1, "cpu (dry run)"
        peak = args.peak_flops
    else:
        if not torch.cuda.is_available():
            raise BadArguments("mfu.py measures a GPU, and torch sees none here; fix: run it on a machine with an "
                               "NVIDIA GPU, or pass --dry-run")
        device, warmup, steps = torch.device("cuda"), args.warmup, args.steps
        name = torch.cuda.get_device_name(device)
        peak = args.peak_flops or peak_flops(name)
        if peak is None:
            raise BadArguments(f"no bf16 peak known for {name!r}; fix: pass --peak-flops (its dense bf16 "
                               "FLOP/s, from the data sheet)")
    rows = []
    for checkpointing in variants:
        torch.manual_seed(0)
        model = build_model(dims, device)
        rows.append(measure(model, dims, device, checkpointing, warmup, steps, peak))
        del model
    print(f"{name}, peak bf16 {peak / 1e12:.0f} TFLOP/s" if peak else f"{name}, no peak given: MFU n/a")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": name, "peak_flops": peak, "dry_run": args.dry_run, "dims": dims,
                       "warmup": warmup, "steps": steps, "torch": torch.__version__, "cuda": torch.version.cuda,
                       "rows": rows}, out, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
