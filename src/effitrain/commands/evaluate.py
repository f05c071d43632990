"""Evaluate a saved model directory on a split of the data, with the metrics `train` writes into
metrics.json. The data flags, their defaults and the data code are train's, so the test split of a
finished run (same data flags, same seed) gives its metrics.json `test` values again. With --reward (or
--rl): online RL's evaluation, greedy completions of the split's prompts scored by the reward functions."""

from __future__ import annotations

import dataclasses
import math
import os

from effitrain import config as cfg
from effitrain.commands import saved_model
from effitrain.errors import UserError
from effitrain.models import saved

# The TrainConfig keys that say which data, how it is split and prepared, and how it is evaluated.
DATA_KEYS = ("data", "validation_file", "test_file", "text_column", "text_pair_column", "label_column",
             "image_column", "audio_column", "skip_bad_rows", "validation_split", "test_split", "seed",
             "max_length", "max_duration", "max_eval_samples", "eval_batch_size", "max_new_tokens", "precision",
             "preference", "beta", "dpo_loss", "dpo_label_smoothing", "rl", "reward", "reward_weights")
# What asks for online RL's evaluation: --rl itself, or a reward to score the completions with (--rl grpo then).
RL_KEYS = ("rl", "reward", "reward_weights")
SPLITS = ("test", "validation", "train")


def evaluate(model_dir: str, values: dict | None = None, split: str = "test", allow_pickle: bool = False,
             task: str | None = None, reference_model: str | None = None) -> dict:
    """The task's metrics on `split`, gathered over all processes (the same on each). `values`: the
    DATA_KEYS given (the others take train's defaults); text is cut at the saved tokenizer's
    model_max_length unless `max_length` is given. `task`, when given, must be the model's own.
    `reference_model`: --preference dpo's reference, a model folder (else none: the policy's own margins)."""
    expected_task = task
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from effitrain.engine import evaluator as engine_evaluate
    from effitrain.engine import precision
    from effitrain.models import loading
    from effitrain.runtime.distributed import make_accelerator

    if split not in SPLITS:
        raise UserError(f"unknown split `{split}`", f"pass --split {' or '.join(SPLITS)}")
    values = {key: value for key, value in (values or {}).items() if value is not None}
    unknown = sorted(set(values) - set(DATA_KEYS))
    if unknown:
        raise UserError(f"evaluate takes no setting `{unknown[0]}`", f"use only {', '.join(DATA_KEYS)}")
    values = _with_rl(values)
    path, task = saved_model.locate(model_dir, allow_pickle, expected_task)
    _check_rl_model(task, values, path)
    cfg.build(None, {**values, "model": str(path), "task": task.name})  # the flags checked before anything loads
    source = loading.ModelSource(path)
    processor = task.load_processor(source)
    model_config = loading.load_config(path)
    if task.is_text and "max_length" not in values:
        values["max_length"] = saved.text_max_length(processor, model_config)
    config = cfg.build(None, {**values, "model": str(path), "task": task.name})  # train's defaults
    task = _objective_task(task, config, reference_model)
    mixed_precision, _ = precision.choose(config.precision)
    accelerator = make_accelerator(mixed_precision=mixed_precision)
    set_seed(config.seed)
    loaded = task.load_data(config)
    label_names = saved.label_names(model_config) if task.has_labels else None
    data = loaded.splits[split]
    _check_conversations(processor, data, config, split)
    if label_names is not None:
        data = _model_labels(data, label_names, f"--data {config.data} ({split} split)")
    from datasets import DatasetDict

    with accelerator.main_process_first():  # the main process fills the preprocessing cache, the others reuse it
        # The task's preprocessing reads a DatasetDict's columns from its `train` split: ours is alone there.
        encoded = task.preprocess(DatasetDict(train=data), processor, config, loaded.base_dir)["train"]
    from effitrain.data import text

    encoded = _with_reference(task, encoded, processor, config, reference_model, allow_pickle, accelerator.device)
    loader = DataLoader(encoded, batch_size=config.eval_batch_size, sampler=text.eval_order(encoded),
                        collate_fn=task.collators(processor, config)[1])
    model = accelerator.prepare_model(saved.build(path, task, processor), evaluation_mode=True)
    loader = accelerator.prepare(loader)  # even_batches: gather_for_metrics drops the padded-in duplicates
    metrics = engine_evaluate.evaluate(accelerator, task, model, loader, label_names,
                                       setting=task.eval_setting(processor, config, encoded))
    accelerator.end_training()
    if not math.isfinite(metrics["loss"]):  # NaN logits would still give an argmax, and an accuracy
        raise UserError(f"model {path} gives non-finite outputs (loss {metrics['loss']}) on --data {config.data}: "
                        "its weights are broken", "evaluate a model whose training ended without an error")
    return metrics


