"""Padding-free batches for text classification: a micro-batch's examples packed into as few rows of at
most --max-length tokens as first-fit decreasing finds, each example's positions restarting at 0.

Which example a token belongs to is read back from the positions (an example starts where its position
is 0 and its attention mask is 1), so the batch needs no key the model does not take; its labels are one
per example, in the order the examples stand in the rows (row by row, left to right). The model side
(block-diagonal attention, each example's first token to the head) is tasks/packed.py."""

from __future__ import annotations

import torch

TOKEN_KEYS = ("input_ids", "token_type_ids")  # per-token inputs copied from the examples


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Example indices per row: longest first, each into the first row with room for it. An example
    longer than `capacity` (never after truncation to it) gets a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        row = next((r for r, free in enumerate(room) if lengths[index] <= free), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


class ClassificationPacker:
    """The training collator of --packing for text classification: rows padded to the longest row,
    rounded up to a multiple of 8 (as the padded collator rounds); padding has mask 0 and position 0."""

    def __init__(self, pad_token_id: int | None, max_length: int, multiple: int = 8):
        self.pad_token_id = pad_token_id or 0
        self.max_length, self.multiple = max_length, multiple

    def __call__(self, features: list[dict]) -> dict:
        lengths = [len(f["input_ids"]) for f in features]
        rows = first_fit(lengths, self.max_length)
        longest = max(sum(lengths[i] for i in row) for row in rows)
        width = -(-longest // self.multiple) * self.multiple
        keys = [key for key in TOKEN_KEYS if key in features[0]]
        batch = {key: torch.full((len(rows), width), self.pad_token_id if key == "input_ids" else 0,
                                 dtype=torch.long) for key in keys}
        batch["attention_mask"] = torch.zeros((len(rows), width), dtype=torch.long)
        batch["position_ids"] = torch.zeros((len(rows), width), dtype=torch.long)
        labels = []
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                end = at + lengths[i]
                for key in keys:
                    batch[key][r, at:end] = torch.as_tensor(features[i][key], dtype=torch.long)
                batch["attention_mask"][r, at:end] = 1
                batch["position_ids"][r, at:end] = torch.arange(lengths[i])
                labels.append(features[i]["labels"] if "labels" in features[i] else features[i]["label"])
                at = end
        batch["labels"] = torch.tensor(labels, dtype=torch.long)
        if "teacher_logits" in features[0]:  # --distill-from: each example's teacher logits, in label order
            batch["teacher_logits"] = torch.tensor([features[i]["teacher_logits"] for row in rows for i in row])
        return batch


def is_packed(batch: dict) -> bool:
    """A packed classification batch: positions given, and one label per example rather than per row."""
    return "position_ids" in batch and batch["labels"].dim() == 1


def segments(batch: dict) -> torch.Tensor:
    """Per token: 1 + the index of its example within its row; 0 for padding."""
    real = batch["attention_mask"].bool()
    starts = real & (batch["position_ids"] == 0)
    return starts.long().cumsum(1) * real


def first_tokens(batch: dict) -> torch.Tensor:
    """The flat index (row * width + column) of each example's first token, in label order."""
    starts = batch["attention_mask"].bool() & (batch["position_ids"] == 0)
    return starts.reshape(-1).nonzero().squeeze(1)


def examples(batch: dict) -> list[dict]:
    """The packed examples back as the padded collator's rows without their padding (in label order):
    what --debug's digests hash, and what the tests compare."""
    seg = segments(batch)
    keys = [key for key in (*TOKEN_KEYS, "attention_mask") if key in batch]
    found = []
    for row in range(seg.shape[0]):
        for number in range(1, int(seg[row].max()) + 1):
            keep = seg[row] == number
            found.append({key: batch[key][row][keep] for key in keys})
    for example, label in zip(found, batch["labels"]):
        example["labels"] = label
    return found
