"""Preference tuning's targets on the built-in `sms-spam-preference`: held-out preference accuracy before
and after DPO, and DPO's memory against SFT's.

Accuracy (the default): a 4-layer Llama-shaped model from a config (benchmarks/techniques/chat_accuracy.py's model and
SFT settings) is first fine-tuned by effitrain on `sms-spam-chat`, then trained by DPO (`--preference dpo`,
the reference precomputed) on `sms-spam-preference`; both split the messages by the same seed, so no
held-out message is trained on. A second DPO run starts from the base model (random weights, never
fine-tuned), since a well fine-tuned model already prefers the right answer. Two accuracies on the test
pairs (487):
- the model's own preference: the share of pairs whose chosen answer (with its <|im_end|>) has a higher
  summed log-prob than the rejected one (before DPO: the reference's log-probs that DPO precomputed and
  stored in the run folder; after: the trained model's, computed the same way);
- DPO's `preference_accuracy` (metrics.json): the share of pairs whose implicit reward beta x (log p -
  log p_ref) is higher for the chosen answer. It is 0 before any training (policy = reference: every pair
  ties), so the "before" figure is the first.
Bar: the model's own preference >= 0.9 after DPO (and about 0.5, i.e. not better than chance, before).

Memory (`--memory`): peak training memory of DPO against SFT on the same model (Llama-shaped, 4 layers,
hidden 256) and the same sequences per step (DPO's micro-batch of b pairs is 2b sequences; SFT's is 2b
conversations): SFT with LoRA vs DPO with LoRA (reference: the adapters switched off), bar <= 1.15x; SFT
full fine-tuning vs DPO with the reference precomputed, bar <= 1.1x. Each run is a fresh
`train --memory-budget 64GiB` process (the budget never binds) on generated pairs whose every sequence is
about --max-length long (so every micro-batch is full length, as the planner assumes); the measured peak is
peak RSS minus the RSS when the run planned (metrics.json's memory_plan.in_use_bytes), set against the
planner's prediction (bar: within 15%), as benchmarks/planner/memory_plan.py --runs does.

    .venv/bin/python benchmarks/techniques/preference_accuracy.py            # SFT, then DPO from it and from the base
                                                                             # (~1 hour on 2 busy cores)
    .venv/bin/python benchmarks/techniques/preference_accuracy.py --start base  # DPO from the base model only
    .venv/bin/python benchmarks/techniques/preference_accuracy.py --memory   # the 4 memory runs
    .venv/bin/python benchmarks/techniques/preference_accuracy.py --dry-run  # both, tiny: DPO from the SFT model; DPO +
                                                                             # LoRA
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

MiB = 2**20
MODEL = ("llama:hidden_size=128,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,"
         "intermediate_size=256,max_position_embeddings=256")
SFT = {"model": MODEL, "task": "causal-lm", "data": "sms-spam-chat", "chat_template": "chatml", "max_length": 256,
       "batch_size": 32, "max_steps": 100, "lr": 2e-3, "precision": "bf16", "max_eval_samples": 32}
DPO = {"task": "causal-lm", "data": "sms-spam-preference", "preference": "dpo", "beta": 0.1, "reference": "precompute",
       "max_length": 256, "batch_size": 16, "max_steps": 60, "lr": 1e-3, "precision": "bf16", "eval_batch_size": 64,
       "max_train_samples": 960}  # the pairs 60 steps of 16 take: the reference pass computes no others
BAR_AFTER = 0.9
DRY_RUN = {"max_steps": 2, "max_train_samples": 8, "max_eval_samples": 8, "max_length": 64}
DRY_MODEL = "llama:hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2"

MEMORY_MODEL = "llama:hidden_size=256,intermediate_size=688,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2"
MEMORY_PAIRS, MEMORY_LENGTH, MEMORY_STEPS = 4, 256, 6  # b pairs (2b sequences) of about MEMORY_LENGTH tokens
# name, objective, peft, reference
MEMORY_RUNS = [("sft-lora", None, "lora", None), ("dpo-lora", "dpo", "lora", "adapters"),
               ("sft-full", None, "none", None), ("dpo-precompute", "dpo", "none", "precompute")]
MEMORY_BARS = {("dpo-lora", "sft-lora"): 1.15, ("dpo-precompute", "sft-full"): 1.10}
PLAN_BAR = 0.15


# --- accuracy -----------------------------------------------------------------------------------------


def own_preference(logps) -> float:
    """The share of pairs ([pairs, 2] summed answer log-probs: chosen, rejected) whose chosen answer is
    the likelier."""
    return float((logps[:, 0] > logps[:, 1]).double().mean())


def stored_reference(run_dir: Path, split: str = "test"):
    """The starting model's log-probs DPO precomputed for `split` (the run folder's file)."""
    from safetensors.torch import load_file

    from effitrain.outputs.run_folder import REFERENCE_LOGPS

    return load_file(str(run_dir / REFERENCE_LOGPS))[split]


def model_logps(model_dir: Path, settings: dict, split: str = "test"):
    """A saved model's [pairs, 2] summed answer log-probs over a split of the preference data, through
    effitrain's own preference pieces (the split, encoding and log-probs DPO trains with), in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.tasks import reference

    config = TrainConfig(**{**{k: v for k, v in settings.items() if k not in ("reference", "beta")},
                            "model": str(model_dir), "preference": "orpo", "chat_template": None})
    task = tasks.for_config(config)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    encoded = task.preprocess(task.load_data(config).splits, tokenizer, config, None)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    collate, _ = task.collators(tokenizer, config)
    return reference.compute(model, encoded[split], collate, config.eval_batch_size, task.answer_logps)


