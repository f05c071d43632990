"""Does a causal LM learn under LoRA alone? A GPT-2-shaped model built from a config (2 layers, 64
wide) is first trained in full for 100 steps on sms-spam's texts (its base: effitrain train from the
config), then fine-tuned with `--peft lora` on bbc-news, another domain: validation perplexity on
bbc-news before (the base) and after the LoRA run, and the trainable share.

    .venv/bin/python benchmarks/peft_causal_lm.py [--lora-steps 120] [--out /tmp/peft_lm]

Why a base first: LoRA over a random frozen model hardly learns, measured (2 x 64, bbc-news, r 16,
60 steps): perplexity 27,769 -> 27,728. Its frozen, random, tied embeddings bound the logits
(ln_f normalises the hidden state, so no adapter can make any token much likelier than another).

Measured 2026-12-03 (2-core CPU): base 6,938 -> LoRA 4,005 after 120 steps (0.58x, 111 s), 3,927 after
240 (0.57x): it levels off above half, so issue 13's bar (perplexity halved) is not met by this setting.
"""

from __future__ import annotations

import argparse
import time

import effitrain
from effitrain.evaluate import evaluate

MODEL = "gpt2:n_layer=2,n_embd=64,n_head=2,n_positions=64"
COMMON = dict(task="causal-lm", max_length=64, batch_size=16, log_every=20, warmup_ratio=0.0, overwrite=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora-steps", type=int, default=120)
    parser.add_argument("--out", default="/tmp/peft_lm")
    args = parser.parse_args()
    start = time.perf_counter()
    effitrain.train(dict(COMMON, model=MODEL, data="sms-spam", max_train_samples=1600, max_eval_samples=16,
                         max_steps=100, lr=1e-2, output_dir=f"{args.out}/base"))
    base_seconds = time.perf_counter() - start
    before = evaluate(f"{args.out}/base/model", {"data": "bbc-news", "max_eval_samples": 48, "max_length": 64},
                      split="validation")
    start = time.perf_counter()
    after = effitrain.train(dict(COMMON, model=f"{args.out}/base/model", data="bbc-news", max_train_samples=1280,
                                 max_eval_samples=48, max_steps=args.lora_steps, lr=1e-2, peft="lora", lora_r=16,
                                 lora_alpha=32, output_dir=f"{args.out}/lora"))
    ratio = after["validation"]["perplexity"] / before["perplexity"]
    print(f"\nbase: {MODEL}, 100 full steps on sms-spam texts ({base_seconds:.0f} s)")
    print(f"LoRA r 16 on bbc-news, {args.lora_steps} steps, lr 1e-2 ({time.perf_counter() - start:.0f} s), "
          f"trainable {after['trainable_share']:.1%}")
    print(f"bbc-news validation perplexity: base {before['perplexity']:.0f} -> LoRA {after['validation']['perplexity']:.0f} "
          f"({ratio:.2f}x; the issue's bar: <= 0.50x)")


if __name__ == "__main__":
    main()
