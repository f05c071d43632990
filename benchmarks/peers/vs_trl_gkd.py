"""effitrain's on-policy distillation (--rl distill) against TRL's GKDTrainer (fully on-policy, lmbda 1).

Both sides train the same 2-layer Llama-shaped student (from a config, random weights from --seed) against the
same 4-layer teacher (the same config with 4 layers, random weights from --seed + 1), both saved once by the
parent with the same byte-level BPE tokenizer and ChatML template as vs_trl.py (_sides.make_model). Random
weights: the student rarely samples its end of turn, so nearly every completion runs to MAX_NEW_TOKENS on both
sides (the work of a step is the same; the report gives each side's completion tokens per step).

Data: sms-spam-chat's user turns (the message and the spam question) as a `prompt` column (one user message)
written to a JSON-lines file; effitrain reads it with --rl distill, and TRL is given effitrain's training split
of it as conversational `messages` (the user turn and the right answer as the assistant's: GKDTrainer's
collator takes all but the last turn as the prompt and renders it with the chat template's generation prompt,
as effitrain renders a conversational prompt), its sampler the order effitrain's sampler draws.

The same settings on both sides: fully on-policy (TRL lmbda 1, seq_kd off: every batch the student's own
samples, generated in TRL's training_step with HF generate; effitrain's rollout, once per optimizer step), the
reverse KL (beta 1: TRL's generalized_jsd_loss, effitrain's --distill-beta 1) at divergence temperature 1 (TRL's
compute_loss always calls generalized_jsd_loss at its default temperature 1, whatever GKDConfig.temperature
says; effitrain's --distill-temperature 1), sampling temperature 1, top-p 1, no top-k (TRL's top_k 0), at most
MAX_NEW_TOKENS new tokens, GENERATIONS completions per prompt, learning rate LR, no warm-up, no weight decay, max
grad norm 1, fused AdamW, one micro-batch a step (TRL's per_device_train_batch_size = prompts x GENERATIONS,
effitrain's --batch-size = prompts), fp32 and bf16 autocast. Completions per prompt: effitrain's
--num-generations must be >= 2 (a rule written for GRPO's groups, also applied to --rl distill); TRL's GKD
generates one per dataset row, so its sampler gives each prompt GENERATIONS times in a row (as vs_trl_grpo.py
gives GRPO's repeats): both sides sample the same prompts GENERATIONS times a step, and prompts/s counts
distinct prompts on both.

Sides (`--sides`):
  trl               GKDTrainer (CPU, gradient checkpointing off, lmbda 1, beta 1)
  effitrain         effitrain.train with --rl distill --distill-from TEACHER
  effitrain-unshared  the same with each row's prompt run on its own (sampling and loss), as TRL's repeated rows
                    run it: what effitrain's step costs where no two rows share a prompt (one completion per
                    prompt, which its --num-generations >= 2 refuses), not a setting of effitrain's
  trl-first-update  the first update checked, not timed: effitrain's rollout samples the first step's completions
                    once; TRL's own generate_on_policy_outputs turns them into its inputs (its masks and labels)
                    and its compute_loss scores them; the losses and every gradient compared (below)

Figures: prompts/s = the prompts of steps 2..N over the time from the end of step 1 to the end of step N;
generation share = the seconds of steps 2..N in sampling (effitrain's rollout; TRL's generate_on_policy_outputs)
over those steps' seconds; peak RSS = ru_maxrss as training ends; completion tokens per step. Each run is a fresh
subprocess (`--only SIDE`), the sides taking turns over `--runs` rounds.

The first update: TRL's compute_loss runs its forwards on left-padded rows with an attention mask and no
position ids (a shorter prompt's row starts at a later position than it was sampled at; Llama's rotary positions
are relative, so that changes only rounding); effitrain counts each row's positions from its first token. The
check reports TRL's loss on the padded batch as TRL computes it, and TRL's compute_loss row by row (each row
unpadded: the same function of the weights as effitrain's), whose loss and gradients must agree with effitrain's
within 1e-5 in fp32. It also reports the normalisation TRL's training loop uses: Trainer passes num_items_in_batch
counted from the collated dataset's labels (the reference answers' tokens), not from the sampled completions'.

    .venv/bin/python benchmarks/peers/vs_trl_gkd.py [--steps 10] [--runs 3] [--precision fp32 bf16] [--json PATH]
    .venv/bin/python benchmarks/peers/vs_trl_gkd.py --dry-run   # 2 steps of 2 prompts, 1-layer models

Needs TRL (pip install -e '.[bench]', trl pinned); a dry run without it runs the effitrain side only.
Compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from _common import fmt, machine, mib, print_columns  # noqa: E402
from peers import _report, _sides  # noqa: E402
from peers.vs_trl import TEMPLATE  # noqa: E402
from peers.vs_trl_grpo import backward_seconds  # noqa: E402

GENERATIONS, MAX_NEW_TOKENS = 2, 32
LR, MAX_GRAD_NORM, BETA, DISTILL_T = 1e-4, 1.0, 1.0, 1.0
STUDENT_LAYERS, TEACHER_LAYERS = 2, 4
MAX_LENGTH = 512  # above the longest prompt on both sides: none is cut (effitrain's default 128 would keep the end)
PROMPTS = 600  # sms-spam-chat's first rows written as prompts: effitrain holds some out, more than enough steps
SIDES = ("trl", "effitrain", "effitrain-unshared", "trl-first-update")
CHECKED = "trl-first-update"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _sides.common_arguments(parser, SIDES, steps=10, batch_size=8,
                            batch_help=f"prompts a step (default 8: {8 * GENERATIONS} completions)",
                            precisions=True,
                            dry_run="every side once (TRL's only where it is installed), fp32, 1-layer models, "
                                    "2 steps of 2 prompts; no --json")
    args = _sides.parsed(parser, argv, dry_run_batch=2)
    _sides.require_peer(parser, args, "trl", "TRL", alone="effitrain")
    if args.only is not None:
        args.precision = args.precision[0]  # a child runs one side in one precision
    return args


# --- the models and the prompts (made once, in the parent) ------------------------------------------------


def teacher_dir(args) -> Path:
    return Path(args.model_dir).parent / "teacher"


def prompts_file(args) -> Path:
    return Path(args.model_dir).parent / "prompts.jsonl"


def make_models(args, folder: Path) -> dict:
    """The teacher (TEACHER_LAYERS) and the student (STUDENT_LAYERS; args.model_dir) of one config and tokenizer
    (_sides.make_model's, ChatML), random weights; 1 layer each in a dry run. The prompts file beside them."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    args.model_dir = folder / "student"
    teacher = teacher_dir(args)
    shape = _sides.make_model(teacher, 512 if args.dry_run else args.vocab, args.seed, TEMPLATE, tiny=args.dry_run)
    config = LlamaConfig.from_pretrained(teacher)
    layers = {"student": 1, "teacher": 1} if args.dry_run else {"student": STUDENT_LAYERS, "teacher": TEACHER_LAYERS}
    for name, seed in (("teacher", args.seed + 1), ("student", args.seed)):
        config.num_hidden_layers = layers[name]
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(folder / name)
        shape[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())
    AutoTokenizer.from_pretrained(teacher).save_pretrained(args.model_dir)
    write_prompts(prompts_file(args))
    return {**shape, **{f"{name}_layers": n for name, n in layers.items()}}


def write_prompts(path: Path) -> None:
    """sms-spam-chat's first PROMPTS conversations: the user turn as `prompt`, the answer as `reply` (TRL's last
    turn; effitrain's distillation reads no other column)."""
    from effitrain.data import builtins

    rows = builtins.sms_spam_chat()["all"].select(range(PROMPTS))
    with path.open("w") as out:
        for messages in rows["messages"]:
            out.write(json.dumps({"prompt": messages[:-1], "reply": messages[-1]["content"]}) + "\n")


def model_text(shape: dict) -> str:
    return (f"Llama-shaped student ({shape['student_layers']} layers, {shape['student_parameters'] / 1e6:.2f}M "
            f"parameters) and teacher ({shape['teacher_layers']} layers, {shape['teacher_parameters'] / 1e6:.2f}M) "
            f"from one config (hidden {shape['hidden_size']}, vocabulary {shape['vocab']}), random weights, "
            f"byte-level BPE tokenizer, ChatML")


# --- the data both sides draw ---------------------------------------------------------------------------


def effitrain_settings(args) -> dict:
    """effitrain.train's settings of this comparison (beside _sides.effitrain_side's model, steps, batch, seed,
    precision)."""
    return {"data": str(prompts_file(args)), "rl": "distill", "distill_from": str(teacher_dir(args)),
            "distill_beta": BETA, "distill_temperature": DISTILL_T, "num_generations": GENERATIONS,
            "max_new_tokens": MAX_NEW_TOKENS, "max_length": MAX_LENGTH, "temperature": 1.0, "top_p": 1.0, "lr": LR,
            "weight_decay": 0.0, "warmup_ratio": 0.0, "max_grad_norm": MAX_GRAD_NORM, "max_eval_samples": 4,
            "log_every": 1}


def effitrain_data(args):
    """effitrain's online-RL task on these settings, its training split's rows, its encoded splits and the order
    its training sampler draws the first epoch in (seeded as effitrain seeds it)."""
    from transformers import AutoTokenizer

    from effitrain import tasks
    from effitrain.config import TrainConfig, resolved
    from effitrain.data import text

    settings = {k: v for k, v in effitrain_settings(args).items() if k not in ("max_eval_samples", "log_every")}
    config = resolved(TrainConfig(model=str(args.model_dir), task="causal-lm", seed=args.seed,
                                  batch_size=args.batch_size, **settings))
    task = tasks.for_config(config)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    splits = task.load_data(config).splits
    encoded = task.preprocess(splits, tokenizer, config, None)
    order = list(text.train_sampler(encoded["train"], args.batch_size, config.group_by_length, args.seed))
    return config, task, tokenizer, splits, encoded, order


def trl_dataset(splits):
    """effitrain's training rows as TRL's conversations: the prompt's turns and the reference answer."""
    train = splits["train"]
    return train.map(lambda row: {"messages": row["prompt"] + [{"role": "assistant", "content": row["reply"]}]},
                     remove_columns=train.column_names)


def prompt_tokens(ids, mask) -> list[tuple]:
    """Each row's prompt token ids without its padding, each distinct prompt once, sorted: the step's prompts."""
    return sorted({tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask)})


