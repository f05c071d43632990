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
    monkeypatch.setattr(torch, "softmax", None)  # the gradient's first step: never reached
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
