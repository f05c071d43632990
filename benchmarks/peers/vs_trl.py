"""effitrain.train against TRL's SFTTrainer: chat fine-tuning of the same causal LM on the same data.

Both sides fine-tune the same Llama-shaped model (4 layers, hidden 256, random weights from a config,
saved once to a temporary folder) with the same byte-level BPE tokenizer (trained here on the SMS
messages, ChatML's special tokens added) and the same ChatML template, whose {% generation %} blocks mark
each assistant turn through its <|im_end|>: TRL's `assistant_only_loss=True` and effitrain's default loss
on the assistant turns then cover the same tokens. Data: effitrain's training split of the built-in
`sms-spam-chat` (TRL is given those very rows), nothing truncated (max_length 512 is above the longest
conversation); the same micro-batch, seed, lr, weight decay, warm-up, max grad norm and fused AdamW;
the same batch order (the Trainer's LengthGroupedSampler seeded as effitrain seeds its own, which gives
the same order index for index), so that the padded sides train on the same batches. Each run then
evaluates the first EVAL_SAMPLES validation and test conversations and saves the model.

Sides (`--sides`):
  trl                SFTTrainer, padded batches
  trl-padding-free   SFTTrainer, padding_free=True (the batch's examples in one row); TRL refuses it with a
                     max_length, so max_length=None (the same: nothing is cut at 512)
  trl-packing        SFTTrainer, packing=True (best-fit decreasing into rows of PACK_LENGTH tokens, padding-free
                     within the batch), PACK_BATCH rows a step: about the tokens of a padded step
  effitrain          effitrain.train with its defaults (padded, length-grouped)
  effitrain-packing  the same with --packing (each micro-batch's examples in one row)
TRL at its best CPU settings: gradient_checkpointing=False (SFTConfig turns it on by default: memory for
speed), the length-grouped sampler, optim adamw_torch_fused; its fused LM head (no whole logits) is always on.

The first step's loss (the mean over answer tokens of the step) is recorded on every side, with a digest
of its batch's examples (token ids and labels, padding removed): the parent checks that the padded sides
saw the same batch and their losses agree within 1e-5 in fp32 (`--precision fp32`).

Each run is a fresh subprocess of this script (`--only SIDE`), the sides taking turns over `--runs`
rounds, each with its own empty datasets cache (both sides tokenise from scratch, as a first run does).
Figures: tokens/s = real (non-padding) tokens of steps 2..N over the time from the end of step 1 to the
end of step N (both sides' callbacks: the one-off start of the first step left out, the batches'
loading kept in); peak RSS = ru_maxrss at the end of training; time to saved model = from the parent's
clock before the process starts to the child's clock after the model is saved.

    .venv/bin/python benchmarks/peers/vs_trl.py [--steps 40] [--runs 3] [--precision fp32 bf16] [--sides ...]
    .venv/bin/python benchmarks/peers/vs_trl.py --dry-run   # trl and effitrain, 2 steps of 4, a 1-layer model

Needs TRL: pip install -e '.[bench]' (trl pinned). Compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from _common import machine  # noqa: E402
from peers import _report, _sides  # noqa: E402

DATA = "sms-spam-chat"
MAX_LENGTH = 512  # above the longest conversation: nothing is truncated on either side
PACK_LENGTH, PACK_BATCH = 512, 2  # TRL's packed rows: about the tokens of a padded step of 16 (checked in notes)
LR, WEIGHT_DECAY, WARMUP_RATIO, MAX_GRAD_NORM = 1e-4, 0.01, 0.1, 1.0
EVAL_SAMPLES, EVAL_BATCH = 64, 32
SIDES = ("trl", "trl-padding-free", "trl-packing", "effitrain", "effitrain-packing")
# ChatML with generation blocks around each answer and its end of turn: what TRL's assistant_only_loss needs.
TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
            "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _sides.common_arguments(parser, SIDES, steps=40, batch_size=16, batch_help="micro-batch (default 16)",
                            precisions=True,
                            dry_run="trl and effitrain once each, fp32, a 1-layer model, 2 steps of 4; no --json")
    args = _sides.parsed(parser, argv, dry_run_batch=4)
    if args.dry_run:
        args.sides = [side for side in args.sides if side in ("trl", "effitrain")] or ["trl", "effitrain"]
    _sides.require_peer(parser, args, "trl", "TRL", alone="effitrain")
    if args.only is not None:
        args.precision = args.precision[0]  # a child runs one side in one precision
    return args


# --- the data both sides train on -------------------------------------------------------------------


def effitrain_splits(args, model_dir: Path):
    """effitrain train's split of the built-in data (test then validation held out, by seed)."""
    return _sides.effitrain_splits(model=str(model_dir), task="causal-lm", data=DATA, seed=args.seed,
                                   max_length=MAX_LENGTH)