# --- what both sides record -------------------------------------------------------------------------------


class StepLog(_sides.StepLog):
    """Each step's end, distinct prompts, loss, completion tokens and seconds in sampling; the first step's
    prompts (their token ids: the digest shows both sides drew the same)."""

    def __init__(self, prompts_of):
        super().__init__(lambda batch: [list(p) for p in prompts_of(batch)], lambda batch: len(prompts_of(batch)))
        self.losses: list[float] = []
        self.generation: list[float] = []
        self.completion_tokens: list[float] = []

    def step_loss(self, loss: float) -> None:
        self.losses.append(loss)

    def figures(self, steps: int) -> dict:
        seconds = self.ends[-1] - self.ends[0]
        return {"steps_timed": len(self.ends) - 1, "seconds": seconds,
                "prompts_per_second": sum(self.tokens[1:steps]) / seconds,
                "generation_share": sum(self.generation[1:steps]) / seconds,
                "completion_tokens_per_step": statistics.mean(self.completion_tokens[:steps]),
                "generation_seconds": self.generation, "step_ends": self.ends, "losses": self.losses,
                "first_digest": _sides.digest(self.first_batch)}


class EffitrainLog(StepLog):
    """effitrain's step result: the window holds the loss sum and items, then the objective's train sums (kl,
    completion_length, truncated_share, generation_seconds: each a sum over completions) and the step's
    completions last."""

    names: tuple = ()

    def step_result(self, result) -> None:
        window = [float(x) for x in result.window]
        completions = window[-1]
        self.generation.append(window[2 + self.names.index("generation_seconds")] / completions)
        self.completion_tokens.append(window[2 + self.names.index("completion_length")])


