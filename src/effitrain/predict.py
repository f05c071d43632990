"""Label texts with a saved model directory, as plain transformers would."""

from __future__ import annotations

import json
from pathlib import Path

from effitrain import models
from effitrain.errors import UserError


def read_inputs(texts: list[str] | None, input_file: str | None) -> list[str]:
    inputs = list(texts or [])
    if input_file:
        path = Path(input_file)
        if not path.is_file():
            raise UserError(f"--input {path} does not exist", "pass a JSONL file with one {\"text\": ...} per line")
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"--input {path} line {number} is not JSON", "write one {\"text\": \"...\"} per line")
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise UserError(f"--input {path} line {number} has no string field `text`",
                                "write one {\"text\": \"...\"} per line")
            inputs.append(record["text"])
    if not inputs:
        raise UserError("nothing to predict", "pass --text \"...\" (repeatable) or --input FILE.jsonl")
    return inputs


def predict(model_dir: str, texts: list[str], batch_size: int = 64) -> list[dict]:
    """One {text, label, score} per input; score is the softmax probability of the label."""
    import torch
    from transformers import AutoModelForSequenceClassification

    path = models.resolve(model_dir)
    tokenizer = models.load_tokenizer(path)
    with models.loading(path):
        model = AutoModelForSequenceClassification.from_pretrained(str(path), use_safetensors=True,
                                                                   local_files_only=True).eval()
    results = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            chunk = texts[start:start + batch_size]
            batch = tokenizer(chunk, truncation=True, padding=True, return_tensors="pt")
            probs = model(**batch).logits.float().softmax(-1)
            scores, labels = probs.max(-1)
            results += [{"text": t, "label": model.config.id2label[int(i)], "score": round(float(s), 6)}
                        for t, i, s in zip(chunk, labels, scores)]
    return results
