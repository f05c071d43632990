"""The objectives a task trains with, by the --preference name that picks them (tasks/preference.py holds
one), and by the --rl name (tasks/online_rl.py holds one). Adding one (on-policy distillation, say): its class
(tasks/objectives/objective.py's interface, with `rollout` if it generates during the step), registered with
what config reads of it (`register` / `register_rl`: its --help words, the flags only it takes, kept torch-free
in catalog/objective_names.py and catalog/rl_names.py). No module outside this package branches on an
objective's name (tests/architecture/test_objective_branches.py)."""

from __future__ import annotations

from effitrain.catalog import objective_names, rl_names
from effitrain.catalog.objective_names import ObjectiveName
from effitrain.catalog.rl_names import RlName
from effitrain.tasks.objectives.dpo import Dpo
from effitrain.tasks.objectives.grpo import Grpo, Rloo
from effitrain.tasks.objectives.objective import Objective
from effitrain.tasks.objectives.on_policy_distill import OnPolicyDistill
from effitrain.tasks.objectives.orpo import Orpo

REGISTRY: dict[str, type[Objective]] = {cls.name: cls for cls in (Dpo, Orpo)}  # their names: in the catalog
# --rl's: their names in catalog/rl_names.py
RL_REGISTRY: dict[str, type[Grpo]] = {cls.name: cls for cls in (Grpo, Rloo, OnPolicyDistill)}


def _registered(registry: dict, add_to_catalog, cls: type, name) -> type:
    if name.name != cls.name:
        raise ValueError(f"{cls.__name__} is named {cls.name}, its catalog entry {name.name}")
    add_to_catalog(name)
    registry[cls.name] = cls
    return cls


def register(cls: type[Objective], name: ObjectiveName) -> type[Objective]:
    """A new objective: its class, and what config, --help and plan read of it (`name.name` == cls.name)."""
    return _registered(REGISTRY, objective_names.add, cls, name)


def of(config) -> Objective:
    """The objective of a run's settings (config.preference names it)."""
    return REGISTRY[config.preference].of(config)


def register_rl(cls: type[Grpo], name: RlName) -> type[Grpo]:
    """A new online RL objective (--rl): its class and its catalog entry (`name.name` == cls.name)."""
    return _registered(RL_REGISTRY, rl_names.add, cls, name)


def of_rl(config) -> Grpo:
    """The online RL objective of a run's settings (config.rl names it)."""
    return RL_REGISTRY[config.rl].of(config)


def takes_reference(name: str | None) -> bool:
    """Whether the objective `name` (None: no preference tuning) compares the policy with a reference model."""
    entry = objective_names.get(name)
    return entry is not None and entry.reference
