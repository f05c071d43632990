"""The online RL objective (tasks/objectives/grpo.py) on a tiny Llama: its rollout samples each prompt's G
completions from the (row, sample) streams of the step's seed, and the first update's gradient is the
group-advantage REINFORCE gradient computed by hand, each completion alone after its prompt (no padding), at
the temperature, for every loss type; the log's sums are the completions' rewards, lengths and shares."""

from __future__ import annotations

import statistics

import pytest
import torch
from effitrain import config as cfg
from effitrain import tasks
from effitrain.engine.step import step_generator
from effitrain.tasks import sampling
from effitrain.tasks.objectives import grpo
from effitrain.tasks.objectives.rewards import RewardFunction

VOCAB, G, NEW, STOP, PAD = 13, 4, 4, 12, 0
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [5]]
ROWS = [7, 2, 11, 0]  # the prompts' indices in the data: what their samples are keyed by


class Tokens:
    """A tokenizer's batch_decode: each id as a letter, the stop id dropped as a special token."""

    @staticmethod
    def batch_decode(rows, skip_special_tokens=True):
        return ["".join(chr(97 + token) for token in row if token != STOP) for row in rows]


def parity(completions, completion_ids, **_):
    """A reward with spread on a random model: the completion's first token's parity, plus its length / 10."""
    return [float(ids[0] % 2) + len(ids) / 10 for ids in completion_ids]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                        pad_token_id=PAD)).double()


def objective(rl: str, **settings) -> grpo.Grpo:
    config = cfg.build(None, {"task": "causal-lm", "rl": rl, "num_generations": G, "max_new_tokens": NEW,
                              **settings})
    task = tasks.for_config(config)
    task.objective.functions, task.objective.weights = [RewardFunction.of(parity, "parity", "test")], [1.0]
    columns = {"prompt": [f"p{i}" for i in range(12)], "answer": [str(i) for i in range(12)]}
    task.objective.data = grpo.PromptData(Tokens(), [STOP], PAD, columns, conversational=False)
    return task.objective


def prompt_batch(indices) -> dict:
    width = max(len(PROMPTS[i]) for i in indices)
    ids = torch.tensor([[PAD] * (width - len(PROMPTS[i])) + PROMPTS[i] for i in indices])
    mask = torch.tensor([[0] * (width - len(PROMPTS[i])) + [1] * len(PROMPTS[i]) for i in indices])
    return {"input_ids": ids, "attention_mask": mask, "row_index": torch.tensor([ROWS[i] for i in indices])}


def hand_advantages(rewards: list[list[float]], rloo: bool) -> list[float]:
    out = []
    for group in rewards:
        if rloo:  # TRL's RLOO, scale none: minus the mean of the others
            out += [r - (sum(group) - r) / (len(group) - 1) for r in group]
        elif len(set(group)) == 1:
            out += [0.0] * len(group)
        else:
            out += [(r - statistics.mean(group)) / (statistics.stdev(group) + 1e-4) for r in group]
    return out


def hand_gradient(model, completions, advantages, loss_type, temperature):
    """-sum_i A_i w_i sum_t log p(token_t | prompt, tokens before) at the temperature, each completion run
    alone after its prompt, its weights' gradient."""
    lengths = [len(ids) for _, ids in completions]
    weights = {"dapo": [1 / sum(lengths)] * len(lengths), "grpo": [1 / (len(lengths) * n) for n in lengths],
               "dr_grpo": [1 / (len(lengths) * NEW)] * len(lengths), "rloo": [1 / len(lengths)] * len(lengths)}
    model.zero_grad()
    total = 0.0
    for (prompt, ids), advantage, weight in zip(completions, advantages, weights[loss_type]):
        sequence = torch.tensor([prompt + ids])
        logps = torch.log_softmax(model(input_ids=sequence).logits[0, :-1] / temperature, -1)
        picked = logps[len(prompt) - 1:].gather(-1, torch.tensor(ids)[:, None]).sum()
        total = total - advantage * weight * picked
    total.backward()
    return [p.grad.clone() for p in model.parameters()], float(total.detach())


