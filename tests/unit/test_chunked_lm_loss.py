"""The chunked output projection + cross-entropy equals the plain full-logits path: loss and gradients."""

import pytest
import torch
import torch.nn.functional as F

from effitrain.speedups import chunked_lm_loss


def inputs(seed=0, rows=37, hidden=16, vocabulary=50, bias=True, ignored=0.3):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=generator, requires_grad=True)
    w = torch.randn(vocabulary, hidden, generator=generator, requires_grad=True)
    b = torch.randn(vocabulary, generator=generator, requires_grad=True) if bias else None
    targets = torch.randint(0, vocabulary, (rows,), generator=generator)
    targets[torch.rand(rows, generator=generator) < ignored] = -100
    return h, w, b, targets


def plain(h, w, b, targets):
    return F.cross_entropy(F.linear(h, w, b).float(), targets, reduction="sum", ignore_index=-100)


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None and t.requires_grad])


@pytest.mark.parametrize("rows_per_chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_gradients_equal_the_full_logits_path(rows_per_chunk, bias):
    h, w, b, targets = inputs(bias=bias)
    expected = plain(h, w, b, targets)
    got = chunked_lm_loss.loss_sum(h, w, b, targets, rows_per_chunk=rows_per_chunk)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(grads(got * 0.7, (h, w, b)), grads(expected * 0.7, (h, w, b))):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_a_batch_shaped_input_and_a_frozen_weight():
    """[batch, positions, hidden] with a frozen head (LoRA leaves the output layer as it is)."""
    h, w, b, targets = inputs(rows=24)
    h3, t2 = h.detach().reshape(4, 6, -1).requires_grad_(), targets.reshape(4, 6)
    w.requires_grad_(False)
    got = chunked_lm_loss.loss_sum(h3, w, None, t2, rows_per_chunk=7)
    expected = plain(h3.reshape(24, -1), w, None, targets)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    (mine,), (theirs,) = grads(got, (h3,)), grads(expected, (h3,))
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert mine[t2 == -100].abs().sum() == 0  # ignored positions get no gradient


def test_without_gradients_only_the_loss_is_made(monkeypatch):
    h, w, b, targets = inputs()
    monkeypatch.setattr(chunked_lm_loss._ChunkBuffers, "loss_and_gradients", None)  # no gradient is made
    with torch.no_grad():
        got = chunked_lm_loss.loss_sum(h, w, b, targets, rows_per_chunk=4)
    assert not got.requires_grad
    torch.testing.assert_close(got, plain(h, w, b, targets).detach(), rtol=1e-5, atol=1e-5)


def test_every_target_ignored_gives_zero_and_zero_gradients():
    h, w, b, targets = inputs(ignored=1.1)
    got = chunked_lm_loss.loss_sum(h, w, b, targets)
    assert got.item() == 0.0
    assert all(g.abs().sum() == 0 for g in grads(got, (h, w, b)))


def test_bf16_autocast_matches_the_plain_path_under_autocast():
    """Under autocast the head multiplies in bf16 and the loss is fp32, as the model's own head and the
    plain loss do; the weight's gradient is summed in fp32 (closer to fp64 than the plain path's)."""
    h, w, b, targets = inputs(rows=200, hidden=64, vocabulary=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain(h, w, b, targets)
        got = chunked_lm_loss.loss_sum(h, w, b, targets, rows_per_chunk=64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    for mine, theirs in zip(grads(got, (h, w, b)), grads(expected, (h, w, b))):
        assert mine.dtype == theirs.dtype == torch.float32
        torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=2e-2)


def test_chunk_rows_keeps_a_chunk_of_logits_bounded():
    assert chunked_lm_loss.chunk_rows(151_936) * 151_936 * 4 <= max(chunked_lm_loss.CHUNK_BYTES, 64 * 151_936 * 4)
    assert chunked_lm_loss.chunk_rows(100) > 1000


# -- the causal-lm task with the transform: the model's output layer hands its input to the loss -------
def tiny_decoder(kind):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":  # tied input and output embeddings, a biasless head
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64))
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                        tie_word_embeddings=False))


def lm_batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, :5] = -100  # a prompt left out of the loss
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_task_loss_and_gradients_equal_the_full_logits_path(kind):
    import copy

    from effitrain import tasks

    task = tasks.get("causal-lm")
    plain_model = tiny_decoder(kind)
    model = copy.deepcopy(plain_model)
    assert chunked_lm_loss.apply(model)
    assert chunked_lm_loss.output_layer(plain_model) is None and chunked_lm_loss.output_layer(model) is not None
    batch = lm_batch()
    torch.manual_seed(2)  # the same dropout masks on both sides
    expected = task.loss_sum(plain_model, batch)
    torch.manual_seed(2)
    got = task.loss_sum(model, batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.backward()
    got.backward()
    for (name, theirs), mine in zip(plain_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5, msg=name)
    model.eval(), plain_model.eval()
    with torch.no_grad():
        for mine, theirs in zip(task.eval_outputs(model, batch), task.eval_outputs(plain_model, batch)):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    # outside the loss the model gives logits, as generation and a saved model need
    torch.testing.assert_close(model(input_ids=batch["input_ids"]).logits,
                               plain_model(input_ids=batch["input_ids"]).logits)
    copied = copy.deepcopy(model)  # a bound method: the copy's output layer is the copy's own
    assert chunked_lm_loss.output_layer(copied) is copied.get_output_embeddings()
    torch.testing.assert_close(task.loss_sum(copied, batch), task.loss_sum(plain_model, batch))


def test_a_model_that_changes_its_logits_after_the_output_layer_keeps_the_plain_loss():
    """Gemma 2 soft-caps its logits: the hidden states times the weight are not its logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=8,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                           final_logit_softcapping=3.0))
    assert not chunked_lm_loss.apply(model)
    assert chunked_lm_loss.output_layer(model) is None
    assert not hasattr(model.get_output_embeddings(), "effitrain_forward")
