"""GRPO (dapo, grpo, dr_grpo, bnpo) and RLOO arithmetic (tasks/objectives/policy_gradient.py) against hand
computations: advantages for each scale_rewards, RLOO's leave-one-out baseline, each loss type's value,
clip-higher, the k3 KL; on a tiny Llama, the gradient with respect to the logits is the group-advantage
REINFORCE gradient; zero-spread groups move nothing; any split of a step into processes x micro-batches
gives the whole step's loss and gradient."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from effitrain.errors import UserError
from effitrain.tasks.objectives import policy_gradient as pg

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 1.0, 0.0]]


# -- advantages ------------------------------------------------------------------------------------
def test_group_scaling_is_the_groups_mean_and_sample_std():
    got = pg.advantages(torch.tensor(REWARDS, dtype=torch.float64), "group")
    for group, row in zip(REWARDS, got):
        mean, std = statistics.mean(group), statistics.stdev(group)
        assert row.tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in group], abs=1e-12)


def test_batch_scaling_divides_by_the_steps_std_and_none_by_nothing():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    std = statistics.stdev([r for group in REWARDS for r in group])
    batch, none = pg.advantages(rewards, "batch"), pg.advantages(rewards, "none")
    for group, batch_row, none_row in zip(REWARDS, batch, none):
        mean = statistics.mean(group)
        assert batch_row.tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in group], abs=1e-12)
        assert none_row.tolist() == pytest.approx([r - mean for r in group], abs=1e-12)


def test_rloo_subtracts_the_mean_of_the_others():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    by_hand = [[r - statistics.mean(group[:i] + group[i + 1:]) for i, r in enumerate(group)] for group in REWARDS]
    got = pg.advantages(rewards, "none", rloo=True)
    for row, hand in zip(got, by_hand):
        assert row.tolist() == pytest.approx(hand, abs=1e-12)
    flat = [a for row in by_hand for a in row]  # "batch": TRL's normalize_advantages over the whole step
    normalised = [(a - statistics.mean(flat)) / (statistics.stdev(flat) + 1e-4) for a in flat]
    assert pg.advantages(rewards, "batch", rloo=True).flatten().tolist() == pytest.approx(normalised, abs=1e-12)
    with pytest.raises(UserError, match="none"):
        pg.advantages(rewards, "group", rloo=True)


def test_an_unscored_completion_gets_zero_and_stays_out_of_the_baseline():
    rewards = torch.tensor([[1.0, float("nan"), 0.0, 2.0]], dtype=torch.float64)
    scored = [1.0, 0.0, 2.0]
    mean, std = statistics.mean(scored), statistics.stdev(scored)
    assert pg.advantages(rewards, "group").tolist()[0] == pytest.approx(
        [(1 - mean) / (std + 1e-4), 0.0, (0 - mean) / (std + 1e-4), (2 - mean) / (std + 1e-4)], abs=1e-12)
    assert pg.advantages(rewards, "none", rloo=True).tolist()[0] == pytest.approx([0.0, 0.0, -1.5, 1.5], abs=1e-12)


def test_zero_spread_groups_get_exactly_zero_and_are_counted():
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 0.0], [float("nan"), 0.3, float("nan")]], dtype=torch.float32)
    assert pg.zero_spread(rewards).tolist() == [True, False, True]
    assert pg.zero_spread_share(rewards) == pytest.approx(2 / 3)
    for scale, rloo in (("group", False), ("batch", False), ("none", False), ("none", True), ("batch", True)):
        values = pg.advantages(rewards, scale, rloo)
        assert torch.equal(values[[0, 2]], torch.zeros(2, 3)), (scale, rloo)
        assert values[1].abs().sum() > 0


def test_bad_names_are_user_errors():
    with pytest.raises(UserError):
        pg.advantages(torch.zeros(1, 2), "sequence")
    with pytest.raises(UserError):
        pg.item_count(torch.ones(1, 2), "ppo", 2)
    assert pg.item_count(torch.ones(3, 2), "dr-grpo", 5) == 15  # the CLI's spelling


# -- the loss of each type, by hand ----------------------------------------------------------------
LOGPS = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]]
OLD = [[-1.1, -1.7, -0.5], [-0.2, -1.0, -3.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [0.8, -1.5]


def hand_token_loss(eps_low=0.2, eps_high=0.2):
    """[[per-token loss]] with python floats: -min(r A, clip(r) A)."""
    out = []
    for logps, old, a in zip(LOGPS, OLD, ADV):
        row = []
        for lp, o in zip(logps, old):
            r = math.exp(lp - o)
            row.append(-min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a))
        out.append(row)
    return out


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_each_loss_type_against_a_hand_computation(loss_type):
    per_token = hand_token_loss()
    masked = [[x * m for x, m in zip(row, mask)] for row, mask in zip(per_token, MASK)]
    lengths = [sum(mask) for mask in MASK]
    by_hand = {"dapo": sum(map(sum, masked)) / sum(lengths), "bnpo": sum(map(sum, masked)) / sum(lengths),
               "grpo": statistics.mean(sum(row) / n for row, n in zip(masked, lengths)),
               "dr_grpo": sum(map(sum, masked)) / (2 * 7)}[loss_type]
    loss, _ = pg.token_loss(*(torch.tensor(x, dtype=torch.float64) for x in (LOGPS, OLD, ADV)), torch.tensor(MASK))
    total, count = pg.loss_sum_and_count(loss, torch.tensor(MASK), loss_type, max_new_tokens=7)
    assert float(total / count) == pytest.approx(by_hand, rel=1e-12)


def test_rloo_loss_is_a_clipped_sequence_ratio_averaged_over_sequences():
    by_hand = []
    for logps, old, mask, a in zip(LOGPS, OLD, MASK, ADV):
        r = math.exp(sum(lp * m for lp, m in zip(logps, mask)) - sum(o * m for o, m in zip(old, mask)))
        by_hand.append(-min(r * a, min(max(r, 0.8), 1.28) * a))
    loss, metrics = pg.sequence_loss(*(torch.tensor(x, dtype=torch.float64) for x in (LOGPS, OLD, ADV)),
                                     torch.tensor(MASK), 0.2, 0.28)
    assert loss.tolist() == pytest.approx(by_hand, rel=1e-12)
    total, count = pg.loss_sum_and_count(loss, torch.tensor(MASK), "rloo", max_new_tokens=7)
    assert float(total / count) == pytest.approx(statistics.mean(by_hand), rel=1e-12)
    # ratios exp(-0.2) = 0.82 (A > 0: unclipped) and exp(-0.3) = 0.74 (A < 0: clipped low)
    assert [float(metrics[k]) for k in ("clip_ratio_low", "clip_ratio_high", "sequences")] == [1.0, 0.0, 2.0]


def test_clip_higher_clips_above_one_plus_epsilon_high_only():
    ratios = torch.tensor([0.7, 0.85, 1.1, 1.25, 1.35], dtype=torch.float64)
    old = torch.zeros(2, 5, dtype=torch.float64)
    logps = ratios.log().repeat(2, 1).requires_grad_()
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metrics = pg.token_loss(logps, old, advantages, torch.ones(2, 5), epsilon_low=0.2, epsilon_high=0.28)
    loss.sum().backward()
    # A = +1: min(r, clip(r)) -> the ratio 1.35 is held at 1.28, its gradient 0; 1.25 (clipped with 0.2) is not.
    # A = -1: min(-r, -clip(r)) -> 0.7 is held at 0.8, its gradient 0; above 1 nothing is clipped for A < 0.
    assert loss[0].tolist() == pytest.approx([-0.7, -0.85, -1.1, -1.25, -1.28], rel=1e-12)
    assert loss[1].tolist() == pytest.approx([0.8, 0.85, 1.1, 1.25, 1.35], rel=1e-12)
    assert logps.grad[0].tolist() == pytest.approx([-0.7, -0.85, -1.1, -1.25, 0.0], rel=1e-12)
    assert logps.grad[1].tolist() == pytest.approx([0.0, 0.85, 1.1, 1.25, 1.35], rel=1e-12)
    assert [float(metrics[k]) for k in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "tokens")] == \
        [1.0, 1.0, 2.0, 10.0]
    symmetric, _ = pg.token_loss(logps.detach(), old, advantages, torch.ones(2, 5), epsilon_low=0.2)
    assert float(symmetric[0, 3]) == pytest.approx(-1.2)  # without clip-higher, 1.25 is clipped


@pytest.mark.parametrize("bias_correction", [True, False])
def test_k3_kl_and_its_gradient_on_policy(bias_correction):
    logps = torch.tensor([[-1.0, -0.2, -3.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -0.1, -2.0]], dtype=torch.float64)
    beta, advantage = 0.1, 0.5
    loss, metrics = pg.token_loss(logps, logps.detach(), torch.tensor([advantage], dtype=torch.float64),
                                  torch.tensor([[1, 1, 0]]), ref_logps=ref, beta=beta,
                                  kl_bias_correction=bias_correction)
    loss.sum().backward()
    kl = [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(logps[0].tolist(), ref[0].tolist())]
    assert loss[0].tolist() == pytest.approx([-advantage + beta * k for k in kl], rel=1e-12)
    assert float(metrics["kl"]) == pytest.approx(kl[0] + kl[1], rel=1e-12)  # masked tokens left out
    # d/dlogp of -r A + beta k3 (x r): r = 1 on policy, dr/dlogp = 1, dk3/dlogp = 1 - exp(ref - logp)
    by_hand = [-advantage + beta * (1 - math.exp(r - lp) + (k if bias_correction else 0.0))
               for lp, r, k in zip(logps[0].tolist(), ref[0].tolist(), kl)]
    assert logps.grad[0].tolist() == pytest.approx(by_hand, rel=1e-12)


def test_rloo_kl_is_a_reward_penalty_of_summed_log_ratios():
    kl = pg.sequence_kl(torch.tensor(OLD), torch.tensor(LOGPS), torch.tensor(MASK))
    assert kl.tolist() == pytest.approx([(-1.1 + 1.0) + (-1.7 + 2.0) + 0.0, (-0.2 + 0.3) + (-1.0 + 1.2)])


def test_truncated_completions_leave_the_tokens_but_not_the_sequences():
    mask = pg.mask_truncated(torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]), torch.tensor([True, False, False]))
    assert mask.tolist() == [[0, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert [int(pg.item_count(mask, t, 3)) for t in ("dapo", "grpo", "dr_grpo")] == [3, 3, 9]
    assert float(pg.loss_sum(torch.ones(3, 3), mask, "grpo")) == 2.0  # the masked row adds 0 (no 0/0)


# -- on a tiny model: the REINFORCE gradient, zero spread, layouts -------------------------------------
PROMPT, NEW = 3, 4  # prompt tokens, max_new_tokens
LENGTHS = [4, 2, 3, 1, 4, 4, 2, 3]  # the completions' lengths: 2 prompts x G = 4


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2)).double()


def step_tokens():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 13, (len(LENGTHS), PROMPT + NEW), generator=generator)
    mask = (torch.arange(NEW)[None] < torch.tensor(LENGTHS)[:, None]).long()
    return ids, mask


def completion_logps(model, ids):
    """(the completion tokens' log-probs [sequences, NEW], the logits that predict them, holding their grad)."""
    logits = model(input_ids=ids).logits
    logits.retain_grad()
    predicting = logits[:, PROMPT - 1:-1]
    return torch.log_softmax(predicting, -1).gather(-1, ids[:, PROMPT:, None]).squeeze(-1), logits


def weights_per_sequence(loss_type):
    """What each sequence's token log-probs are multiplied by in the loss (its normaliser)."""
    sequences, tokens = len(LENGTHS), sum(LENGTHS)
    return {"dapo": [1 / tokens] * sequences, "grpo": [1 / (sequences * n) for n in LENGTHS],
            "dr_grpo": [1 / (sequences * NEW)] * sequences, "rloo": [1 / sequences] * sequences}[loss_type]


def step_loss(model, ids, mask, adv, loss_type):
    logps, logits = completion_logps(model, ids)
    if loss_type == "rloo":
        loss, _ = pg.sequence_loss(logps, logps.detach(), adv, mask)
    else:
        loss, _ = pg.token_loss(logps, logps.detach(), adv, mask)
    total, count = pg.loss_sum_and_count(loss, mask, loss_type, NEW)
    return total / count, logits


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "rloo"])
def test_one_update_per_generation_is_the_group_advantage_reinforce_gradient(loss_type):
    model, (ids, mask) = tiny_llama(), step_tokens()
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 2.0]], dtype=torch.float64)
    adv = pg.advantages(rewards, "none" if loss_type == "rloo" else "group", rloo=loss_type == "rloo").flatten()
    loss, logits = step_loss(model, ids, mask, adv, loss_type)
    loss.backward()
    # By hand: d(-A w log softmax(z)[y]) / dz = -A w (onehot(y) - softmax(z)), at each completion token.
    probs, by_hand = torch.softmax(logits.detach(), -1), torch.zeros_like(logits)
    for b, (a, w) in enumerate(zip(adv.tolist(), weights_per_sequence(loss_type))):
        for t in range(LENGTHS[b]):
            onehot = torch.nn.functional.one_hot(ids[b, PROMPT + t], 13).double()
            by_hand[b, PROMPT - 1 + t] = -a * w * (onehot - probs[b, PROMPT - 1 + t])
    torch.testing.assert_close(logits.grad, by_hand, rtol=1e-10, atol=1e-14)
    reinforce = sum(-a * w * n for a, w, n in zip(adv.tolist(), weights_per_sequence(loss_type), LENGTHS))
    assert float(loss.detach()) == pytest.approx(reinforce if loss_type != "rloo" else -float(adv.mean()), abs=1e-12)
    # and through the model: the weights' gradient is the hand logits-gradient back-propagated
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, logits = completion_logps(model, ids)
    logits.backward(by_hand)
    for got, expected in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "rloo"])
