"""speedups/dropout.py: torch's dropout semantics (keep 1 - p, scale 1 / (1 - p), one mask for forward and
backward) with masks drawn by rand_like, and the attention that applies it, against SDPA and a
reference computed by hand from the same draws."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from effitrain.speedups import dropout

from conftest import tiny_bert


def dropping_bert(dropout: float = 0.1, **overrides):
    return tiny_bert(num_attention_heads=4, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                     attn_implementation="sdpa", **overrides)


def batch():
    torch.manual_seed(1)
    ids = torch.randint(5, 100, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, 7:], mask[1, 3:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1])}


def test_dropout_keeps_one_minus_p_scaled_and_the_backward_uses_the_same_mask():
    torch.manual_seed(0)
    x = torch.randn(400, 500, requires_grad=True)
    y = dropout.dropout(x, 0.3)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.005
    torch.testing.assert_close(y[kept], x[kept] / 0.7)
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.7)  # the forward's mask, not a second draw
    assert dropout.dropout(x, 0.3, training=False) is x and dropout.dropout(x, 0.0) is x


def same_on_one_and_two_threads(draw, x):
    """draw(x) after torch.manual_seed(11) with one torch thread and with two: the same; returned."""
    threads = torch.get_num_threads()
    draws = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            torch.manual_seed(11)
            draws.append(draw(x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(draws[0], draws[1])
    return draws[0]


def test_uniforms_follow_torchs_seed_and_not_the_thread_count():
    """Seeded from torch's generator: the same seed, the same draws, whatever the number of threads;
    spread over chunks whose draws are independent and uniform."""
    x = torch.empty(3 * dropout.CHUNK + 5)
    u = same_on_one_and_two_threads(dropout.uniform, x)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 1e-3
    chunks = u[: 3 * dropout.CHUNK].view(3, -1)
    assert not torch.equal(chunks[0], chunks[1])  # each chunk its own stream
    assert abs(torch.corrcoef(chunks[:2])[0, 1].item()) < 5e-3
    torch.manual_seed(12)
    assert not torch.equal(dropout.uniform(x), u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_mask_is_the_16_bit_draws_compared_and_scaled_bit_for_bit(dtype):
    """keep_mask compares 16-bit draws a block at a time; it must give exactly the mask of the same draws
    made at once (keep_draws) compared with round(p * 2^16) and scaled in x's dtype, across blocks, chunks
    and thread counts, for p that keep all (tiny) or nothing (1 - 1e-9), and move torch's generator alike."""
    sizes = (1, 999, dropout.BLOCK + 3, 2 * dropout.CHUNK + dropout.BLOCK + 7)
    threads = torch.get_num_threads()
    try:
        for count, size, p in [(2, n, p) for n in sizes for p in (0.1, 0.25, 1 / 3, 0.9)] + \
                [(1, sizes[-1], 0.1), (2, 5000, 1e-9), (2, 5000, 1 - 1e-9)]:
            torch.set_num_threads(count)
            x = torch.empty(size, dtype=dtype)
            torch.manual_seed(7)
            mask = dropout.keep_mask(x, p)
            after_mask = torch.get_rng_state()
            torch.manual_seed(7)
            expected = (dropout.keep_draws(x) >= round(p * 2**16)).to(dtype).mul_(1.0 / (1.0 - p))
            assert mask.dtype == dtype and mask.shape == x.shape
            assert torch.equal(mask.view(torch.uint8), expected.view(torch.uint8)), (count, size, p)
            assert torch.equal(after_mask, torch.get_rng_state())  # torch's generator moved on alike
    finally:
        torch.set_num_threads(threads)


