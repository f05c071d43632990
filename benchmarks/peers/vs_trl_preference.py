"""effitrain's preference tuning (--preference dpo / orpo) against TRL's DPOTrainer and ORPOTrainer.

Both sides train the same Llama-shaped model (4 layers, hidden 256, random weights from a config, saved
once to a temporary folder) with the same byte-level BPE tokenizer as vs_trl.py (peers/_sides.py builds both),
on the same pairs: the first STEPS x BATCH rows of effitrain's training split of the built-in `sms-spam-preference`
(conversational, an explicit prompt: the user's message and question; chosen the right label as the
assistant's turn, rejected the wrong one), in the same order (effitrain's own length-grouped training
sampler, given to TRL as its sampler: less padding for both), with the same beta, micro-batch, seed, lr, weight decay, warm-up, max grad norm,
fused AdamW and precision, dropout off (TRL's default for both trainers).

The template is ChatML with {% generation %} blocks around each answer and its <|im_end|>, the newline
between turns written before a turn rather than after it: the rendered prompt plus answer then ends on
<|im_end|>, so that TRL's completion (what prompt + answer renders beyond the prompt with its generation
prompt) is exactly effitrain's answer tokens (the assistant mask). With vs_trl.py's template (a newline
after every <|im_end|>) TRL's DPO would also score that newline, and ORPO would add a second <|im_end|>.

Sides (`--sides`), each TRL side paired with the effitrain side of the same name:
  trl-dpo / effitrain-dpo                        DPO (sigmoid loss), the reference a frozen copy of the
                                                 model (TRL's default for a full model; --reference copy)
  trl-dpo-precompute / effitrain-dpo-precompute  DPO, the reference log-probs computed once before training
                                                 (precompute_ref_log_probs=True; --reference precompute)
  trl-orpo / effitrain-orpo                      ORPO (trl.experimental.orpo), no reference
TRL at its best CPU settings: gradient_checkpointing=False and bf16 off in fp32 (its configs turn both on
by default), the same fused AdamW; DPO's fused LM head (no whole logits) is TRL's own and always on.

The first step's loss is recorded on every side with a digest of its batch (each pair's prompt + chosen
and prompt + rejected token ids and answer tokens, padding removed): the parent checks that paired sides
saw the same batch and prints both losses and their difference (target: within 1e-5 in fp32).

Each run is a fresh subprocess (`--only SIDE`), the sides taking turns over `--runs` rounds, each with its
own empty datasets cache. Figures: tokens/s = the real (non-padding) tokens of the chosen and rejected
sequences of steps 2..N over the time from the end of step 1 to the end of step N; peak RSS = ru_maxrss
at the end of training; time to saved model = from the parent's clock before the process starts to the
model saved (precomputing the reference, where a side does it, is counted there, not in tokens/s).

    .venv/bin/python benchmarks/peers/vs_trl_preference.py [--steps 20] [--runs 3] [--sides ...] [--json PATH]
    .venv/bin/python benchmarks/peers/vs_trl_preference.py --dry-run   # trl-dpo and effitrain-dpo, 2 steps of 2

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

DATA = "sms-spam-preference"
MAX_LENGTH = 512  # above the longest pair: nothing is truncated on either side
BETA = 0.1  # DPO's beta and ORPO's lambda: TRL's defaults
LR, WEIGHT_DECAY, WARMUP_RATIO, MAX_GRAD_NORM = 1e-4, 0.01, 0.1, 1.0
EVAL_SAMPLES, EVAL_BATCH = 64, 32
SIDES = ("trl-dpo", "effitrain-dpo", "trl-dpo-precompute", "effitrain-dpo-precompute", "trl-orpo", "effitrain-orpo")
IGNORE = -100
# ChatML, generation blocks around each answer and its end of turn, the newline between turns before a turn.
TEMPLATE = ("{% for message in messages %}{% if not loop.first %}{{ '\n' }}{% endif %}"
            "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
            "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}{{ '\n<|im_start|>assistant\n' }}{% endif %}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _sides.common_arguments(parser, SIDES, steps=20, batch_size=8,
                            batch_help="pairs a step (default 8: 16 sequences)", precisions=False,
                            sides_help="default: all (a dry run: the DPO pair)",
                            dry_run="trl-dpo and effitrain-dpo once each, fp32, a 1-layer model, 2 steps of 2; "
                                    "no --json")
    args = _sides.parsed(parser, argv, dry_run_batch=2)
    if args.dry_run:
        args.sides = args.sides or ["trl-dpo", "effitrain-dpo"]
    args.sides = args.sides or list(SIDES)
    _sides.require_peer(parser, args, "trl", "TRL", alone="effitrain-dpo")
    return args


def effitrain_data(args):
    """effitrain's preference task with this benchmark's settings: its splits of the built-in data (the
    pairs both sides train on: the first steps x batch rows of its training split; EVAL_SAMPLES of
    validation and test) and the order its training sampler draws the first epoch in (length-grouped,
    seeded as effitrain seeds it), given to TRL's trainers so that both sides see the same batches."""
    from transformers import AutoTokenizer

    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.data import text

    config = TrainConfig(model=str(args.model_dir), task="causal-lm", data=DATA, preference="orpo", seed=args.seed,
                         max_length=MAX_LENGTH, max_train_samples=args.steps * args.batch_size,
                         max_eval_samples=EVAL_SAMPLES)
    task = tasks.for_config(config)
    splits = task.load_data(config).splits
    encoded = task.preprocess(splits, AutoTokenizer.from_pretrained(str(args.model_dir)), config, None)
    order = list(text.train_sampler(encoded["train"], args.batch_size, config.group_by_length, args.seed))
    return splits, order