def _check_conversations(processor, data, config, split: str) -> None:
    """A model trained on conversations (its tokenizer's record) is measured on conversations: on text data
    its loss would be of raw text, not of answers, and say nothing of the model."""
    from effitrain.data import conversations, templates

    if config.preference is None and templates.trained_on_conversations(processor) \
            and conversations.of_data(data) not in conversations.CONVERSATIONAL:
        raise UserError(f"the model was trained on conversations, and --data {config.data} ({split} split) holds "
                        f"text (columns: {', '.join(data.column_names[:8])})", "evaluate it on conversations (a "
                        "`messages` column, or prompt/completion as message lists)")


def _with_rl(values: dict) -> dict:
    """A --reward (or --reward-weights) without --rl asks for online RL's evaluation: --rl grpo, whose greedy
    completions and metrics every --rl objective shares (its sampling settings play no part)."""
    if values.get("rl") is None and any(values.get(key) is not None for key in RL_KEYS):
        return {**values, "rl": cfg.RL[0]}
    return values


def _check_rl_model(task, values: dict, path) -> None:
    """Rewards score generated completions: a model of a task that generates none is refused by name."""
    if values.get("rl") is not None and not task.supports_rl:
        given = next(key for key in ("reward", "reward_weights", "rl") if values.get(key) is not None)
        raise UserError(f"{cfg.flag(given)} applies to causal LMs (rewards score generated completions), and the "
                        f"model in {path} is a {task.name} model", f"drop {cfg.flag(given)}, or pass a causal-lm model")


def _objective_task(task, config, reference_model: str | None):
    """--preference: the causal-lm task on pairs (tasks.for_config), its reference, where its objective has
    one, a --reference-model's log-probs (precomputed in one pass) or none. --rl: the causal-lm task on
    prompts, its objective's rewards loaded with the data (tasks.for_config)."""
    from effitrain import tasks
    from effitrain.tasks import objectives

    if reference_model is not None and not objectives.takes_reference(config.preference):
        raise UserError("--reference-model is DPO's reference", "pass --preference dpo too, or drop --reference-model")
    if config.rl is not None:
        return tasks.for_config(config)
    if config.preference is None:
        return task
    if objectives.takes_reference(config.preference):
        config = dataclasses.replace(config, reference="precompute" if reference_model is not None else "none")
    return tasks.for_config(config)  # --preference on a model of another task: refused with its name


def _with_reference(task, encoded, processor, config, reference_model: str | None, allow_pickle: bool, device):
    """The reference model's log-probs of the split as its column (--reference-model), computed with the
    code training's precomputed reference uses."""
    if reference_model is None:
        return encoded
    from datasets import DatasetDict

    from effitrain.models import loading

    try:
        path, _ = saved_model.locate(reference_model, allow_pickle, task.name)
    except UserError as err:  # its words are for --model ("drop --task"): these are for the reference
        raise UserError(f"--reference-model {reference_model}: {err.problem}", f"pass the {task.name} model the "
                        "policy was trained from as --reference-model") from None
    own = task.load_processor(loading.ModelSource(path))
    if own.get_vocab() != processor.get_vocab():  # its log-probs would be of other tokens (or of resized rows)
        raise UserError(f"--reference-model {reference_model} has another vocabulary than the model ({len(own)} "
                        f"tokens, the model {len(processor)})", "pass the model the policy was trained from (the "
                        "same tokenizer, chat template tokens included)")
    model = saved.build(path, task, own).to(device)
    return task.before_training(model, DatasetDict(train=encoded), processor, config, None)["train"]


