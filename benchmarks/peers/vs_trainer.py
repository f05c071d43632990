"""effitrain.train against the Hugging Face transformers.Trainer, same model, data and hyper-parameters.

Both fine-tune the default model (all-MiniLM-L6-v2) on effitrain's sms-spam training split for the
same number of optimizer steps, micro-batch size, seed, lr 1e-4, weight decay 0.01, warm-up ratio 0.1
(linear warm-up then linear decay), max grad norm 1.0, max_length 128, no gradient accumulation, in
fp32 and in bf16 autocast (`--precision`), then evaluate the validation and the test split (batch 128)
and save the model and tokenizer: the time from the process's start to the saved model, and to its exit.

The Trainer runs at its best equal settings (`trainer-best`): its length-grouped sampler
(`train_sampling_strategy="group_by_length"`, transformers' LengthGroupedSampler, whose order effitrain's
sampler gives; seeded here as effitrain seeds its own, so both train on the same batches), fused AdamW
(`optim="adamw_torch_fused"`, the kernel effitrain uses), the same precision (`bf16=True` for bf16), evaluation batch 128. `--trainer-defaults` adds the Trainer as its
documentation sets it up (`trainer`: random order, TrainingArguments' defaults, evaluation batch 8).
effitrain runs with its own defaults. The notes printed at the end list where the sides differ.

Each run is a fresh subprocess of this script (`--only SIDE`), one after the other, the sides taking
turns (`--runs` rounds), so that each run's peak memory is its own and a busier moment of the machine
hits every side; the parent prints the medians and their ratios.

    .venv/bin/python benchmarks/peers/vs_trainer.py [--steps 60] [--runs 3] [--precision fp32 bf16] [--json PATH]
    .venv/bin/python benchmarks/peers/vs_trainer.py --dry-run   # trainer-best and effitrain, a tiny model, 2 steps of 4
    .venv/bin/python benchmarks/peers/vs_trainer.py --peft lora  # effitrain + LoRA against the Trainer + peft

With `--peft lora` or `--peft qlora` both sides train LoRA adapters of the same LoraConfig (effitrain's
own, built by the same code for the Trainer's model: rank 8, alpha 16, `--lora-dropout` (0 by default,
effitrain's and peft's default), every linear layer of the body, the classifier trained in full through
`modules_to_save`) at lr 1e-3 (LoRA's usual 10x); QLoRA loads the base in 4-bit nf4 with double
quantisation (effitrain's BitsAndBytesConfig, computing in the run's precision) on both sides; the
Trainer side calls peft's get_peft_model itself, as its documentation shows, without
prepare_model_for_kbit_training (which would switch gradient checkpointing on: effitrain does not).

What is timed: samples/s of the training loop: the Trainer's `trainer.train()` wall clock (and its
own `train_runtime` / `train_samples_per_second`); effitrain's `train_seconds` (the loop only).
Time to a saved model: from the subprocess's start (interpreter, imports; the parent's clock just before
it starts the process) to the moment the model and tokenizer are saved (the child's clock right after
its save returns: `effitrain.train` returning, `trainer.save_model`). Time to exit: the same start to
the process's end, measured by the parent: it adds the interpreter's teardown, which both sides run in
the same way (a script calling `effitrain.train`, not the `effitrain` command, which skips most of it).
Each optimizer step is also timed, without loading the batch, through each side's callbacks: the
Trainer's on_step_begin -> on_step_end, effitrain's (engine/callbacks.py, `Observer` below) the same,
which also takes in its step's log line (one record, on the last step); the parent sums the steps by
the width the batch is padded to: where each side's time goes.
Peak memory: the subprocess's peak resident set (`ru_maxrss`) at the end of training: effitrain's
on_train_end callback, the Trainer's end of `train()`. Real and padded tokens are counted from each
step's batches (effitrain's on_step_begin) and by wrapping the Trainer's collator.

Each run also records the CPU that other processes used during its training (/proc/stat minus its
own getrusage); above 0.1 core the parent prints a WARNING, since two torch threads sharing two cores
with another busy process slow down far more than the lost share (8x was seen on a 2-core machine).

Speeds depend on the machine and on whatever else runs on it; compare the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from _common import (  # noqa: E402
    cpu_share,
    cpu_snapshot,
    fmt,
    machine,
    mib,
    print_columns,
    rss_peak_bytes,
)
from peers import _report, _sides  # noqa: E402

from effitrain.speedups import allocator  # noqa: E402

MAX_LENGTH = 128
LR, WEIGHT_DECAY, WARMUP_RATIO, MAX_GRAD_NORM = 1e-4, 0.01, 0.1, 1.0
DATA = "sms-spam"
VALIDATION_SPLIT = TEST_SPLIT = 0.1
SIDES = ("trainer", "trainer-best", "effitrain")
EVAL_BATCH = 128
LORA_LR = 1e-3  # adapters' usual lr, 10x full fine-tuning's (effitrain's own default with --peft)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of each run (default 60)")
    parser.add_argument("--batch-size", type=int, default=16, help="micro-batch per device (default 16)")
    parser.add_argument("--seed", type=int, default=42, help="split, head initialisation, data order (default 42)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures to PATH")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side and precision (default 3)")
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--trainer-defaults", action="store_true",
                        help="also run the Trainer with its documented defaults (random order, unfused AdamW)")
    parser.add_argument("--peft", choices=("none", "lora", "qlora"), default="none",
                        help="train LoRA (or QLoRA) adapters on both sides (default: full fine-tuning)")
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="both sides' LoRA dropout (default 0)")
    parser.add_argument("--trainer-allocator", action="store_true",
                        help="start the Trainer's runs under the allocator effitrain preloads too (tcmalloc where "
                             "installed), to see what the allocator alone gives; by default they run as a script "
                             "does, under glibc's malloc")
    parser.add_argument("--only", choices=SIDES, default=None,
                        help="run only this side, in this process (what the parent starts each subprocess with)")
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)  # where --only writes
    parser.add_argument("--dry-run", action="store_true",
                        help="trainer-best and effitrain once each, fp32, a tiny model (benchmarks/_common.py), "
                             "2 steps of 4; no --json")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.steps < 1 or args.runs < 1:
        parser.error("--batch-size, --steps and --runs must be at least 1")
    args.lr = LR if args.peft == "none" else LORA_LR
    if args.dry_run and args.peft == "qlora":  # bitsandbytes' CPU kernels: widths in multiples of 64
        parser.error("--dry-run's tiny model is 32 wide, and 4-bit layers on a CPU need widths in multiples of 64: "
                     "run --peft qlora without --dry-run")
    if args.dry_run:
        args.steps, args.batch_size, args.runs, args.precision, args.trainer_defaults, args.json = (
            2, 4, 1, ["fp32"], False, None)
    return args


class CountingCollator:
    """Wraps the Trainer's collator; records examples, real (attention_mask) and padded tokens of each batch."""

    def __init__(self, inner):
        self.inner = inner
        self.batches: list[tuple[int, int, int]] = []

    def __call__(self, features):
        batch = self.inner(features)
        mask = batch["attention_mask"]
        self.batches.append((int(mask.shape[0]), int(mask.sum()), int(mask.numel())))
        return batch


