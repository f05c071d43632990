"""What both sides of a peer comparison (vs_trainer.py, vs_trl.py, vs_trl_preference.py) start from and how
each runs: the peer library there or the dry run's effitrain side alone, the versions, the Llama-shaped model
and BPE tokenizer the TRL comparisons train, effitrain's own split of the data, the batch order both sides
draw, the digest that shows they drew the same batch, effitrain's step observer, and one run in a fresh
process. Not a benchmark of its own: equal starts are what make the figures comparable, so they are written
once."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import cpu_snapshot, rss_peak_bytes  # benchmarks/ is on sys.path: this module is imported as peers._sides

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ChatML's tokens, special in the BPE tokenizer


def require_peer(parser, args, module: str, name: str, alone: str) -> None:
    """The peer library must be installed for a comparison; a dry run without it runs effitrain's sides only
    (`alone` where none is left). Checked in the parent: its children run one side each."""
    if args.only is not None or importlib.util.find_spec(module) is not None:
        return
    if not args.dry_run:
        parser.error(f"{name} is not installed: pip install -e '.[bench]' (the pinned version)")
    print(f"dry run: {name} is not installed (pip install -e '.[bench]'): the effitrain side only", flush=True)
    args.sides = [side for side in args.sides if not side.startswith(module)] or [alone]


def versions() -> dict:
    """The versions both sides run on."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def make_model(folder: Path, vocab: int, seed: int, template: str, tiny: bool = False) -> dict:
    """A byte-level BPE tokenizer trained on the SMS messages (ChatML's tokens special, `template` set) and a
    Llama-shaped model from a config, random weights from `seed`, saved to `folder`: both sides load it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from effitrain.data import builtins

    texts = list(builtins.sms_spam()["all"]["text"]) + [builtins.SPAM_QUESTION, "user assistant spam ham"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                                           show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        extra_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = template
    shape = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64) if tiny else \
        dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=688)
    config = LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=shape["num_attention_heads"],
                         max_position_embeddings=1024, tie_word_embeddings=False, attention_dropout=0.0,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"vocab": len(tokenizer), "parameters": sum(p.numel() for p in model.parameters()), **shape}


def effitrain_splits(**settings):
    """effitrain train's split of the built-in data under `settings` (TrainConfig's fields): test then
    validation held out, by seed. The peer is given those very rows."""
    from effitrain import tasks
    from effitrain.config import TrainConfig

    config = TrainConfig(**settings)
    return tasks.get(config.task).load_data(config).splits


def in_effitrains_order(sampler, seed: int):
    """The Trainer's length-grouped sampler seeded as effitrain seeds its own (seed, epoch 0): the same batches,
    index for index. Left to itself it draws from torch's global generator, whose state by then depends on what
    the set-up drew (the head's initialisation): another order, another amount of padding."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    if isinstance(sampler, LengthGroupedSampler):
        sampler.generator = torch.Generator().manual_seed(seed)
    return sampler


def step_clock(ends: list[float]):
    """A Trainer callback appending each optimizer step's end (perf_counter) to `ends`."""
    import transformers

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    return Clock()


def digest(examples: list) -> str:
    """A short hash of a batch's examples, whatever their order: the sides trained on the same batch when their
    digests are equal."""
    return hashlib.sha256(json.dumps(sorted(examples)).encode()).hexdigest()[:16]


class Observer:
    """effitrain's callbacks (engine/callbacks.py) feeding a step log (vs_trl.py's or vs_trl_preference.py's
    StepLog): each step's batch, end and loss; the peak RSS and CPU when the loop ends."""

    def __init__(self, log):
        self.log = log
        self.rss = self.cpu_end = None

    def on_step_begin(self, state, group):
        for batch in group:
            if batch is not None:
                self.log.batch(batch)

    def on_step_end(self, state, result):
        self.log.ends.append(time.perf_counter())
        loss_sum, items = (float(x) for x in result.window[:2])
        self.log.step_loss(loss_sum / items)

    def on_train_end(self, state):
        self.rss, self.cpu_end = rss_peak_bytes(), cpu_snapshot()


def run_side(script: Path, side: str, precision: str, args, tmp: Path) -> dict:
    """One side of a TRL comparison: `script --only side` in a fresh process with an empty datasets cache (each
    run tokenises from scratch, as a first run does); its result file read back."""
    result = tmp / f"{side}-{precision}.json"
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=tmp))
    command = [sys.executable, str(script.resolve()), "--only", side, "--precision", precision,
               "--model-dir", str(args.model_dir), "--result", str(result), "--steps", str(args.steps),
               "--batch-size", str(args.batch_size), "--seed", str(args.seed)] + (["--dry-run"] if args.dry_run else [])
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        return run_fresh(command, result, f"{side} {precision}", args.steps, env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run_fresh(command: list[str], result: Path, what: str, steps: int, env: dict | None = None) -> dict:
    """One side's run: `command` in a fresh process (its own peak memory, heap and threads) that writes its
    figures to `result`, read back with `process_seconds` (its start to its exit, by this clock) and
    `saved_seconds` (its start to the model saved, by the child's `saved_at`)."""
    print(f"running {what} ({steps} steps) in a fresh process ...", flush=True)
    start, started_at = time.perf_counter(), time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or not result.is_file():
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"the {what} run failed (exit code {done.returncode})")
    run = json.loads(result.read_text())
    return {**run, "process_seconds": seconds, "saved_seconds": run["saved_at"] - started_at}