def _model_labels(data, names: list[str], where: str):
    """The split's labels as the model's output units (its id2label order); a label the model does not
    know is refused: it could never be predicted."""
    from datasets import ClassLabel

    own = data.features["label"].names
    unknown = sorted({own[i] for i in data.unique("label")} - set(names))
    if unknown:
        raise UserError(f"{where}: label `{unknown[0]}` is not one the model knows (its labels: "
                        f"{', '.join(names[:20])})", "evaluate on data with the model's labels, or pass the "
                                                     "--label-column the model was trained on")
    if own == names:
        return data
    ids = [names.index(name) if name in names else -1 for name in own]  # -1: absent from this split
    features = data.features.copy()
    features["label"] = ClassLabel(names=names)
    return data.map(lambda batch: {"label": [ids[i] for i in batch["label"]]}, batched=True, features=features)


def add_parser(commands) -> None:
    evaluate = commands.add_parser(
        "evaluate", help="the metrics `train` writes into metrics.json, for a trained model directory on a split "
                         "of the data (same data flags and defaults as train)")
    evaluate.add_argument("--model", required=True, help="a model/ directory written by `effitrain train`")
    evaluate.add_argument("--split", default="test", choices=SPLITS, help="the split to evaluate (default: test)")
    evaluate.add_argument("--task", choices=cfg.TASKS, default=None, help="the task the data is for; refused "
                                                                          "unless it is the model's (default: the "
                                                                          "model's, from its config.json)")
    evaluate.add_argument("--output", help="also write the metrics to this JSON file")
    evaluate.add_argument("--reference-model", default=None,
                          help="--preference dpo: the reference model (e.g. the model the run started from) whose "
                               "log-probs the rewards are measured against (default: none; the rewards are beta x "
                               "the model's own log-probs)")
    cfg.add_flags(evaluate, ["allow_pickle"], defaults=True)
    evaluate.add_argument("--debug", action="store_true")
    cfg.add_flags(evaluate, [f for f in cfg.fields() if f.name in DATA_KEYS],
                  {"max_length": " (default: the saved tokenizer's, i.e. train's --max-length)",
                   "rl": " (evaluate: greedy completions of the split's prompts scored by the rewards, as a run's "
                         "evaluation does; every objective's the same; default: none, grpo when --reward is given)",
                   "reward": "; evaluate scores the greedy completions with them",
                   "max_new_tokens": f"; with --rl or --reward: {cfg.RL_MAX_NEW_TOKENS} unless given, as train --rl's"})


def check_flags(args) -> None:
    """Each data flag by train's rules, and --output: before any model or library loads."""
    cfg.check_value("model", args.model)
    for key in DATA_KEYS:
        cfg.check_value(key, getattr(args, key, None))
    check_output_file(args.output)


def main(args) -> int:
    from effitrain.outputs import files
    from effitrain.runtime import libraries

    output = check_output_file(args.output)
    libraries.quiet_libraries(args.debug)
    values = {key: getattr(args, key) for key in DATA_KEYS if hasattr(args, key)}
    metrics = evaluate(args.model, values, args.split, args.allow_pickle, args.task, args.reference_model)
    if int(os.environ.get("RANK", "0")) == 0:  # every process has the gathered metrics; one prints them
        print(files.json_text(metrics))
        if output is not None:
            try:
                files.place(output, lambda temporary: files.write_json(temporary, metrics))
            except FileExistsError:
                raise UserError(f"--output {output} appeared while the model was evaluated; it was left as it is",
                                "pass a new file path (effitrain never replaces a file it did not write)") from None
            except OSError as err:
                raise UserError(f"--output {output} cannot be written ({err.strerror or err})",
                                "pass a file path you can write") from err
    return 0


def check_output_file(given: str | None):
    """--output: a new file in an existing, writable folder; checked before anything runs. An existing
    file is never replaced (it may be a run's own metrics.json or config.json)."""
    from pathlib import Path

    if given is None:
        return None
    output = Path(given)
    if not given or output.is_dir():
        raise UserError(f"--output `{given}` is a folder", "pass a file path, e.g. --output metrics.json")
    if output.exists() or output.is_symlink():
        raise UserError(f"--output {output} already exists", "pass a new file path (effitrain never replaces a "
                        "file it did not write)")
    if not output.parent.is_dir():
        raise UserError(f"--output {output}: no folder {output.parent}", "pass a file path in an existing folder")
    if not os.access(output.parent, os.W_OK):
        raise UserError(f"--output {output}: the folder {output.parent} is not writable",
                        "pass a file path in a folder you can write")
    return output