def token_summary(batches: list[tuple[int, int, int]], steps: int) -> dict | None:
    """Real and padded tokens of the first `steps` batches (the dataloader fetches one batch ahead, so
    more may have been collated than trained on)."""
    trained = batches[:steps]
    if len(trained) < steps:
        return None
    samples = sum(b[0] for b in trained)
    real = sum(b[1] for b in trained)
    padded = sum(b[2] for b in trained)
    return {"samples": samples, "real_tokens": real, "padded_tokens": padded,
            "padding_waste": 1 - real / padded, "mean_padded_length": padded / samples,
            "mean_real_length": real / samples}


def widths(batches: list[tuple[int, int, int]], steps: int) -> list[int] | None:
    """Each trained batch's padded width in tokens (the first `steps` collated)."""
    trained = batches[:steps]
    return [padded // examples for examples, _, padded in trained] if len(trained) == steps else None


def cuda_peak() -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


def effitrain_split(seed: int):
    """effitrain train's split of the built-in data: stratified, test then validation held out, by seed."""
    return _sides.effitrain_splits(data=DATA, validation_split=VALIDATION_SPLIT, test_split=TEST_SPLIT, seed=seed)


# --- the Trainer side ------------------------------------------------------------------------------


def run_trainer(args, best: bool) -> dict:
    """`best`: length grouping, fused AdamW, evaluation batch 128 (else TrainingArguments' defaults)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import DataCollatorWithPadding

    from effitrain.runtime import libraries

    libraries.quiet_libraries(False)  # no load reports / progress bars from datasets and transformers
    tokenizer, (train, validation, test), model = trainer_inputs(args)
    dtype = str(next(model.parameters()).dtype)
    head_checksum = head_sum(model)
    collator = CountingCollator(DataCollatorWithPadding(tokenizer))
    out_dir = tempfile.mkdtemp(prefix="vs_trainer_hf_")
    training_args = trainer_arguments(args, best, out_dir)
    step_seconds: list[float] = []
    trainer = make_trainer(args, best, model, training_args, train, collator, tokenizer, step_seconds)
    measured = train_evaluate_save(trainer, validation, test, out_dir)
    return {
        "side": "trainer-best" if best else "trainer",
        "allocator": allocator.serving()[0],
        "precision": args.precision,
        **trainer_figures(args, measured, collator),
        "step_seconds": step_seconds,
        "step_widths": widths(collator.batches, args.steps),
        "dtype": dtype,
        "head_checksum": head_checksum,
        "settings": trainer_settings(trainer, training_args, collator, args.steps),
        **versions(),
    }


def trainer_inputs(args):
    """The tokenizer, the tokenized train, validation and test splits, and the model with its new head, in
    effitrain's loop's order: seed, tokenizer, data, tokenization, then the model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

    from effitrain.models import loading

    model_path = loading.resolve("default")
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    splits = effitrain_split(args.seed)
    labels = splits["train"].features["label"].names

    def encode(batch):
        return tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH)

    encoded = tuple(splits[name].map(encode, batched=True)  # `text` stays: the Trainer drops it
                    for name in ("train", "validation", "test"))
    quantized = {}
    if args.peft == "qlora":  # effitrain's BitsAndBytesConfig, the classifier kept in full precision
        from effitrain.models import adapters

        quantized = {"quantization_config": adapters.quantization_config(args.precision, ["classifier"]),
                     "device_map": {"": "cpu"}}
    model = AutoModelForSequenceClassification.from_pretrained(
        str(model_path), num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)}, local_files_only=True, **quantized)
    if args.peft != "none":
        model = with_adapters(model, args.lora_dropout)
    return tokenizer, encoded, model


