"""Online RL's training sequences: each prompt (left-padded, as sampled) followed by one of its sampled
completions (right-padded), with positions counted from each row's first token, so that a row computes what
it computed alone while it was sampled, whatever the rows beside it; and the completion tokens' log-probs of
the policy's forward over them (through the LM head: tasks/lm_head.py, chunked where it can be).

The forward runs each prompt once for the rows that share it (a prompt's G completions sit side by side):
the prompts alone, their keys and values then copied to each of their rows (as sampling shares a prompt's
pass) and the completions run through that cache. The positions multiplied are the distinct prompts' and
the completions' (less each completion's last token, which predicts nothing) instead of every row's whole
sequence: at G = 8 and a prompt as long as its completions, 9/16 of them; the prompt's gradient flows back
through the copies. The same function of the weights as one forward over the whole rows (equal to float
rounding); that whole-row forward is kept where the prompt pass cannot be shared (no two rows share a
prompt, gradient checkpointing, which drops the cache, a cache other than transformers' plain DynamicCache).
The planner's fake tensors run the same code: having no values to compare, its example batch says how many
neighbouring rows share each prompt (PLANNED_GROUP_ROWS)."""

from __future__ import annotations

import torch

import effitrain.tasks.sampling as sampling
from effitrain.tasks.lm_head import LMHead

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
# A micro-batch's tensors a column per completion token (the rest: a column per position, or none).
COMPLETION_COLUMNS = ("completion_mask", "old_logps", "ref_logps")
# The planner's example batch (tasks/online_rl.py's example_batch): how many neighbouring rows share each prompt
# (G, a prompt's completions), which its fake tensors cannot show by their values.
PLANNED_GROUP_ROWS = "planned_group_rows"


def sequences(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
              completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """[rows, prompt width + completion width] ids, attention mask and positions, a row per completion;
    `prompt_ids`/`prompt_mask` already repeated once per completion."""
    ids = torch.cat([prompt_ids, completion_ids.to(prompt_ids.device)], dim=1)
    mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.device, prompt_mask.dtype)], dim=1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def rows_of(batch: dict, keep: torch.Tensor) -> dict:
    """The micro-batch's rows where `keep` (bool, a row each), in their order, and its completion columns cut
    after the last one a kept row counts (completion_mask); the first row where none is kept (a forward still
    runs: every parameter in the graph, as DDP needs). The batch itself where that changes nothing, or its
    tensors are the planner's fake ones."""
    from torch._subclasses.fake_tensor import is_fake

    mask = batch["completion_mask"]
    if is_fake(mask):
        return batch
    rows = keep.nonzero().squeeze(1)
    rows = rows if len(rows) else rows.new_zeros(1)
    counted = mask.index_select(0, rows).any(dim=0).nonzero()
    width = int(counted.max()) + 1 if len(counted) else 1
    cut = mask.shape[1] - width
    if len(rows) == len(mask) and cut == 0:
        return batch
    out = {}
    for key, value in batch.items():
        value = value if len(rows) == len(mask) else value.index_select(0, rows)
        if cut and key in COMPLETION_COLUMNS:
            value = value[:, :width]
        elif cut and key in MODEL_INPUTS:
            value = value[:, :value.shape[1] - cut]
        out[key] = value
    return out


