"""Predict with a saved model directory, whatever its task: labels of texts, text pairs, images and
audio clips, or continuations of prompts. The task (from the directory's config.json) reads the inputs,
builds the batches and says what the outputs mean; this module batches and keeps the input order."""

from __future__ import annotations

import math

from effitrain import inference
from effitrain.errors import UserError
from effitrain.tasks.base import PredictInputs, PredictOptions

NOTHING = ("nothing to predict", "pass --text \"...\" (classifiers, repeatable), --prompt \"...\" (language models) "
                                 "or --input FILE (a JSONL/CSV of texts or prompts, an image or audio file, a folder)")


# Inputs per forward pass. Measured on 10,000 SMS texts with all-MiniLM-L6-v2 (benchmarks/predict_speed.py).
BATCH_SIZE = 64


def predict(model_dir: str, texts: list[str] | None = None, batch_size: int = BATCH_SIZE, *,
            text_pairs: list[str] | None = None, prompts: list[str] | None = None, input_file: str | None = None,
            options: PredictOptions | None = None, seed: int = 42, allow_pickle: bool = False,
            progress: bool = False) -> list[dict]:
    """One dict per input, in input order: the input (`text`/`text_pair`, `image`, `audio`, `prompt`)
    and the prediction (`label` and `score`, the softmax probability of the label; or `generated`)."""
    import torch
    from tqdm.auto import tqdm

    if batch_size <= 0:
        raise UserError(f"--batch-size must be > 0, got {batch_size}", f"pass e.g. --batch-size {BATCH_SIZE}")
    given = PredictInputs(list(texts or []), list(text_pairs or []), list(prompts or []), input_file)
    if not given.flags():
        raise UserError(*NOTHING)
    path, task = inference.locate(model_dir, allow_pickle)
    records = task.prediction_records(given, str(path))
    if not records:
        raise UserError(*NOTHING)
    saved = inference.load(path, task)
    options = options or PredictOptions()
    if task.is_text and options.max_length is None:
        options.max_length = inference.text_max_length(saved.processor, saved.model.config)
    device = inference.device()
    model = saved.model.to(device)
    encodings = task.prediction_encodings(records, saved.processor, options)
    # Inputs of similar sizes batched together (texts: by token count, so little padding); results go
    # back to input order.
    order = sorted(range(len(records)), key=lambda i: task.prediction_size(encodings[i]))
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    results: list[dict | None] = [None] * len(records)
    torch.manual_seed(seed)  # sampling (--temperature, --top-p) draws from it, on every device
    # disable=None: a bar only where stderr is a terminal.
    bar = tqdm(batches, desc="predict", unit="batch", disable=None if progress and len(batches) > 3 else True)
    with torch.inference_mode():
        for indices in bar:
            batch = task.prediction_batch([encodings[i] for i in indices], saved.processor, options)
            batch = {key: value.to(device) for key, value in batch.items()}
            for i, prediction in zip(indices, task.predictions(model, batch, saved.processor, options)):
                results[i] = {**records[i], **prediction}
                if not math.isfinite(prediction.get("score", 0.0)):  # NaN logits still give an argmax label
                    raise UserError(f"model {path} gives non-finite outputs (input {i + 1}): its weights are "
                                    "broken", "predict with a model whose training ended without an error")
    return results