def with_adapters(model, dropout: float):
    """peft's get_peft_model with effitrain's LoraConfig for this model: the same target modules (every
    linear layer of the body), rank, alpha and dropout, the classifier trained in full."""
    from peft import LoraConfig, get_peft_model

    from effitrain.config import ALL_LINEAR, TrainConfig
    from effitrain.models import adapters

    defaults, head = TrainConfig(), adapters.head_modules(model)
    lora = LoraConfig(r=defaults.lora_r, lora_alpha=defaults.lora_alpha, lora_dropout=dropout,
                      target_modules=adapters.targets(model, ALL_LINEAR, head), modules_to_save=head,
                      task_type="SEQ_CLS")
    return get_peft_model(model, lora)


def head_sum(model) -> float | None:
    """The classifier's initial weights summed (peft keeps a trained copy of it: the original's)."""
    classifier = getattr(model, "classifier", None)
    classifier = getattr(classifier, "original_module", classifier)  # peft's modules_to_save wrapper
    weight = getattr(classifier, "weight", None)
    return float(weight.detach().double().sum()) if weight is not None else None


def trainer_arguments(args, best: bool, out_dir: str):
    """TrainingArguments for effitrain's hyper-parameters; with `best`, the Trainer's best equal settings."""
    import dataclasses

    from transformers import TrainingArguments

    from effitrain.runtime import devices

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    # transformers 5 dropped warmup_ratio: a warmup_steps float < 1 is a share of the steps.
    warmup = {"warmup_ratio": WARMUP_RATIO} if "warmup_ratio" in fields else {"warmup_steps": WARMUP_RATIO}
    tuned = {}
    if best:
        tuned = {"optim": "adamw_torch_fused", "per_device_eval_batch_size": EVAL_BATCH,
                 **({"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in fields
                    else {"group_by_length": True})}
    return TrainingArguments(
        output_dir=out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=WEIGHT_DECAY,
        **warmup,
        max_grad_norm=MAX_GRAD_NORM,
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10**9,
        use_cpu=not devices.has_accelerator(),
        dataloader_num_workers=0,
        bf16=args.precision == "bf16",
        **tuned,
    )


def make_trainer(args, best: bool, model, training_args, train, collator, tokenizer, step_seconds: list):
    """The Trainer (with `best`, one whose length-grouped sampler is seeded as effitrain's), each optimizer
    step's seconds appended to `step_seconds`."""
    import transformers
    from transformers import Trainer

    class StepClock(transformers.TrainerCallback):
        """Each optimizer step's wall clock: forward, backward, clipping, optimizer, schedule, zero_grad
        (the Trainer's on_step_begin -> on_step_end; the batch's loading is before both)."""

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_seconds.append(time.perf_counter() - self.started)

    class SameOrderTrainer(Trainer):
        """The Trainer drawing effitrain's batches, index for index (left to itself: 1.7% fewer tokens than
        effitrain's over the first 60 steps, another order)."""

        def _get_train_sampler(self, train_dataset=None):
            return _sides.in_effitrains_order(super()._get_train_sampler(train_dataset), args.seed)

    return (SameOrderTrainer if best else Trainer)(
        model=model, args=training_args, train_dataset=train, data_collator=collator, processing_class=tokenizer,
        compute_metrics=accuracy, callbacks=[StepClock()])


def train_evaluate_save(trainer, validation, test, out_dir: str) -> dict:
    """trainer.train() timed, then what effitrain.train does after its loop: validation, test, the model
    and tokenizer saved."""
    rss_before = rss_peak_bytes()
    cpu_start = cpu_snapshot()
    output = trainer.train()
    cpu_end = cpu_snapshot()
    rss_after = rss_peak_bytes()
    trainer.evaluate(validation)
    test_metrics = trainer.evaluate(test, metric_key_prefix="test")
    trainer.save_model(os.path.join(out_dir, "model"))
    saved_at = time.time()
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"output": output, "test_metrics": test_metrics, "cpu_start": cpu_start, "cpu_end": cpu_end,
            "rss_before": rss_before, "rss_after": rss_after, "saved_at": saved_at}


