"""What both sides of a peer comparison (vs_trainer.py, vs_trl.py, vs_trl_preference.py, vs_trl_grpo.py) start
from and how each runs: the peer library there or the dry run's effitrain side alone, the versions, the
Llama-shaped model and BPE tokenizer the TRL comparisons train, effitrain's own split of the data, the batch
order both sides draw, the digest that shows they drew the same batch, effitrain's step observer, and one
run in a fresh process. For the TRL comparisons also their flags, their step log's speed figures, each side's run around
its trainer and their main: a next one (GRPO) writes only its sides, data and report. Not a benchmark of its
own: equal starts are what make the figures comparable, so they are written once."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # benchmarks/ is on sys.path: this module is imported as peers._sides
from _common import cpu_share, cpu_snapshot, rss_peak_bytes

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ChatML's tokens, special in the BPE tokenizer
PRECISIONS = ("fp32", "bf16")


# --- the TRL comparisons' command line ---------------------------------------------------------------


def common_arguments(parser, sides: tuple[str, ...], *, steps: int, batch_size: int, batch_help: str,
                     precisions: bool, dry_run: str, sides_help: str | None = None) -> None:
    """The flags every TRL comparison takes, in the order --help shows them. `precisions`: a run measures
    several (--precision fp32 bf16, the default both) rather than one (fp32 by default); `sides_help`: --sides
    is left None when not given, for the script to fill (a dry run has a default of its own)."""
    parser.add_argument("--steps", type=int, default=steps, help=f"optimizer steps of each run (default {steps})")
    parser.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--runs", type=int, default=3,
                        help=f"runs of each side{' and precision' if precisions else ''} (default 3)")
    if precisions:
        parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    else:
        parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--sides", nargs="+", choices=sides, default=None if sides_help else list(sides),
                        help=sides_help)
    parser.add_argument("--vocab", type=int, default=8192, help="the BPE tokenizer's vocabulary (default 8192)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write every run's figures")
    parser.add_argument("--only", choices=sides, default=None, help="run one side in this process (the children)")
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help=dry_run)


def parsed(parser, argv, dry_run_batch: int) -> argparse.Namespace:
    """common_arguments' flags read and checked; a dry run's: 2 steps of `dry_run_batch`, 1 run, fp32, no --json
    (its sides are the script's to choose)."""
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.steps < 2 or args.runs < 1:
        parser.error("--batch-size and --runs must be at least 1, --steps at least 2")
    if args.dry_run:
        args.steps, args.batch_size, args.runs, args.json = 2, dry_run_batch, 1, None
        args.precision = ["fp32"] if isinstance(args.precision, list) else "fp32"
    return args


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


def comparison_model(args, folder: Path, template: str) -> dict:
    """make_model for a TRL comparison, saved to `folder`/model (args.model_dir): --vocab, or a 1-layer model
    with a 512-token vocabulary for a dry run."""
    args.model_dir = Path(folder) / "model"
    return make_model(args.model_dir, 512 if args.dry_run else args.vocab, args.seed, template, tiny=args.dry_run)


def model_text(shape: dict) -> str:
    """The report's first words on make_model's model."""
    return (f"Llama-shaped model from a config ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"vocabulary {shape['vocab']}, {shape['parameters'] / 1e6:.1f}M parameters), ChatML with generation blocks")


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


class StepLog:
    """What both sides of a TRL comparison record alike: each step's end (perf_counter) and real tokens
    (`real_tokens(batch)`), the first batch's examples (`examples(batch)`) and the CPU readings from then on.
    Each comparison adds the losses and digests it compares."""

    def __init__(self, examples, real_tokens):
        self.examples, self.real_tokens = examples, real_tokens
        self.ends: list[float] = []
        self.tokens: list[int] = []
        self.first_batch: list | None = None
        self.cpu_start = None

    def batch(self, batch: dict) -> None:
        if self.first_batch is None:
            self.first_batch = self.examples(batch)
            self.cpu_start = cpu_snapshot()
        self.tokens.append(self.real_tokens(batch))

    def speed(self, steps: int) -> dict:
        """tokens/s = the real tokens of steps 2..N over the time from the end of step 1 to the end of step N."""
        seconds = self.ends[-1] - self.ends[0]
        tokens = sum(self.tokens[1:steps])
        return {"steps_timed": len(self.ends) - 1, "seconds": seconds, "tokens_per_second": tokens / seconds,
                "tokens_per_step": statistics.mean(self.tokens[:steps])}


class Observer:
    """effitrain's callbacks (engine/callbacks.py) feeding a step log (vs_trl.py's, vs_trl_preference.py's or
    vs_trl_grpo.py's StepLog): each step's batch, end and loss (and the step's result, to a log that takes
    it); the peak RSS and CPU when the loop ends."""

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
        if hasattr(self.log, "step_result"):  # a log that reads the task's own sums (vs_trl_grpo.py's rewards)
            self.log.step_result(result)

    def on_train_end(self, state):
        self.rss, self.cpu_end = rss_peak_bytes(), cpu_snapshot()


# --- each side's run (a child process) -----------------------------------------------------------------


def trl_side(trainer, args, side: str, log: StepLog, out_dir: str, evaluate, loss_key: str) -> dict:
    """A TRL side once its trainer is built: trained (peak RSS and CPU read as training ends), evaluated
    (`evaluate(trainer)`, whose eval_loss is reported as `loss_key`), saved; its figures."""
    import trl

    trainer.train()
    rss = rss_peak_bytes()
    cpu_end = cpu_snapshot()
    evaluated = evaluate(trainer)
    trainer.save_model(os.path.join(out_dir, "model"))
    saved_at = time.time()
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"side": side, "precision": args.precision, "steps": trainer.state.global_step, "peak_rss_bytes": rss,
            "saved_at": saved_at, loss_key: evaluated.get("eval_loss"),
            "cpu": cpu_share(log.cpu_start, cpu_end), **log.figures(args.steps),
            "versions": {"trl": trl.__version__, **versions()}}


