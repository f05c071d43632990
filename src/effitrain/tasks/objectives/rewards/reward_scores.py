"""The reward functions on one batch of completions: each function's values checked (a function that raises,
returns the wrong count, a non-number or a non-finite number stops the run with one line naming it, the row
and the fix) and weighed as TRL 1.16's GRPOTrainer does: None is NaN, the weighted reward is the nansum over
the functions, and a row every function returned None for is NaN itself (unscorable: TRL leaves it out of its
group's mean and std and gives it advantage 0)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import NamedTuple

import torch

from effitrain.errors import UserError, raised_by_code
from effitrain.tasks.objectives.rewards.builtin_rewards import completion_text
from effitrain.tasks.objectives.rewards.reward_file import first_line
from effitrain.tasks.objectives.rewards.reward_function import NOT_COLUMNS, RewardFunction


FLOAT32_MAX = torch.finfo(torch.float32).max


class RewardScores(NamedTuple):
    weighted: torch.Tensor  # [N] float32: sum over functions of weight x value, NaN-skipping; NaN if unscorable
    per_function: torch.Tensor  # [N, F] float32: each function's values, NaN where it returned None

    @property
    def unscorable(self) -> torch.Tensor:
        """[N] bool: rows every function returned None for."""
        return torch.isnan(self.weighted)


def score(functions: Sequence[RewardFunction], weights: Sequence[float], prompts: list, completions: list,
          columns: dict[str, list], *, row_ids: Sequence[int] | None = None, completion_ids: list | None = None,
          completion_ended: Sequence[bool] | None = None) -> RewardScores:
    """N completions scored. `prompts[i]` is completion i's prompt (repeated per generation, as TRL passes them),
    `columns` the data's other columns, one value per completion likewise; `row_ids[i]`, the index of completion
    i's prompt in the data, names the row in messages; `completion_ids` (token ids) and `completion_ended`
    (whether the completion ended with the end-of-turn/EOS token) reach the functions as keywords when given."""
    count = len(completions)
    keywords = {key: list(values) for key, values in columns.items() if key not in NOT_COLUMNS}
    generated = (("completion_ids", completion_ids), ("completion_ended", completion_ended))
    keywords.update({key: list(values) for key, values in generated if values is not None})
    lengths = {key: len(values) for key, values in [("prompts", prompts), *keywords.items()] if len(values) != count}
    if lengths or len(weights) != len(functions) or not functions:
        raise ValueError(f"{count} completions, {len(functions)} functions, {len(weights)} weights; lengths {lengths}")
    batch = _Batch(prompts, completions, keywords, row_ids)
    per_function = torch.tensor([batch.values(function) for function in functions], dtype=torch.float32).T
    per_function = per_function.reshape(count, len(functions))
    weighted = (per_function * torch.tensor(list(weights), dtype=torch.float32)).nansum(dim=1)
    weighted[torch.isnan(per_function).all(dim=1)] = torch.nan
    return RewardScores(weighted, per_function)


class _Batch:
    """One batch's arguments, and where a failure happened in the words a user finds it by."""

    def __init__(self, prompts: list, completions: list, keywords: dict[str, list], row_ids):
        self.prompts, self.completions, self.keywords, self.row_ids = prompts, completions, keywords, row_ids

    def values(self, function: RewardFunction) -> list[float]:
        """The function's value for each completion, NaN for None; a UserError on anything else it does."""
        try:
            # Copies: a function that edits its lists in place must not change what the next one sees.
            output = function(list(self.prompts), list(self.completions),
                              **{key: list(values) for key, values in self.keywords.items()})
        except BaseException as error:  # SystemExit too: a function's exit() would end the run with code 0
            if not raised_by_code(error):  # Ctrl-C or SIGTERM while it ran: stop as they stop
                raise
            raise self._failed(function, error, self._first_failing(function)) from error
        if hasattr(output, "tolist") and not isinstance(output, (list, tuple)):  # a tensor or an array
            output = output.tolist()
        elif isinstance(output, Iterable) and not isinstance(output, (list, tuple, str, bytes, Mapping, Set)):
            output = list(output)  # a generator: TRL takes one too (not a set: it has no order)
        count = len(self.completions)
        if not isinstance(output, (list, tuple)) or len(output) != count:
            got = f"{len(output)} reward(s)" if isinstance(output, (list, tuple)) else f"a {type(output).__name__}"
            raise UserError(f"reward {function.name} ({function.source}) returned {got} for {count} completions",
                            f"return a list of {count} rewards (a number, or None to leave one unscored), one per "
                            "completion, in their order")
        return [self._checked(function, value, index) for index, value in enumerate(output)]

    def _checked(self, function: RewardFunction, value, index: int) -> float:
        if value is None:
            return math.nan
        value = _scalar(value)
        if not isinstance(value, numbers.Real):  # a bool counts, as in TRL: True is 1.0
            raise UserError(f"reward {function.name} ({function.source}) returned {str(value)[:40]!r}, a "
                            f"{type(value).__name__}, {self._where(index)}",
                            "return a number (float, int or bool) or None for each completion")
        # abs first: an int beyond a float's range would overflow math.isfinite
        if abs(value) > FLOAT32_MAX or not math.isfinite(value):  # rewards are float32, as TRL's
            raise UserError(f"reward {function.name} ({function.source}) returned {_shown(value)} "
                            f"{self._where(index)}",
                            "return a finite number, or None for a completion it cannot score")
        return float(value)

    def _first_failing(self, function: RewardFunction) -> int | None:
        """The first completion the function raises on alone (None: it fails only on the whole batch)."""
        for index in range(len(self.completions)):
            try:
                function([self.prompts[index]], [self.completions[index]],
                         **{key: [values[index]] for key, values in self.keywords.items()})
            except BaseException as error:
                if not raised_by_code(error):
                    raise
                return index
        return None

    def _failed(self, function: RewardFunction, error: BaseException, index: int | None) -> UserError:
        where = self._where(index) if index is not None else f"on a batch of {len(self.completions)} completions"
        if isinstance(error, UserError):  # a built-in's refusal: its own fix
            return UserError(f"reward {function.name} {where}: {error.problem}", error.fix)
        return UserError(f"reward {function.name} ({function.source}) raised {first_line(error)} {where}",
                         "fix the function so that it returns a number, or None, for each completion (call it on "
                         "that completion to see the traceback)")

    def _where(self, index: int) -> str:
        row = f"row {self.row_ids[index]} of the data, " if self.row_ids is not None else ""
        return f"on {row}completion {index} of {len(self.completions)} " \
               f"({completion_text(self.completions[index])[:60]!r})"


def _shown(value) -> str:
    """A number as a message shows it: an int too long to print (Python refuses past 4,300 digits) by its size."""
    try:
        text = str(value)
    except ValueError:
        return f"an integer of {value.bit_length():,} bits"
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text):,} characters)"


def _scalar(value):
    """A one-element tensor or array, or a numpy scalar, as the Python number it holds; anything else as it is."""
    if isinstance(value, numbers.Real) or not hasattr(value, "item"):
        return value
    try:
        return value.item()
    except (TypeError, ValueError, RuntimeError):  # more than one element
        return value