def test_zero_spread_groups_give_zero_gradient(loss_type):
    model, (ids, mask) = tiny_llama(), step_tokens()
    rloo = loss_type == "rloo"
    rewards = torch.tensor([[0.1, 0.1, 0.1, 0.1], [0.0, 0.0, 1.0, 2.0]], dtype=torch.float64)
    loss, logits = step_loss(model, ids, mask, pg.advantages(rewards, "batch" if rloo else "group", rloo).flatten(),
                             loss_type)
    loss.backward()
    assert torch.equal(logits.grad[:4], torch.zeros_like(logits.grad[:4]))  # group 0's four sequences
    assert logits.grad[4:].abs().sum() > 0
    model.zero_grad()
    flat = torch.full((2, 4), 0.7, dtype=torch.float64)
    loss, _ = step_loss(model, ids, mask, pg.advantages(flat, "none", rloo).flatten(), loss_type)
    loss.backward()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


LAYOUTS = {"2 processes x 2 micro-batches, even": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
           "2 processes x 2 micro-batches, uneven": [[[0, 1, 2], [3]], [[4], [5, 6, 7]]],
           "groups straddle processes": [[[3, 4], [0]], [[7, 1, 5], [2, 6]]]}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "rloo"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_any_split_of_the_step_gives_the_whole_steps_loss_and_gradient(loss_type, layout):
    """Off policy (old != current), with clipping and a KL term: the step runner's sum over pieces divided by
    the count over pieces equals the whole step's loss, and so does the gradient."""
    generator = torch.Generator().manual_seed(2)
    logps = (-torch.rand(8, NEW, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + torch.randn(8, NEW, generator=generator, dtype=torch.float64) * 0.3
    ref = logps.detach() + torch.randn(8, NEW, generator=generator, dtype=torch.float64) * 0.3
    _, mask = step_tokens()
    adv = pg.advantages(torch.rand(2, 4, generator=generator, dtype=torch.float64), "group").flatten()

    def piece_sum(rows):
        if loss_type == "rloo":
            loss, _ = pg.sequence_loss(logps[rows], old[rows], adv[rows], mask[rows], 0.2, 0.28)
        else:
            loss, _ = pg.token_loss(logps[rows], old[rows], adv[rows], mask[rows], 0.2, 0.28, ref[rows], 0.05)
        return pg.loss_sum(loss, mask[rows], loss_type)

    whole = piece_sum(list(range(8))) / pg.item_count(mask, loss_type, NEW)
    (whole_grad,) = torch.autograd.grad(whole, logps)
    pieces = [rows for process in LAYOUTS[layout] for rows in process]
    step_items = sum(pg.item_count(mask[rows], loss_type, NEW) for rows in pieces)  # reduced over processes
    split = sum(piece_sum(rows) / step_items for rows in pieces)  # each piece's backward, accumulated
    (split_grad,) = torch.autograd.grad(split, logps)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(split_grad, whole_grad, rtol=0, atol=1e-12)


def test_trls_per_micro_batch_grpo_mean_depends_on_the_layout_where_the_step_global_one_does_not():
    """Why the step-global normalisation: with micro-batches of 3 and 1 sequences, the mean of their means
    (TRL's grpo with accumulation) is not the mean over the step's sequences."""
    per_sequence = torch.tensor([1.0, 2.0, 3.0, 10.0], dtype=torch.float64)
    mean_of_means = (per_sequence[:3].mean() + per_sequence[3:].mean()) / 2
    assert float(mean_of_means) == pytest.approx(6.0) and float(per_sequence.mean()) == pytest.approx(4.0)


def test_the_rows_that_contribute_have_an_advantage_and_a_counted_token():
    advantages = torch.tensor([0.0, 1.2, -0.4, 0.0, 2.0])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0], [0, 0], [1, 1]])
    assert pg.contributing(advantages, mask).tolist() == [False, True, False, False, True]
    assert pg.contributing(advantages[:, None], mask).tolist() == [False, True, False, False, True]