@pytest.fixture
def fp64_head(monkeypatch):
    """The plain head's logits kept in the model's fp64 (it casts them to fp32, as TRL does), and Llama's RMSNorm
    in fp64 (transformers computes it in fp32: the objective runs a shared prompt once for its G rows, so its
    gradient there is summed before that fp32 arithmetic, the hand computation's after), so that the comparison
    with the hand computation is exact to fp64's rounding: the arithmetic, not its precision."""
    from transformers.models.llama import modeling_llama

    from effitrain.tasks import lm_head

    def fp64_norm(self, hidden):
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(lm_head.LMHead, "held", lambda self, logits: logits)
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", fp64_norm)


@pytest.mark.parametrize("rl, loss_type", [("grpo", "dapo"), ("grpo", "grpo"), ("grpo", "dr-grpo"), ("rloo", None)])
def test_the_first_update_is_the_group_advantage_reinforce_gradient(rl, loss_type, fp64_head):
    settings = {"temperature": 0.7} | ({"loss_type": loss_type} if loss_type else {})
    rl_objective, model = objective(rl, **settings), tiny_llama()
    generator = step_generator(42, 1, "cpu")
    group = [prompt_batch([0, 1]), None, prompt_batch([2, 3])]  # accumulation 3, one micro-batch missing here
    trained = rl_objective.rollout(model, group, generator)
    assert trained[1] is None and [len(b["input_ids"]) for b in (trained[0], trained[2])] == [2 * G, 2 * G]
    # Each completion, as the rows' own streams draw it: (row index, sample) of the step's seed, each alone.
    completions = []
    for batch in (trained[0], trained[2]):
        width = batch["completion_mask"].shape[1]
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            full = ids[mask.bool()].tolist()
            length = int(mask[-width:].sum())
            completions.append((full[:-length], full[-length:]))
    for index, (prompt, ids) in enumerate(completions):
        alone = sampling.sample(model, [prompt], [(ROWS[index // G], index % G)], max_new_tokens=NEW,
                                temperature=0.7, stop_ids=[STOP], pad_id=PAD, seed=generator.initial_seed())
        assert alone.ids[0, :alone.lengths[0]].tolist() == ids
    rewards = [parity(None, [ids for _, ids in completions[g * G:(g + 1) * G]]) for g in range(4)]
    assert any(len(set(group)) > 1 for group in rewards)
    advantages = hand_advantages(rewards, rloo=rl == "rloo")
    torch.testing.assert_close(torch.cat([trained[0]["advantages"], trained[2]["advantages"]]).double(),
                               torch.tensor(advantages, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    # The step runner's arithmetic: each micro-batch's loss sum over the step's item count, accumulated.
    model.zero_grad()
    items = sum(rl_objective.item_count(b) for b in trained if b is not None)
    losses = [rl_objective.loss(model, b) for b in trained if b is not None]
    sum(loss.loss_sum for loss in losses).div(items).backward()
    got = [p.grad.clone() for p in model.parameters()]
    (name,) = {"dapo": ["dapo"], "grpo": ["grpo"], "dr-grpo": ["dr_grpo"], None: ["rloo"]}[loss_type]
    used = torch.cat([trained[0]["advantages"], trained[2]["advantages"]]).tolist()
    wanted, _ = hand_gradient(model, completions, used, name, 0.7)
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    # The log's sums: over the step's completions, then their count.
    sums = sum(loss.sums for loss in losses)
    names = rl_objective.train_metric_names
    assert float(sums[-1]) == len(completions)
    means = dict(zip(names, (sums[:-1] / sums[-1]).tolist()))
    flat = [r for group in rewards for r in group]
    assert means["reward"] == pytest.approx(statistics.mean(flat)) == means["reward_parity"]
    assert means["completion_length"] == pytest.approx(statistics.mean(len(ids) for _, ids in completions))
    assert means["truncated_share"] == pytest.approx(statistics.mean(STOP not in ids for _, ids in completions))
    assert means["zero_spread_share"] == pytest.approx(statistics.mean(len(set(g)) == 1 for g in rewards))
    assert means["clip_ratio"] == 0.0  # one update per generation: the ratio is exactly 1


def test_the_step_seed_and_the_rows_key_the_samples_not_the_micro_batches():
    rl_objective, model = objective("grpo"), tiny_llama()

    def completions(group, step):
        """row index -> its G completions (new tokens and padding)."""
        trained = rl_objective.rollout(model, group, step_generator(42, step, "cpu"))
        found = {}
        for batch in filter(None, trained):
            width = batch["completion_mask"].shape[1]
            for row, ids, mask in zip(batch["row_index"].tolist(), batch["input_ids"], batch["completion_mask"]):
                found.setdefault(row, []).append(ids[-width:][mask.bool()].tolist())
        return found

    together = completions([prompt_batch([0, 1, 2, 3])], 1)
    assert sorted(together) == sorted(ROWS) and all(len(samples) == G for samples in together.values())
    apart = completions([prompt_batch([3]), prompt_batch([1, 0]), None, prompt_batch([2])], 1)
    assert apart == together
    assert completions([prompt_batch([0, 1, 2, 3])], 2) != together


def test_the_reference_is_the_adapters_switched_off_with_peft_else_a_frozen_copy():
    from effitrain.tasks import reference

    assert objective("grpo").reference is None  # --kl-beta 0: no reference held
    assert isinstance(objective("grpo", kl_beta=0.1).reference, reference.FrozenCopy)
    assert isinstance(objective("grpo", kl_beta=0.1, peft="lora").reference, reference.AdaptersOff)


def odd_answers_parity(completions, answer, completion_ids, **_):
    """The parity reward on the prompts whose answer is odd (rows 7 and 11); 0.5 on the others (rows 2 and 0):
    groups with no spread, whose advantages are exactly 0."""
    return [float(ids[0] % 2) + len(ids) / 10 if int(a) % 2 else 0.5 for a, ids in zip(answer, completion_ids)]


@pytest.mark.parametrize("rl, settings", [("grpo", {"loss_type": "dapo"}), ("grpo", {"loss_type": "grpo"}),
                                          ("grpo", {"loss_type": "dapo", "mask_truncated": True}), ("rloo", {})])
def test_rows_without_a_gradient_stay_out_of_the_forward_and_change_nothing(rl, settings):
    """Zero-advantage rows (groups with no spread) and, with --mask-truncated, rows with no counted token: the
    loss runs its forward on the others only, and its loss sum, log sums and gradient equal those of the
    forward over every row; its counts are every row's."""
    rl_objective, model = objective(rl, temperature=0.7, **settings), tiny_llama()
    rl_objective.functions = [RewardFunction.of(odd_answers_parity, "odd", "test")]
    (batch,) = rl_objective.rollout(model, [prompt_batch([0, 1, 2, 3])], step_generator(42, 1, "cpu"))
    zero = batch["advantages"] == 0
    assert zero[G:2 * G].all() and zero[3 * G:].all()  # rows 2 and 0: no spread
    assert not zero[:G].all() and not zero[2 * G:3 * G].all()
    kept = grpo.pg.contributing(batch["advantages"], batch["completion_mask"])
    assert 0 < kept.sum() <= 2 * G
    rows_seen = []
    handle = model.model.embed_tokens.register_forward_hook(lambda m, args, out: rows_seen.append(len(args[0])))

    def step(objective_now):
        model.zero_grad()
        result = objective_now.loss(model, batch)
        result.loss_sum.div(objective_now.item_count(batch)).backward()
        return result, [p.grad.clone() for p in model.parameters()]

    skipping, skipping_grads = step(rl_objective)
    assert rows_seen[-1] == int(kept.sum())  # the completions' forward (the prompts': one row a kept prompt)
    rl_objective._contributing = lambda batch: batch  # every row
    every, every_grads = step(rl_objective)
    handle.remove()
    assert rows_seen[-1] == 4 * G
    torch.testing.assert_close(skipping.loss_sum, every.loss_sum, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(skipping.sums, every.sums, rtol=1e-12, atol=1e-15)
    assert any(g.abs().max() > 0 for g in every_grads)
    for a, b in zip(skipping_grads, every_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
