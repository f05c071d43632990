"""effitrain's online RL (--rl grpo) against TRL's GRPOTrainer: GRPO on the built-in `addition` prompts.

Both sides train the same Llama-shaped model (2 layers, hidden 128, from a config) with the same
character-level tokenizer (digits, `+`, `=`, an end of sequence and a pad token; `addition`'s spaces between
digits dropped in encoding and put back between tokens in decoding, so every prompt, "2 3 + 4 5 =", is 6
tokens, an answer "6 8" 2 or 3 tokens and its end, no row is padded and both sides count positions alike),
from the same weights: random from --seed, then --sft-steps of effitrain SFT on `addition` (prompt-completion,
run once in the parent) so that some answers are right and the groups have a reward spread to learn from.
Data: effitrain's training split of `addition` (TRL is given those rows, its sampler the order effitrain's
sampler draws, each prompt repeated G times as TRL's RepeatSampler repeats it: the same prompts in every
step). The same G (GENERATIONS), at most MAX_NEW_TOKENS new tokens, temperature 1, top-p 1, learning rate, no
warm-up, no weight decay, max grad norm 1, fused AdamW, loss dapo with group-scaled rewards, no KL (beta 0, no
reference held: TRL's default), one update per generation (the whole step's prompts x G completions one
micro-batch on both sides: TRL's per_device_train_batch_size = prompts x G, effitrain's --batch-size =
prompts), the same reward: effitrain's built-in exact-match (the completion stripped equals the `answer`
column), given to TRL as its reward function.

Sides (`--sides`):
  trl               GRPOTrainer (CPU, no vLLM, gradient checkpointing off, bf16 autocast with --precision bf16)
  effitrain         effitrain.train with --rl grpo
  trl-first-update  the first update checked, not timed: effitrain's rollout makes the first step's
                    completions once; they are fed to TRL's GRPOTrainer through its rollout_func (TRL then
                    scores them, computes its advantages and its loss with its own code), and to effitrain's
                    objective; the loss and every parameter's gradient of both (target: within 1e-5 in fp32)

Figures: prompts/s = the prompts of steps 2..N over the time from the end of step 1 to the end of step N
(each step's generation, scoring and update); generation share = the seconds of steps 2..N in generation
and scoring (effitrain's rollout, as its log's generation_seconds; TRL's _generate_and_score_completions)
over those steps' seconds; peak RSS = ru_maxrss at the end of training; the reward curve: each step's mean
reward over its completions (they differ by sampling: each side draws its own completions).

Each run is a fresh subprocess (`--only SIDE`), the sides taking turns over `--runs` rounds.

    .venv/bin/python benchmarks/peers/vs_trl_grpo.py [--steps 20] [--runs 3] [--precision fp32 bf16] [--json PATH]
    .venv/bin/python benchmarks/peers/vs_trl_grpo.py --dry-run   # 2 steps of 2 prompts, a 1-layer model, no SFT

Needs TRL (pip install -e '.[bench]', trl pinned); a dry run without it runs the effitrain side only.
Compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from _common import fmt, machine, mib, print_columns  # noqa: E402
from peers import _report, _sides  # noqa: E402

DATA = "addition"
GENERATIONS, MAX_NEW_TOKENS = 8, 4  # issue 43's learning target: 8 completions, at most 4 new tokens
LR, MAX_GRAD_NORM = 3e-4, 1.0
SFT_STEPS, SFT_LR, SFT_BATCH = 1500, 3e-3, 32  # docs/rl.md walk-through's SFT
SIDES = ("trl", "effitrain", "trl-first-update")
CHECKED = "trl-first-update"
PAD, EOS = "<pad>", "<eos>"
SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=256)
TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _sides.common_arguments(parser, SIDES, steps=20, batch_size=32,
                            batch_help=f"prompts a step (default 32: {32 * GENERATIONS} completions)",
                            precisions=True,
                            dry_run="every side once (TRL's only where it is installed), fp32, a 1-layer model, "
                                    "no SFT, 2 steps of 2 prompts; no --json")
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS,
                        help=f"effitrain SFT steps on {DATA} before GRPO, both sides' start (default {SFT_STEPS})")
    args = _sides.parsed(parser, argv, dry_run_batch=2)
    if args.dry_run:
        args.sft_steps = 0
    _sides.require_peer(parser, args, "trl", "TRL", alone="effitrain")
    if args.only is not None:
        args.precision = args.precision[0]  # a child runs one side in one precision
    return args


# --- the model ----------------------------------------------------------------------------------------


def make_model(folder: Path, seed: int, tiny: bool) -> dict:
    """A character-level tokenizer (pad, end of sequence, the digits, `+`, `=`) and a Llama-shaped model from
    a config with random weights from `seed`, saved to `folder`. Whitespace is dropped when encoding and
    tokens are joined by a space when decoding (no decoder: the tokenizers library's default), as `addition`
    writes its digits apart ("2 3 + 4 5 =" -> "6 8"): without that its spaces are unknown tokens, a prompt is
    11 tokens and a three-digit answer needs 6 new tokens, more than MAX_NEW_TOKENS."""
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate([PAD, EOS, "<unk>", *"0123456789+="])}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Split(Regex("."), behavior="isolated")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD, unk_token="<unk>")
    shape = TINY if tiny else SHAPE
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=64, tie_word_embeddings=False,
                         attention_dropout=0.0, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"vocab": len(tokenizer), "parameters": sum(p.numel() for p in model.parameters()), **shape}


def fine_tuned(args, folder: Path) -> dict:
    """effitrain SFT of the random model on `addition` for --sft-steps (none in a dry run): both sides' start,
    args.model_dir; its held-out exact match."""
    import effitrain

    random = folder / "random"
    shape = make_model(random, args.seed, tiny=args.dry_run)
    args.model_dir = random
    if args.sft_steps == 0:
        return {**shape, "sft_steps": 0}
    print(f"SFT on {DATA}: {args.sft_steps} steps of {SFT_BATCH} (both sides' start) ...", flush=True)
    metrics = effitrain.train({"model": str(random), "task": "causal-lm", "data": DATA, "batch_size": SFT_BATCH,
                               "max_steps": args.sft_steps, "lr": SFT_LR, "warmup_ratio": 0.02, "seed": args.seed,
                               "max_eval_samples": 200, "max_new_tokens": MAX_NEW_TOKENS, "precision": "fp32",
                               "output_dir": str(folder / "sft")})
    args.model_dir = folder / "sft" / "model"
    return {**shape, "sft_steps": args.sft_steps, "sft_validation": metrics.get("validation"),
            "sft_test": metrics.get("test")}


def model_text(shape: dict) -> str:
    sft = (f"then {shape['sft_steps']} steps of effitrain SFT on {DATA} (held-out greedy exact match "
           f"{fmt((shape.get('sft_validation') or {}).get('exact_match'), '.3f')} validation, "
           f"{fmt((shape.get('sft_test') or {}).get('exact_match'), '.3f')} test)") if shape["sft_steps"] else \
        "no SFT"
    return (f"Llama-shaped model from a config ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"{shape['parameters'] / 1e6:.2f}M parameters), character-level tokenizer of {shape['vocab']}, "
            f"random weights, {sft}")


# --- the data both sides draw ---------------------------------------------------------------------------


def effitrain_config(args, **more):
    from effitrain.config import TrainConfig, resolved

    return resolved(TrainConfig(model=str(args.model_dir), task="causal-lm", data=DATA, rl="grpo", seed=args.seed,
                                num_generations=GENERATIONS, max_new_tokens=MAX_NEW_TOKENS,
                                batch_size=args.batch_size, **more))


def effitrain_data(args):
    """effitrain's online-RL task on this benchmark's settings, its training split's rows, its encoded
    splits and the order its training sampler draws the first epoch in (seeded as effitrain seeds it)."""
    from transformers import AutoTokenizer

    from effitrain import tasks
    from effitrain.data import text

    config = effitrain_config(args)
    task = tasks.for_config(config)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    splits = task.load_data(config).splits
    encoded = task.preprocess(splits, tokenizer, config, None)
    order = list(text.train_sampler(encoded["train"], args.batch_size, config.group_by_length, args.seed))
    return config, task, tokenizer, splits, encoded, order


def trl_dataset(splits):
    """effitrain's training rows for TRL: the prompt, the answer (the reward's column) and the row's index
    (what the step log records; the reward function ignores it)."""
    train = splits["train"]
    return train.select_columns(["prompt", "answer"]).add_column("row", list(range(len(train))))


# --- what both sides record -------------------------------------------------------------------------------


class StepLog(_sides.StepLog):
    """Each step's end, prompts, loss, mean reward and seconds in generation; the first step's prompt rows."""

    def __init__(self, examples):
        super().__init__(examples, lambda batch: len(examples(batch)))
        self.losses: list[float] = []
        self.rewards: list[float] = []
        self.generation: list[float] = []

    def step_loss(self, loss: float) -> None:
        self.losses.append(loss)

    def figures(self, steps: int) -> dict:
        seconds = self.ends[-1] - self.ends[0]
        return {"steps_timed": len(self.ends) - 1, "seconds": seconds,
                "prompts_per_second": sum(self.tokens[1:steps]) / seconds,
                "generation_share": sum(self.generation[1:steps]) / seconds,
                "generation_seconds": self.generation, "step_ends": self.ends, "losses": self.losses,
                "rewards": self.rewards, "first_rows": sorted(self.first_batch),
                "first_digest": _sides.digest(self.first_batch)}


def effitrain_rows(batch) -> list[int]:
    return [int(row) for row in batch["row_index"]]


class EffitrainLog(StepLog):
    """effitrain's step result: the window holds the loss sum and items, then the objective's train sums
    (reward first, generation_seconds among them) and the step's completions last."""

    names: tuple = ()

    def step_result(self, result) -> None:
        window = [float(x) for x in result.window]
        completions = window[-1]
        self.rewards.append(window[2] / completions)
        self.generation.append(window[2 + self.names.index("generation_seconds")] / completions)


