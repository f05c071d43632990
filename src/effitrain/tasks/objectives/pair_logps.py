"""The log-probs the preference objectives read from a micro-batch of pairs ([pairs, 2, width]: chosen,
rejected), run as one forward of 2 x pairs rows (TRL's concatenated forward), through the LM head
(tasks/lm_head.py: chunked, no whole logits, where it can), and the sums a step logs of their rewards."""

from __future__ import annotations

import torch

from effitrain.tasks.lm_head import LMHead


def token_logps(model, batch, whole_chosen: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(each position's log-prob of the next token, [pairs, 2, width - 1], 0 where it does not count; the
    targets.) The positions that count: the answers, and with `whole_chosen` every real token of the chosen
    sequences, as ORPO's NLL takes them."""
    ids, mask, labels = (batch[key].flatten(0, 1) for key in ("input_ids", "attention_mask", "labels"))
    targets = labels[:, 1:]
    if whole_chosen:
        every = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
        targets = torch.where(torch.arange(len(ids), device=ids.device)[:, None] % 2 == 0, every, targets)
    logps = LMHead(model).token_log_probs({"input_ids": ids, "attention_mask": mask}, targets)
    return logps.view(*batch["input_ids"].shape[:2], -1), targets.view(*batch["input_ids"].shape[:2], -1)


def answer_logps(model, batch) -> torch.Tensor:
    """Each pair's answers' summed log-probs, [pairs, 2] (chosen, rejected)."""
    return token_logps(model, batch)[0].sum(-1)


def answer_mask(batch) -> torch.Tensor:
    return batch["labels"][..., 1:] != -100


def pair_count(batch) -> torch.Tensor:
    return torch.tensor(batch["input_ids"].shape[0], device=batch["input_ids"].device)


def reward_sums(rewards: torch.Tensor, log_odds_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """The step's log line's sums over a micro-batch's pairs (`rewards`: [pairs, 2]), as the evaluation's
    metrics compute them, and last the pairs: rewards of each answer, margin, pairs ranked right (and
    ORPO's log-odds term)."""
    rewards = rewards.double()
    margin = rewards[:, 0] - rewards[:, 1]
    sums = [rewards[:, 0].sum(), rewards[:, 1].sum(), margin.sum(), (margin > 0).double().sum()]
    if log_odds_ratio is not None:
        sums.append(log_odds_ratio.double())
    return torch.stack([*sums, rewards.new_tensor(float(len(rewards)))]).detach()


def pair_metrics(rewards: torch.Tensor, pairs: int) -> dict[str, float]:
    """The evaluation's means over pairs of the [pairs, 2] rewards."""
    return {"rewards_chosen": float(rewards[:, 0].sum()) / pairs,
            "rewards_rejected": float(rewards[:, 1].sum()) / pairs,
            "reward_margin": float((rewards[:, 0] - rewards[:, 1]).sum()) / pairs,
            "preference_accuracy": float((rewards[:, 0] > rewards[:, 1]).double().sum()) / pairs}