def effitrain_side(args, side: str, log: StepLog, prefix: str, loss_key: str, settings: dict) -> dict:
    """An effitrain side: effitrain.train on args.model_dir, the causal-lm task, --steps of --batch-size,
    --seed and --precision, with `settings` (the comparison's data, hyper-parameters and the side's switches),
    observed into `log` and saved to a temporary folder (`prefix`); its figures, the validation loss as
    `loss_key`."""
    import effitrain

    observer = Observer(log)
    out_dir = Path(tempfile.mkdtemp(prefix=prefix)) / "run"
    config = {"output_dir": str(out_dir), "model": str(args.model_dir), "task": "causal-lm",
              "max_steps": args.steps, "batch_size": args.batch_size, "grad_accum": 1, "seed": args.seed,
              "precision": args.precision, **settings}
    try:
        metrics = effitrain.train(config, callbacks=[observer])
        saved_at = time.time()
    finally:
        shutil.rmtree(out_dir.parent, ignore_errors=True)
    return {"side": side, "precision": args.precision, "steps": metrics["steps"], "peak_rss_bytes": observer.rss,
            "saved_at": saved_at, loss_key: (metrics.get("validation") or {}).get("loss"),
            "cpu": cpu_share(log.cpu_start, observer.cpu_end), "transforms": metrics.get("transforms"),
            **log.figures(args.steps), "versions": {"effitrain": effitrain.__version__, **versions()}}


def main(args, compare, run_trl, run_effitrain, skipped: str) -> None:
    """A TRL comparison's main: the parent compares the sides (`compare(args)`, each side a child); a child
    (--only SIDE) runs its side (`run_trl` or `run_effitrain`) and writes the figures to --result."""
    if args.dry_run:
        _common._one_thread()
        if args.only is None:
            _common.skipped(skipped)
    if args.only is None:
        compare(args)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = run_trl(args, args.only) if args.only.startswith("trl") else run_effitrain(args, args.only)
    args.result.write_text(json.dumps(result, indent=2) + "\n")


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