def effitrain_prompts(batch) -> list[tuple]:
    return prompt_tokens(batch["input_ids"], batch["attention_mask"])


def trl_prompts(inputs) -> list[tuple]:
    return prompt_tokens(inputs["prompts"], inputs["prompt_attention_mask"])


# --- TRL -----------------------------------------------------------------------------------------------


def trl_config(args, out_dir: str, max_steps: int):
    from trl.experimental.gkd import GKDConfig

    return GKDConfig(
        output_dir=out_dir, max_steps=max_steps, learning_rate=LR, weight_decay=0.0, warmup_steps=0,
        lr_scheduler_type="linear", max_grad_norm=MAX_GRAD_NORM, seed=args.seed, optim="adamw_torch_fused",
        per_device_train_batch_size=args.batch_size * GENERATIONS, gradient_accumulation_steps=1,
        lmbda=1.0, seq_kd=False, beta=BETA, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, max_length=MAX_LENGTH,
        bf16=args.precision == "bf16", gradient_checkpointing=False, use_cpu=True, report_to="none",
        save_strategy="no", eval_strategy="no", logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0)


def trl_trainer(args, student, teacher, tokenizer, dataset, order, log, out_dir, max_steps):
    """A GKDTrainer drawing effitrain's order (each prompt GENERATIONS times in a row), timing each sampling."""
    from trl.experimental.gkd import GKDTrainer

    class Recorded(GKDTrainer):
        def _get_train_sampler(self, dataset=None):
            return [index for index in order for _ in range(GENERATIONS)]

        def generate_on_policy_outputs(self, model, inputs, generation_config):
            started = time.perf_counter()
            out = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            if log is not None:
                log.generation.append(time.perf_counter() - started)
                log.batch(inputs)
                labels = out[2]
                log.completion_tokens.append(float((labels != -100).sum()))
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if log is not None:
                log.step_loss(float((loss[0] if return_outputs else loss).detach()))
            return loss

    return Recorded(model=student, teacher_model=teacher, args=trl_config(args, out_dir, max_steps),
                    train_dataset=dataset, processing_class=tokenizer,
                    callbacks=[] if log is None else [_sides.step_clock(log.ends)])