# --- what both sides record -------------------------------------------------------------------------


def pair_examples(chosen_ids, chosen_answer, rejected_ids, rejected_answer) -> list[tuple]:
    """Each pair as (prompt + chosen ids, chosen's answer ids, prompt + rejected ids, rejected's answer
    ids), from rows without padding: lists of id lists and of answer masks."""
    found = []
    for ci, ca, ri, ra in zip(chosen_ids, chosen_answer, rejected_ids, rejected_answer):
        found.append((tuple(ci), tuple(i for i, a in zip(ci, ca) if a),
                      tuple(ri), tuple(i for i, a in zip(ri, ra) if a)))
    return found


def unpadded(ids, keep) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(ids, keep)]


def trl_dpo_examples(batch: dict) -> list[tuple]:
    """DPOTrainer's batch: chosen rows then rejected rows, right-padded, completion_mask on the answers."""
    ids, keep, answer = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    half = ids.shape[0] // 2
    rows, masks = unpadded(ids, keep), unpadded(answer, keep)
    return pair_examples(rows[:half], masks[:half], rows[half:], masks[half:])


def trl_orpo_examples(batch: dict) -> list[tuple]:
    """ORPOTrainer's batch: chosen_* and rejected_* tensors, labels -100 on the prompt and padding."""
    sides = []
    for side in ("chosen", "rejected"):
        keep = batch[f"{side}_attention_mask"]
        sides += [unpadded(batch[f"{side}_input_ids"], keep), unpadded(batch[f"{side}_labels"] != IGNORE, keep)]
    return pair_examples(*sides)


def effitrain_examples(batch: dict) -> list[tuple]:
    """effitrain's preference batch: [pairs, 2, width] tensors (chosen at [:, 0], rejected at [:, 1]),
    labels -100 off the answers."""
    sides = []
    for side in (0, 1):
        keep = batch["attention_mask"][:, side]
        sides += [unpadded(batch["input_ids"][:, side], keep), unpadded(batch["labels"][:, side] != IGNORE, keep)]
    return pair_examples(*sides)


def real_tokens(batch: dict) -> int:
    """The non-padding tokens of a step's chosen and rejected sequences."""
    return int(sum(batch[key].sum() for key in batch if key.endswith("attention_mask") and not
                   key.startswith("prompt")))


COMPARED_STEPS = 5  # the first steps whose losses are compared: step 1's DPO loss is ln 2 whatever the model


class StepLog(_sides.StepLog):
    """Each step's end (perf_counter), real tokens and loss; the first steps' batch digests; the first
    step's metrics."""

    def __init__(self, examples):
        super().__init__(examples, real_tokens)
        self.losses: list[float] = []
        self.digests: list[str] = []
        self.first_metrics: dict = {}

    def batch(self, batch: dict) -> None:
        super().batch(batch)
        if len(self.digests) < COMPARED_STEPS:
            self.digests.append(_sides.digest(self.examples(batch)))

    def step_loss(self, loss: float) -> None:
        self.losses.append(loss)

    def figures(self, steps: int) -> dict:
        return {**self.speed(steps), "first_loss": self.losses[0],
                "losses": self.losses[:COMPARED_STEPS], "digests": self.digests,
                "first_metrics": self.first_metrics, "first_batch_digest": self.digests[0],
                "first_batch_pairs": len(self.first_batch),
                "first_batch_answer_tokens": sum(len(p[1]) + len(p[3]) for p in self.first_batch)}


