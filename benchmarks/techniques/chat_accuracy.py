"""The chat fine-tuning target on the built-in `sms-spam-chat`: a 4-layer Llama-shaped model from a config,
trained with the ChatML template, answers the held-out test prompts by generation. Prints test exact match
(the majority answer, `ham`, gives 0.860), the share of answers that stop at <|im_end|>, and the run's
seconds, against the bars exact match >= 0.95 and stop share >= 0.99 (exit 1 below them).

The command is README's and docs/data-and-tasks.md's example, run in this process through effitrain.train.

`--lora`: the issue's second bar (exact match >= 0.90). The same model is first trained by plain language
modelling on the text of sms-spam-chat's training conversations (each conversation's contents, no template,
no roles: the same held-out rows as the chat run, so no test message is seen), then LoRA fine-tunes that
saved base on the chat data with `--chat-template chatml`, whose two tokens the base lacks: their rows are
trained in full (peft's trainable tokens, models/adapters.py), the rest of the base stays frozen.

    .venv/bin/python benchmarks/techniques/chat_accuracy.py              # about 8 minutes on 2 idle Xeon cores
    .venv/bin/python benchmarks/techniques/chat_accuracy.py --lora       # base then LoRA: about 2.5 minutes on 2 cores
    .venv/bin/python benchmarks/techniques/chat_accuracy.py --dry-run    # 2 steps, 8 examples per split: seconds
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

MODEL = ("llama:hidden_size=128,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,"
         "intermediate_size=256,max_position_embeddings=256")
SETTINGS = {"model": MODEL, "task": "causal-lm", "data": "sms-spam-chat", "chat_template": "chatml",
            "max_length": 256, "batch_size": 32, "max_steps": 100, "lr": 2e-3, "precision": "bf16"}
BARS = {"exact_match": 0.95, "end_of_turn_share": 0.99}
# --lora: the base's language modelling, then the adapters over it (all-linear, the new tokens' rows in full).
# The base needs 3.7 epochs (450 steps): after 150 or 300 it never preferred `spam` at the answer position and
# LoRA over it stayed at the majority's 0.860 (over 150: at any LoRA lr, length or rank tried); after 450 the
# base's own answer is right 0.98 and LoRA's 0.988.
BASE = {"model": MODEL, "task": "causal-lm", "max_length": 256, "batch_size": 32, "max_steps": 450, "lr": 2e-3,
        "precision": "bf16"}
LORA = {"task": "causal-lm", "data": "sms-spam-chat", "chat_template": "chatml", "max_length": 256, "batch_size": 32,
        "max_steps": 120, "lr": 2e-3, "precision": "bf16", "peft": "lora", "lora_r": 16, "lora_alpha": 32,
        "lora_dropout": 0.0, "lora_target_modules": "all-linear"}
LORA_BARS = {"exact_match": 0.90}


def text_view(folder: Path) -> dict[str, str]:
    """sms-spam-chat's splits as plain text (each conversation's contents, one turn a paragraph), held out
    as effitrain holds out the chat data (the default seed, which both runs keep): JSONL files for --data,
    --validation-file and --test-file."""
    import json

    from effitrain import tasks
    from effitrain.config import TrainConfig

    splits = tasks.get("causal-lm").load_data(TrainConfig(task="causal-lm", data="sms-spam-chat")).splits
    paths = {}
    for name, split in splits.items():
        paths[name] = str(folder / f"{name}.jsonl")
        with open(paths[name], "w") as out:
            for messages in split["messages"]:
                out.write(json.dumps({"text": "\n\n".join(m["content"] for m in messages)}) + "\n")
    return paths


def lora_over_a_trained_base(folder: Path, dry: dict, base_dir: str | None) -> tuple[dict | None, dict, float]:
    """(the base's validation metrics, None for a given base; the LoRA run's test metrics; seconds in all)."""
    import effitrain

    start = time.perf_counter()
    base = None
    if base_dir is None:
        text = text_view(folder)
        base = effitrain.train({**BASE, **dry, "data": text["train"], "validation_file": text["validation"],
                                "test_file": text["test"], "output_dir": str(folder / "base")})["validation"]
        base_dir = str(folder / "base" / "model")
    test = effitrain.train({**LORA, **dry, "model": base_dir, "output_dir": str(folder / "lora")})["test"]
    return base, test, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="2 steps, 8 examples per split; no bars")
    parser.add_argument("--lora", action="store_true", help="LoRA over a base first trained on the text alone")
    parser.add_argument("--base", help="--lora over this base (the model/ folder of an earlier first stage) "
                                       "instead of training one")
    args = parser.parse_args(argv)
    import effitrain

    dry = {}
    if args.dry_run:
        _common.dry_run_model()
        dry = {"max_steps": 2, "max_train_samples": 8, "max_eval_samples": 8}
    with tempfile.TemporaryDirectory() as folder:
        if args.lora:
            base, test, seconds = lora_over_a_trained_base(Path(folder), dry, args.base)
            if base is not None:
                print(f"base (language modelling on the text): validation loss {base['loss']:.4f}, "
                      f"perplexity {base['perplexity']:.2f}")
        else:
            start = time.perf_counter()
            test = effitrain.train({**SETTINGS, **dry, "output_dir": str(Path(folder) / "run")})["test"]
            seconds = time.perf_counter() - start
    print(f"test: exact match {test['exact_match']:.3f}, end-of-turn share {test['end_of_turn_share']:.3f} "
          f"over {test['samples']} prompts; loss {test['loss']:.4f}; {seconds:.0f} s in all")
    print(f"machine: {_common.machine(torch_version=True)}")
    if args.dry_run:
        return 0
    bars = LORA_BARS if args.lora else BARS
    missed = [f"{name} {test[name]:.3f} < {bar}" for name, bar in bars.items() if test[name] < bar]
    print("bars met" if not missed else "below the bars: " + "; ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
