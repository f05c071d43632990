"""What an objective is: the loss a task trains with on its micro-batches, their item counts, the sums the
step's log line shows beside the loss, and what evaluation measures; plus, for an objective that generates
(GRPO, on-policy distillation), the rollout hook the step runner calls once per optimizer step. A new
objective is one class registered in tasks/objectives/__init__.py; no engine edit."""

from __future__ import annotations

import torch

from effitrain.tasks.base import TrainLoss

# The metrics every objective on preference pairs reports, in this order (the evaluation's and the log's).
PAIR_METRICS = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy")


class Objective:
    """One objective of the preference task (tasks/preference.py), built from a run's settings by `of`.
    `name`: the --preference value that picks it; `reference`: where DPO-like objectives read their
    reference log-probs (tasks/reference.py), None for those without one."""

    name = ""
    reference = None
    train_metric_names: tuple[str, ...] = ()  # the sums `loss` returns beside the loss, one per name
    metric_names: tuple[str, ...] = PAIR_METRICS

    def __init__(self, beta: float):
        self.beta = beta

    @classmethod
    def of(cls, config) -> "Objective":
        return cls(config.beta)

    def describe(self) -> str:
        """What the run's first line says of the objective."""
        return f"{self.name} beta {self.beta:g}"

    # -- training ----------------------------------------------------------------------------------
    def rollout(self, model, group: list, generator: torch.Generator) -> list:
        """Called by the step runner (engine/step.py) once per optimizer step, before the step's forwards,
        with `group`, this process's micro-batches of the step (None where it has none: keep those None),
        and `generator`, the step's RNG, seeded from (seed, step) only: the same on every process and after
        a resume, so that samples do not depend on the process layout (draw by the examples' global
        positions, not this process's). Returns the micro-batches the step trains on: an objective that
        generates (GRPO: completions and their rewards; on-policy distillation: the student's samples)
        returns the micro-batches with what it made; item_count and loss see those. The model is the
        runner's (wrapped by the run's strategy) in training mode: generate under `torch.no_grad()` and,
        where dropout matters, in evaluation mode. A process without a micro-batch runs the run's stand-in
        (a batch as the data gives it, weighted zero), so `loss` must take one of those too. By default
        the micro-batches are trained on as they are."""
        return group

    def item_count(self, batch) -> torch.Tensor:
        """The items `loss` sums over (one count, or one per term when the loss is a vector)."""
        raise NotImplementedError

    def loss(self, model, batch) -> TrainLoss:
        """The micro-batch's loss summed over its items, and the train_metric_names' sums with their count."""
        raise NotImplementedError

    # -- evaluation --------------------------------------------------------------------------------
    def eval_outputs(self, model, batch) -> tuple[torch.Tensor, ...]:
        """Per-example tensors, gathered over the processes and then read by `metrics`."""
        raise NotImplementedError

    def metrics(self, outputs: tuple) -> dict[str, float]:
        raise NotImplementedError
