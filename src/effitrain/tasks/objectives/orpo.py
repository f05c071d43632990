"""ORPO (TRL's ORPOTrainer): the chosen sequences' NLL, a mean over their tokens (prompt and answer, as TRL
computes it), minus beta x the mean over pairs of log sigmoid(log-odds ratio) of the answers' mean token
log-probs; no reference. Two terms, each a mean over its own items: the loss and the item count are vectors,
and the step divides each by its own count over the whole step (engine/step.py), so the step is exact too
(a mean of micro-batch means, as TRL with accumulation computes, is not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from effitrain.tasks.base import TrainLoss
import effitrain.tasks.objectives.pair_logps as pair_logps
from effitrain.tasks.objectives.objective import PAIR_METRICS, Objective


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (TRL's ORPO)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def log_odds(logps: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """ORPO's log odds ratio of each pair, from the answers' mean token log-probs."""
    mean = (logps / counts.clamp(min=1)).float()
    return (mean[:, 0] - mean[:, 1]) - (log1mexp(mean[:, 0]) - log1mexp(mean[:, 1]))


class Orpo(Objective):
    name = "orpo"
    train_metric_names = (*PAIR_METRICS[1:], "log_odds_ratio")
    metric_names = (*PAIR_METRICS, "nll", "log_odds_ratio")

    def item_count(self, batch) -> torch.Tensor:
        """[the chosen sequences' predicted tokens, the pairs]."""
        return torch.stack([batch["attention_mask"][:, 0, 1:].sum(), pair_logps.pair_count(batch)])

    def parts(self, model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each chosen sequence's NLL summed over its tokens, [pairs]; the answers' summed log-probs and
        token counts, [pairs, 2])."""
        logps, _ = pair_logps.token_logps(model, batch, whole_chosen=True)
        answers = pair_logps.answer_mask(batch)
        return -logps[:, 0].sum(-1), (logps * answers).sum(-1), answers.sum(-1)

    def loss(self, model, batch) -> TrainLoss:
        nll, logps, counts = self.parts(model, batch)
        ratio = F.logsigmoid(log_odds(logps, counts))
        sums = pair_logps.reward_sums(self.beta * logps.detach() / counts.clamp(min=1), ratio.detach().sum())
        return TrainLoss(torch.stack([nll.sum(), -self.beta * ratio.sum()]), sums)

    def eval_outputs(self, model, batch) -> tuple[torch.Tensor, ...]:
        """Per pair, as DPO's: the policy's answer log-probs, zeros for the reference's, the answers' token
        counts, the chosen sequence's NLL sum and its token count."""
        counts = pair_logps.answer_mask(batch).sum(-1)
        nll, policy, _ = self.parts(model, batch)
        reference = torch.zeros_like(policy)
        return (policy.double(), reference.double(), counts, nll.double(), batch["attention_mask"][:, 0, 1:].sum(-1))

    def metrics(self, outputs: tuple) -> dict[str, float]:
        policy, _, counts, nll, tokens = outputs
        pairs = max(len(policy), 1)
        ratio = F.logsigmoid(log_odds(policy.double(), counts).double())
        rewards = self.beta * policy / counts.clamp(min=1)  # TRL's ORPO rewards: beta x mean token log-prob
        nll_mean = float(nll.sum()) / max(int(tokens.sum()), 1)
        log_odds_ratio = float(ratio.mean()) if len(ratio) else 0.0
        return {"loss": nll_mean - self.beta * log_odds_ratio, **pair_logps.pair_metrics(rewards, pairs),
                "nll": nll_mean, "log_odds_ratio": log_odds_ratio, "samples": len(policy)}