def train(settings: dict, out_dir: Path) -> tuple[dict, float]:
    import effitrain

    start = time.perf_counter()
    metrics = effitrain.train({**settings, "output_dir": str(out_dir)})
    return metrics, time.perf_counter() - start


def accuracy(args) -> int:
    sft, dpo, base = dict(SFT), dict(DPO), MODEL
    if args.dry_run:
        sft.update(DRY_RUN, model=DRY_MODEL)
        dpo.update(DRY_RUN)
        base = DRY_MODEL
    rows, folder = [], Path(tempfile.mkdtemp(prefix="preference_accuracy_"))
    try:
        starts = [("SFT model", {"model": str(folder / "sft" / "model")}),
                  ("base model (no SFT)", {"model": base, "chat_template": "chatml"})]
        starts = starts[:1] if args.dry_run else [s for s in starts if args.start in ("both", s[0].split()[0].lower())]
        if args.start != "base":
            print(f"SFT on sms-spam-chat: {json.dumps(sft)}", flush=True)
            sft_metrics, seconds = train(sft, folder / "sft")
            print(f"  {seconds:.0f} s; test exact match {sft_metrics['test'].get('exact_match', float('nan')):.3f}",
                  flush=True)
        for start_name, start in starts:  # a dry run: from the SFT model
            settings = {**dpo, **start}
            run_dir = folder / ("dpo-from-sft" if start_name.startswith("SFT") else "dpo-from-base")
            print(f"DPO from the {start_name}: {json.dumps(settings)}", flush=True)
            metrics, seconds = train(settings, run_dir)
            before = own_preference(stored_reference(run_dir))
            after = own_preference(model_logps(run_dir / "model", settings))
            test = metrics["test"]
            rows.append((start_name, before, after, test["preference_accuracy"], test["reward_margin"], seconds,
                         test["samples"]))
            print(f"  {seconds:.0f} s; own preference {before:.3f} -> {after:.3f}; DPO preference_accuracy "
                  f"{test['preference_accuracy']:.3f}, reward margin {test['reward_margin']:.3f}", flush=True)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    print()
    _common.print_columns(("DPO from", "test pairs", "own preference before", "after", "DPO preference_accuracy",
                           "reward margin", "DPO seconds"),
                          [(name, str(n), f"{b:.3f}", f"{a:.3f}", f"{p:.3f}", f"{m:.3f}", f"{s:.0f}")
                           for name, b, a, p, m, s, n in rows])
    print(f"machine: {_common.machine(torch_version=True)}")
    if args.dry_run:
        return 0
    missed = [f"from the {name}: {a:.3f} < {BAR_AFTER}" for name, _, a, *_ in rows if a < BAR_AFTER]
    print("bar met (own preference >= 0.9 after DPO)" if not missed else "below the bar: " + "; ".join(missed))
    return 1 if missed else 0


# --- memory -------------------------------------------------------------------------------------------


def memory_data(folder: Path, length: int, rows: int) -> tuple[Path, Path]:
    """Generated data where every sequence is about `length` tokens of the default tokenizer: a prompt of
    bbc-news words cut to length - 8 tokens, answers `yes` / `no`. The same prompts and chosen answers as
    SFT prompt-completion data and as preference pairs."""
    from transformers import AutoTokenizer

    from effitrain.data import builtins
    from effitrain.models.loading import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    texts = builtins.bbc_news()["all"]["text"][:rows]
    prompts = [tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:length - 8]) for text in texts]
    sft, pairs = folder / "sft.jsonl", folder / "pairs.jsonl"
    sft.write_text("".join(json.dumps({"prompt": p, "completion": "yes"}) + "\n" for p in prompts))
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": "yes", "rejected": "no"}) + "\n" for p in prompts))
    return sft, pairs