def load_models(args):
    import torch
    from transformers import AutoModelForCausalLM

    return (AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32),
            AutoModelForCausalLM.from_pretrained(str(teacher_dir(args)), dtype=torch.float32))


def run_trl(args, side: str) -> dict:
    from transformers import set_seed

    from effitrain.runtime import libraries

    libraries.quiet_libraries(False)
    if side == CHECKED:
        return first_update(args)
    set_seed(args.seed)
    _, _, tokenizer, splits, _, order = effitrain_data(args)
    log = StepLog(trl_prompts)
    student, teacher = load_models(args)
    out_dir = tempfile.mkdtemp(prefix="vs_trl_gkd_trl_")
    trainer = trl_trainer(args, student, teacher, tokenizer, trl_dataset(splits), order[:args.steps * args.batch_size],
                          log, out_dir, args.steps)
    return _sides.trl_side(trainer, args, side, log, out_dir, lambda trainer: {}, "held_out_loss")


# --- effitrain ---------------------------------------------------------------------------------------------


def run_effitrain(args, side: str) -> dict:
    from effitrain.config import TrainConfig
    from effitrain.tasks import objectives

    if side == "effitrain-unshared":
        unshare_prompts()
    log = EffitrainLog(effitrain_prompts)
    config = TrainConfig(model=str(args.model_dir), task="causal-lm", **effitrain_settings(args))
    log.names = objectives.of_rl(config).train_metric_names
    result = _sides.effitrain_side(args, side, log, "vs_trl_gkd_effitrain_", "held_out_loss",
                                   effitrain_settings(args))
    return {**result, "trl_imported": "trl" in sys.modules}


class _RowToken(int):
    """A token id equal only to the same id of the same row: a row's prompt made of them differs from every other
    row's, so sampling._decode's one-pass-per-distinct-prompt runs each row's prompt on its own."""

    def __new__(cls, value: int, row: int):
        token = super().__new__(cls, value)
        token.row = row
        return token

    def __hash__(self):
        return hash((int(self), self.row))

    def __eq__(self, other):
        return isinstance(other, _RowToken) and int(self) == int(other) and self.row == other.row


