"""Online RL's training forward (tasks/objectives/completion_batches.py) on a tiny fp64 Llama: each shared prompt
run once and its cache copied to its rows gives the whole-row forward's log-probs and gradients (left-padded
prompts, right-padded completions, the plain and the chunked head, groups cut by a micro-batch's pieces), with
the positions it multiplies counted; where it cannot share it runs the whole rows; rows_of keeps rows and cuts
columns by hand."""

from __future__ import annotations

import pytest
import torch
from effitrain.speedups import chunked_lm_loss
from effitrain.tasks.objectives import completion_batches

PAD = 0


@pytest.fixture(autouse=True)
def fp64(monkeypatch):
    """Llama's RMSNorm in fp64 (transformers computes it in fp32: the shared prompt's gradient is summed over its
    rows before that arithmetic, the whole rows' after) and the plain head's logits kept in fp64 (it casts them
    to fp32): both ways are then exact to fp64's rounding."""
    from transformers.models.llama import modeling_llama

    from effitrain.tasks import lm_head

    monkeypatch.setattr(lm_head.LMHead, "held", lambda self, logits: logits)

    def forward(self, hidden):
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def tiny_llama(chunked: bool = False, dtype: torch.dtype = torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=17, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                         pad_token_id=PAD))
    model = model if dtype == torch.float32 else model.to(dtype)
    if chunked:
        assert chunked_lm_loss.apply(model)
    return model.train()


def micro_batch(prompts: list[list[int]], completions: list[list[int]], width: int) -> dict:
    """Rows of (prompt, completion): prompts left-padded, completions right-padded to `width`, as the rollout
    makes them (completion_batches.sequences)."""
    longest = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[PAD] * (longest - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    ids = torch.tensor([c + [PAD] * (width - len(c)) for c in completions])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    batch = completion_batches.sequences(prompt_ids, prompt_mask, ids, mask)
    batch["completion_mask"] = mask
    return batch


# Three prompts (one shorter: left padding) x 3 completions, some shorter than the widest (right padding).
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10]]
COMPLETIONS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10], [11, 12, 13], [14], [15, 16, 1, 2], [3, 4, 5, 6], [7], [8, 9]]
BATCH = micro_batch([p for p in PROMPTS for _ in range(3)], COMPLETIONS, 4)


def logps_and_grads(model, batch, logps) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    values = logps(model, batch, 0.7)
    weights = torch.linspace(-1, 1, values.numel(), dtype=values.dtype).view(values.shape)
    (values * weights).sum().backward()
    return values.detach(), [p.grad.clone() for p in model.parameters()]


def by_hand(model, batch) -> torch.Tensor:
    """Each completion token's log-prob at temperature 0.7, each row alone without padding (0 on padding)."""
    width = batch["completion_mask"].shape[1]
    out = torch.zeros(batch["completion_mask"].shape, dtype=torch.float64)
    for row, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"])):
        tokens = ids[mask.bool()]
        length = int(batch["completion_mask"][row].sum())
        logps = torch.log_softmax(model(input_ids=tokens[None]).logits[0, :-1] / 0.7, -1)
        picked = logps.gather(-1, tokens[1:, None])[:, 0]
        out[row, :length] = picked[len(tokens) - 1 - length:].detach()
    return out[:, :width]


