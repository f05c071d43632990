"""Online RL's training sequences: each prompt (left-padded, as sampled) followed by one of its sampled
completions (right-padded), with positions counted from each row's first token, so that a row computes what
it computed alone while it was sampled, whatever the rows beside it; and the completion tokens' log-probs of
the policy's forward over them (through the LM head: tasks/lm_head.py, chunked where it can be)."""

from __future__ import annotations

import torch

from effitrain.tasks.lm_head import LMHead

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def sequences(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
              completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """[rows, prompt width + completion width] ids, attention mask and positions, a row per completion;
    `prompt_ids`/`prompt_mask` already repeated once per completion."""
    ids = torch.cat([prompt_ids, completion_ids.to(prompt_ids.device)], dim=1)
    mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.device, prompt_mask.dtype)], dim=1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def completion_logps(model, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """[rows, completion width] fp32: each completion token's log-prob under `model` at `temperature` (the
    log-softmax of the logits divided by it), 0 where `completion_mask` is 0; differentiable."""
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
