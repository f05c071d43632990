"""A LoRA training step against a full fine-tuning step, in one process, and where each millisecond goes.

The default model (all-MiniLM-L6-v2) trains on one random batch of `--batch-size` x `--length` tokens
(all real), one whole step each (forward, loss, backward, fused AdamW over what trains, zero_grad),
every variant built through models/transforms.py with effitrain's CPU speed-ups, from the same weights,
with the default job's LoRA settings (r 8, alpha 16, all-linear; dropout `--lora-dropout`, 0.05):

  full        full fine-tuning (every weight trains)
  peft        peft's own lora.Linear forward and nn.Dropout (CPU `bernoulli_` masks; each adapter keeps
              its dropped copy of the input and its mask for the backward)
  recompute   effitrain before issue 31: peft's dropout + lora_A recomputed in the backward under a
              checkpoint (the same torch masks drawn twice; only the shared input kept)
  fast-mask   peft's forward with speedups/dropout.py's Dropout as each adapter's dropout: the change
              of the mask's draw alone (drawn once with keep_mask, the scaled mask kept)
  effitrain   speedups/adapter_step.py (the `adapter-step` transform), what `effitrain train --peft lora` runs: the fast mask drawn
              once and kept with the dropped input, no cast of the input per adapter, the adapter's
              product added into the base output by one addmm
  lean        adapter_step with the dropped input recomputed in the backward from x and the mask (one
              multiply per adapter) instead of kept: less memory
  p0          effitrain with --lora-dropout 0 (the default): what all adapter dropout costs
  p0-nodes    p0 with the base's and the adapter's products as separate autograd nodes (before the
              frozen base and its adapter became one node, speedups/adapter_step._AdaptedLinear)
  p0-cast     p0 with the frozen base cast to the compute dtype every step, as autocast casts it (before
              adapter_step kept the casts; the same as p0 in fp32, which casts nothing)
  qlora-peft  QLoRA (the base loaded in 4-bit nf4, dropout 0) with peft's own Linear4bit forward (the
              base's output copied, the adapter's scaled, then added)
  qlora       QLoRA as `effitrain train --peft qlora` runs it (the adapter added by one addmm)

Variants take turns (`--rounds` rounds of `--steps` steps each, after 2 warm-up steps each), so a
slower moment of the machine hits all of them; each turn starts with one untimed step (with
`--job-batches`, one untimed pass), since the first step after another variant's runs slower (a full
fine-tuning pass of the default job 1.2-1.7 s slower in 8.5 in bf16, a LoRA pass ~0.3 s: timing that
first pass made a bf16 LoRA step look 0.85-0.89x a full one where in steady state, one variant per
process, it is ~1.0x); medians, and the fastest steps, are compared with `full`. Saved for backward:
the bytes autograd keeps from one forward (distinct storages, through saved_tensors_hooks).
`--keep-freed-memory` makes glibc keep freed memory for reuse (speedups/allocator.py, as `effitrain train`
does on CPUs), for every variant. `--profile` then profiles 3 steps of `full`, `recompute`, `effitrain`, `p0` and `p0-cast` and prints milliseconds per
step in each group of operators, and the top operators.

    .venv/bin/python benchmarks/speedups/lora_step.py [--precision fp32|bf16] [--lora-dropout 0.05] [--profile]
        [--keep-freed-memory] [--variants full,effitrain,p0]
    .venv/bin/python benchmarks/speedups/lora_step.py --dry-run   # a tiny model, 1 step per variant, and --profile
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from speedups import dropout as dropout_bench  # noqa: E402  speedups/dropout.py: the same step, batch, flags

VARIANTS = ("full", "peft", "recompute", "fast-mask", "effitrain", "lean", "p0", "p0-nodes", "p0-cast", "qlora-peft",
            "qlora")
GROUPS = {
    "matrix products": {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise"},
    "dropout masks": {"aten::bernoulli_", "aten::uniform_", "aten::ge", "aten::ge_", "aten::div_",
                      "aten::native_dropout", "aten::native_dropout_backward", "_KeepMask", "_DroppedProjection"},
    "optimizer": {"aten::_fused_adamw_", "Optimizer.step#AdamW.step"},
    "casts and copies": {"aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous"},
    "element-wise": {"aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::gelu", "aten::gelu_backward",
                     "aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::_softmax",
                     "aten::_softmax_backward_data", "aten::tanh", "aten::tanh_backward", "aten::sum",
                     "aten::fill_", "aten::zero_", "aten::masked_fill_", "aten::where", "aten::embedding_dense_backward",
                     "aten::index_select", "aten::embedding_backward", "aten::div", "aten::threshold_backward"},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dropout_bench.batch_arguments(parser)
    parser.add_argument("--job-batches", type=int, default=0, metavar="N",
                        help="instead of one random batch: the default job's first N training batches (sms-spam, "
                             "batch 16, length grouping, seed 42), each variant stepping through all N per turn, "
                             "with the job's loss and gradient clipping at 1.0")
    parser.add_argument("--lora-dropout", type=float, default=0.05)
    parser.add_argument("--shape", choices=("default", "bert-base"), default="default",
                        help="bert-base: the default model's layers at BERT-base's shape instead (hidden 768, 12 "
                             "layers, 12 heads, feed-forward 3072; 109M parameters, random weights from seed 0), "
                             "to see how the LoRA / full ratio moves with the model's size (same tokens)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list (default: all)")
    dropout_bench.timing_arguments(parser, profile="also profile full, recompute, effitrain and p0")
    args = dropout_bench.parsed(parser, argv)
    if args.dry_run:
        args.job_batches = min(args.job_batches, 2)
    args.variants = [v for v in VARIANTS if v in args.variants.split(",")]
    return args


# --- effitrain before issue 31, kept here to measure against -------------------------------------------


def recompute_dropout(model) -> None:
    """adapters.lean_dropout as it was: each adapter's dropout and first matmul under a non-reentrant
    checkpoint (torch's masks, drawn again in the backward)."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, dropout in list(module.lora_dropout.items()):
                if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
                    module.lora_dropout[name] = torch.nn.Identity()
                    first = module.lora_A[name]
                    first.forward = functools.partial(_checkpointed, first, dropout.p)


def _checkpointed(linear, p, x):
    from torch.utils.checkpoint import checkpoint

    def dropped(x, weight):
        return torch.nn.functional.linear(torch.nn.functional.dropout(x, p, training=True), weight)

    return checkpoint(dropped, x, linear.weight, use_reentrant=False)


def fast_mask_dropout(model) -> None:
    """Each adapter's nn.Dropout as speedups/dropout.py's Dropout, peft's forward otherwise."""
    from peft.tuners.lora import LoraLayer

    from effitrain.speedups import dropout

    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, layer in list(module.lora_dropout.items()):
                if type(layer) is torch.nn.Dropout:
                    module.lora_dropout[name] = dropout.Dropout(layer.p)


# --- the variants ----------------------------------------------------------------------------------------


def build(name: str, base, p: float, precision: str = "fp32"):
    from effitrain import tasks
    from effitrain.optimizers import classic as optim
    from effitrain.models import adapters, transforms
    from effitrain.speedups import adapter_step

    task = tasks.get("sequence-classification")
    if name.startswith("qlora"):
        return build_qlora(name, task, precision)
    peft = None if name == "full" else adapters.Peft("lora", lora_dropout=0.0 if name.startswith("p0") else p)
    skip = ("adapter-step",) if name in ("peft", "recompute", "fast-mask") else ()
    model, _ = transforms.apply_all(copy.deepcopy(base), transforms.Settings(task, peft=peft), skip=skip)
    if name in ("recompute", "fast-mask"):
        (recompute_dropout if name == "recompute" else fast_mask_dropout)(model)
    elif name == "lean":
        adapter_step.apply(model, lean=True)
    elif name == "p0-nodes":
        adapter_step.apply(model, one_node=False)
    elif name == "p0-cast":
        adapter_step.apply(model, keep_half_casts=False)
    model.train()
    return model, optim.adamw(model, 1e-4 if name == "full" else 1e-3, 0.01)


def build_qlora(name: str, task, precision: str):
    from peft.tuners.lora.bnb import Linear4bit
    from transformers import AutoModelForSequenceClassification

    from effitrain.optimizers import classic as optim
    from effitrain.models import adapters, loading, transforms

    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(
        str(loading.resolve("default")), num_labels=2, attn_implementation="sdpa",
        quantization_config=adapters.quantization_config(precision, ["classifier"]))
    model, _ = transforms.apply_all(base, transforms.Settings(task, peft=adapters.Peft("qlora", lora_dropout=0.0)))
    if name == "qlora-peft":
        for module in model.modules():
            if type(module) is Linear4bit:
                del module.forward  # adapter_step's bound forward: peft's class method again
    model.train()
    return model, optim.adamw(model, 1e-3, 0.01)


def bert_base_shaped(config):
    """The default model's configuration (vocabulary, dropout, positions) at BERT-base's shape, random weights."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(config)
    config.update({"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072})
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


def job_batches(count: int, batch_size: int) -> list[dict]:
    """The default job's first `count` training batches, as `effitrain train` makes them (its data, tokenizer,
    length-grouped sampler and collator, seed 42)."""
    from torch.utils.data import DataLoader

    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.data import text
    from effitrain.models import loading

    task, config = tasks.get("sequence-classification"), TrainConfig(batch_size=batch_size)
    tokenizer = task.load_processor(loading.resolve_source("default"))
    loaded = task.load_data(config)
    encoded = task.preprocess(loaded.splits, tokenizer, config, loaded.base_dir)
    collate, _ = task.collators(tokenizer, config)
    loader = DataLoader(encoded["train"], batch_size=batch_size, collate_fn=collate,
                        sampler=text.train_sampler(encoded["train"], batch_size, config.group_by_length, config.seed))
    return [batch for _, batch in zip(range(count), loader)]


def make_job_step(model, optimizer, batches: list[dict], precision: str):
    """One pass over `batches`, each an optimizer step as the default job's: the task's loss (mean over the
    batch), backward, clipping at 1.0, AdamW, zero_grad."""
    from effitrain import tasks

    task = tasks.get("sequence-classification")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]

    def steps() -> None:
        for batch in batches:
            with autocast:
                loss = task.loss_sum(model, batch) / task.item_count(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return steps


def saved_bytes(model, batch: dict, precision: str) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward."""
    storages, weights = {}, {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:  # the weights are held anyway
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    del logits
    return sum(storages.values())


def group_of(key: str) -> str:
    return next((group for group, keys in GROUPS.items() if key in keys), "other")


def profile(step, calls: int = 3, steps_per_call: int = 1) -> tuple[dict, list, float]:
    """ms per optimizer step in each group of operators (self time), the top operators, and the profiled ms
    per step, over `calls` calls of `step` (each `steps_per_call` optimizer steps)."""
    events = _common.profiled_events(step, calls)
    per = calls * steps_per_call
    groups = {group: 0.0 for group in (*GROUPS, "other")}
    for e in events:
        groups[group_of(e.key)] += e.self_cpu_time_total / per / 1e3
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
    return groups, [(e.key, e.self_cpu_time_total / per / 1e3, e.count // per) for e in top], sum(groups.values())


def main(argv=None) -> None:
    args = parse_args(argv)
    dropout_bench.start(args)
    from transformers import AutoModelForSequenceClassification

    from effitrain.models import loading

    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(str(loading.resolve("default")), num_labels=2,
                                                              attn_implementation="sdpa")
    if args.shape == "bert-base":
        base = bert_base_shaped(base.config)
    torch.manual_seed(1)
    batch = dropout_bench.batch_of(args.batch_size, args.length)
    built = {name: build(name, base, args.lora_dropout, args.precision) for name in args.variants}
    if args.job_batches:  # a "step" is then a pass over the job's batches
        batches = job_batches(args.job_batches, args.batch_size)
        steps = {name: make_job_step(model, optimizer, batches, args.precision)
                 for name, (model, optimizer) in built.items()}
        widths = [batch["input_ids"].shape[1] for batch in batches]
        shape = f"the default job's first {len(batches)} batches of {args.batch_size} ({min(widths)}-{max(widths)} " \
                f"tokens wide, {sum(widths) / len(widths):.0f} on average; ms per pass over them)"
    else:
        steps = {name: dropout_bench.make_step(model, optimizer, batch, args.precision)
                 for name, (model, optimizer) in built.items()}
        shape = f"{args.batch_size} x {args.length} tokens"
    # one untimed step at each turn: the first step after another variant's is slower (see the module's doc)
    times = _common.timed_turns(steps, args.rounds, args.steps, warmup=1 if args.job_batches else 2)
    model_name = "default model" if args.shape == "default" else \
        "the default model at BERT-base's shape (random weights)"
    print(f"{model_name}, {shape}, {args.precision}, lora dropout "
          f"{args.lora_dropout}, {_common.machine()}{', glibc keeping freed memory' if args.keep_freed_memory else ''}, {args.rounds} rounds x {args.steps} steps each, median step time")
    reference = statistics.median(times[args.variants[0]])
    fastest = min(times[args.variants[0]])  # the least disturbed step: on a busy machine, the steadier ratio
    print(f"  {'variant':10s} {'ms/step':>8s}  {'x ' + args.variants[0]:>8s}  {'fastest':>8s}  {'x':>6s}  "
          "saved for backward")
    for name, measured in times.items():
        median = statistics.median(measured)
        saved = saved_bytes(built[name][0], batch, args.precision)
        print(f"  {name:10s} {median * 1000:8.1f}  {median / reference:8.2f}  {min(measured) * 1000:8.1f}  "
              f"{min(measured) / fastest:6.2f}  {saved / 2**20:8.0f} MiB")
    if args.profile:
        profiled = [name for name in ("full", "recompute", "effitrain", "p0", "p0-cast") if name in steps]
        found = {name: profile(steps[name], *((1, len(batches)) if args.job_batches else ())) for name in profiled}
        print("profiled (self time, ms per step): " + "  ".join(f"{name} {found[name][2]:.1f}" for name in profiled))
        for group in (*GROUPS, "other"):
            print(f"  {group:18s}" + "".join(f" {found[name][0][group]:9.1f}" for name in profiled))
        for name in profiled:
            print(f"  top of {name}: " + ", ".join(f"{key.removeprefix('aten::')} {ms:.1f} ({count})"
                                                  for key, ms, count in found[name][1]))


if __name__ == "__main__":
    main()
