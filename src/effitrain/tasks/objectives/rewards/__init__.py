"""Reward functions for online RL (GRPO, RLOO), with TRL's signature so a user's reward file ports unchanged:
`f(prompts, completions, **columns) -> list[float | None]`. The names a run gives them, and the checks that need
no import, are in catalog/reward_names.py; here: `load` (the names and weights as functions),
`check_columns` (before the first step: each function finds the columns it needs), `score` (one batch of
completions: the weighted reward and each function's, every value checked). docs/rl.md is the user's page."""

from effitrain.tasks.objectives.rewards.reward_function import RewardFunction, check_columns, load
from effitrain.tasks.objectives.rewards.reward_scores import RewardScores, score

__all__ = ["RewardFunction", "RewardScores", "check_columns", "load", "score"]