# --- what both sides record -------------------------------------------------------------------------


def examples_of(batch: dict) -> list[tuple[tuple, tuple]]:
    """(token ids, labels) of each example of a batch, padding removed: padded rows by their attention
    mask, flattened rows split where the positions restart. Each example's first label is left out: it is
    never a target (padding-free collators set it to -100 so that no example predicts the next one)."""
    ids, labels = batch["input_ids"], batch["labels"]
    found = []
    for row in range(ids.shape[0]):
        if "attention_mask" in batch:
            keep = batch["attention_mask"][row].bool()
            found.append((ids[row][keep], labels[row][keep]))
        else:
            starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            found += [(ids[row][a:b], labels[row][a:b]) for a, b in zip(starts, starts[1:])]
    return [(tuple(i.tolist()), tuple(lab.tolist()[1:])) for i, lab in found]


def real_tokens(batch: dict) -> int:
    return int(batch["attention_mask"].sum()) if "attention_mask" in batch else int(batch["input_ids"].numel())


class StepLog(_sides.StepLog):
    """Each step's end (perf_counter) and real tokens, the first batch's examples and loss."""

    def __init__(self):
        super().__init__(examples_of, real_tokens)
        self.first_loss: float | None = None

    def step_loss(self, loss: float) -> None:
        if self.first_loss is None:
            self.first_loss = loss

    def figures(self, steps: int) -> dict:
        return {**self.speed(steps), "first_loss": self.first_loss,
                "first_batch_digest": _sides.digest(self.first_batch),
                "first_batch_examples": len(self.first_batch),
                "first_batch_answer_tokens": sum(sum(lab != -100 for lab in labels)
                                                 for _, labels in self.first_batch)}


# --- TRL ----------------------------------------------------------------------------------------------