def memory_settings(run, data: dict, out_dir: str, dry_run: bool) -> dict:
    name, objective, peft, reference = run
    settings = {"model": MEMORY_MODEL, "task": "causal-lm", "data": str(data["pairs" if objective else "sft"]),
                "batch_size": MEMORY_PAIRS if objective else 2 * MEMORY_PAIRS, "max_length": MEMORY_LENGTH,
                "precision": "fp32", "peft": peft, "memory_budget": "64GiB", "max_steps": MEMORY_STEPS,
                "max_eval_samples": 4, "eval_batch_size": 4, "output_dir": out_dir, "overwrite": True}
    if objective:
        settings.update(preference=objective, reference=reference)
    if dry_run:
        settings.update(model=DRY_MODEL, max_length=32, max_steps=2)
    return settings


def memory_child(settings: dict) -> None:
    """In a fresh process: the run, its peak and the planner's numbers as one JSON line."""
    import effitrain

    metrics = effitrain.train(settings)
    plan = metrics.get("memory_plan") or {}
    print(json.dumps({"peak": metrics["peak_memory_bytes"], "in_use": plan.get("in_use_bytes"),
                      "predicted": plan.get("predicted_peak_bytes"), "note": plan.get("note")}))


def memory(args) -> int:
    _common.run_under_effitrains_allocator()  # the runs under the allocator `effitrain train` gets
    with tempfile.TemporaryDirectory(prefix="preference_memory_") as tmp:
        length = 32 if args.dry_run else MEMORY_LENGTH
        sft, pairs = memory_data(Path(tmp), length, 64)
        data, measured = {"sft": sft, "pairs": pairs}, {}
        for run in MEMORY_RUNS[1:2] if args.dry_run else MEMORY_RUNS:  # a dry run: DPO with LoRA alone
            settings = memory_settings(run, data, str(Path(tmp) / run[0]), args.dry_run)
            print(f"running {run[0]} in a fresh process ...", flush=True)
            out = _common.child_json([sys.executable, __file__, "--memory-child", json.dumps(settings)],
                                     {**os.environ, "HF_HUB_OFFLINE": "1"})
            out["measured"] = out["peak"] - out["in_use"]
            measured[run[0]] = out
    rows = [(name, mib(m["peak"]), mib(m["in_use"]), mib(m["measured"]), mib(m["predicted"]),
             f"{m['predicted'] / m['measured'] - 1:+.1%}" if m["predicted"] else "-") for name, m in measured.items()]
    print()
    _common.print_columns(("run", "peak RSS", "RSS at planning", "measured (peak - at planning)", "predicted",
                           "plan error"), rows)
    print()
    missed = []
    for (ours, base), bar in MEMORY_BARS.items():
        if ours not in measured or base not in measured:
            continue
        for what, key in (("peak RSS", "peak"), ("training peak", "measured")):
            ratio = measured[ours][key] / measured[base][key]
            print(f"{ours} / {base} {what}: {ratio:.3f}x (bar <= {bar}x)")
            if key == "peak" and ratio > bar:
                missed.append(f"{ours} / {base} {ratio:.3f}x")
    errors = [m["predicted"] / m["measured"] - 1 for m in measured.values() if m["predicted"]]
    missed += [f"plan error {e:+.1%}" for e in errors if abs(e) > PLAN_BAR]
    print(f"machine: {_common.machine(torch_version=True)}")
    if args.dry_run:
        return 0
    print("bars met" if not missed else "below the bars: " + "; ".join(missed))
    return 1 if missed else 0


def mib(value) -> str:
    return _common.mib(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", action="store_true", help="the memory runs instead of the accuracy runs")
    parser.add_argument("--start", choices=("both", "sft", "base"), default="both",
                        help="DPO from the SFT model, from the base model, or both (default)")
    parser.add_argument("--dry-run", action="store_true", help="both parts, a tiny model, 2 steps; no bars")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child is not None:
        memory_child(json.loads(args.memory_child))
        return 0
    if args.dry_run:  # the re-execution under effitrain's allocator first: memory() would start the script again
        _common.run_under_effitrains_allocator()
        _common.dry_run_model()
        return accuracy(args) or memory(args)
    return memory(args) if args.memory else accuracy(args)


if __name__ == "__main__":
    sys.exit(main())
