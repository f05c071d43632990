"""The chat fine-tuning target on the built-in `sms-spam-chat`: a 4-layer Llama-shaped model from a config,
trained with the ChatML template, answers the held-out test prompts by generation. Prints test exact match
(the majority answer, `ham`, gives 0.860), the share of answers that stop at <|im_end|>, and the run's
seconds, against the bars exact match >= 0.95 and stop share >= 0.99 (exit 1 below them).

The command is README's and docs/data-and-tasks.md's example, run in this process through effitrain.train.

    .venv/bin/python benchmarks/chat_accuracy.py              # about 8 minutes on 2 idle Xeon cores
    .venv/bin/python benchmarks/chat_accuracy.py --dry-run    # 2 steps, 8 examples per split: seconds
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_common.py
import _common  # noqa: E402

MODEL = ("llama:hidden_size=128,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,"
         "intermediate_size=256,max_position_embeddings=256")
SETTINGS = {"model": MODEL, "task": "causal-lm", "data": "sms-spam-chat", "chat_template": "chatml",
            "max_length": 256, "batch_size": 32, "max_steps": 100, "lr": 2e-3, "precision": "bf16"}
BARS = {"exact_match": 0.95, "end_of_turn_share": 0.99}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="2 steps, 8 examples per split; no bars")
    args = parser.parse_args(argv)
    import effitrain

    settings = dict(SETTINGS)
    if args.dry_run:
        _common.dry_run_model()
        settings.update(max_steps=2, max_train_samples=8, max_eval_samples=8)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        test = effitrain.train({**settings, "output_dir": str(Path(folder) / "run")})["test"]
        seconds = time.perf_counter() - start
    print(f"test: exact match {test['exact_match']:.3f}, end-of-turn share {test['end_of_turn_share']:.3f} "
          f"over {test['samples']} prompts; loss {test['loss']:.4f}; {seconds:.0f} s in all")
    print(f"machine: {_common.machine(torch_version=True)}")
    if args.dry_run:
        return 0
    missed = [f"{name} {test[name]:.3f} < {bar}" for name, bar in BARS.items() if test[name] < bar]
    print("bars met" if not missed else "below the bars: " + "; ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