# --- TRL ----------------------------------------------------------------------------------------------


def trl_config(args, side: str, out_dir: str):
    import trl

    shared = dict(output_dir=out_dir, max_steps=args.steps, learning_rate=LR, weight_decay=WEIGHT_DECAY,
                  warmup_steps=WARMUP_RATIO, max_grad_norm=MAX_GRAD_NORM, seed=args.seed, optim="adamw_torch_fused",
                  per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=EVAL_BATCH,
                  bf16=args.precision == "bf16", gradient_checkpointing=False, beta=BETA, max_length=MAX_LENGTH,
                  disable_dropout=True, use_cpu=True, report_to="none", save_strategy="no", eval_strategy="no",
                  logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0)
    if side == "trl-orpo":
        from trl.experimental.orpo import ORPOConfig

        return ORPOConfig(**shared)
    return trl.DPOConfig(**shared, loss_type=["sigmoid"], precompute_ref_log_probs=side == "trl-dpo-precompute")


def trl_trainer_class(side: str):
    import trl

    if side == "trl-orpo":
        from trl.experimental.orpo import ORPOTrainer

        return ORPOTrainer
    return trl.DPOTrainer


def run_trl(args, side: str) -> dict:
    import torch
    from datasets import concatenate_datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from effitrain.runtime import libraries

    libraries.quiet_libraries(False)
    orpo = side == "trl-orpo"
    log = StepLog(trl_orpo_examples if orpo else trl_dpo_examples)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    splits, order = effitrain_data(args)
    model = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
    out_dir = tempfile.mkdtemp(prefix="vs_trl_preference_trl_")
    # The validation and test pairs effitrain evaluates, as one set: ORPOTrainer takes no dict of sets.
    held_out = concatenate_datasets([splits["validation"], splits["test"]])

    class Recorded(trl_trainer_class(side)):
        """Records each training batch and the first step's loss and metrics; draws the pairs in
        effitrain's order."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                if not log.losses:
                    log.first_metrics = first_metrics(self, orpo)
                log.step_loss(float(loss.detach()))
                log.batch(inputs)
            return loss

        def _get_train_sampler(self, train_dataset=None):
            return order

    trainer = Recorded(model=model, args=trl_config(args, side, out_dir), train_dataset=splits["train"],
                       eval_dataset=held_out,
                       processing_class=tokenizer, callbacks=[_sides.step_clock(log.ends)])
    return _sides.trl_side(trainer, args, side, log, out_dir, lambda trainer: trainer.evaluate(), "held_out_loss")


def first_metrics(trainer, orpo: bool) -> dict:
    """TRL's metrics of the first step, under effitrain's names."""
    if orpo:
        stored = {key: values[0] for key, values in trainer._stored_metrics["train"].items()}
        names = {"rewards/chosen": "rewards_chosen", "rewards/rejected": "rewards_rejected",
                 "rewards/margins": "reward_margin", "rewards/accuracies": "preference_accuracy",
                 "nll_loss": "nll", "log_odds_ratio": "log_odds_ratio"}
    else:
        stored = {key: values[0] for key, values in trainer._metrics["train"].items() if isinstance(values, list)}
        names = {"rewards/chosen": "rewards_chosen", "rewards/rejected": "rewards_rejected",
                 "rewards/margins": "reward_margin", "rewards/accuracies": "preference_accuracy"}
    return {ours: float(stored[theirs]) for theirs, ours in names.items() if theirs in stored}


# --- effitrain ----------------------------------------------------------------------------------------


def effitrain_settings(args, side: str) -> dict:
    preference = "orpo" if side.endswith("orpo") else "dpo"
    settings = {"preference": preference, "beta": BETA}
    if preference == "dpo":
        settings["reference"] = "precompute" if side.endswith("precompute") else "copy"
    return settings


def run_effitrain(args, side: str) -> dict:
    settings = {"data": DATA, "lr": LR, "weight_decay": WEIGHT_DECAY, "warmup_ratio": WARMUP_RATIO,
                "max_grad_norm": MAX_GRAD_NORM, "max_length": MAX_LENGTH,
                "max_train_samples": args.steps * args.batch_size, "max_eval_samples": EVAL_SAMPLES,
                "eval_batch_size": EVAL_BATCH, "log_every": 1, **effitrain_settings(args, side)}
    return _sides.effitrain_side(args, side, StepLog(effitrain_examples), "vs_trl_preference_effitrain_",
                                 "held_out_loss", settings)


# --- the parent ---------------------------------------------------------------------------------------


def summary(results: dict) -> tuple[list[tuple], dict]:
    """Each side's row of the tokens/s table (medians of all its runs), and those medians."""
    rows, medians = [], {}
    for side, runs in results.items():
        row, medians[side] = _report.token_row(side, runs)
        rows.append(row)
    return rows, medians


