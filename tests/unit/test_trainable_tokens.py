"""Tokens a chat template adds to a vocabulary, under LoRA: their rows (input embeddings and an untied output
layer) are trained in full through peft's trainable tokens, the rest of both stays frozen, the chunked loss
multiplies by the effective output weight, and the merged weights compute what the adapted model does."""

import copy

import pytest
import torch

from effitrain import tasks
from effitrain.errors import UserError
from effitrain.models import adapters
from effitrain.speedups import chunked_lm_loss

VOCABULARY, ADDED = 97, {97: "<|im_start|>", 98: "<|im_end|>"}


def grown_decoder(kind):
    """A tiny decoder whose vocabulary gained two tokens, as tasks/causal_lm.py's adapt_model leaves it."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":  # tied input and output embeddings
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCABULARY, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCABULARY,
                                             tie_word_embeddings=False))
    model.resize_token_embeddings(VOCABULARY + len(ADDED))
    adapters.mark_new_tokens(model, ADDED)
    return model


def adapted(model, targets="all-linear"):
    torch.manual_seed(1)  # the same LoRA matrices for every model built here
    settings = adapters.Peft(peft="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=targets)
    return adapters.apply(model, tasks.get("causal-lm"), settings)


def batch():
    """Every row uses the new tokens, as ChatML conversations do; some positions left out of the loss."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCABULARY, (3, 12), generator=generator)
    ids[:, 0], ids[:, 6], ids[:, 11] = 97, 98, 98
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, :4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def trainable(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_chunked_loss_sees_the_trained_rows_and_equals_the_full_logits_path(kind):
    task = tasks.get("causal-lm")
    plain = adapted(grown_decoder(kind))
    chunked = grown_decoder(kind)
    assert chunked_lm_loss.apply(chunked)
    chunked = adapted(chunked)
    head = chunked_lm_loss.output_layer(chunked)
    assert head is chunked.get_base_model().get_output_embeddings()  # the wrapper, not the layer inside it
    assert chunked_lm_loss.output_layer(plain) is None
    with torch.no_grad():  # move the new rows, so that a loss reading the frozen ones would differ
        for p in trainable(plain).values():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        for p in trainable(chunked).values():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    expected, got = task.loss_sum(plain, batch()), task.loss_sum(chunked, batch())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.backward()
    got.backward()
    mine, theirs = trainable(chunked), trainable(plain)
    assert mine.keys() == theirs.keys() and any("trainable_tokens_delta" in name for name in mine)
    for name in mine:
        torch.testing.assert_close(mine[name].grad, theirs[name].grad, rtol=1e-5, atol=1e-5, msg=name)
    plain.eval(), chunked.eval()
    with torch.no_grad():
        for a, b in zip(task.eval_outputs(chunked, batch()), task.eval_outputs(plain, batch())):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_only_the_new_rows_train_and_the_merged_weights_are_the_adapted_model(kind):
    task = tasks.get("causal-lm")
    model = grown_decoder(kind)
    untied = kind == "llama"
    before = {key: value.clone() for key, value in model.state_dict().items()}
    chunked_lm_loss.apply(model)
    model = adapted(model)
    deltas = {name: p for name, p in trainable(model).items() if "trainable_tokens_delta" in name}
    assert len(deltas) == (2 if untied else 1)  # a tied output layer shares the input embeddings' rows
    assert all(p.shape == (len(ADDED), 32) for p in deltas.values())
    optimizer = torch.optim.AdamW(trainable(model).values(), lr=1e-2)
    task.loss_sum(model, batch()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in deltas.values())
    optimizer.step()
    merged = adapters.merged_state_dict(model)
    rows = list(ADDED)
    embed = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    outputs = [embed] + (["lm_head.weight"] if untied else [])
    for key in outputs:
        old, new = before[key], merged[key]
        assert torch.equal(new[:VOCABULARY], old[:VOCABULARY]), key  # the base's rows stay as they were
        assert (new[rows] - old[rows]).abs().min() > 0, key  # every new row moved
    # The merged weights in a plain model compute the adapted model's logits (the new tokens' included).
    plain = copy.deepcopy(model.get_base_model()).__class__(model.get_base_model().config)
    plain.load_state_dict({k: v for k, v in merged.items() if k in plain.state_dict()}, strict=False)
    if not untied:
        plain.tie_weights()
    plain.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=batch()["input_ids"]).logits,
                                   model(input_ids=batch()["input_ids"]).logits, rtol=1e-5, atol=1e-5)


def test_counts_include_the_new_rows():
    model = adapted(grown_decoder("llama"))
    lora_only = adapted(grown_decoder("llama").__class__(grown_decoder("llama").config))  # no tokens marked
    assert adapters.counts(model)["trainable"] == adapters.counts(lora_only)["trainable"] + 2 * len(ADDED) * 32


def test_an_adapter_on_the_output_layer_with_new_tokens_is_refused():
    with pytest.raises(UserError, match="peft cannot do under a LoRA adapter.*leave `lm_head` out"):
        adapted(grown_decoder("llama"), targets="q_proj,lm_head")


def test_without_new_tokens_nothing_is_trained_in_full():
    model = grown_decoder("llama")
    adapters.mark_new_tokens(model, {})
    assert adapters.token_rows(model, []) is None
    assert not any("trainable_tokens" in name for name in trainable(adapted(model)))