def trainer_figures(args, measured: dict, collator) -> dict:
    output, cpu_start, cpu_end = measured["output"], measured["cpu_start"], measured["cpu_end"]
    seconds = cpu_end[0] - cpu_start[0]
    tokens = token_summary(collator.batches, args.steps)
    samples = args.steps * args.batch_size
    return {
        "test": {"accuracy": measured["test_metrics"].get("test_accuracy")},
        "steps": output.global_step,
        "seconds": seconds,
        "seconds_measured_by": "time.perf_counter around trainer.train()",
        "saved_at": measured["saved_at"],
        "samples_per_second": samples / seconds,
        "own_samples_per_second": output.metrics.get("train_samples_per_second"),
        "own_runtime_seconds": output.metrics.get("train_runtime"),
        "tokens_per_second": tokens["real_tokens"] / seconds if tokens else None,
        "peak_rss_bytes_end_of_training": measured["rss_after"],
        "peak_rss_bytes_before_training": measured["rss_before"],
        "peak_rss_bytes_end_of_process": rss_peak_bytes(),
        "cuda_peak_allocated_bytes": cuda_peak(),
        "cpu": cpu_share(cpu_start, cpu_end),
        "train_loss_mean": output.training_loss,
        "tokens": tokens,
    }


def trainer_settings(trainer, training_args, collator, steps: int) -> dict:
    """What the Trainer ran with: its optimizer as built, schedule, sampling, padding, precision."""
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    return {
        "optim": str(getattr(training_args.optim, "value", training_args.optim)),
        "optimizer_class": type(inner).__name__,
        "fused": inner.defaults.get("fused"),
        "foreach": inner.defaults.get("foreach"),
        "decayed_tensors": sum(len(g["params"]) for g in inner.param_groups if g["weight_decay"] > 0),
        "undecayed_tensors": sum(len(g["params"]) for g in inner.param_groups if g["weight_decay"] == 0),
        "lr_scheduler_type": str(getattr(training_args.lr_scheduler_type, "value",
                                         training_args.lr_scheduler_type)),
        "warmup_steps": training_args.get_warmup_steps(steps),
        "train_sampling_strategy": getattr(training_args, "train_sampling_strategy", None),
        "group_by_length": getattr(training_args, "group_by_length", None),
        "pad_to_multiple_of": collator.inner.pad_to_multiple_of,
        "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
        "bf16": training_args.bf16, "fp16": training_args.fp16,
        "torch_compile": training_args.torch_compile,
        "dataloader_pin_memory": training_args.dataloader_pin_memory,
    }


def versions(effitrain_too: bool = False) -> dict:
    found = _sides.versions()
    if effitrain_too:
        import effitrain

        found["effitrain"] = effitrain.__version__
    return {"versions": found, "machine": machine()}


def accuracy(prediction) -> dict:
    import numpy as np

    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    return {"accuracy": float((np.argmax(logits, -1) == prediction.label_ids).mean())}


# --- the effitrain side ----------------------------------------------------------------------------