def pairs_of(sides) -> list[tuple[str, str]]:
    """(effitrain side, TRL side) of each kind both ran."""
    return [(side, "trl" + side[len("effitrain"):]) for side in sides
            if side.startswith("effitrain") and "trl" + side[len("effitrain"):] in sides]


def ratio_rows(medians: dict) -> list[tuple]:
    """Each effitrain side over the TRL side of its kind."""
    return [_report.ratio_row(f"{ours} / {theirs}", medians[ours], medians[theirs])
            for ours, theirs in pairs_of(medians)]


def first_step_lines(results: dict) -> list[str]:
    """Each side's first-step loss (its first run); paired sides' batches and losses compared."""
    first = {side: runs[0] for side, runs in results.items()}
    lines = []
    for side, run in first.items():
        shown = ", ".join(f"{key} {value:.6f}" for key, value in run["first_metrics"].items())
        lines.append(f"{side}: first-step loss {run['first_loss']:.8f} over {run['first_batch_pairs']} pairs, "
                     f"{run['first_batch_answer_tokens']} answer tokens, batch digest {run['first_batch_digest']}"
                     + (f"; {shown}" if shown else ""))
    for ours, theirs in pairs_of(first):
        a, b = first[ours], first[theirs]
        if a["first_batch_digest"] != b["first_batch_digest"]:
            lines.append(f"WARNING: {ours} and {theirs} did not train on the same first batch")
            continue
        difference = abs(a["first_loss"] - b["first_loss"])
        lines.append(f"same first batch, {ours} vs {theirs}: first-step loss {a['first_loss']:.8f} vs "
                     f"{b['first_loss']:.8f}, |difference| = {difference:.2e} ({_report.loss_verdict(difference)})")
        same = 0
        while same < min(len(a["digests"]), len(b["digests"])) and a["digests"][same] == b["digests"][same]:
            same += 1
        worst = max(abs(x - y) for x, y in zip(a["losses"][:same], b["losses"][:same]))
        lines.append(f"  steps 1-{same} (the same batches): losses {' '.join(f'{x:.6f}' for x in a['losses'][:same])} "
                     f"vs {' '.join(f'{y:.6f}' for y in b['losses'][:same])}, largest |difference| {worst:.2e}")
    return lines


def compare(args) -> None:
    with tempfile.TemporaryDirectory(prefix="vs_trl_preference_") as tmp:
        shape = _sides.comparison_model(args, Path(tmp), TEMPLATE)
        results = _common.take_turns(args.sides, args.runs, lambda side: _sides.run_side(
            Path(__file__), side, args.precision, args, Path(tmp)))
    print(f"\n{_sides.model_text(shape)}; {DATA} (the first {args.steps * args.batch_size} pairs of effitrain's "
          f"training split); {args.steps} steps "
          f"of {args.batch_size} pairs; beta {BETA}; {args.precision}; seed {args.seed}; {args.runs} run(s) each, "
          f"medians; {machine()}; {_report.versions_text(results)}\n")
    rows, medians = summary(results)
    _report.print_token_tables(rows, ratio_rows(medians))
    for line in first_step_lines(results):
        print(line)
    _report.warn_if_busy(results, before="\n")
    if args.json is not None:
        _report.write_json(args.json, {"date": _report.utc_now(), "machine": machine(), "model": shape,
                                       "steps": args.steps, "batch_size": args.batch_size, "beta": BETA,
                                       "precision": args.precision, "runs": results})


def main(argv=None) -> None:
    args = parse_args(argv)
    _sides.main(args, compare, run_trl, run_effitrain, skipped="repeats and --json" if len(args.sides) != 2 else
                "the precompute and ORPO sides, repeats and --json")


if __name__ == "__main__":
    main()