@pytest.mark.parametrize("chunked", [False, True], ids=["plain-head", "chunked-head"])
def test_each_prompt_once_equals_the_whole_rows_and_each_row_alone(chunked):
    model = tiny_llama(chunked)
    assert completion_batches.shared_prompts(BATCH, model)[1].tolist() == [3, 3, 3]
    shared, shared_grads = logps_and_grads(model, BATCH, completion_batches.completion_logps)
    whole, whole_grads = logps_and_grads(model, BATCH, completion_batches._whole_rows_logps)
    tolerance = 1e-6 if chunked else 1e-12  # the chunked head's log-probs are fp32 whatever the model's dtype
    torch.testing.assert_close(shared, by_hand(model, BATCH).to(shared.dtype), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(shared, whole, rtol=tolerance, atol=tolerance)
    for a, b in zip(shared_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def forward_shapes(model, batch) -> list[tuple[int, ...]]:
    """The input_ids shape of each forward completion_logps runs."""
    shapes = []
    handle = model.model.embed_tokens.register_forward_hook(lambda module, args, out: shapes.append(args[0].shape))
    try:
        completion_batches.completion_logps(model, batch)
    finally:
        handle.remove()
    return [tuple(shape) for shape in shapes]


def test_the_prompts_run_once_and_the_completions_but_their_last_token():
    """9 rows of 3 prompt + 4 completion positions: 3 prompts x 3, then 9 rows x 3 completion tokens (36
    positions instead of 63)."""
    assert forward_shapes(tiny_llama(), BATCH) == [(3, 3), (9, 3)]


def test_groups_are_neighbouring_rows_with_the_same_prompt_so_a_piece_may_cut_one():
    """A piece of the micro-batch (engine/memory_fit.split_batch) that starts inside the first group."""
    piece = {key: value[2:7] for key, value in BATCH.items()}
    firsts, sizes = completion_batches.shared_prompts(piece)
    assert firsts.tolist() == [0, 1, 4] and sizes.tolist() == [1, 3, 1]
    model = tiny_llama()
    shared, shared_grads = logps_and_grads(model, piece, completion_batches.completion_logps)
    whole, whole_grads = logps_and_grads(model, piece, completion_batches._whole_rows_logps)
    torch.testing.assert_close(shared, whole, rtol=1e-12, atol=1e-12)
    for a, b in zip(shared_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_whole_rows_where_no_prompt_is_shared_or_checkpointing_drops_the_cache():
    alone = {key: value[::3] for key, value in BATCH.items()}  # one row of each prompt
    assert completion_batches.shared_prompts(alone) is None
    assert forward_shapes(tiny_llama(), alone) == [(3, 7)]
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert completion_batches.shared_prompts(BATCH, model) is None
    assert forward_shapes(model, BATCH) == [(9, 7)]


@pytest.mark.parametrize("chunked", [False, True], ids=["plain-head", "chunked-head"])
def test_the_planners_fake_tensors_share_each_prompt_as_their_batch_says(chunked):
    """The planner (planning/simulate.py) runs the loss on fake tensors, which have no values to compare: grouped
    by PLANNED_GROUP_ROWS, 2 prompts x 3 rows run the prompts once (2 x 3 positions) and the completions but
    their last token (6 x 3) through the copied cache, DynamicCache's growth and the copies' backward included
    (every parameter gets its gradient); without it, the whole rows."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    with FakeTensorMode():
        model = tiny_llama(chunked, torch.float32)  # (fake parameters refuse .to)
        ids = torch.zeros(6, 7, dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "position_ids": torch.arange(7).expand(6, -1), "completion_mask": torch.ones(6, 4),
                 completion_batches.PLANNED_GROUP_ROWS: 3}
        firsts, sizes = completion_batches.shared_prompts(batch, model)
        assert is_fake(firsts) and firsts.shape == sizes.shape == (2,)
        assert forward_shapes(model, batch) == [(2, 3), (6, 3)]
        model.zero_grad(set_to_none=True)
        completion_batches.completion_logps(model, batch).sum().backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
        del batch[completion_batches.PLANNED_GROUP_ROWS]
        assert completion_batches.shared_prompts(batch, model) is None
        assert forward_shapes(model, batch) == [(6, 7)]


def test_rows_of_keeps_rows_in_order_and_cuts_the_completion_columns_no_kept_row_counts():
    """Rows 1 and 4 kept: prompts [3, 4, 5] and [6, 7] (3 columns), completions [5, 6] and [14], so 2 completion
    columns of 4 remain; every per-row tensor follows, the prompt columns stay."""
    batch = {**BATCH, "advantages": torch.arange(9.0), "old_logps": torch.randn(9, 4)}
    keep = torch.zeros(9, dtype=torch.bool)
    keep[[1, 4]] = True
    kept = completion_batches.rows_of(batch, keep)
    assert kept["advantages"].tolist() == [1.0, 4.0]
    assert kept["completion_mask"].tolist() == [[1, 1], [1, 0]]
    assert kept["input_ids"].tolist() == [[3, 4, 5, 5, 6], [PAD, 6, 7, 14, PAD]]
    assert kept["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    assert torch.equal(kept["position_ids"], BATCH["position_ids"][[1, 4], :5])
    assert torch.equal(kept["old_logps"], batch["old_logps"][[1, 4], :2])
    none = completion_batches.rows_of(batch, torch.zeros(9, dtype=torch.bool))
    assert none["advantages"].tolist() == [0.0] and none["completion_mask"].shape == (1, 4)  # the first row
    assert completion_batches.rows_of(batch, torch.ones(9, dtype=torch.bool)) is batch
