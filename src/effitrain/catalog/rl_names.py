"""The online RL objectives --rl picks (the causal LM generates completions of the data's prompts in each step
and learns from their rewards), by name, with what config needs of each before anything loads: its words in
--help, the settings only it takes, its default --scale-rewards and those it accepts. The classes that train
them (tasks/objectives/grpo.py) are keyed by the same names (a test keeps the two the same); a new one is
registered with `tasks.objectives.register_rl`, which adds its entry here."""

from __future__ import annotations

from dataclasses import dataclass

from effitrain.catalog.live_names import Catalog

SCALE_REWARDS = ("group", "batch", "none")  # --scale-rewards (tasks/objectives/policy_gradient.py's names)
LOSS_TYPES = ("dapo", "grpo", "dr-grpo")  # --loss-type (policy_gradient.py reads dr-grpo as dr_grpo)


@dataclass(frozen=True)
class RlName:
    name: str
    words: str  # what --rl's help says of it
    scale_rewards: str  # its default --scale-rewards
    scalings: tuple[str, ...] = SCALE_REWARDS  # the --scale-rewards it accepts
    settings: tuple[str, ...] = ()  # the online-RL flags that only it takes (the others take every one)
    teacher: bool = False  # it learns from a teacher (--distill-from), not from rewards


_CATALOG = Catalog("online RL objective")
NAMES, add, get = _CATALOG.names, _CATALOG.add, _CATALOG.get


def owners(setting: str) -> list[str]:
    """The objectives that take `setting` as their own."""
    return [entry.name for entry in _CATALOG.entries() if setting in entry.settings]


def owners_of_any() -> list[str]:
    """The settings some objective takes as its own (the others refuse them)."""
    return list(dict.fromkeys(setting for entry in _CATALOG.entries() for setting in entry.settings))


def help_text() -> str:
    """--rl's help, from every registered objective's words."""
    listed = _CATALOG.listed()
    return ("--task causal-lm on prompts (a `prompt` column: text, or a list of messages; the other columns reach "
            f"the reward functions): completions sampled in each step and learnt from their rewards: {listed} "
            "(docs/rl.md)")


# What the objectives that learn from rewards take and on-policy distillation does not.
REWARD_SETTINGS = ("reward", "reward_weights", "clip_epsilon", "clip_epsilon_high", "kl_beta")

add(RlName("grpo", "group-relative policy optimisation: each completion's reward against its group's mean, TRL's "
           "clipped per-token loss", scale_rewards="group", settings=("loss_type", *REWARD_SETTINGS)))
add(RlName("rloo", "REINFORCE leave-one-out: each completion's reward against the mean of its group's others, "
           "TRL's RLOOTrainer's per-sequence loss", scale_rewards="none", scalings=("batch", "none"),
           settings=REWARD_SETTINGS))
add(RlName("distill", "on-policy distillation: the teacher (--distill-from) scores each sampled token, the loss is "
           "the per-token reverse KL to it (TRL GKD's generalised JSD with --distill-beta); no rewards",
           scale_rewards="none", scalings=SCALE_REWARDS, settings=("distill_beta",), teacher=True))
