"""Does a causal LM learn under LoRA alone? Two runs on bbc-news's texts (validation perplexity before
and after, trainable share):

1. `--experiment random` (issue 13's bar): a Llama-shaped model built from a config (2 layers, 128
   wide, untied output layer), random weights, LoRA r 16 on every linear layer AND the output layer
   (`--lora-target-modules q_proj,...,down_proj,lm_head`), 120 steps, lr 1e-2.
2. `--experiment domain`: a GPT-2-shaped model (2 x 64) first trained in full for 100 steps on
   sms-spam's texts (its base), then `--peft lora` (all-linear, r 16) on bbc-news, another domain.

    .venv/bin/python benchmarks/techniques/peft_causal_lm.py [--experiment random|domain|both] [--lora-steps 120]
    .venv/bin/python benchmarks/techniques/peft_causal_lm.py --dry-run   # both, 1 step each, 16 examples

Why the output layer: LoRA over a random frozen model's all-linear hardly learns when the output
layer is frozen and random: measured (GPT-2 2 x 64, r 16, 60 steps) perplexity 27,769 -> 27,728, and a
Llama 2 x 256 over all-linear, 120 steps: 32,265 -> 18,683 (0.58x). The final norm bounds the hidden
state and the random output rows are nearly orthogonal, so no adapter of the body can make many tokens
much likelier. peft's all-linear leaves the output layer out; effitrain accepts it by name when it is
not tied to the input embeddings (a tied one cannot be merged into model/).

Measured 2026-12-03 (2-core CPU, other processes busy):
- random: 30,851 -> 1,462 after 120 steps (0.05x), trainable 6.4% (the output layer's adapter is
  r x (128 + 30,522)); tests/integration/test_peft.py checks a 64-wide one halves in 12 steps (30,814 -> 2,833).
- domain: base 6,938 -> LoRA 4,005 after 120 steps (0.58x, 111 s), 3,927 after 240 (0.57x).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import effitrain
from effitrain.commands.evaluate import evaluate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

MODEL = "gpt2:n_layer=2,n_embd=64,n_head=2,n_positions=64"
COMMON = dict(task="causal-lm", max_length=64, batch_size=16, log_every=20, warmup_ratio=0.0, overwrite=True)


RANDOM_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
# --dry-run: the same calls on fewer examples, the random Llama 32 wide (the suite's time)
SIZES = dict(train=1280, base_train=1600, evaluate=48, base_evaluate=16, hidden=128)
DRY_SIZES = dict(train=16, base_train=16, evaluate=8, base_evaluate=8, hidden=32)


def random_llama(out: str, steps: int, sizes: dict = SIZES) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from effitrain.models.loading import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=sizes["hidden"], intermediate_size=2 * sizes["hidden"],
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(f"{out}/random")
    tokenizer.save_pretrained(f"{out}/random")
    before = evaluate(f"{out}/random", {"data": "bbc-news", "max_eval_samples": sizes["evaluate"], "max_length": 64},
                      split="validation")
    start = time.perf_counter()
    after = effitrain.train(dict(COMMON, model=f"{out}/random", data="bbc-news", max_train_samples=sizes["train"],
                                 max_eval_samples=sizes["evaluate"], max_steps=steps, lr=1e-2, peft="lora", lora_r=16,
                                 lora_alpha=32, lora_target_modules=RANDOM_TARGETS, output_dir=f"{out}/random-lora"))
    ratio = after["validation"]["perplexity"] / before["perplexity"]
    print(f"\nrandom Llama 2 x {sizes['hidden']}, LoRA r 16 on {RANDOM_TARGETS}, {steps} steps, lr 1e-2 "
          f"({time.perf_counter() - start:.0f} s), trainable {after['trainable_share']:.1%}")
    print(f"bbc-news validation perplexity: {before['perplexity']:.0f} -> {after['validation']['perplexity']:.0f} "
          f"({ratio:.2f}x; the issue's bar: <= 0.50x)")


def domain(out: str, steps: int, base_steps: int = 100, sizes: dict = SIZES) -> None:
    start = time.perf_counter()
    effitrain.train(dict(COMMON, model=MODEL, data="sms-spam", max_train_samples=sizes["base_train"],
                         max_eval_samples=sizes["base_evaluate"], max_steps=base_steps, lr=1e-2,
                         output_dir=f"{out}/base"))
    base_seconds = time.perf_counter() - start
    before = evaluate(f"{out}/base/model", {"data": "bbc-news", "max_eval_samples": sizes["evaluate"],
                                             "max_length": 64}, split="validation")
    start = time.perf_counter()
    after = effitrain.train(dict(COMMON, model=f"{out}/base/model", data="bbc-news", max_train_samples=sizes["train"],
                                 max_eval_samples=sizes["evaluate"], max_steps=steps, lr=1e-2, peft="lora", lora_r=16,
                                 lora_alpha=32, output_dir=f"{out}/lora"))
    ratio = after["validation"]["perplexity"] / before["perplexity"]
    print(f"\nbase: {MODEL}, {base_steps} full steps on sms-spam texts ({base_seconds:.0f} s)")
    print(f"LoRA r 16 on bbc-news, {steps} steps, lr 1e-2 ({time.perf_counter() - start:.0f} s), "
          f"trainable {after['trainable_share']:.1%}")
    print(f"bbc-news validation perplexity: base {before['perplexity']:.0f} -> LoRA {after['validation']['perplexity']:.0f} "
          f"({ratio:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", choices=("random", "domain", "both"), default="both")
    parser.add_argument("--lora-steps", type=int, default=120)
    parser.add_argument("--out", default="/tmp/peft_lm")
    parser.add_argument("--dry-run", action="store_true",
                        help="both experiments, 1 step of each training on 16 examples (8 evaluated), in a "
                             "temporary folder; the random model 32 wide, its tokenizer from a tiny model "
                             "(benchmarks/_common.py)")
    args = parser.parse_args()
    base_steps, sizes = 100, SIZES
    if args.dry_run:
        _common.dry_run_model()
        folder = tempfile.TemporaryDirectory(prefix="peft_lm_")
        args.experiment, args.lora_steps, base_steps, args.out, sizes = "both", 1, 1, folder.name, DRY_SIZES
    if args.experiment in ("random", "both"):
        random_llama(args.out, args.lora_steps, sizes)
    if args.experiment in ("domain", "both"):
        domain(args.out, args.lora_steps, base_steps, sizes)


if __name__ == "__main__":
    main()