def run_effitrain(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    observer = Observer()
    observed, batches = observer.observed, observer.batches
    out_dir = Path(tempfile.mkdtemp(prefix="vs_trainer_effitrain_")) / "run"
    config = effitrain_config(args, out_dir)
    metrics, loss, call_seconds, saved_at = train_effitrain(config, out_dir, observer)
    tokens = token_summary(batches, args.steps) if batches else None
    seconds = metrics["train_seconds"]
    samples = args.steps * args.batch_size
    return {
        "side": "effitrain",
        "allocator": allocator.serving()[0],
        "precision": args.precision,
        "wall_seconds_by_phase": metrics.get("wall_seconds_by_phase"),
        "steps": metrics["steps"],
        "seconds": seconds,
        "seconds_measured_by": "effitrain's train_seconds (the training loop)",
        "samples_per_second": samples / seconds,
        "own_samples_per_second": metrics["train_samples_per_second"],
        "own_runtime_seconds": seconds,
        "tokens_per_second": metrics.get("train_tokens_per_second"),
        "peak_rss_bytes_end_of_training": observed.get("rss_end_of_training"),
        "peak_rss_bytes_end_of_process": rss_peak_bytes(),
        "peak_memory_bytes": metrics.get("peak_memory_bytes"),
        "cuda_peak_allocated_bytes": cuda_peak(),
        # from the first training batch to the end of the loop: close to train_seconds
        "cpu": (cpu_share(observer.first_snapshot, observed["cpu_end_of_training"])
                if observer.first_snapshot and "cpu_end_of_training" in observed else None),
        "train_loss_mean": loss,
        "test": metrics.get("test"),
        "validation": metrics.get("validation"),
        "wall_seconds": metrics.get("wall_seconds"),
        "call_seconds": call_seconds,
        "saved_at": saved_at,
        "tokens": tokens,
        "step_seconds": observer.step_seconds,
        "step_widths": widths(batches, args.steps),
        "dtype": observed.get("dtype"),
        "head_checksum": observed.get("head_checksum"),
        "settings": effitrain_settings(args, observed),
        "config": config,
        **versions(effitrain_too=True),
    }


class Observer:
    """effitrain's callbacks (engine/callbacks.py), to record what the Trainer's side records: the model's
    dtype and initial head, the tokens of each step's batches and the CPU from the first one, each
    optimizer step's seconds (from before its forward to after its log line, the Trainer's on_step_begin
    to on_step_end), and the peak RSS and CPU when the loop ends (before the test evaluation)."""

    def __init__(self):
        self.observed: dict = {}
        self.batches: list[tuple[int, int, int]] = []  # (examples, real tokens, padded tokens)
        self.first_snapshot = None
        self.step_seconds: list[float] = []
        self.started = 0.0

    def on_train_begin(self, job):
        model = job.accelerator.unwrap_model(job.model)
        self.observed["dtype"] = str(next(model.parameters()).dtype)
        self.observed["head_checksum"] = head_sum(model)
        collate = getattr(job.train_dl, "collate_fn", None)
        self.observed["pad_to_multiple_of"] = getattr(collate, "pad_to_multiple_of", None)

    def on_step_begin(self, state, group):
        if self.first_snapshot is None:
            self.first_snapshot = cpu_snapshot()
        for batch in group:
            if batch is not None:
                mask = batch["attention_mask"]
                self.batches.append((int(mask.shape[0]), int(mask.sum()), int(mask.numel())))
        self.started = time.perf_counter()

    def on_step_end(self, state, result):
        self.step_seconds.append(time.perf_counter() - self.started)

    def on_train_end(self, state):
        self.observed["rss_end_of_training"] = rss_peak_bytes()
        self.observed["cpu_end_of_training"] = cpu_snapshot()


def effitrain_config(args, out_dir: Path) -> dict:
    """effitrain.train's settings: the Trainer's hyper-parameters, fp32 and AdamW whatever effitrain's
    defaults become; settings this version lacks are left out."""
    from effitrain.config import fields as config_fields

    config = {
        "output_dir": str(out_dir), "data": DATA, "max_steps": args.steps, "batch_size": args.batch_size,
        "grad_accum": 1, "lr": args.lr, "weight_decay": WEIGHT_DECAY, "warmup_ratio": WARMUP_RATIO,
        "max_grad_norm": MAX_GRAD_NORM, "seed": args.seed, "max_length": MAX_LENGTH,
        "validation_split": VALIDATION_SPLIT, "test_split": TEST_SPLIT, "log_every": args.steps,
        "eval_batch_size": EVAL_BATCH,
    }
    if args.peft != "none":
        config.update(peft=args.peft, lora_dropout=args.lora_dropout)
    known = {f.name for f in config_fields()}
    config.update({k: v for k, v in {"precision": args.precision, "optim": "adamw", "gradient_checkpointing": False,
                                     "beta1": 0.9, "beta2": 0.999}.items() if k in known})
    return config


def train_effitrain(config: dict, out_dir: Path, observer: Observer) -> tuple[dict, float | None, float, float]:
    """effitrain.train(config) watched by `observer`: its metrics, the mean training loss, the call's seconds and the time the
    model was saved; the run's folder is then removed."""
    import effitrain

    try:
        start = time.perf_counter()
        metrics = effitrain.train(config, callbacks=[observer])
        call_seconds, saved_at = time.perf_counter() - start, time.time()
        loss = metrics.get("train_loss")  # log_every = steps: the mean over every example of the run
        log_path = out_dir / "log.jsonl"
        if log_path.is_file():
            for line in log_path.read_text().splitlines():
                record = json.loads(line)
                if loss is None and "split" not in record and record.get("step") == metrics["steps"]:
                    loss = record["loss"]
    finally:
        shutil.rmtree(out_dir.parent, ignore_errors=True)  # the saved model is not needed
    return metrics, loss, call_seconds, saved_at


def effitrain_settings(args, observed: dict) -> dict:
    """What effitrain ran with: the optimizer its AdamW factory builds, its sampling, padding, schedule."""
    import torch

    from effitrain.config import TrainConfig
    from effitrain.optimizers import classic as optim
    from effitrain.optimizers import schedule

    defaults = TrainConfig()
    try:  # what effitrain's AdamW factory builds (its signature may grow)
        probe = optim.adamw(torch.nn.Linear(2, 2), LR, WEIGHT_DECAY)
    except Exception:  # noqa: BLE001
        probe = None
    return {
        "optimizer_class": type(probe).__name__ if probe is not None else None,
        "fused": probe.defaults.get("fused") if probe is not None else None,
        "foreach": probe.defaults.get("foreach") if probe is not None else None,
        "group_by_length": defaults.group_by_length,
        "pad_to_multiple_of": observed.get("pad_to_multiple_of"),
        "warmup_steps": schedule.warmup_steps(args.steps, WARMUP_RATIO),
        "eval_batch_size": defaults.eval_batch_size,
    }


# --- the parent ------------------------------------------------------------------------------------


def run_child(side: str, precision: str, args, tmp: Path) -> dict:
    """One run in a fresh process; `process_seconds`: its wall clock from start to exit; `saved_seconds`:
    from its start to its saved model."""
    result = tmp / f"{side}-{precision}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--only", side, "--result", str(result),
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
               "--precision", precision, "--peft", args.peft, "--lora-dropout", str(args.lora_dropout)]
    # effitrain's side starts as the `effitrain` command runs, under the allocator it preloads (tcmalloc where
    # installed: EFFITRAIN_ALLOCATOR chooses); the Trainer's as a script runs, under glibc's malloc.
    env = allocator.preloaded_environment(os.environ) if side == "effitrain" or args.trainer_allocator else None
    return _sides.run_fresh(command, result, f"{side} {precision}", args.steps, env)


