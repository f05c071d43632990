"""Evaluation batches run as pieces padded to their own longest rows (data/text.trimmed_pieces): the same
per-example outputs as the whole padded batch, in the batch's order, for fewer padded tokens."""

import itertools
import random
import types

import pytest
import torch
from effitrain import tasks
from effitrain.data import text
from effitrain.engine import evaluator

TEXTS = ["ok", "a much longer message that has quite a few more tokens in it, and then a few more again",
         "see you at eight", "free prize! call now", "no", "the meeting moved to thursday afternoon because of it",
         "yes", "mid length text here", "another one of middling size, yes indeed", "hi"]
CPU = types.SimpleNamespace(device=torch.device("cpu"))


def padded(tokenizer, texts=TEXTS, side="right", labels=True):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path, padding_side=side)
    batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    if labels:
        batch["labels"] = torch.arange(len(texts)) % 3
    return batch


def tiny(kind: str, tokenizer):
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    torch.manual_seed(0)
    if kind == "classifier":
        config = AutoConfig.for_model("bert", vocab_size=len(tokenizer), num_labels=3, **sizes)
        return AutoModelForSequenceClassification.from_config(config).eval()
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **sizes)
    return AutoModelForCausalLM.from_config(config).eval()


def test_cuts_are_the_least_padding_plus_cost():
    """Against every way of cutting small sorted lists: the dynamic programme's total is the least."""
    rng = random.Random(0)
    for _ in range(60):
        extents = sorted((rng.randint(1, 40) for _ in range(rng.randint(1, 8))), reverse=True)
        cost = rng.choice([0, 3, 64])

        def total(cuts):
            return sum(extents[a] * (b - a) + cost for a, b in zip(cuts, cuts[1:]))

        inner = range(1, len(extents))
        best = min(total([0, *chosen, len(extents)]) for r in range(len(extents))
                   for chosen in itertools.combinations(inner, r))
        cuts = text.piece_cuts(extents, cost)
        assert cuts[0] == 0 and cuts[-1] == len(extents) and total(cuts) == best, (extents, cost, cuts)


def test_pieces_cover_each_row_once_trimmed_to_its_longest(tokenizer):
    batch = padded(tokenizer)
    pieces, order = text.trimmed_pieces(batch)
    lengths = batch["attention_mask"].sum(1)
    assert order is not None and sorted(order.tolist()) == list(range(len(TEXTS)))  # the rows were not sorted
    assert torch.equal(torch.cat([p["labels"] for p in pieces]), batch["labels"][order])
    assert sum(p["input_ids"].numel() for p in pieces) < batch["input_ids"].numel()
    for piece in pieces:
        assert piece["input_ids"].shape == piece["attention_mask"].shape == piece["token_type_ids"].shape
        assert piece["input_ids"].shape[1] == piece["attention_mask"].sum(1).max()  # no column all padding
    sorted_batch = {key: value[lengths.argsort(descending=True, stable=True)] for key, value in batch.items()}
    assert text.trimmed_pieces(sorted_batch)[1] is None  # in order already: no reordering
    alone = {"input_ids": torch.ones(3, 5, dtype=torch.long), "attention_mask": torch.ones(3, 5, dtype=torch.long)}
    assert text.trimmed_pieces(alone) == ([alone], None)  # nothing to trim
    images = {"pixel_values": torch.zeros(2, 3, 8, 8), "labels": torch.zeros(2, dtype=torch.long)}
    assert text.trimmed_pieces(images) == ([images], None)


@pytest.mark.parametrize("kind,side", [("classifier", "right"), ("causal-lm", "right"), ("causal-lm", "left")])
def test_pieces_give_the_outputs_of_the_whole_batch(tokenizer, kind, side):
    """Per example (in the batch's order): the same predictions and labels, the losses to 1e-5; left
    padding is not trimmed (its positions would move), so its outputs are the batch's exactly."""
    task = tasks.get("sequence-classification" if kind == "classifier" else "causal-lm")
    model = tiny(kind, tokenizer)
    batch = padded(tokenizer, side=side, labels=kind == "classifier")
    if kind == "causal-lm":
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.inference_mode():
        whole = task.eval_outputs(model, batch)
        pieced = evaluator.batch_outputs(CPU, task, model, batch)
    for a, b in zip(whole, pieced):
        assert a.shape == b.shape
        if a.dtype.is_floating_point:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b)
    pieces, _ = text.trimmed_pieces(batch)
    assert (len(pieces) > 1) == (side == "right")