def completion_logps(model, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """[rows, completion width] fp32: each completion token's log-prob under `model` at `temperature` (the
    log-softmax of the logits divided by it), 0 where `completion_mask` is 0; differentiable. Each shared
    prompt run once (the module's doc) where it can be."""
    groups = shared_prompts(batch, model)
    logps = None if groups is None else _shared_prompt_logps(model, batch, temperature, *groups)
    return _whole_rows_logps(model, batch, temperature) if logps is None else logps


def shared_prompts(batch: dict, model=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(each group's first row, its number of rows) where neighbouring rows with the same prompt (ids and
    mask) form a group; None where no two rows share one, or the prompt pass cannot be shared: `model` with
    gradient checkpointing (its layers drop the cache). The planner's fake tensors, which have no values to
    compare, are grouped as their batch says (PLANNED_GROUP_ROWS; none said: no group)."""
    from torch._subclasses.fake_tensor import is_fake

    ids = batch["input_ids"]
    if model is not None and _checkpointing(model):
        return None
    if is_fake(ids):
        return _planned_groups(len(ids), batch.get(PLANNED_GROUP_ROWS, 1), ids.device)
    start = ids.shape[1] - batch["completion_mask"].shape[1]
    prompts = torch.cat([ids[:, :start], batch["attention_mask"][:, :start]], dim=1)
    new = torch.ones(len(ids), dtype=torch.bool, device=ids.device)
    new[1:] = (prompts[1:] != prompts[:-1]).any(dim=1)
    firsts = new.nonzero().squeeze(1)
    if len(firsts) == len(ids):
        return None
    return firsts, torch.diff(firsts, append=firsts.new_tensor([len(ids)]))


def _planned_groups(rows: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """shared_prompts' answer for `rows` rows in groups of `size` neighbours (the last one shorter where
    `size` does not divide them), made as shared_prompts makes it (the same small tensors)."""
    if size < 2 or rows < 2:
        return None
    firsts = torch.arange(0, rows, size, device=device)
    return firsts, torch.diff(firsts, append=firsts.new_tensor([rows]))


def _checkpointing(model) -> bool:
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def completion_logits(model, batch: dict) -> torch.Tensor:
    """[rows, completion width, vocabulary] fp32: the logits of the positions that predict each completion token
    (the whole vocabulary: on-policy distillation's divergences), each shared prompt run once where it can be
    (as completion_logps); differentiable."""
    groups = shared_prompts(batch, model)
    found = None if groups is None else _shared_prompt_held(model, batch, *groups)
    if found is None:
        width, head = batch["completion_mask"].shape[1], LMHead(model)
        inputs = {key: batch[key] for key in MODEL_INPUTS}
        found = head, head.held(head.run(inputs, use_cache=False).logits[:, -width - 1:-1])
    head, held = found
    return head.logits_of(held)


def _shared_prompt_logps(model, batch: dict, temperature: float, firsts: torch.Tensor,
                         sizes: torch.Tensor) -> torch.Tensor | None:
    """completion_logps with each group's prompt run once (`firsts`, `sizes`: shared_prompts'); None where the
    prompt pass cannot be shared (_shared_prompt_held)."""
    found = _shared_prompt_held(model, batch, firsts, sizes)
    if found is None:
        return None
    head, held = found
    ids, width = batch["input_ids"], batch["completion_mask"].shape[1]
    targets = ids[:, ids.shape[1] - width:].masked_fill(batch["completion_mask"] == 0, -100)
    return head.log_probs_of(held, targets, temperature)


def _shared_prompt_held(model, batch: dict, firsts: torch.Tensor, sizes: torch.Tensor):
    """(the LM head, what the positions that predict the completion tokens hold for it: LMHead.held) with each
    group's prompt run once (`firsts`, `sizes`: shared_prompts'); None where the model's cache is not a plain
    DynamicCache, whose layers' keys and values are copied to each row here and grown by torch.cat, both
    differentiable (the gradient of a row's copy is summed into its prompt's)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    ids, mask, positions = (batch[key] for key in MODEL_INPUTS)
    width = batch["completion_mask"].shape[1]
    start = ids.shape[1] - width  # the prompt's width

    rows = torch.arange(len(firsts), device=ids.device).repeat_interleave(sizes, output_size=len(ids))

    def copied(tensor: torch.Tensor) -> torch.Tensor:  # each group's tensor once per row of the group
        return _RowCopies.apply(tensor, rows)

    keyword = sampling.cache_keyword()
    # The prompts through the model itself, not a DDP wrapper: DDP sees the one forward below, whose graph
    # reaches the prompts' through the cache, so its gradient hooks fire once per parameter as always.
    prompt_head = LMHead(getattr(model, "module", model) if isinstance(
        model, torch.nn.parallel.DistributedDataParallel) else model)
    prompts = {key: batch[key][firsts, :start] for key in MODEL_INPUTS}
    out = prompt_head.run(prompts, use_cache=True, logits_to_keep=1)
    cache = getattr(out, keyword)
    if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    first = copied(prompt_head.held(out.logits))  # the last prompt position predicts token 0
    head = LMHead(model)
    if width > 1:  # the completions but their last token, through each row's copy of its prompt's cache
        for layer in cache.layers:
            layer.keys, layer.values = copied(layer.keys), copied(layer.values)
        rest = {"input_ids": ids[:, start:-1], "attention_mask": mask[:, :-1], "position_ids": positions[:, start:-1]}
        later = head.held(head.run(rest, use_cache=True, **{keyword: cache}).logits)
        first = torch.cat([first, later], dim=1)
    return head, first


class _RowCopies(torch.autograd.Function):
    """tensor.index_select(0, rows), whose backward sums each copy's gradient into its row from a contiguous
    gradient: torch's index_add_ from the strided gradients that reach the cache's copies (a slice of the
    attention's) takes a scatter-add 20-40x slower on a CPU than the whole micro-batch's attention."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.shape = tensor.shape
        return tensor.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).index_add_(0, rows, grad.contiguous()), None


def _whole_rows_logps(model, batch: dict, temperature: float) -> torch.Tensor:
    """completion_logps over every row's whole sequence in one forward."""
    ids, width = batch["input_ids"], batch["completion_mask"].shape[1]
    targets = torch.full_like(ids[:, 1:], -100)  # position t predicts token t + 1
    targets[:, -width:] = ids[:, -width:].masked_fill(batch["completion_mask"] == 0, -100)
    inputs = {key: batch[key] for key in MODEL_INPUTS}
    # planned_per_row: the planner's fake tensors have no mask to select by; a row has at most `width` targets
    return LMHead(model, planned_per_row=width).token_log_probs(inputs, targets, temperature)[:, -width:]


def prompt_only_logps(model, batch: dict) -> torch.Tensor:
    """A prompt micro-batch's forward through the head, for the zero-weight stand-in of a process that has no
    micro-batch in a step (every parameter in the graph, as DDP needs): the prompts' own token log-probs."""
    mask = batch["attention_mask"]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": mask,
              "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    return LMHead(model).token_log_probs(inputs, batch["input_ids"][:, 1:].masked_fill(mask[:, 1:] == 0, -100))
