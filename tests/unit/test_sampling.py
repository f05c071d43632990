"""Sampling inside the step (tasks/sampling.py): each row drawn from its own key's stream, so a row's
completion is the same alone, in a batch, in any order; inverse-CDF draws against hand computations and
frequencies; stops, truncation, top-p -> greedy; log-probs against a separate forward; modes restored."""

import pytest
import torch
from effitrain.tasks import sampling

PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15], [1], [20, 21, 22]]
SETTINGS = dict(max_new_tokens=10, temperature=1.0, top_p=0.95, pad_id=0, seed=7)


def tiny_llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                        **extra)).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def keys(count, step=3, sample=0):
    return [(step, prompt, sample) for prompt in range(count)]


def rows(done: sampling.Completions) -> list[list[int]]:
    return [ids[:length] for ids, length in zip(done.ids.tolist(), done.lengths.tolist())]


def test_draw_by_inverse_cdf_over_the_nucleus_in_vocabulary_order():
    """Probabilities 0.2, 0.5, 0.3, cumulative 0.2, 0.7, 1.0 (vocabulary order). Top-p 1: u 0.6 -> 1, u 0.9 -> 2,
    u 0.1 -> 0. Top-p 0.7 keeps tokens 1 and 2 (sorted 0.5, 0.3, 0.2: the mass above them 0 and 0.5 < 0.7), so
    0, 0.5, 0.3, cumulative 0, 0.5, 0.8: u 0.6 -> target 0.48 -> 1, u 0.7 -> 0.56 -> 2, u 0.999 -> 2 (never 0)."""
    logits = torch.tensor([[0.2, 0.5, 0.3]]).log().repeat(3, 1)
    u = torch.tensor([0.6, 0.9, 0.1], dtype=torch.float64)
    tokens, logps = sampling.draw(logits, u, 1.0, 1.0)
    assert tokens.tolist() == [1, 2, 0]
    torch.testing.assert_close(logps, torch.tensor([0.5, 0.3, 0.2]).log())
    tokens, _ = sampling.draw(logits, torch.tensor([0.6, 0.7, 0.999], dtype=torch.float64), 1.0, 0.7)
    assert tokens.tolist() == [1, 2, 2]
    # The temperature divides the logits: at 2, probabilities are proportional to sqrt(0.2, 0.5, 0.3), cumulative
    # 0.263, 0.678, 1.
    _, logps = sampling.draw(logits, u, 2.0, 1.0)
    root = torch.tensor([0.2, 0.5, 0.3]).sqrt()
    torch.testing.assert_close(logps, (root / root.sum()).log()[[1, 2, 0]])


def test_float_noise_in_near_uniform_logits_moves_next_to_no_draw():
    """A random model's near-uniform distribution over a large vocabulary, and the same logits with float noise
    (another layout's weights after an update differ so): drawn in vocabulary order, a token moves only where u
    falls within the noise of a cumulative sum; in sorted order nearly equal probabilities swap places, and a u
    that falls on either of them moves: several times as many draws."""
    rows, size = 500, 10000
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, size, generator=generator).repeat(rows, 1) * 0.02
    noisy = logits * (1 + torch.randn(logits.shape, generator=generator) * 1e-5)
    u = sampling.uniforms(1, keys(rows), 1)[:, 0]
    moved = {top_p: int((sampling.draw(noisy, u, 1.0, top_p)[0] != sampling.draw(logits, u, 1.0, top_p)[0]).sum())
             for top_p in (1.0, 0.9)}

    def sorted_draw(values):  # inverse CDF over the probabilities sorted, the draw this replaced
        probs, order = values.softmax(-1).sort(dim=-1, descending=True, stable=True)
        return order.gather(-1, torch.searchsorted(probs.cumsum(-1), u.float()[:, None]).clamp(max=size - 1))

    assert max(moved.values()) <= 2 and int((sorted_draw(logits) != sorted_draw(noisy)).sum()) >= 8, moved