def unshare_prompts() -> None:
    """effitrain's step with no prompt pass shared between rows: the loss's forward over whole rows
    (completion_batches.shared_prompts finds no group) and the sampling's prefill once per row (every row's prompt
    distinct to sampling._decode): what its step costs at one completion per prompt, as TRL's repeated rows run."""
    import effitrain.tasks.objectives.completion_batches as completion_batches
    import effitrain.tasks.sampling as sampling

    completion_batches.shared_prompts = lambda batch, model=None: None
    decode = sampling._decode

    def every_row(model, prompt_ids, *rest):
        return decode(model, [[_RowToken(t, row) for t in ids] for row, ids in enumerate(prompt_ids)], *rest)

    sampling._decode = every_row


# --- the first update on the same completions ------------------------------------------------------------


class _Sampled:
    """What TRL's generate_on_policy_outputs reads from `model.generate`: fixed sequences (TRL's prompts and
    effitrain's completions), so that TRL's own code makes its masks and labels from them."""

    def __init__(self, sequences):
        self.sequences = sequences

    def generate(self, **_):
        return self


def first_update(args) -> dict:
    """The first step's prompts (effitrain's order), their completions sampled once by effitrain's rollout;
    effitrain's loss (its sum over the step's count) and TRL's compute_loss on TRL's inputs made from those
    completions, each backward from the same weights: the losses and every parameter's gradient compared."""
    import torch
    from trl.experimental.gkd import GKDTrainer

    torch.manual_seed(args.seed)
    config, task, tokenizer, splits, encoded, order = effitrain_data(args)
    rows = order[:args.batch_size]
    ours, _ = load_models(args)
    theirs, teacher = load_models(args)
    out_dir = tempfile.mkdtemp(prefix="vs_trl_gkd_check_")
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.precision == "bf16" else \
        contextlib.nullcontext
    task.before_training(ours, encoded, tokenizer, config, out_dir, autocast=autocast)  # the teacher's too
    collate = task.collators(tokenizer, config)[0]
    prompts = collate([encoded["train"][row] for row in rows])
    ours.train()
    with autocast():
        (micro,) = task.rollout(ours, [prompts], torch.Generator().manual_seed(args.seed))
        loss = task.train_loss(ours, micro).loss_sum / task.item_count(micro)
    loss.backward()
    width = prompts["input_ids"].shape[1]
    completion_mask = micro["completion_mask"]

    trainer = trl_trainer(args, theirs, teacher, tokenizer, trl_dataset(splits), rows, None, out_dir, 1)
    trainer.model.train()
    dataset = trl_dataset(splits)
    collated = trainer.data_collator([dataset[row] for row in rows for _ in range(GENERATIONS)])
    same_prompts = prompt_tokens(collated["prompts"], collated["prompt_attention_mask"]) == prompt_tokens(
        micro["input_ids"][:, :width], micro["attention_mask"][:, :width])
    completions = micro["input_ids"][:, width:].masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    sequences = torch.cat([collated["prompts"], completions], dim=1)
    ids, mask, labels = GKDTrainer.generate_on_policy_outputs(_Sampled(sequences), collated, trainer.generation_config)
    made = {**collated, "input_ids": ids, "attention_mask": mask, "labels": labels}
    counted = int((labels[:, 1:] != -100).sum())
    loop_items = trainer._get_num_items_in_batch([collated], ids.device)  # what the training loop would pass

    def their_loss(batch, items=None):
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(trainer.model, batch, num_items_in_batch=items)

    padded = float(their_loss(made).detach())
    in_loop = float(their_loss(made, loop_items).detach())

    def row_by_row():  # each row unpadded (its positions from its first token), the sums over the step's tokens
        total = 0
        for i in range(len(ids)):
            keep = mask[i].bool() | (labels[i] != -100)
            one = {"input_ids": ids[i][keep][None], "attention_mask": mask[i][keep][None],
                   "labels": labels[i][keep][None]}
            total = total + their_loss(one, 1)
        return total / counted

    theirs.zero_grad()
    unpadded_loss = row_by_row()
    unpadded_loss.backward()
    grads = {name: (p.grad, dict(theirs.named_parameters())[name].grad) for name, p in ours.named_parameters()}
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in grads.values())
    largest = max(float(b.float().abs().max()) for _, b in grads.values())
    same_tokens = bool((mask[:, -completion_mask.shape[1]:] == completion_mask).all())
    ours_seconds = backward_seconds(ours, lambda: task.train_loss(ours, micro).loss_sum / task.item_count(micro),
                                    autocast)
    theirs_seconds = backward_seconds(theirs, lambda: their_loss(made), contextlib.nullcontext)
    widths = collated["prompt_attention_mask"].sum(1)
    return {"side": CHECKED, "precision": args.precision, "saved_at": time.time(), "prompts": len(rows),
            "completions": len(ids), "completion_tokens": int(completion_mask.sum()), "trl_counted_tokens": counted,
            "same_prompt_tokens": same_prompts, "same_completion_mask": same_tokens,
            "padded_rows": int((widths < widths.max()).sum()),
            "effitrain_loss": float(loss), "trl_loss_unpadded": float(unpadded_loss), "trl_loss_padded": padded,
            "trl_loss_training_loop": in_loop, "trl_loop_items": int(loop_items),
            "loss_difference": abs(float(loss) - float(unpadded_loss)),
            "padded_difference": abs(float(loss) - padded),
            "effitrain_loss_backward_seconds": ours_seconds, "trl_loss_backward_seconds": theirs_seconds,
            "gradient_difference": worst, "largest_gradient": largest, "parameters": len(grads),
            "versions": {"trl": __import__("trl").__version__, **_sides.versions()}}