def run_trl(args, side: str) -> dict:
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from effitrain.runtime import libraries

    libraries.quiet_libraries(False)
    log = StepLog()
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    splits = effitrain_splits(args, args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
    out_dir = tempfile.mkdtemp(prefix="vs_trl_trl_")
    packing, padding_free = side == "trl-packing", side == "trl-padding-free"
    config = trl.SFTConfig(
        output_dir=out_dir, max_steps=args.steps, learning_rate=LR, weight_decay=WEIGHT_DECAY,
        warmup_steps=WARMUP_RATIO, max_grad_norm=MAX_GRAD_NORM, seed=args.seed, optim="adamw_torch_fused",
        per_device_train_batch_size=PACK_BATCH if packing and not args.dry_run else args.batch_size,
        per_device_eval_batch_size=EVAL_BATCH, bf16=args.precision == "bf16", gradient_checkpointing=False,
        assistant_only_loss=True, packing=packing, padding_free=padding_free,
        max_length=None if padding_free else PACK_LENGTH if packing else MAX_LENGTH,
        train_sampling_strategy="group_by_length", use_cpu=True, report_to="none", save_strategy="no",
        eval_strategy="no", logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0)

    class Recorded(trl.SFTTrainer):
        """Records each training batch and the first step's loss; its length-grouped sampler seeded as
        effitrain seeds its own (left alone it draws from torch's global generator: another order)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                if log.first_loss is None:
                    log.first_loss = float(loss.detach())
                log.batch(inputs)
            return loss

        def _get_train_sampler(self, train_dataset=None):
            return _sides.in_effitrains_order(super()._get_train_sampler(train_dataset), args.seed)

    def evaluate(trainer) -> dict:
        """The first EVAL_SAMPLES validation conversations (the loss reported), then the test ones."""
        limit = range(min(EVAL_SAMPLES, len(splits["validation"])))
        validation = trainer.evaluate(splits["validation"].select(limit))
        trainer.evaluate(splits["test"].select(range(min(EVAL_SAMPLES, len(splits["test"])))),
                         metric_key_prefix="test")
        return validation

    trainer = Recorded(model=model, args=config, train_dataset=splits["train"], processing_class=tokenizer,
                       callbacks=[_sides.step_clock(log.ends)])
    return _sides.trl_side(trainer, args, side, log, out_dir, evaluate, "validation_loss")


# --- effitrain ----------------------------------------------------------------------------------------


def run_effitrain(args, side: str) -> dict:
    settings = {"data": DATA, "lr": LR, "weight_decay": WEIGHT_DECAY, "warmup_ratio": WARMUP_RATIO,
                "max_grad_norm": MAX_GRAD_NORM, "max_length": MAX_LENGTH, "max_eval_samples": EVAL_SAMPLES,
                "eval_batch_size": EVAL_BATCH, "log_every": args.steps, "packing": side == "effitrain-packing"}
    return _sides.effitrain_side(args, side, StepLog(), "vs_trl_effitrain_", "validation_loss", settings)


# --- the parent ---------------------------------------------------------------------------------------


QUIET = 0.1  # cores other processes may keep busy during a run whose speed is counted as clean


def quiet_runs(runs: list[dict]) -> list[dict]:
    """The runs other processes left alone (under QUIET cores busy), or all of them when none was: a shared
    machine's busy moment is not a side's speed."""
    quiet = [run for run in runs if ((run.get("cpu") or {}).get("other_cores") or 0) < QUIET]
    return quiet or runs


def summary(results: dict, precision: str, sides: list[str]) -> tuple[list[tuple], dict]:
    """Each side's row of the tokens/s table, the medians of its quiet runs, and those medians."""
    rows, medians = [], {}
    for side in sides:
        runs = results[(side, precision)]
        row, medians[side] = _report.token_row(f"{side} {precision}", runs, quiet_runs(runs))
        rows.append(row)
    return rows, medians


def ratio_rows(medians: dict, precision: str) -> list[tuple]:
    """Every effitrain side over every TRL side."""
    ours = [side for side in medians if side.startswith("effitrain")]
    theirs = [side for side in medians if side.startswith("trl")]
    return [_report.ratio_row(f"{e} / {t} {precision}", medians[e], medians[t]) for e in ours for t in theirs]


def first_step_lines(results: dict, precision: str, sides: list[str]) -> list[str]:
    """The first step's loss of each side's first run; the padded sides' batches and losses compared."""
    first = {side: results[(side, precision)][0] for side in sides}
    lines = [f"{side} {precision}: first-step loss {run['first_loss']:.8f} over {run['first_batch_examples']} examples, "
             f"{run['first_batch_answer_tokens']} answer tokens, batch digest {run['first_batch_digest']}"
             for side, run in first.items()]
    pairs = [(a, b) for a in first for b in first if a < b and first[a]["first_batch_digest"] ==
             first[b]["first_batch_digest"]]
    for a, b in pairs:
        difference = abs(first[a]["first_loss"] - first[b]["first_loss"])
        lines.append(f"same first batch, {a} vs {b}: |loss difference| = {difference:.2e} "
                     f"({_report.loss_verdict(difference)})")
    if ("trl", precision) in results and ("effitrain", precision) in results and \
            first["trl"]["first_batch_digest"] != first["effitrain"]["first_batch_digest"]:
        lines.append("WARNING: trl and effitrain did not train on the same first batch")
    return lines


def compare(args) -> None:
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        shape = _sides.comparison_model(args, Path(tmp), TEMPLATE)
        turns = _common.take_turns([(side, p) for p in args.precision for side in args.sides], args.runs,
                                   lambda side_precision: _sides.run_side(Path(__file__), *side_precision, args,
                                                                          Path(tmp)))
    results = dict(turns)
    print(f"\n{_sides.model_text(shape)}, loss on the assistant turns; {DATA} (effitrain's training split); "
          f"{args.steps} steps of {args.batch_size} "
          f"(trl-packing: {PACK_BATCH} rows of {PACK_LENGTH}); seed {args.seed}; {args.runs} run(s) each, medians; "
          f"{machine()}; {_report.versions_text(results)}\n")
    for precision in args.precision:
        rows, medians = summary(results, precision, args.sides)
        print(f"medians of the quiet runs (other processes under {QUIET} cores busy); * a run left out")
        _report.print_token_tables(rows, ratio_rows(medians, precision))
        for line in first_step_lines(results, precision, args.sides):
            print(line)
        print()
    _report.warn_if_busy(results)
    if args.json is not None:
        _report.write_json(args.json, {"date": _report.utc_now(), "machine": machine(), "model": shape,
                                       "steps": args.steps, "batch_size": args.batch_size,
                                       "runs": {f"{side} {p}": runs for (side, p), runs in results.items()}})


def main(argv=None) -> None:
    _sides.main(parse_args(argv), compare, run_trl, run_effitrain,
                skipped="bf16, the padding-free and packing sides, repeats and --json")


if __name__ == "__main__":
    main()
