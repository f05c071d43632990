"""A reward for rl_plan_runs.py that gives every group a spread, so that the update keeps every row: an untrained
model's completions are random tokens, which the task's exact-match scores 0 in every group (no spread: rows
left out of the forward, grpo.py's `_contributing`), while the plan counts every row (the worst case). A
weighted sum of a completion's ids differs between any two completions but by chance."""


def distinct(completions, completion_ids, **_) -> list[float]:
    return [float(sum((i + 1) * token for i, token in enumerate(ids)) % 10007) for ids in completion_ids]