# --- TRL -----------------------------------------------------------------------------------------------


def trl_config(args, out_dir: str, max_steps: int):
    import trl

    return trl.GRPOConfig(
        output_dir=out_dir, max_steps=max_steps, learning_rate=LR, weight_decay=0.0, warmup_steps=0,
        max_grad_norm=MAX_GRAD_NORM, seed=args.seed, optim="adamw_torch_fused",
        per_device_train_batch_size=args.batch_size * GENERATIONS, gradient_accumulation_steps=1,
        num_generations=GENERATIONS, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0,
        beta=0.0, loss_type="dapo", scale_rewards="group", num_iterations=1, use_vllm=False,
        bf16=args.precision == "bf16", gradient_checkpointing=False, use_cpu=True, report_to="none",
        save_strategy="no", eval_strategy="no", logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False)


def trl_trainer(args, model, tokenizer, dataset, order, log, out_dir, max_steps, rollout_func=None):
    """A GRPOTrainer drawing the prompts in effitrain's order (each repeated G times), timing and logging
    each generation, with effitrain's exact-match as its reward."""
    import trl

    from effitrain.tasks.objectives.rewards import builtin_rewards

    class Recorded(trl.GRPOTrainer):
        def _get_train_sampler(self, dataset=None):
            return [index for index in order for _ in range(GENERATIONS)]

        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            if log is not None:
                log.generation.append(time.perf_counter() - started)
                log.rewards.append(float(self._metrics["train"]["reward"][-1]))
                log.batch(inputs)
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if log is not None:
                log.step_loss(float(loss.detach()))
            return loss

    def exact_match(completions, answer, **_):  # TRL names the reward's metric after the function
        return builtin_rewards.exact_match(completions, answer)

    return Recorded(model=model, reward_funcs=exact_match, args=trl_config(args, out_dir, max_steps),
                    train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout_func,
                    callbacks=[] if log is None else [_sides.step_clock(log.ends)])


