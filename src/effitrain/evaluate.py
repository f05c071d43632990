"""Evaluate a saved model directory on a split of the data, with the metrics `train` writes into
metrics.json. The data flags, their defaults and the data code are train's, so the test split of a
finished run (same data flags, same seed) gives its metrics.json `test` values again."""

from __future__ import annotations

import math

from effitrain import inference
from effitrain.errors import UserError

# The TrainConfig keys that say which data, how it is split and prepared, and how it is evaluated.
DATA_KEYS = ("data", "validation_file", "test_file", "text_column", "text_pair_column", "label_column",
             "image_column", "audio_column", "skip_bad_rows", "validation_split", "test_split", "seed",
             "max_length", "max_duration", "max_eval_samples", "eval_batch_size", "precision")
SPLITS = ("test", "validation", "train")


def evaluate(model_dir: str, values: dict | None = None, split: str = "test", allow_pickle: bool = False,
             task: str | None = None) -> dict:
    """The task's metrics on `split`, gathered over all processes (the same on each). `values`: the
    DATA_KEYS given (the others take train's defaults); text is cut at the saved tokenizer's
    model_max_length unless `max_length` is given. `task`, when given, must be the model's own."""
    expected_task = task
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from effitrain import config as cfg
    from effitrain import models
    from effitrain.devices import make_accelerator
    from effitrain.engine import evaluate as engine_evaluate, precision

    if split not in SPLITS:
        raise UserError(f"unknown split `{split}`", f"pass --split {' or '.join(SPLITS)}")
    values = {key: value for key, value in (values or {}).items() if value is not None}
    unknown = sorted(set(values) - set(DATA_KEYS))
    if unknown:
        raise UserError(f"evaluate takes no setting `{unknown[0]}`", f"use only {', '.join(DATA_KEYS)}")
    path, task = inference.locate(model_dir, allow_pickle, expected_task)
    cfg.build(None, {**values, "model": str(path), "task": task.name})  # the flags checked before anything loads
    source = models.ModelSource(path)
    processor = task.load_processor(source)
    model_config = models.load_config(path)
    if task.is_text and "max_length" not in values:
        values["max_length"] = inference.text_max_length(processor, model_config)
    config = cfg.build(None, {**values, "model": str(path), "task": task.name})  # train's defaults
    mixed_precision, _ = precision.choose(config.precision)
    accelerator = make_accelerator(mixed_precision=mixed_precision)
    set_seed(config.seed)
    loaded = task.load_data(config)
    label_names = inference.label_names(model_config) if task.has_labels else None
    data = loaded.splits[split]
    if label_names is not None:
        data = _model_labels(data, label_names, f"--data {config.data} ({split} split)")
    from datasets import DatasetDict

    with accelerator.main_process_first():  # the main process fills the preprocessing cache, the others reuse it
        # The task's preprocessing reads a DatasetDict's columns from its `train` split: ours is alone there.
        encoded = task.preprocess(DatasetDict(train=data), processor, config, loaded.base_dir)["train"]
    from effitrain.data import text

    loader = DataLoader(encoded, batch_size=config.eval_batch_size, sampler=text.eval_order(encoded),
                        collate_fn=task.collators(processor, config)[1])
    model = accelerator.prepare_model(inference.build(path, task, processor), evaluation_mode=True)
    loader = accelerator.prepare(loader)  # even_batches: gather_for_metrics drops the padded-in duplicates
    metrics = engine_evaluate.evaluate(accelerator, task, model, loader, label_names)
    accelerator.end_training()
    if not math.isfinite(metrics["loss"]):  # NaN logits would still give an argmax, and an accuracy
        raise UserError(f"model {path} gives non-finite outputs (loss {metrics['loss']}) on --data {config.data}: "
                        "its weights are broken", "evaluate a model whose training ended without an error")
    return metrics


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