def test_the_16_bit_draws_are_uniform_and_independent_between_chunks():
    """The draws keep_mask compares: every 16-bit value equally likely (chi-square over 64 bins of 3M
    draws), chunks independent of one another, the same whatever the thread count."""
    d = same_on_one_and_two_threads(dropout.keep_draws, torch.empty(3 * dropout.CHUNK))
    assert d.min() >= 0 and d.max() < 2**16
    counts = torch.bincount(d // 1024, minlength=64).double()
    expected = d.numel() / 64
    assert ((counts - expected) ** 2 / expected).sum().item() < 120  # chi-square, 63 degrees of freedom: p ~ 1e-5
    chunks = d.view(3, -1).double()
    assert abs(torch.corrcoef(chunks[:2])[0, 1].item()) < 5e-3


def test_bf16_inputs_keep_the_same_share():
    """The uniform draw is made in fp32 even for bf16 inputs (bf16 uniforms are rounded)."""
    torch.manual_seed(0)
    x = torch.ones(1000, 1000, dtype=torch.bfloat16)
    y = dropout.dropout(x, 0.1)
    assert y.dtype == torch.bfloat16 and abs((y != 0).float().mean().item() - 0.9) < 0.002


def test_dropout_keeps_what_torchs_cpu_dropout_keeps_for_the_backward():
    """One mask of the input's size and dtype (torch's CPU dropout keeps its scaled float mask), so the
    memory planner's counts and real runs agree with or without effitrain's dropout."""
    def saved_by(function):
        saved = []
        x = torch.randn(64, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            function(x)
        return [(t.dtype, t.numel()) for t in saved]

    assert saved_by(lambda x: dropout.dropout(x, 0.5)) == saved_by(lambda x: torch.nn.functional.dropout(x, 0.5))


def test_gradient_matches_finite_differences():
    x = torch.randn(4, 5, dtype=torch.double, requires_grad=True)

    def seeded(t):
        torch.manual_seed(3)  # the same mask at every evaluation
        return dropout.dropout(t, 0.4)

    assert torch.autograd.gradcheck(seeded, (x,))


def qkv(heads: int = 4, kv_heads: int = 4, length: int = 10):
    torch.manual_seed(2)
    return (torch.randn(3, heads, length, 8), torch.randn(3, kv_heads, length, 8), torch.randn(3, kv_heads, length, 8))


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none", "causal"])
def test_attention_math_path_equals_sdpa(mask_kind):
    """With the dropout made negligible (1e-12 keeps everything), the math path computes what
    transformers' SDPA computes, for boolean and additive masks, none, causal, and grouped keys."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = dropping_bert().bert.encoder.layer[0].attention.self
    module.num_key_value_groups = 2
    module.is_causal = mask_kind == "causal"
    q, k, v = qkv(4, 2)
    keep = batch()["attention_mask"][:, None, None, :10].bool().expand(3, 1, 10, 10)
    mask = {"bool": keep, "float": torch.zeros(3, 1, 10, 10).masked_fill(~keep, -1e9), "none": None,
            "causal": None}[mask_kind]
    ours, _ = dropout.attention(module, q, k, v, mask, dropout=1e-12, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.3)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_attention_dropout_is_the_softmax_dropped_by_a_mask_of_the_same_draws():
    module = dropping_bert().bert.encoder.layer[0].attention.self
    module.train()
    q, k, v = qkv()
    keep = batch()["attention_mask"][:, None, None, :10].bool().expand(3, 1, 10, 10)
    torch.manual_seed(5)
    ours, _ = dropout.attention(module, q, k, v, keep, dropout=0.25, scaling=0.5)
    torch.manual_seed(5)
    probs = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep, torch.finfo(q.dtype).min).softmax(-1)
    expected = (probs * (dropout.keep_draws(probs) >= 0.25 * 2**16) / 0.75) @ v
    torch.testing.assert_close(ours, expected.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_apply_keeps_the_model_its_evaluation_and_its_saved_config(tmp_path):
    model = dropping_bert()
    plain = copy.deepcopy(model)
    assert dropout.apply(model) == 8  # embeddings, 3 per layer, the head
    assert all(type(m) is not torch.nn.Dropout for m in model.modules())
    assert model.config._attn_implementation == dropout.ATTENTION
    model.eval(), plain.eval()
    inputs = {k: v for k, v in batch().items() if k != "labels"}
    assert torch.equal(model(**inputs).logits, plain(**inputs).logits)  # evaluation: SDPA, no dropout
    model.save_pretrained(tmp_path)
    assert dropout.ATTENTION not in (tmp_path / "config.json").read_text()
    assert json.loads((tmp_path / "config.json").read_text())["hidden_dropout_prob"] == 0.1


def test_training_with_dropout_draws_the_expected_share_and_recomputes_the_same_masks():
    """Training mode through the whole model: gradient checkpointing recomputes each block's forward
    in the backward, and must draw the very same masks (torch restores the RNG), so the gradients equal
    those of the run that kept its activations."""
    grads = []
    for checkpointing in (False, True):
        model = dropping_bert(dropout=0.2)
        dropout.apply(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        inputs = batch()
        torch.manual_seed(7)
        model(**inputs).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=0, rtol=0)
    # and dropout really ran: another seed gives other gradients
    model = dropping_bert(dropout=0.2)
    dropout.apply(model)
    model.train()
    inputs = batch()
    torch.manual_seed(8)
    model(**inputs).loss.backward()
    other = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert not torch.allclose(other, grads[0])
