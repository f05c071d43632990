"""Predict with a saved model directory, whatever its task: labels of texts, text pairs, images and
audio clips, or continuations of prompts. The task (from the directory's config.json) reads the inputs,
builds the batches and says what the outputs mean; this module batches and keeps the input order."""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING

from effitrain import config as cfg
from effitrain.commands import saved_model
from effitrain.errors import UserError
from effitrain.models import saved as inference

if TYPE_CHECKING:
    from effitrain.tasks.base import PredictOptions

NOTHING = ("nothing to predict", "pass --text \"...\" (classifiers, repeatable), --prompt \"...\" (language models) "
                                 "or --input FILE (a JSONL/CSV of texts or prompts, an image or audio file, a folder)")


# Inputs per forward pass. Measured on 10,000 SMS texts with all-MiniLM-L6-v2 (benchmarks/peers/predict_speed.py).
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
    from effitrain.tasks.base import PredictInputs, PredictOptions

    given = PredictInputs(list(texts or []), list(text_pairs or []), list(prompts or []), input_file)
    if not given.flags():
        raise UserError(*NOTHING)
    path, task = saved_model.locate(model_dir, allow_pickle)
    records = task.prediction_records(given, str(path))
    if not records:
        raise UserError(*NOTHING)
    saved = inference.load(path, task)
    options = options or PredictOptions()
    if task.is_text and options.max_length is None:
        options.max_length = inference.text_max_length(saved.processor, saved.model.config)
    options.min_samples = task.shortest_input(saved.model.config)
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


def add_parser(commands) -> None:
    predict = commands.add_parser(
        "predict", help="label texts, text pairs, images or audio clips, or continue prompts, with a trained model "
                        "directory (its task comes from its config.json)")
    predict.add_argument("--model", required=True, help="a model/ directory written by `effitrain train` (or any "
                                                        "save_pretrained classifier or causal LM)")
    predict.add_argument("--text", action="append", help="a text to classify (repeatable)")
    predict.add_argument("--text-pair", action="append", help="the second text of a pair, paired with --text by "
                                                              "position (repeatable)")
    predict.add_argument("--prompt", action="append", help="a prompt for a causal LM to continue (repeatable)")
    predict.add_argument("--input", help="texts or prompts: a JSONL/CSV file with a `text` (and `text_pair`) or "
                                         "`prompt` field; images and audio: a file, a folder of files, or a "
                                         "JSONL/CSV file with a `path` (or `image`/`audio`) column")
    predict.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                         help=f"inputs per forward pass (default: {BATCH_SIZE})")
    predict.add_argument("--max-length", type=int, default=None, help="text: tokens kept per input (default: the "
                                                                      "saved tokenizer's, i.e. train's --max-length)")
    cfg.add_flags(predict, ["max_duration"], defaults=True)
    predict.add_argument("--max-new-tokens", type=int, default=32, help="causal LM: tokens generated per prompt "
                                                                        "(default: 32)")
    predict.add_argument("--temperature", type=float, default=None, help="causal LM: sample at this temperature "
                                                                         "(default: greedy)")
    predict.add_argument("--top-p", type=float, default=None, help="causal LM: sample from the smallest set of "
                                                                   "tokens holding this probability (default: greedy)")
    predict.add_argument("--seed", type=int, default=42, help="seed for sampling (default: 42)")
    predict.add_argument("--all-scores", action="store_true", help="classification: every label's probability")
    cfg.add_flags(predict, ["allow_pickle"], defaults=True)
    predict.add_argument("--debug", action="store_true")


def check_flags(args) -> None:
    cfg.check_value("model", args.model)
    cfg.check_value("batch_size", args.batch_size, {"positive": True, "example": BATCH_SIZE})
    for name in ("max_length", "max_duration", "seed"):  # train's rules (predict's own defaults)
        cfg.check_value(name, getattr(args, name))
    for name in ("max_new_tokens", "temperature"):
        cfg.check_value(name, getattr(args, name), {"positive": True})
    cfg.check_value("top_p", args.top_p, {"within": (0, 1), "ends": "(]", "fix": "pass e.g. {flag} 0.9"})


def main(args) -> int:
    # Only what prediction needs is imported (torch, transformers): no datasets, no accelerate, no engine.
    from effitrain.outputs import files
    from effitrain.runtime import libraries
    from effitrain.tasks.base import PredictOptions

    if not args.debug:  # libraries.quiet_libraries would import datasets, which prediction never uses
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        libraries.quiet_import_warnings()
        libraries.quiet_known_warnings()
    options = PredictOptions(max_length=args.max_length, max_duration=args.max_duration,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             all_scores=args.all_scores)
    results = predict(args.model, args.text, args.batch_size, text_pairs=args.text_pair, prompts=args.prompt,
                      input_file=args.input, options=options, seed=args.seed, allow_pickle=args.allow_pickle,
                      progress=True)
    try:
        for result in results:
            print(files.json_text(result, ensure_ascii=False))
        sys.stdout.flush()
    except BrokenPipeError:  # `predict ... | head`: the reader took what it wanted (the Python docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