def notes(trainer: dict, ours: dict) -> list[str]:
    t, e = trainer["settings"], ours["settings"]
    lines = []
    sampling = t.get("train_sampling_strategy") or ("group_by_length" if t.get("group_by_length") else "random")
    lines.append(f"batch order: Trainer {sampling}, effitrain "
                 f"{'length-grouped (LengthGroupedSampler, its default)' if e['group_by_length'] else 'random'}")
    lines.append(f"padding: both pad to the longest example of the batch; multiple of "
                 f"{t['pad_to_multiple_of'] or 1} (Trainer, DataCollatorWithPadding default) vs "
                 f"{e['pad_to_multiple_of'] or 1} (effitrain)")
    for side, run in (("Trainer", trainer), ("effitrain", ours)):
        if run["tokens"]:
            k = run["tokens"]
            lines.append(f"  {side}: {k['mean_padded_length']:.1f} padded / {k['mean_real_length']:.1f} real tokens "
                         f"per sample over the {run['steps']} steps, padding waste {k['padding_waste']:.1%}")
    lines.append(f"malloc: Trainer {trainer.get('allocator', '?')}, effitrain {ours.get('allocator', '?')} (what the "
                 "`effitrain` command preloads; --trainer-allocator gives the Trainer the same)")
    same = t["fused"] == e["fused"]
    lines.append(f"optimizer: Trainer optim={t['optim']} ({t['optimizer_class']}, fused={t['fused']}), "
                 f"effitrain {e['optimizer_class']} fused={e['fused']}"
                 + (" -- the same kernel" if same else " -- different kernels"))
    lines.append(f"weight decay: Trainer decays {t['decayed_tensors']} tensors and exempts "
                 f"{t['undecayed_tensors']} (biases, LayerNorm); effitrain exempts every 1-d tensor (the same set "
                 f"on this BERT)")
    lines.append(f"schedule: linear, warm-up {t['warmup_steps']} steps (Trainer) / {e['warmup_steps']} (effitrain); "
                 f"accumulation {t['gradient_accumulation_steps']} in both, so the Trainer's loss scaling with "
                 f"gradient accumulation plays no part; dtype {trainer['dtype']} / {ours['dtype']}")
    if trainer.get("head_checksum") is not None and ours.get("head_checksum") is not None:
        same_head = trainer["head_checksum"] == ours["head_checksum"]
        lines.append("initial classifier head: " + ("identical in both runs" if same_head
                                                      else "differs between the runs"))
    lines.append(f"timed: Trainer = trainer.train() wall clock ({trainer['seconds']:.1f} s; its own train_runtime "
                 f"{fmt(trainer['own_runtime_seconds'], '.1f')} s starts after its dataloader, optimizer and "
                 f"accelerate setup); effitrain = its train_seconds, the loop only "
                 f"(effitrain.train took {ours['call_seconds']:.1f} s in all: data, tokenization, model load, "
                 f"validation + test at batch {e['eval_batch_size']}, saving)")
    share = [(run.get("cpu") or {}) for run in (trainer, ours)]
    lines.append(f"CPU during training ({os.cpu_count()} cores): the run itself kept "
                 f"{fmt(share[0].get('own_cores'), '.2f')} (Trainer) / {fmt(share[1].get('own_cores'), '.2f')} "
                 f"(effitrain) cores busy, other processes {fmt(share[0].get('other_cores'), '.2f')} / "
                 f"{fmt(share[1].get('other_cores'), '.2f')} cores; above ~0.1 the speeds are not clean")
    lines.append("peak RSS: ru_maxrss of each subprocess at the end of training (imports, data, model, optimizer "
                 f"state, training); effitrain's own peak_memory_bytes ({mib(ours['peak_memory_bytes'])}) is taken "
                 "after its evaluation")
    return lines


