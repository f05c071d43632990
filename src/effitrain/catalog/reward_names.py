"""The reward functions a run names, before anything loads: the built-in rewards (their names and help
words) and a user's `path.py:name`, told apart and checked as far as a check can go without importing the
file (it exists, is a readable .py file, `name` is a Python name), and their weights checked against them.
The functions themselves are in tasks/objectives/rewards/; this module imports no heavy library (config
reads it), and of ours only errors.py, for the one-line refusals."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from effitrain.errors import UserError


@dataclass(frozen=True)
class BuiltinReward:
    name: str
    words: str  # what the reward flag's help and docs/rl.md say of it
    argument: str = ""  # what `name:ARG` sets, "" when it takes none
    default: float | None = None  # the argument's value when none is written


BUILTINS: dict[str, BuiltinReward] = {entry.name: entry for entry in (
    BuiltinReward("exact-match", "1.0 when the completion, stripped, equals the `answer` (or `solution`) column, "
                  "stripped, else 0.0"),
    BuiltinReward("number-match", "1.0 when the last number in the completion is within TOL of the `answer` (or "
                  "`solution`) column's number (its last one, for text), else 0.0", "TOL", 1e-6),
    BuiltinReward("ends-turn", "1.0 when the completion ended with the end-of-turn/EOS token, 0.0 when it was cut at "
                  "the token limit"),
)}


@dataclass(frozen=True)
class RewardSpec:
    """One reward as the user named it: a built-in (`path` None, `name` the built-in's, `argument` its value)
    or a user's function (`path` the file, `name` the function's)."""

    text: str  # as the user wrote it
    name: str
    path: Path | None = None
    argument: float | None = None

    @property
    def builtin(self) -> bool:
        return self.path is None


def help_text() -> str:
    listed = "; ".join(f"{entry.name}{':' + entry.argument if entry.argument else ''} ({entry.words})"
                       for entry in BUILTINS.values())
    return f"a reward function, several allowed: path.py:name (TRL's signature) or a built-in: {listed}"


def parse(text: str) -> RewardSpec:
    """`text` as a built-in or a user's file and function, the file checked but not imported; a UserError
    (one line) on anything that would fail later for a reason visible now."""
    text = str(text).strip()
    head, colon, tail = text.partition(":")
    if head in BUILTINS:
        return _builtin(text, BUILTINS[head], tail if colon else None)
    path, colon, name = text.rpartition(":")
    if not colon:
        if text.endswith(".py"):
            raise UserError(f"reward {text} names a file but no function in it",
                            f"write {text}:FUNCTION, the name of the reward function the file defines")
        raise UserError(f"reward {text!r} is neither a built-in reward nor path.py:name",
                        f"pass one of {', '.join(BUILTINS)}, or a file and its function as path.py:name")
    if not name.isidentifier():
        raise UserError(f"reward {text}: {name!r} is not a Python function name",
                        "write path.py:name with the name the function has in the file (letters, digits, _)")
    return RewardSpec(text, name, _checked_file(text, Path(path).expanduser()))


def _builtin(text: str, entry: BuiltinReward, argument: str | None) -> RewardSpec:
    if argument is None:
        return RewardSpec(text, entry.name, argument=entry.default)
    if not entry.argument:
        raise UserError(f"reward {text}: the built-in {entry.name} takes no argument", f"write {entry.name}")
    value = _finite(argument)
    if value is None or value < 0:
        raise UserError(f"reward {text}: {entry.argument} must be a number >= 0, not {argument!r}",
                        f"write {entry.name}:{entry.default:g} (or another tolerance), or {entry.name}")
    return RewardSpec(text, entry.name, argument=value)


def _checked_file(text: str, path: Path) -> Path:
    if not path.exists():
        raise UserError(f"reward {text}: the file {path} does not exist",
                        "pass the path of your reward file (relative to where you run effitrain, or absolute)")
    if path.is_dir():
        raise UserError(f"reward {text}: {path} is a folder, not a Python file", "pass path/to/file.py:name")
    if path.suffix != ".py":
        raise UserError(f"reward {text}: {path} is not a .py file", "put the reward function in a .py file")
    if not os.access(path, os.R_OK):
        raise UserError(f"reward {text}: the file {path} cannot be read", f"make it readable (chmod u+r {path})")
    return path.resolve()


def check_weights(weights, count: int) -> list[float]:
    """The rewards' weights: one finite number per reward function (all 1.0 when none are given)."""
    if weights is None or len(weights) == 0:
        return [1.0] * count
    weights = list(weights)
    if len(weights) != count:
        raise UserError(f"the reward weights are {len(weights)} value(s) for {count} reward function(s)",
                        "give one weight per reward function, in the same order, or no weights (all 1.0)")
    values = [_finite(weight) for weight in weights]
    for weight, value in zip(weights, values):
        if value is None:
            raise UserError(f"the reward weight {weight!r} is not a finite number",
                            "give each reward's weight as a number such as 1, 0.5 or -1")
    return values


def _finite(value) -> float | None:
    """`value` as a finite float, None when it is not one (a bool is not a weight, though TRL's rewards may be)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