def test_draws_follow_the_renormalised_nucleus():
    """20000 rows, each its own key: the tokens' frequencies match the top-p-cut, renormalised
    probabilities (4 standard deviations), and nothing outside the nucleus is drawn."""
    probs = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    count = 20000
    u = sampling.uniforms(11, keys(count), 1)[:, 0]
    tokens, _ = sampling.draw(probs.log().repeat(count, 1), u, 1.0, 0.8)
    nucleus = torch.tensor([0.0, 0.4, 0.25, 0.2, 0.0]) / 0.85  # 0.4, 0.25 and 0.2: the mass above 0.2 is 0.65
    frequencies = torch.bincount(tokens, minlength=5) / count
    spread = (nucleus * (1 - nucleus) / count).sqrt()
    assert (frequencies - nucleus).abs().le(4 * spread + 1e-9).all(), frequencies
    assert frequencies[0] == 0 and frequencies[4] == 0


def test_a_rows_stream_is_its_keys_alone():
    both = sampling.uniforms(5, [(1, 2, 3), (1, 2, 4)], 6)
    assert torch.equal(both[1], sampling.uniforms(5, [(1, 2, 4)], 6)[0])
    assert not torch.equal(both[0], both[1])
    assert not torch.equal(both[0], sampling.uniforms(6, [(1, 2, 3)], 6)[0])  # the seed counts
    assert sampling.row_seed(5, (1, 2, 3)) == sampling.row_seed(5, (1, 2, 3)) < 2**63


def test_a_rows_completion_does_not_depend_on_the_rows_beside_it(model):
    """Bitwise the same ids alone, in a batch of prompts of other lengths, and in reversed order."""
    stops = [2, 30, 31, 32]
    batched = sampling.sample(model, PROMPTS, keys(5), stop_ids=stops, **SETTINGS)
    alone = [sampling.sample(model, [p], [k], stop_ids=stops, **SETTINGS) for p, k in zip(PROMPTS, keys(5))]
    reverse = sampling.sample(model, PROMPTS[::-1], keys(5)[::-1], stop_ids=stops, **SETTINGS)
    assert rows(batched) == [rows(one)[0] for one in alone] == rows(reverse)[::-1]
    assert batched.stopped.tolist() == [bool(one.stopped[0]) for one in alone] == reverse.stopped.tolist()[::-1]
    assert batched.stopped.any() and not batched.stopped.all()  # both kinds of row are compared
    assert len({tuple(row) for row in rows(batched)}) == 5


def test_samples_of_one_prompt_share_its_pass_and_each_is_its_own_row(model):
    """Three samples of each prompt, the copies spread through the batch (one prompt pass, its cache
    copied to its rows): each row is what it is alone, and a prompt's samples differ."""
    order = [(prompt, sample) for sample in range(3) for prompt in range(5)]
    prompts, row_keys = [PROMPTS[p] for p, _ in order], [(3, p, s) for p, s in order]
    batched = sampling.sample(model, prompts, row_keys, stop_ids=[2, 30], **SETTINGS)
    alone = [rows(sampling.sample(model, [p], [k], stop_ids=[2, 30], **SETTINGS))[0] for p, k in zip(prompts, row_keys)]
    assert rows(batched) == alone
    assert all(len({tuple(alone[s * 5 + p]) for s in range(3)}) == 3 for p in range(5))


def test_same_keys_same_completions_another_sample_index_others(model):
    first = sampling.sample(model, PROMPTS, keys(5), stop_ids=[], **SETTINGS)
    again = sampling.sample(model, PROMPTS, keys(5), stop_ids=[], **SETTINGS)
    other = sampling.sample(model, PROMPTS, keys(5, sample=1), stop_ids=[], **SETTINGS)
    assert torch.equal(first.ids, again.ids) and torch.equal(first.logps, again.logps)
    assert all(a != b for a, b in zip(rows(first), rows(other)))


