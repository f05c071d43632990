"""The objectives a task trains with, by the --preference name that picks them (tasks/preference.py holds
one). Adding one, GRPO or on-policy distillation say: its class (tasks/objectives/objective.py's interface,
with `rollout` if it generates during the step) and one entry here. No module outside this package
branches on an objective's name (tests/architecture/test_objective_branches.py)."""

from __future__ import annotations

from effitrain.tasks.objectives.dpo import Dpo
from effitrain.tasks.objectives.objective import Objective
from effitrain.tasks.objectives.orpo import Orpo

REGISTRY: dict[str, type[Objective]] = {cls.name: cls for cls in (Dpo, Orpo)}


def of(config) -> Objective:
    """The objective of a run's settings (config.preference names it)."""
    return REGISTRY[config.preference].of(config)


def takes_reference(name: str | None) -> bool:
    """Whether the objective `name` (None: no preference tuning) compares the policy with a reference model."""
    return name in REGISTRY and REGISTRY[name].takes_reference