# --- the parent ----------------------------------------------------------------------------------------


MEDIANS = ("prompts_per_second", "generation_share", "peak_rss_bytes", "saved_seconds", "completion_tokens_per_step")


def summary(results: dict, precision: str, sides) -> tuple[list[tuple], dict]:
    rows, medians = [], {}
    for side in sides:
        runs = results.get((side, precision))
        if not runs:
            continue
        medians[side] = {key: _report.median(runs, key) for key in MEDIANS}
        other = max((run["cpu"] or {}).get("other_cores") or 0 for run in runs)
        m = medians[side]
        rows.append((f"{side} {precision}", " / ".join(f"{run['prompts_per_second']:.2f}" for run in runs),
                     fmt(m["prompts_per_second"], ".2f"), fmt(m["completion_tokens_per_step"], ".0f"),
                     fmt(m["generation_share"], ".2f"), mib(m["peak_rss_bytes"]), fmt(m["saved_seconds"], ".1f"),
                     f"{other:.2f}"))
    return rows, medians


def ratios_of(results: dict, side: str, precision: str, medians: dict) -> dict:
    """`side`'s medians over TRL's (prompts/s, peak RSS), and its prompts/s over TRL's round by round (the sides
    took turns: a round's runs met about the same contention)."""
    ours, theirs = medians[side], medians["trl"]
    rounds = [a["prompts_per_second"] / b["prompts_per_second"]
              for a, b in zip(results[(side, precision)], results[("trl", precision)])]
    return {"prompts_per_second": ours["prompts_per_second"] / theirs["prompts_per_second"],
            "peak_rss": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"], "rounds": rounds,
            "round_median": statistics.median(rounds)}