def test_stop_ids_cut_the_same_stream_and_the_mask_covers_the_stop(model):
    """With stop ids a row is the stop-free row cut after its first stop id (the same draws); the mask is 1
    through the stop, the ids after it are padding; a row without a stop is cut at max_new_tokens."""
    stops = [25, 36, 45]
    free = sampling.sample(model, PROMPTS, keys(5), stop_ids=[], **{**SETTINGS, "pad_id": 49})
    cut = sampling.sample(model, PROMPTS, keys(5), stop_ids=stops, **{**SETTINGS, "pad_id": 49})
    assert not free.stopped.any() and free.lengths.tolist() == [10] * 5 and free.mask.all()
    width = cut.ids.shape[1]
    for row, whole, length, stopped, mask, ids in zip(rows(cut), rows(free), cut.lengths.tolist(),
                                                      cut.stopped.tolist(), cut.mask.tolist(), cut.ids.tolist()):
        firsts = [i for i, token in enumerate(whole) if token in stops]
        assert length == (firsts[0] + 1 if firsts else 10) and stopped == bool(firsts)
        assert row == whole[:length] and mask == [1] * length + [0] * (width - length)
        assert ids[length:] == [49] * (width - length)
    # Rows stop at tokens 5, 8, 4 and 10 (a stop as the last allowed token still counts); one runs to the end.
    assert cut.lengths.tolist() == [5, 8, 10, 4, 10] and cut.stopped.tolist() == [True, True, False, True, True]
    torch.testing.assert_close(cut.logps, free.logps * cut.mask, atol=1e-6, rtol=0)


def test_all_rows_stopping_ends_the_batch_early(model):
    everything = list(range(50))
    done = sampling.sample(model, PROMPTS, keys(5), stop_ids=everything, **SETTINGS)
    assert done.ids.shape == (5, 1) and done.lengths.tolist() == [1] * 5 and done.stopped.all()


def test_truncation_is_flagged(model):
    done = sampling.sample(model, PROMPTS, keys(5), stop_ids=[], **{**SETTINGS, "max_new_tokens": 3})
    assert done.ids.shape == (5, 3) and done.lengths.tolist() == [3] * 5
    assert not done.stopped.any() and done.mask.all()


def test_tiny_top_p_is_greedy(model):
    """A nucleus of one token: the argmax at every step, as transformers' greedy generate gives it."""
    done = sampling.sample(model, PROMPTS, keys(5), stop_ids=[2], **{**SETTINGS, "top_p": 1e-6})
    with torch.no_grad():
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=[2],
                                 pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert rows(done) == [row[:row.index(2) + 1] if 2 in row else row for row in greedy]


def test_log_probs_equal_a_separate_forward(model):
    """Each sampled token's log-prob equals log_softmax(logits / temperature) at that token in one forward
    over the prompt and its completion (the row alone, no cache), within 1e-5."""
    temperature = 0.7
    done = sampling.sample(model, PROMPTS, keys(5), stop_ids=[2, 30, 31], **{**SETTINGS, "temperature": temperature})
    assert done.logps.dtype == torch.float32
    for prompt, row, logps, length in zip(PROMPTS, rows(done), done.logps, done.lengths.tolist()):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + row])).logits[0, len(prompt) - 1:-1].float()
        wanted = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(row)[:, None])[:, 0]
        torch.testing.assert_close(logps[:length], wanted, atol=1e-5, rtol=0)
        assert not logps[length:].any()
    skipped = sampling.sample(model, PROMPTS, keys(5), stop_ids=[2], with_logps=False, **SETTINGS)
    assert skipped.logps is None


def test_sampling_runs_without_dropout_and_restores_training_modes():
    """A model with attention dropout, in training mode with one layer left in evaluation mode: it
    samples what its evaluation-mode self samples, and every module's flag is back after."""
    model = tiny_llama(attention_dropout=0.5).train()
    model.model.layers[1].eval()
    before = {name: module.training for name, module in model.named_modules()}
    done = sampling.sample(model, PROMPTS, keys(5), stop_ids=[], **SETTINGS)
    assert {name: module.training for name, module in model.named_modules()} == before
    model.eval()
    assert torch.equal(done.ids, sampling.sample(model, PROMPTS, keys(5), stop_ids=[], **SETTINGS).ids)


@pytest.mark.parametrize("bad", [{"top_p": 0.0}, {"temperature": 0.0}, {"max_new_tokens": 0}])
def test_settings_outside_their_range_are_refused(model, bad):
    with pytest.raises(ValueError):
        sampling.sample(model, PROMPTS, keys(5), stop_ids=[2], **{**SETTINGS, **bad})
