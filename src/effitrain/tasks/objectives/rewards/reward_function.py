"""A reward function as the run holds it: the user's callable (or a built-in) with its name, where it came
from, and the keywords it takes, read once from its signature; `load` makes them from the names a run gives and
`check_columns` refuses, before the first step, a function that needs a column the data lacks."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from effitrain.catalog import reward_names
from effitrain.errors import UserError
import effitrain.tasks.objectives.rewards.builtin_rewards as builtin_rewards
from effitrain.tasks.objectives.rewards.reward_file import function_of

# What TRL's GRPOTrainer passes beside prompts, completions and the data's columns that effitrain does not
# (its trainer object, its logging hooks, its environments): a function requiring one is refused with the fix.
TRL_ONLY = ("trainer_state", "log_extra", "log_metric", "environments")
# What the caller passes beside the data's columns, when it has them: each completion's token ids (as TRL) and
# whether it ended with the end-of-turn/EOS token (for ends-turn). A data column of one of these names, or
# `prompt` / `completion`, does not reach the functions (TRL leaves them out too).
GENERATED = ("completion_ids", "completion_ended")
NOT_COLUMNS = ("prompt", "completion", *GENERATED)


@dataclass(frozen=True)
class RewardFunction:
    name: str  # in messages and metrics: the built-in's name, or the function's as the user wrote it
    function: Callable
    source: str  # the name it came from: built-in, or path.py:name
    takes_any: bool  # it has **kwargs: every column reaches it
    keywords: frozenset[str]  # the parameters it takes by name
    required: frozenset[str]  # those without a default
    needs_one_of: tuple[str, ...] = ()  # columns of which the data must have one (the answer-checking built-ins)

    @classmethod
    def of(cls, function: Callable, name: str, source: str, needs_one_of: tuple[str, ...] = ()) -> "RewardFunction":
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):  # a C function or the like: pass it everything, as TRL does
            return cls(name, function, source, True, frozenset(), frozenset(), needs_one_of)
        positional_only = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
        if positional_only:
            raise UserError(f"reward {source}: {name} takes {', '.join(positional_only)} by position only, and "
                            "reward functions are called with keywords (prompts=, completions=, one per column)",
                            "drop the `/` from its parameters")
        named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return cls(name, function, source, any(p.kind is p.VAR_KEYWORD for p in parameters),
                   frozenset(p.name for p in named), frozenset(p.name for p in named if p.default is p.empty),
                   needs_one_of)

    def __call__(self, prompts: list, completions: list, **columns) -> object:
        """The function on one batch, given the columns it takes (all of them with **kwargs); an async
        function (TRL allows them) is run to its end here."""
        if not self.takes_any:
            columns = {key: value for key, value in columns.items() if key in self.keywords}
        given = {key: value for key, value in (("prompts", prompts), ("completions", completions))
                 if self.takes_any or key in self.keywords}
        output = self.function(**given, **columns)
        return asyncio.run(output) if inspect.iscoroutine(output) else output


def load(texts: Sequence[str], weights: Sequence | None = None) -> tuple[list[RewardFunction], list[float]]:
    """The rewards named (built-in names or path.py:name) as functions, and their weights as one float each
    (all 1.0 when None). Imports the users' files: their import errors are one-line UserErrors."""
    if not texts:
        raise UserError("no reward function given",
                        f"name a reward function, path.py:name, or a built-in ({', '.join(reward_names.BUILTINS)})")
    specs = [reward_names.parse(text) for text in texts]
    weights = reward_names.check_weights(weights, len(specs))
    imported = {}
    functions = [_builtin(spec) if spec.builtin else
                 RewardFunction.of(function_of(spec, imported), spec.name, spec.text) for spec in specs]
    names = [function.name for function in functions]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        sources = ", ".join(function.source for function in functions if function.name == twice[0])
        raise UserError(f"the reward {twice[0]} is named twice ({sources})",
                        "give each reward function once (with a larger weight), or rename one of two "
                        "functions of the same name")
    return functions, weights


def _builtin(spec: reward_names.RewardSpec) -> RewardFunction:
    function = RewardFunction.of(builtin_rewards.function_of(spec.name, spec.argument), spec.name, spec.text)
    reads_answers = function.keywords.intersection(builtin_rewards.ANSWER_COLUMNS)
    return replace(function, needs_one_of=builtin_rewards.ANSWER_COLUMNS) if reads_answers else function


def check_columns(functions: Sequence[RewardFunction], columns: Sequence[str],
                  generated: Sequence[str] = GENERATED) -> None:
    """Before the first step: each function finds what it needs among the data's `columns` (`prompt` aside)
    and what the caller will pass (`generated`), else a UserError naming the function and the fix."""
    available = {"prompts", "completions", *generated, *(column for column in columns if column not in NOT_COLUMNS)}
    for function in functions:
        if function.needs_one_of and not available.intersection(function.needs_one_of):
            raise UserError(f"reward {function.source} compares with an `answer` or `solution` column, and the data "
                            f"has neither (it has {', '.join(columns)})",
                            "add an `answer` column holding each prompt's expected answer, or use another reward")
        missing = sorted(function.required - available)
        if missing and missing[0] in TRL_ONLY:
            raise UserError(f"reward {function.source}: {function.name} requires {missing[0]}, which TRL's trainer "
                            "passes and effitrain does not", f"give it a default in the function ({missing[0]}=None)")
        if missing:
            raise UserError(f"reward {function.source}: {function.name} requires a column {missing[0]!r}, which the "
                            f"data does not have (it has {', '.join(columns)})",
                            f"add the column to the data, or give the parameter a default ({missing[0]}=None)")