def summary_rows(results: dict, precision: str, sides: list[str]) -> list[tuple]:
    """Per side: medians over the runs of samples/s, peak RSS at the end of training, seconds from the
    process's start to the saved model and to its exit, test accuracy; then effitrain's ratios to each
    Trainer side."""
    rows, medians = [], {}
    for side in sides:
        runs = results[(side, precision)]
        medians[side] = {key: _report.median(runs, key) for key in (
            "samples_per_second", "peak_rss_bytes_end_of_training", "saved_seconds", "process_seconds", "seconds")}
        medians[side]["accuracy"] = _report.median([run["test"] or {} for run in runs], "accuracy")
        m = medians[side]
        rows.append((f"{side} {precision}", " / ".join(f"{run['samples_per_second']:.1f}" for run in runs),
                     fmt(m["samples_per_second"], ".1f"), mib(m["peak_rss_bytes_end_of_training"]),
                     fmt(m["saved_seconds"], ".1f"), fmt(m["process_seconds"], ".1f"), fmt(m["accuracy"], ".4f")))
    ours = medians["effitrain"]
    for side in sides[:-1]:
        theirs = medians[side]
        rows.append((f"effitrain / {side}", "", f"{ours['samples_per_second'] / theirs['samples_per_second']:.2f}x",
                     f"{ours['peak_rss_bytes_end_of_training'] / theirs['peak_rss_bytes_end_of_training']:.2f}x",
                     f"{theirs['saved_seconds'] / ours['saved_seconds']:.2f}x faster",
                     f"{theirs['process_seconds'] / ours['process_seconds']:.2f}x faster", ""))
    return rows


WIDTH_BUCKETS = ((1, 16), (17, 32), (33, 64), (65, 10**9))


