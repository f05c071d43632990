"""The rewards named without a file (catalog/reward_names.py holds their names and words), written
as a user's would be, with TRL's signature: exact match of the completion's text, the last number in it
within a tolerance, and whether it ended with the end-of-turn token. A row whose answer is None is not scored
(None, as TRL's functions do for rows they do not apply to)."""

from __future__ import annotations

import math
import numbers
import re

from effitrain.errors import UserError

ANSWER_COLUMNS = ("answer", "solution")  # the columns the answer-checking rewards read, the first a row has

# A number as people write it: a sign (not after a digit: "3-5" is 3 and 5), thousands commas, decimals, an
# exponent; "42." at a sentence's end is 42.
NUMBER = re.compile(r"(?<![\d.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|(?<![\d.])[-+]?\.\d+")


def completion_text(completion) -> str:
    """A completion's text: the string itself, or the contents of its messages (conversational prompts: TRL's
    `[{"role": "assistant", "content": text}]`)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    return "".join(_content_text(message.get("content")) for message in completion)


def _content_text(content) -> str:
    """A message's content: a string, or a list of parts of which the text ones count."""
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content
                       if isinstance(part, dict) and part.get("type") == "text")
    return content or ""

def answers(name: str, answer: list | None, solution: list | None) -> list:
    """Each row's expected answer: its `answer`, else its `solution` (None where the row has neither)."""
    if answer is None and solution is None:
        raise UserError(f"the {name} reward compares with an `answer` or `solution` column, and the data has neither",
                        "add an `answer` column holding each prompt's expected answer, or use another reward")
    rows = len(answer if answer is not None else solution)
    answer = answer if answer is not None else [None] * rows
    solution = solution if solution is not None else [None] * rows
    return [mine if mine is not None else theirs for mine, theirs in zip(answer, solution)]


def exact_match(completions, answer=None, solution=None, **_) -> list[float | None]:
    """1.0 when the completion's text, stripped, equals the answer's (as text, stripped), else 0.0."""
    return [None if expected is None else float(completion_text(completion).strip() == str(expected).strip())
            for completion, expected in zip(completions, answers("exact-match", answer, solution))]


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def expected_number(value) -> float:
    """An answer column's value as a number: a number as it is, a text by its last number (GSM8K's '... #### 72')."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        number = last_number(str(value))
    if number is None or not math.isfinite(number):
        raise UserError(f"the answer {str(value)[:60]!r} holds no number to compare with",
                        "give each row's answer as a number (or a text that ends with one), or use the "
                        "exact-match reward")
    return number


def number_match(tolerance: float):
    """The reward: 1.0 when the completion's last number is within `tolerance` of the answer's, else 0.0 (also
    when the completion holds no number)."""

    def number_match(completions, answer=None, solution=None, **_) -> list[float | None]:
        scores = []
        for completion, expected in zip(completions, answers("number-match", answer, solution)):
            if expected is None:
                scores.append(None)
                continue
            got = last_number(completion_text(completion))
            scores.append(float(got is not None and abs(got - expected_number(expected)) <= tolerance))
        return scores

    return number_match


def function_of(name: str, argument: float | None):
    """The built-in reward `name` (catalog/reward_names.py's), with its argument where it takes one."""
    if name == "number-match":
        return number_match(argument)
    return {"exact-match": exact_match, "ends-turn": ends_turn}[name]


def ends_turn(completions, completion_ended, **_) -> list[float]:
    """1.0 where the completion ended with the end-of-turn/EOS token (`completion_ended`, given by the caller
    that generated them), 0.0 where it was cut at the token limit."""
    return [float(bool(ended)) for ended in completion_ended]