def trl_rows(inputs: list[dict]) -> list[int]:
    """The prompt rows of TRL's generation batch (each row G times)."""
    return sorted(set(int(x["row"]) for x in inputs))


def run_trl(args, side: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    from effitrain.runtime import libraries

    libraries.quiet_libraries(False)
    if side == CHECKED:
        return first_update(args)
    set_seed(args.seed)
    _, _, tokenizer, splits, _, order = effitrain_data(args)
    log = StepLog(trl_rows)
    model = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
    out_dir = tempfile.mkdtemp(prefix="vs_trl_grpo_trl_")
    trainer = trl_trainer(args, model, tokenizer, trl_dataset(splits), order[:args.steps * args.batch_size], log,
                          out_dir, args.steps)
    return _sides.trl_side(trainer, args, side, log, out_dir, lambda trainer: {}, "held_out_loss")


# --- effitrain ---------------------------------------------------------------------------------------------


def run_effitrain(args, side: str) -> dict:
    from effitrain.tasks import objectives

    log = EffitrainLog(effitrain_rows)
    objective = objectives.of_rl(effitrain_config(args))
    objective.load_rewards(["prompt", "answer"])  # the default reward, exact-match: a sum of its own in the log
    log.names = objective.train_metric_names
    settings = {"data": DATA, "rl": "grpo", "num_generations": GENERATIONS, "max_new_tokens": MAX_NEW_TOKENS,
                "temperature": 1.0, "top_p": 1.0, "loss_type": "dapo", "scale_rewards": "group", "kl_beta": 0.0,
                "lr": LR, "weight_decay": 0.0, "warmup_ratio": 0.0, "max_grad_norm": MAX_GRAD_NORM,
                "max_eval_samples": 8, "log_every": 1}
    result = _sides.effitrain_side(args, side, log, "vs_trl_grpo_effitrain_", "held_out_loss", settings)
    return {**result, "trl_imported": "trl" in sys.modules}


# --- the first update on the same completions ------------------------------------------------------------


def first_update(args) -> dict:
    """The first step's prompts (effitrain's order), their completions sampled once by effitrain's rollout;
    effitrain's objective loss (its sum over the step's count) and TRL's GRPOTrainer.compute_loss on TRL's
    own inputs made from those completions (rollout_func: TRL scores them and makes its advantages), each
    backward from the same weights; the losses, the advantages and every parameter's gradient compared."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    config, task, tokenizer, splits, encoded, order = effitrain_data(args)
    rows = order[:args.batch_size]
    ours = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
    out_dir = tempfile.mkdtemp(prefix="vs_trl_grpo_check_")
    task.before_training(ours, encoded, tokenizer, config, out_dir)
    collate = task.collators(tokenizer, config)[0]
    prompts = collate([encoded["train"][row] for row in rows])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()
    ours.train()
    with autocast:
        (micro,) = task.rollout(ours, [prompts], torch.Generator().manual_seed(args.seed))
        loss = task.train_loss(ours, micro).loss_sum / task.item_count(micro)
    loss.backward()
    width = prompts["input_ids"].shape[1]
    completions = [ids[:int(n)].tolist() for ids, n in zip(micro["input_ids"][:, width:],
                                                            micro["completion_mask"].sum(1))]
    prompt_ids = [ids.tolist() for ids in micro["input_ids"][:, :width]]

    def fixed(prompt_texts, trainer):  # TRL's generation replaced by effitrain's completions, in the same order
        expected = [splits["train"][row]["prompt"] for row in rows for _ in range(GENERATIONS)]
        assert list(prompt_texts) == expected, "TRL was given other prompts"
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    trainer = trl_trainer(args, theirs, tokenizer, trl_dataset(splits), rows, None, out_dir, 1, rollout_func=fixed)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before its first step
    dataset = trl_dataset(splits)
    inputs = [dataset[row] for row in rows for _ in range(GENERATIONS)]
    made = trainer._generate_and_score_completions(inputs)
    with trainer.accelerator.autocast():
        their_loss = trainer.compute_loss(trainer.model, made)
    their_loss.backward()
    grads = {name: (p.grad, dict(theirs.named_parameters())[name].grad) for name, p in ours.named_parameters()}
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in grads.values())
    largest = max(float(b.float().abs().max()) for _, b in grads.values())
    ours_mask, their_mask = micro["completion_mask"], made["completion_mask"]
    ours_seconds = backward_seconds(ours, lambda: task.train_loss(ours, micro).loss_sum / task.item_count(micro),
                                    lambda: autocast)
    theirs_seconds = backward_seconds(theirs, lambda: trainer.compute_loss(trainer.model, made),
                                      trainer.accelerator.autocast)
    same_tokens = ours_mask.shape == their_mask.shape and bool((ours_mask == their_mask).all()) and bool(
        (made["completion_ids"] * their_mask == micro["input_ids"][:, width:] * ours_mask).all())
    return {"side": CHECKED, "precision": args.precision, "saved_at": time.time(), "prompts": len(rows),
            "completions": len(completions), "completion_tokens": int(ours_mask.sum()),
            "same_completion_tokens": same_tokens,
            "reward_mean": float(micro["completion_sums"][:, 0].mean()),
            "advantage_difference": float((micro["advantages"].float() - made["advantages"].float()).abs().max()),
            "effitrain_loss": float(loss), "trl_loss": float(their_loss),
            "loss_difference": abs(float(loss) - float(their_loss)),
            "effitrain_loss_backward_seconds": ours_seconds, "trl_loss_backward_seconds": theirs_seconds,
            "gradient_difference": worst, "largest_gradient": largest, "parameters": len(grads),
            "versions": {"trl": __import__("trl").__version__, **_sides.versions()}}


def backward_seconds(model, loss, autocast, repeats: int = 5) -> float:
    """The median seconds of `loss()` (under `autocast()`) and its backward on one step's batch (the update
    without the optimizer): where a difference in prompts/s lies, generation or update."""
    times = []
    for _ in range(repeats):
        model.zero_grad()
        started = time.perf_counter()
        with autocast():
            value = loss()
        value.backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# --- the parent ----------------------------------------------------------------------------------------


def summary(results: dict, precision: str, sides) -> tuple[list[tuple], dict]:
    rows, medians = [], {}
    for side in sides:
        runs = results.get((side, precision))
        if not runs:
            continue
        medians[side] = {key: _report.median(runs, key) for key in
                         ("prompts_per_second", "generation_share", "peak_rss_bytes", "saved_seconds")}
        other = max((run["cpu"] or {}).get("other_cores") or 0 for run in runs)
        rows.append((f"{side} {precision}", " / ".join(f"{run['prompts_per_second']:.1f}" for run in runs),
                     fmt(medians[side]["prompts_per_second"], ".1f"),
                     fmt(medians[side]["generation_share"], ".2f"), mib(medians[side]["peak_rss_bytes"]),
                     fmt(medians[side]["saved_seconds"], ".1f"), f"{other:.2f}"))
    return rows, medians


def reward_lines(results: dict, precision: str, sides) -> list[str]:
    """Each side's reward curve: the median over runs of each step's mean reward."""
    lines = []
    for side in sides:
        runs = results.get((side, precision))
        if not runs:
            continue
        curve = [statistics.median(values) for values in zip(*(run["rewards"] for run in runs))]
        lines.append(f"  {side} {precision}: " + " ".join(f"{value:.3f}" for value in curve))
    return lines


def check_lines(checks: dict) -> list[str]:
    lines = []
    for precision, run in checks.items():
        lines.append(f"first update, {precision}, the same {run['completions']} completions ({run['prompts']} prompts,"
                     f" {run['completion_tokens']} completion tokens, mean reward {run['reward_mean']:.3f}; "
                     f"TRL's completion tokens and mask the same: {run['same_completion_tokens']}): loss effitrain "
                     f"{run['effitrain_loss']:.9f} vs TRL {run['trl_loss']:.9f}, |difference| "
                     f"{run['loss_difference']:.2e}; advantages |difference| {run['advantage_difference']:.2e}; "
                     f"gradient largest |difference| {run['gradient_difference']:.2e} over {run['parameters']} "
                     f"tensors (largest |gradient| {run['largest_gradient']:.2e})"
                     + (f" ({_report.loss_verdict(max(run['loss_difference'], run['gradient_difference']))})"
                        if precision == "fp32" else ""))
        lines.append(f"  the step's loss and backward alone (median of 5): effitrain "
                     f"{run['effitrain_loss_backward_seconds']:.3f} s, TRL {run['trl_loss_backward_seconds']:.3f} s")
        if run["largest_gradient"] == 0:
            lines.append("  (no group had a reward spread: both gradients are zero, which checks little; "
                         "start from an SFT checkpoint, --sft-steps)")
    return lines


def compare(args) -> None:
    timed = [side for side in args.sides if side != CHECKED]
    with tempfile.TemporaryDirectory(prefix="vs_trl_grpo_") as tmp:
        shape = fine_tuned(args, Path(tmp))
        checks = {p: _sides.run_side(Path(__file__), CHECKED, p, args, Path(tmp)) for p in args.precision
                  if CHECKED in args.sides}
        turns = _common.take_turns([(side, p) for p in args.precision for side in timed], args.runs,
                                   lambda side_precision: _sides.run_side(Path(__file__), *side_precision, args,
                                                                          Path(tmp)))
    results = dict(turns)
    print(f"\n{model_text(shape)}; {DATA} (effitrain's training split, its order); {args.steps} steps of "
          f"{args.batch_size} prompts x {GENERATIONS} completions of at most {MAX_NEW_TOKENS} new tokens; lr {LR}; "
          f"seed {args.seed}; {args.runs} run(s) each, medians; {machine()}; "
          f"{_report.versions_text(results or {CHECKED: list(checks.values())})}\n")
    for precision in args.precision:
        rows, medians = summary(results, precision, timed)
        if rows:
            print_columns(("", "prompts/s of each run", "median prompts/s", "generation share", "peak RSS",
                           "s to saved model", "other cores"), rows)
            if "effitrain" in medians and "trl" in medians:
                ours, theirs = medians["effitrain"], medians["trl"]
                print(f"effitrain / TRL, {precision}: prompts/s "
                      f"{ours['prompts_per_second'] / theirs['prompts_per_second']:.2f}x, "
                      f"peak RSS {ours['peak_rss_bytes'] / theirs['peak_rss_bytes']:.2f}x")
                same = {run["first_digest"] for side in ("effitrain", "trl") for run in results[(side, precision)]}
                print(f"the same first step's prompts on every run: {len(same) == 1}")
            print("reward curve (each step's mean reward over its completions, median over runs):")
            for line in reward_lines(results, precision, timed):
                print(line)
            print()
    for line in check_lines(checks):
        print(line)
    if any(run.get("trl_imported") for runs in results.values() for run in runs):
        print("WARNING: an effitrain run imported trl")
    _report.warn_if_busy(results, before="\n")
    if args.json is not None:
        _report.write_json(args.json, {"date": _report.utc_now(), "machine": machine(), "model": shape,
                                       "steps": args.steps, "batch_size": args.batch_size,
                                       "generations": GENERATIONS, "max_new_tokens": MAX_NEW_TOKENS, "lr": LR,
                                       "first_update": checks,
                                       "runs": {f"{side} {p}": runs for (side, p), runs in results.items()}})


def main(argv=None) -> None:
    args = parse_args(argv)
    _sides.main(args, compare, run_trl, run_effitrain, skipped="SFT, bf16, repeats and --json")


if __name__ == "__main__":
    main()