def width_rows(results: dict, precision: str, sides: list[str]) -> tuple[list[tuple], list[str]] | None:
    """Where the time goes by batch width: each step's median seconds over the runs, summed over the
    steps whose batch is padded to a width in each bucket, per side, and each Trainer side's over
    effitrain's. Only the sides that trained on effitrain's batches (not `trainer`'s random order); None
    if a run lacks its step times."""
    runs_of = {side: results[(side, precision)] for side in sides}
    if any(not run.get("step_seconds") or not run.get("step_widths") for runs in runs_of.values() for run in runs):
        return None
    padded = runs_of["effitrain"][0]["step_widths"]
    sides = [side for side in sides if all(run["step_widths"] == padded for run in runs_of[side])]
    per_side = {side: [statistics.median(run["step_seconds"][i] for run in runs_of[side])
                       for i in range(min(len(run["step_seconds"]) for run in runs_of[side]))] for side in sides}
    rows = []
    for low, high in (*WIDTH_BUCKETS, (1, 10**9)):
        steps = [i for i, w in enumerate(padded) if low <= w <= high and all(i < len(t) for t in per_side.values())]
        if not steps:
            continue
        label = "all" if (low, high) == (1, 10**9) else f"{low}-{high}" if high < 10**9 else f">= {low}"
        sums = {side: sum(per_side[side][i] for i in steps) for side in sides}
        rows.append((f"{label} tokens", str(len(steps)), *(f"{sums[side]:.2f} s" for side in sides),
                     *(f"{sums[side] / sums['effitrain']:.2f}x" for side in sides[:-1])))
    return rows, sides


def print_width_table(rows: list[tuple], sides: list[str], precision: str) -> None:
    print_columns((f"batch width, {precision}", "steps", *(f"{side} steps" for side in sides),
                   *(f"{side} / effitrain" for side in sides[:-1])), rows)


def print_table(rows: list[tuple]) -> None:
    print_columns(("", "samples/s of each run", "median samples/s", "peak RSS", "seconds to saved model", "to exit",
                   "test acc"), rows)


def compare(args) -> None:
    sides = (["trainer"] if args.trainer_defaults else []) + ["trainer-best", "effitrain"]
    with tempfile.TemporaryDirectory(prefix="vs_trainer_") as tmp:  # the sides take turns
        turns = _common.take_turns([(side, p) for p in args.precision for side in sides], args.runs,
                                   lambda side_precision: run_child(*side_precision, args, Path(tmp)))
    results: dict = {(side, p): turns[(side, p)] for side in sides for p in args.precision}
    first = results[(sides[-1], args.precision[0])][0]
    adapted = "" if args.peft == "none" else f" + {args.peft} (r 8, alpha 16, dropout {args.lora_dropout:g}, all-linear)"
    print(f"\nall-MiniLM-L6-v2{adapted} on {DATA}: {args.steps} optimizer steps of {args.batch_size}, seed {args.seed}, "
          f"lr {args.lr}, weight decay {WEIGHT_DECAY}, warm-up ratio {WARMUP_RATIO}, max grad norm {MAX_GRAD_NORM}, "
          f"max_length {MAX_LENGTH}; then validation + test (batch {EVAL_BATCH}) and the model saved; "
          f"{args.runs} run(s) each, medians; {first['machine']}; torch {first['versions']['torch']}, "
          f"transformers {first['versions']['transformers']}, effitrain {first['versions']['effitrain']}\n")
    for precision in args.precision:
        print_table(summary_rows(results, precision, sides))
        print()
    print("samples/s: steps x batch / seconds of the training loop; peak RSS: at the end of training; seconds to "
          "saved model: from the process's start (interpreter, imports) to the model saved; to exit: to the "
          "process's end (the interpreter's teardown added)")
    tables = [(by_width, precision) for precision in args.precision
              if (by_width := width_rows(results, precision, sides)) and len(by_width[1]) > 1]
    for by_width, precision in tables:
        print()
        print_width_table(*by_width, precision)
    if tables:
        print("step time by batch width: each optimizer step's wall clock (forward to zero_grad, not the batch's "
              "loading), its median over the runs, summed over the steps whose batch is padded to that width")
    _report.warn_if_busy(results, before="\n", after="; rerun on an idle machine")
    print("\nnotes:")
    for line in notes(results[("trainer-best", args.precision[0])][0], first):
        print(("  " if line.startswith("  ") else "- ") + line.strip())
    if args.json is not None:
        _report.write_json(args.json, {"date": _report.utc_now(), "machine": first["machine"], "steps": args.steps,
                                       "batch_size": args.batch_size, "seed": args.seed,
                                       "runs": {f"{side} {p}": runs for (side, p), runs in results.items()}},
                           before="\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run and args.only is None:
        _common.dry_run_model()
        _common.skipped("the Trainer's defaults (--trainer-defaults), bf16, repeats and --json")
    if args.only is None:
        compare(args)
        return
    args.precision = args.precision[0]  # a child runs one
    result = run_effitrain(args) if args.only == "effitrain" else run_trainer(args, best=args.only == "trainer-best")
    text = json.dumps(result, indent=2) + "\n"
    if args.result is not None:
        args.result.write_text(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    if args.result is None and args.json is None:
        print(text)


if __name__ == "__main__":
    main()
