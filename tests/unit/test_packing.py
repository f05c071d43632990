"""--packing for text classification is exact: a packed batch gives each example the logits, the loss and
the gradients of the same examples padded, and counts the same examples and tokens."""

import json

import effitrain
import pytest
import torch
from effitrain import tasks
from effitrain.data import packing, text
from effitrain.speedups import dropout
from effitrain.tasks import packed

TEXTS = ["a short one", "a much longer sentence that has quite a few more tokens in it, and then some more",
         "mid length text here", "ok", "another one of middling size, yes", "free prize! call now to claim it",
         "see you at eight", "the meeting moved to thursday afternoon because of the holiday"]
PAIRS = ["pair a", "pair b is longer than a", "c", "d d d d", "e", "the second text of a pair", "f g", "h"]
CAPACITY = 40  # --max-length: small enough that the examples take several rows


def tiny_model(model_type: str, tokenizer, attention: str = "sdpa", labels: int = 3):
    """A 2-layer model of `model_type` with random weights and dropout off, so that both batches compute
    the same function."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if model_type == "distilbert":
        sizes = {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64, "dropout": 0.0, "attention_dropout": 0.0,
                 "seq_classif_dropout": 0.0}
    if model_type == "electra":
        sizes["embedding_size"] = 16  # a projection between the embeddings and the encoder
    if model_type in ("roberta", "xlm-roberta"):
        sizes["max_position_embeddings"] = 64 + tokenizer.pad_token_id + 1  # positions after the padding index
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), num_labels=labels,
                                  pad_token_id=tokenizer.pad_token_id, **sizes)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config)


def features(tokenizer, pairs: bool, token_types: bool = True) -> list[dict]:
    encoded = tokenizer(TEXTS, PAIRS if pairs else None, truncation=True, max_length=CAPACITY)
    keys = [key for key in encoded if token_types or key != "token_type_ids"]
    return [{**{key: encoded[key][i] for key in keys}, "labels": i % 3} for i in range(len(TEXTS))]


def both(tokenizer, examples: list[dict]) -> tuple[dict, dict, list[int]]:
    """(padded batch, packed batch, the padded row of each packed example, in the packed order)."""
    padded = text.collator(tokenizer)([dict(f) for f in examples])
    batch = packing.ClassificationPacker(tokenizer.pad_token_id, CAPACITY)([dict(f) for f in examples])
    order = [i for row in packing.first_fit([len(f["input_ids"]) for f in examples], CAPACITY) for i in row]
    return padded, batch, order


@pytest.mark.parametrize("model_type", sorted(packed.ENCODERS))
@pytest.mark.parametrize("attention", ["sdpa", "eager", dropout.ATTENTION])
def test_packed_logits_equal_padded(tokenizer, model_type, attention):
    typed = model_type in ("bert", "electra")  # the models with two token types: text pairs
    dropout.register()
    model = tiny_model(model_type, tokenizer, attention).eval()
    for pairs in ([False, True] if typed else [False]):
        padded, batch, order = both(tokenizer, features(tokenizer, pairs, token_types=typed))
        assert 1 < len(batch["input_ids"]) < len(TEXTS) and batch["input_ids"].shape[1] % 8 == 0
        with torch.no_grad():
            expected = model(**{k: v for k, v in padded.items() if k != "labels"}).logits[order]
            got = packed.logits(model, batch)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch["labels"], padded["labels"][order])


def test_attention_across_examples_would_differ(tokenizer, monkeypatch):
    """The block-diagonal mask is what makes it exact: one block per row attends across examples."""
    model = tiny_model("bert", tokenizer).eval()
    padded, batch, order = both(tokenizer, features(tokenizer, pairs=False))
    whole_rows = packed.block_diagonal
    monkeypatch.setattr(packed, "block_diagonal", lambda seg, *args: whole_rows((seg > 0).long(), *args))
    with torch.no_grad():
        expected = model(**{k: v for k, v in padded.items() if k != "labels"}).logits[order]
        crossing = packed.logits(model, batch)
    assert not torch.allclose(crossing, expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("pairs", [False, True])
def test_packed_loss_gradients_and_counts_equal_padded(tokenizer, pairs):
    task = tasks.get("sequence-classification")
    model = tiny_model("bert", tokenizer).train()  # train mode: dropout is off in the tiny config
    padded, batch, _ = both(tokenizer, features(tokenizer, pairs))
    results = []
    for one in (padded, batch):
        model.zero_grad()
        loss = task.loss_sum(model, one)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_padded, grads_padded), (loss_packed, grads_packed) = results
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-5)
    assert grads_packed.keys() == grads_padded.keys()
    for name, grad in grads_padded.items():
        torch.testing.assert_close(grads_packed[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    for count in (task.item_count, task.example_count, task.token_count):
        assert int(count(batch)) == int(count(padded)), count.__name__
    assert int(task.example_count(batch)) == len(TEXTS)
    assert sorted(task.example_digests(batch)) == sorted(task.example_digests(padded))  # each example's own


def test_first_fit_decreasing_fills_rows():
    rows = packing.first_fit([30, 5, 20, 12, 8, 40], 40)
    assert rows == [[5], [0, 4], [2, 3, 1]]
    assert packing.first_fit([50], 40) == [[0]]  # longer than a row: a row of its own


def test_packed_run_counts_samples_and_tokens_as_the_padded_run(tiny_model_dir, tmp_path):
    """End to end: with dropout off, a packed run trains on the same examples with the same losses as the
    padded run, and reports the same numbers of samples and real tokens."""
    rows = "\n".join(f"\"{TEXTS[i % 8]} {i}\",{['ham', 'spam'][i % 3 == 0]}" for i in range(60))
    (tmp_path / "d.csv").write_text("text,label\n" + rows + "\n")
    runs = {}
    for packing_on in (False, True):
        out = tmp_path / f"run-{packing_on}"
        metrics = effitrain.train({"model": str(tiny_model_dir), "data": str(tmp_path / "d.csv"), "max_steps": 3,
                                   "batch_size": 8, "grad_accum": 2, "max_length": 24, "packing": packing_on,
                                   "log_every": 1, "debug": True, "output_dir": str(out), "lr": 1e-3})
        lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        runs[packing_on] = metrics, [r for r in lines if "loss" in r and "split" not in r], \
            [r for r in lines if "examples_digest" in r]
    (padded, padded_steps, padded_seen), (packed_, packed_steps, packed_seen) = runs[False], runs[True]
    assert packed_["steps"] == 3 and packed_seen == padded_seen  # the same 16 examples each step
    assert all(r["examples"] == 16 for r in packed_seen)
    for key in ("train_samples_per_second", "train_tokens_per_second"):
        done = packed_[key] * packed_["train_seconds"]
        assert done == pytest.approx(padded[key] * padded["train_seconds"], rel=1e-9), key
    assert packed_["train_samples_per_second"] * packed_["train_seconds"] == pytest.approx(48)
    for a, b in zip(packed_steps, padded_steps, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert packed_["test"]["samples"] == padded["test"]["samples"]


def test_attention_without_a_4d_mask_is_refused():
    from effitrain.errors import UserError

    with pytest.raises(UserError, match="this model uses flash_attention_2"):
        packed.block_diagonal(torch.ones(1, 8, dtype=torch.long), "flash_attention_2", torch.float32)


def test_a_decoder_configured_encoder_is_refused():
    from effitrain.errors import UserError
    from transformers import BertConfig

    packed.check_model(BertConfig())
    with pytest.raises(UserError, match="configured as a decoder"):
        packed.check_model(BertConfig(is_decoder=True))
