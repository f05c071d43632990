"""DPO (TRL's DPOTrainer, loss_type sigmoid): with r = beta x (log p - log p_ref) of each answer, the loss of
a pair is -log sigmoid(r_chosen - r_rejected) (with --dpo-label-smoothing e, the conservative
-(1 - e) log sigmoid(x) - e log sigmoid(-x)); --dpo-loss ipo: (the per-token log-ratio margin -
1 / (2 beta))^2, the IPO paper's (TRL 1.16 also weighs it by the answers' probabilities: not here).
The item is the pair: a step's loss is the mean over its pairs, whatever the processes, micro-batches and
accumulation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import effitrain.tasks.reference as references
from effitrain.tasks.base import TrainLoss
import effitrain.tasks.objectives.pair_logps as pair_logps
from effitrain.tasks.objectives.objective import PAIR_METRICS, Objective


class Dpo(Objective):
    name = "dpo"
    loss_name = "sigmoid"  # --dpo-loss
    train_metric_names = PAIR_METRICS[1:]

    def __init__(self, beta: float, reference: str | None = None, smoothing: float = 0.0):
        super().__init__(beta)
        self.mode = reference  # --reference as given
        # A config not yet resolved (config.resolved fills it in) gets train's default without adapters.
        self.reference = references.MODES[reference or "precompute"]()
        self.smoothing = smoothing  # the share of pairs assumed flipped (sigmoid loss)

    @classmethod
    def of(cls, config) -> "Dpo":
        loss = LOSSES[config.dpo_loss]
        return loss(config.beta, config.reference, config.dpo_label_smoothing)

    def describe(self) -> str:
        return f"{super().describe()} ({self.loss_name}), reference {self.mode}"

    def pair_losses(self, policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each pair's loss from the [pairs, 2] log-probs of the policy and the reference."""
        ratios = policy - reference.to(policy.dtype)
        margin = self.beta * (ratios[:, 0] - ratios[:, 1])
        return -(1 - self.smoothing) * F.logsigmoid(margin) - self.smoothing * F.logsigmoid(-margin)

    def item_count(self, batch) -> torch.Tensor:
        return pair_logps.pair_count(batch)

    def loss(self, model, batch) -> TrainLoss:
        # The reference first: its forward's activations are freed before the policy's are kept for the backward.
        reference = self.reference.logps(model, batch, pair_logps.answer_logps)
        policy = pair_logps.answer_logps(model, batch)
        sums = pair_logps.reward_sums(self.beta * (policy.detach() - reference.to(policy.dtype)))
        counts = pair_logps.answer_mask(batch).sum(-1)
        return TrainLoss(self.pair_losses(policy, reference, counts).sum(), sums)

    def eval_outputs(self, model, batch) -> tuple[torch.Tensor, ...]:
        """Per pair: the policy's and the reference's answer log-probs ([pairs, 2] each), the answers' token
        counts; then zeros where ORPO has its chosen sequence's NLL, and the chosen sequence's token count."""
        counts = pair_logps.answer_mask(batch).sum(-1)
        policy = pair_logps.answer_logps(model, batch)
        reference = self.reference.logps(model, batch, pair_logps.answer_logps)
        nll = torch.zeros_like(policy[:, 0])
        return (policy.double(), reference.double(), counts, nll.double(), batch["attention_mask"][:, 0, 1:].sum(-1))

    def metrics(self, outputs: tuple) -> dict[str, float]:
        policy, reference, counts, _, _ = outputs
        pairs = max(len(policy), 1)
        loss = float(self.pair_losses(policy, reference, counts).sum()) / pairs
        rewards = self.beta * (policy - reference)
        return {"loss": loss, **pair_logps.pair_metrics(rewards, pairs), "samples": len(policy)}


class Ipo(Dpo):
    """--dpo-loss ipo: the squared distance of the per-token log-ratio margin to 1 / (2 beta)."""

    loss_name = "ipo"

    def pair_losses(self, policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        per_token = (policy - reference.to(policy.dtype)) / counts.clamp(min=1)
        return (per_token[:, 0] - per_token[:, 1] - 1 / (2 * self.beta)) ** 2


LOSSES = {Dpo.loss_name: Dpo, Ipo.loss_name: Ipo}  # --dpo-loss -> class