def check_lines(checks: dict) -> list[str]:
    lines = []
    for precision, run in checks.items():
        verdict = f" ({_report.loss_verdict(max(run['loss_difference'], run['gradient_difference']))})" \
            if precision == "fp32" else ""
        lines += [
            f"first update, {precision}, the same {run['completions']} completions ({run['prompts']} prompts, "
            f"{run['completion_tokens']} completion tokens; the same prompt tokens: {run['same_prompt_tokens']}; "
            f"TRL's completion mask the same: {run['same_completion_mask']}; {run['padded_rows']} rows left-padded "
            f"in TRL's batch):",
            f"  loss effitrain {run['effitrain_loss']:.9f} vs TRL row by row {run['trl_loss_unpadded']:.9f}, "
            f"|difference| {run['loss_difference']:.2e}; gradient largest |difference| "
            f"{run['gradient_difference']:.2e} over {run['parameters']} tensors (largest |gradient| "
            f"{run['largest_gradient']:.2e}){verdict}",
            f"  TRL on its padded batch {run['trl_loss_padded']:.9f} (|difference| {run['padded_difference']:.2e}: "
            f"rows left-padded, positions not counted from each row's start); as its training loop normalises it "
            f"{run['trl_loss_training_loop']:.9f} (divided by {run['trl_loop_items']} reference-answer tokens, not "
            f"the {run['trl_counted_tokens']} sampled ones)",
            f"  the step's loss and backward alone (median of 5): effitrain "
            f"{run['effitrain_loss_backward_seconds']:.3f} s, TRL {run['trl_loss_backward_seconds']:.3f} s"]
    return lines


def compare(args) -> None:
    timed = [side for side in args.sides if side != CHECKED]
    with tempfile.TemporaryDirectory(prefix="vs_trl_gkd_") as tmp:
        shape = make_models(args, Path(tmp))
        checks = {p: _sides.run_side(Path(__file__), CHECKED, p, args, Path(tmp)) for p in args.precision
                  if CHECKED in args.sides}
        turns = _common.take_turns([(side, p) for p in args.precision for side in timed], args.runs,
                                   lambda side_precision: _sides.run_side(Path(__file__), *side_precision, args,
                                                                          Path(tmp)))
    results = dict(turns)
    print(f"\n{model_text(shape)}; sms-spam-chat user turns as prompts (effitrain's training split, its order); "
          f"{args.steps} steps of {args.batch_size} prompts x {GENERATIONS} completions of at most {MAX_NEW_TOKENS} "
          f"new tokens; reverse KL (beta {BETA:g}) at temperature {DISTILL_T:g}; lr {LR}; seed {args.seed}; "
          f"{args.runs} run(s) each, medians; {machine()}; "
          f"{_report.versions_text(results or {CHECKED: list(checks.values())})}\n")
    ratios = {}
    for precision in args.precision:
        rows, medians = summary(results, precision, timed)
        if not rows:
            continue
        print_columns(("", "prompts/s of each run", "median prompts/s", "completion tokens/step",
                       "generation share", "peak RSS", "s to saved model", "other cores"), rows)
        for ours_side in ("effitrain", "effitrain-unshared"):
            if ours_side in medians and "trl" in medians:
                ratios[f"{ours_side} {precision}"] = ratio = ratios_of(results, ours_side, precision, medians)
                print(f"{ours_side} / TRL, {precision}: prompts/s {ratio['prompts_per_second']:.2f}x (each round's: "
                      f"{' / '.join(f'{r:.2f}' for r in ratio['rounds'])}, median {ratio['round_median']:.2f}x), "
                      f"peak RSS {ratio['peak_rss']:.2f}x")
        if len(medians) > 1:
            same = {run["first_digest"] for side in medians for run in results[(side, precision)]}
            print(f"the same first step's prompt tokens on every run: {len(same) == 1}")
        print()
    for line in check_lines(checks):
        print(line)
    if any(run.get("trl_imported") for runs in results.values() for run in runs):
        print("WARNING: an effitrain run imported trl")
    if results:
        _report.warn_if_busy(results, before="\n")
    if args.json is not None:
        _report.write_json(args.json, {"date": _report.utc_now(), "machine": machine(), "model": shape,
                                       "steps": args.steps, "batch_size": args.batch_size,
                                       "generations": GENERATIONS, "max_new_tokens": MAX_NEW_TOKENS, "lr": LR,
                                       "ratios": ratios, "first_update": checks,
                                       "runs": {f"{side} {p}": runs for (side, p), runs in results.items()}})


def main(argv=None) -> None:
    args = parse_args(argv)
    _sides.main(args, compare, run_trl, run_effitrain, skipped="bf16, repeats and --json")


if __name__ == "__main__":
    main()
