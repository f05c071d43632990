"""Reward functions (tasks/objectives/rewards/, catalog/reward_names.py): a user's file written here and loaded
by --reward path.py:name; each refusal as its one line; the built-ins on hand examples; score() against hand
computations of TRL 1.16's weighing (None is NaN, nansum over functions, a row all None is NaN); a TRL-style
function receiving the data's other columns repeated per generation."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from effitrain.catalog import reward_names
from effitrain.errors import Interrupted, UserError
from effitrain.tasks.objectives import rewards
from effitrain.tasks.objectives.rewards import builtin_rewards

NAN = math.nan


def write(tmp_path, source: str, name: str = "my_rewards.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def refused(call, *args, **kwargs) -> str:
    with pytest.raises(UserError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and "; fix: " in message, message
    return message


TRL_STYLE = textwrap.dedent("""
    import re

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]

    def seen(prompts, completions, **kwargs):
        seen.calls.append((list(prompts), list(completions), kwargs))
        return [float(len(c)) for c in completions]
    seen.calls = []

    def only_some(completions, **kwargs):
        return [None if c == "skip" else 2.0 for c in completions]

    LIMIT = 3
    not_a_function = 42
    """)


# -- --reward's values, checked before anything imports ---------------------------------------------------

def test_builtins_parse_with_and_without_their_argument():
    assert reward_names.parse("exact-match") == reward_names.RewardSpec("exact-match", "exact-match")
    assert reward_names.parse(" number-match ").argument == 1e-6
    assert reward_names.parse("number-match:0.5").argument == 0.5
    assert reward_names.parse("ends-turn").builtin


def test_a_user_file_parses_to_its_path_and_function(tmp_path):
    path = write(tmp_path, TRL_STYLE)
    spec = reward_names.parse(f"{path}:correct")
    assert (spec.path, spec.name, spec.builtin) == (path.resolve(), "correct", False)


@pytest.mark.parametrize("text, words", [
    ("rewards.py", "names a file but no function in it"),
    ("exact_match", "is neither a built-in reward nor path.py:name"),
    ("{dir}/my_rewards.py:not-a-name", "is not a Python function name"),
    ("{dir}/missing.py:f", "does not exist"),
    ("{dir}:f", "is a folder, not a Python file"),
    ("{dir}/notes.txt:f", "is not a .py file"),
    ("exact-match:1", "takes no argument"),
    ("number-match:abc", "TOL must be a number >= 0, not 'abc'"),
    ("number-match:-1", "TOL must be a number >= 0"),
    ("number-match:nan", "TOL must be a number >= 0"),
])
def test_each_bad_reward_value_is_one_line(tmp_path, text, words):
    write(tmp_path, TRL_STYLE)
    (tmp_path / "notes.txt").write_text("")
    assert words in refused(reward_names.parse, text.format(dir=tmp_path))


def test_an_unreadable_file_is_refused(tmp_path, monkeypatch):
    path = write(tmp_path, TRL_STYLE)
    monkeypatch.setattr(reward_names.os, "access", lambda *_: False)  # root reads everything: say it cannot
    assert "cannot be read" in refused(reward_names.parse, f"{path}:correct")


def test_weights_one_finite_number_per_reward():
    assert reward_names.check_weights(None, 2) == [1.0, 1.0]
    assert reward_names.check_weights(["0.5", -1], 2) == [0.5, -1.0]
    assert "2 value(s) for 3 reward function(s)" in refused(reward_names.check_weights, [1, 2], 3)
    for bad in ("nan", "inf", float("-inf"), "abc", True, None):
        assert "is not a finite number" in refused(reward_names.check_weights, [1, bad], 2), bad


def test_the_checks_before_import_load_no_torch(tmp_path):
    path = write(tmp_path, "import torch\n")
    code = (f"from effitrain.catalog import reward_names; import sys; reward_names.parse({str(path) + ':f'!r}); "
            "reward_names.check_weights([1], 1); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


# -- a user's file imported ------------------------------------------------------------------------------

def test_a_users_file_loads_and_its_functions_share_its_module(tmp_path):
    path = write(tmp_path, TRL_STYLE)
    functions, weights = rewards.load([f"{path}:correct", f"{path}:seen"], ["2", 0.5])
    assert [f.name for f in functions] == ["correct", "seen"] and weights == [2.0, 0.5]
    assert functions[0].function.__globals__ is functions[1].function.__globals__
    assert functions[0](["p"], ["3 "], answer=[3], other=["x"]) == [1.0]


def test_a_users_file_imports_its_neighbours(tmp_path):
    write(tmp_path, "BONUS = 7.0\n", "helpers_of_mine.py")
    path = write(tmp_path, "from helpers_of_mine import BONUS\n\ndef f(completions, **kw):\n"
                           "    return [BONUS for _ in completions]\n", "uses_helper.py")
    functions, _ = rewards.load([f"{path}:f"])
    assert functions[0](["p"], ["c"]) == [7.0]


@pytest.mark.parametrize("source, words", [
    ("def f(:\n", "my_rewards.py fails to import: SyntaxError: "),
    ("import not_a_module_anyone_has\n", "fails to import: ModuleNotFoundError: No module named "
                                         "'not_a_module_anyone_has'"),
    ("raise RuntimeError('first line\\nsecond line')\n", "fails to import: RuntimeError: first line"),
    ("import sys\nsys.exit(3)\n", "fails to import: SystemExit: 3"),
])
def test_a_file_that_does_not_import_names_the_exception(tmp_path, source, words):
    path = write(tmp_path, source)
    message = refused(rewards.load, [f"{path}:f"])
    assert words in message and "second line" not in message and f"run `python {path.resolve()}`" in message


def test_no_such_function_lists_those_the_file_defines(tmp_path):
    path = write(tmp_path, TRL_STYLE)
    message = refused(rewards.load, [f"{path}:corect"])
    assert "my_rewards.py has no 'corect' (it defines correct, only_some, seen)" in message


def test_a_name_that_is_not_a_function_is_refused(tmp_path):
    path = write(tmp_path, TRL_STYLE)
    assert "not_a_function in my_rewards.py is an int, not a function" in refused(
        rewards.load, [f"{path}:not_a_function"])


def test_load_refuses_no_reward_a_name_twice_and_wrong_weights(tmp_path):
    path = write(tmp_path, TRL_STYLE)
    assert "no reward function given" in refused(rewards.load, [])
    assert "the reward exact-match is named twice" in refused(rewards.load, ["exact-match", "exact-match"])
    assert "1 value(s) for 2" in refused(rewards.load, [f"{path}:seen", "ends-turn"], [1])


# -- the functions checked against the data before the first step ------------------------------------------

def test_check_columns_refuses_what_the_data_lacks(tmp_path):
    path = write(tmp_path, TRL_STYLE + "\ndef needs_state(completions, trainer_state, **kw):\n    return []\n")
    functions, _ = rewards.load(["exact-match", f"{path}:correct", f"{path}:seen", "ends-turn"])
    rewards.check_columns(functions, ["prompt", "answer"])
    rewards.check_columns(functions[:1], ["prompt", "solution"])
    assert "compares with an `answer` or `solution` column, and the data has neither (it has prompt, x)" in refused(
        rewards.check_columns, functions[:1], ["prompt", "x"])
    assert "correct requires a column 'answer', which the data does not have" in refused(
        rewards.check_columns, functions[1:2], ["prompt", "solution"])
    assert "ends-turn requires a column 'completion_ended'" in refused(
        rewards.check_columns, functions[3:], ["prompt"], generated=())
    state, _ = rewards.load([f"{path}:needs_state"])
    assert "requires trainer_state, which TRL's trainer passes and effitrain does not; fix: give it a default" in \
        refused(rewards.check_columns, state, ["prompt"])


# -- the built-ins --------------------------------------------------------------------------------------

def test_exact_match_compares_stripped_text_with_answer_else_solution():
    completions = [" 57\n", "57.0", "58", "x", [{"role": "assistant", "content": "hi "}]]
    assert builtin_rewards.exact_match(completions, answer=[57, "57", "57", None, "hi"],
                                       solution=[None, None, None, "x", None]) == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert builtin_rewards.exact_match(["a", "b"], solution=["a", "c"]) == [1.0, 0.0]
    assert builtin_rewards.exact_match(["a"], answer=[None]) == [None]  # no answer: not scored
    assert "`answer` or `solution` column, and the data has neither" in refused(builtin_rewards.exact_match, ["a"])


@pytest.mark.parametrize("text, number", [
    ("The sum is 57.", 57.0), ("3-5", 5.0), ("x = -5", -5.0), ("1,234,567 and then 12", 12.0),
    ("total: $1,234.50", 1234.5), ("answer42", 42.0), ("1e3", 1000.0), ("-.5", -0.5), ("no digits", None),
])
def test_the_last_number_of_a_text(text, number):
    assert builtin_rewards.last_number(text) == number


def test_number_match_within_its_tolerance():
    match = builtin_rewards.number_match(0.5)
    completions = ["I think 57", "57.5", "57.6", "none", "#### 72", "x"]
    answers = [57, "57", 57, 57, "so #### 72", None]
    assert match(completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0, None]  # |57.5 - 57| = 0.5: inside
    assert builtin_rewards.number_match(0.0)(["0.1 + 0.2 = 0.3"], answer=[0.3]) == [1.0]
    assert "holds no number" in refused(match, ["1"], answer=["seven"])
    functions, _ = rewards.load(["number-match:0.5"])
    assert functions[0](["p"], ["57.4"], answer=[57]) == [1.0]


def test_ends_turn_reads_whether_the_completion_stopped():
    assert builtin_rewards.ends_turn(["a", "b"], completion_ended=[True, False]) == [1.0, 0.0]


# -- score(): values checked and weighed as TRL ------------------------------------------------------------

def test_weights_and_none_against_a_hand_computation(tmp_path):
    path = write(tmp_path, TRL_STYLE)
    functions, weights = rewards.load([f"{path}:only_some", "exact-match", "ends-turn"], [0.5, 2.0, -1.0])
    completions = ["3", "skip", "skip", "4"]
    scores = rewards.score(functions, weights, ["p0"] * 4, completions, {"answer": ["3", "3", None, "5"]},
                           completion_ended=[True, False, True, False])
    # only_some: 2, None, None, 2; exact-match: 1, 0, None, 0; ends-turn: 1, 0, 1, 0
    expected_values = torch.tensor([[2.0, 1.0, 1.0], [NAN, 0.0, 0.0], [NAN, NAN, 1.0], [2.0, 0.0, 0.0]])
    torch.testing.assert_close(scores.per_function, expected_values, equal_nan=True)
    expected = torch.tensor([0.5 * 2 + 2 * 1 - 1, 2 * 0 - 0, -1.0, 0.5 * 2])
    torch.testing.assert_close(scores.weighted, expected)
    assert scores.weighted.dtype == torch.float32 and not scores.unscorable.any()


def test_a_row_every_function_leaves_unscored_is_nan(tmp_path):
    path = write(tmp_path, TRL_STYLE)
    functions, weights = rewards.load([f"{path}:only_some", "exact-match"])
    scores = rewards.score(functions, weights, ["p"] * 2, ["skip", "skip"], {"answer": [None, "skip"]})
    assert math.isnan(scores.weighted[0]) and scores.weighted[1] == 1.0
    assert scores.unscorable.tolist() == [True, False]
    weighted, per_function = scores  # a tuple too
    assert per_function.shape == (2, 2)


def test_a_trl_style_function_receives_the_columns_repeated_per_generation(tmp_path):
    path = write(tmp_path, TRL_STYLE)
    functions, _ = rewards.load([f"{path}:seen", f"{path}:correct"])
    data = [{"prompt": "1+2=", "answer": 3, "level": "easy"}, {"prompt": "2+2=", "answer": 4, "level": "hard"}]
    generations = 3
    repeated = [row for row in data for _ in range(generations)]  # as TRL's sampler repeats each prompt G times
    prompts = [row["prompt"] for row in repeated]
    columns = {key: [row[key] for row in repeated] for key in data[0]}
    completions = ["3", "33", "4", "4", "5", "4"]
    ids = [[51], [51, 51], [52], [52], [53], [52]]
    scores = rewards.score(functions, [1.0, 1.0], prompts, completions, columns, completion_ids=ids,
                           completion_ended=[True] * 6, row_ids=[0, 0, 0, 1, 1, 1])
    called_prompts, called_completions, keywords = functions[0].function.calls[-1]
    assert called_prompts == prompts and called_completions == completions
    assert keywords == {"answer": [3, 3, 3, 4, 4, 4], "level": ["easy"] * 3 + ["hard"] * 3, "completion_ids": ids,
                        "completion_ended": [True] * 6}  # no `prompt`: it arrives as prompts, as in TRL
    torch.testing.assert_close(scores.per_function[:, 1], torch.tensor([1.0, 0, 0, 1, 0, 1]))


def test_conversational_completions_reach_the_functions_as_messages():
    functions, _ = rewards.load(["exact-match"])
    prompts = [[{"role": "user", "content": "1+2?"}]] * 2
    completions = [[{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "4"}]]
    scores = rewards.score(functions, [1.0], prompts, completions, {"answer": [3, 3]})
    assert scores.weighted.tolist() == [1.0, 0.0]


def test_a_function_that_edits_its_lists_does_not_change_the_next_ones():
    def greedy(completions, answer, **_):
        answer.clear()
        completions.clear()
        return [0.0, 0.0]

    functions, _ = rewards.load(["exact-match"])
    scores = rewards.score([rewards.RewardFunction.of(greedy, "greedy", "test"), *functions], [1.0, 1.0],
                           ["p", "p"], ["a", "b"], {"answer": ["a", "a"]})
    assert scores.weighted.tolist() == [1.0, 0.0]


def test_a_function_without_kwargs_gets_only_what_it_names():
    def short(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    function = rewards.RewardFunction.of(short, "short", "test")
    scores = rewards.score([function], [1.0], ["p", "p"], ["a", "b"], {"answer": ["a", "a"], "other": [1, 2]})
    assert scores.weighted.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("output", [
    [True, 0, np.float32(0.5)], (1.0, False, 0.5), np.array([1.0, 0.0, 0.5]), torch.tensor([1.0, 0.0, 0.5]),
    [torch.tensor(1.0), np.bool_(False), np.float64(0.5)], (value for value in [1, 0, 0.5]),
])
def test_numbers_of_any_kind_are_taken_bools_as_trl_does(output):
    function = rewards.RewardFunction.of(lambda completions, **_: output, "any", "test")
    scores = rewards.score([function], [1.0], ["p"] * 3, ["a", "b", "c"], {})
    assert scores.weighted.tolist() == [1.0, 0.0, 0.5]


def test_an_async_function_is_run():
    async def later(completions, **_):
        return [1.0 for _ in completions]

    scores = rewards.score([rewards.RewardFunction.of(later, "later", "test")], [1.0], ["p"], ["a"], {})
    assert scores.weighted.tolist() == [1.0]


def failing(on: str):
    def fails(completions, **_):
        if on in completions:
            raise ZeroDivisionError("division by zero\nmore detail")
        return [0.0 for _ in completions]
    return rewards.RewardFunction.of(fails, "fails", "bad.py:fails")


def test_a_function_that_raises_names_itself_the_row_and_the_fix():
    message = refused(rewards.score, [failing("boom")], [1.0], ["p"] * 4, ["ok", "ok", "boom", "ok"], {},
                      row_ids=[7, 7, 9, 9])
    assert "reward fails (bad.py:fails) raised ZeroDivisionError: division by zero on row 9 of the data, " \
           "completion 2 of 4 ('boom')" in message and "more detail" not in message
    assert "fix: fix the function so that it returns a number, or None, for each completion" in message


def test_a_function_that_fails_only_on_the_whole_batch():
    def batch_only(completions, **_):
        if len(completions) > 1:
            raise ValueError("too many")
        return [0.0]

    function = rewards.RewardFunction.of(batch_only, "batch_only", "b.py:batch_only")
    assert "raised ValueError: too many on a batch of 2 completions" in refused(
        rewards.score, [function], [1.0], ["p", "p"], ["a", "b"], {})


def test_a_builtins_refusal_keeps_its_fix_and_gains_the_row():
    functions, _ = rewards.load(["number-match"])
    message = refused(rewards.score, functions, [1.0], ["p", "p"], ["1", "2"], {"answer": [1, "seven"]},
                      row_ids=[4, 5])
    assert "reward number-match on row 5 of the data, completion 1 of 2 ('2'): the answer 'seven' holds no number" \
        in message and "give each row's answer as a number" in message


@pytest.mark.parametrize("output, words", [
    ([1.0], "returned 1 reward(s) for 2 completions; fix: return a list of 2 rewards"),
    (1.0, "returned a float for 2 completions"),
    ("ab", "returned a str for 2 completions"),
    ([1.0, "yes"], "returned 'yes', a str, on completion 1 of 2 ('b'); fix: return a number (float, int or bool)"),
    ([1.0, [1.0]], "returned '[1.0]', a list, on completion 1 of 2"),
    ([NAN, 1.0], "returned nan on completion 0 of 2 ('a'); fix: return a finite number, or None"),
    ([1.0, float("-inf")], "returned -inf on completion 1 of 2"),
    ([1e39, 0.0], "returned 1e+39 on completion 0 of 2"),  # finite, but inf in float32
    (torch.tensor([1.0, NAN]), "returned nan on completion 1 of 2"),
    ({1.0, 2.0}, "returned a set for 2 completions"),  # no order: which completion gets which reward?
    ({0: 1.0, 1: 0.0}, "returned a dict for 2 completions"),
    ([10 ** 400, 0], "returned 10000000000000000000... (401 characters) on completion 0 of 2"),  # no OverflowError
    ([10 ** 5000, 0], "returned an integer of 16,610 bits on completion 0 of 2"),  # too long for str()
])
def test_a_wrong_output_is_one_line(output, words):
    function = rewards.RewardFunction.of(lambda completions, **_: output, "odd", "odd.py:odd")
    message = refused(rewards.score, [function], [1.0], ["p", "p"], ["a", "b"], {})
    assert message.startswith("reward odd (odd.py:odd) ") and words in message, message


@pytest.fixture
def cli_signal_handler():
    """SIGINT held as the CLI holds it (cli._signals_unwind: each Ctrl-C raises errors.Interrupted)."""
    def unwind(signum, frame):
        raise Interrupted()

    unwind.raises_interrupted = True
    previous = signal.signal(signal.SIGINT, unwind)
    yield
    signal.signal(signal.SIGINT, previous)


def stopping(error: BaseException):
    def stops(completions, **_):
        raise error
    return rewards.RewardFunction.of(stops, "stops", "stop.py:stops")


@pytest.mark.parametrize("error, words", [(SystemExit(0), "raised SystemExit: 0 "), (SystemExit(), "raised SystemExit "),
                                          (KeyboardInterrupt(), "raised KeyboardInterrupt ")])
def test_exit_or_a_keyboardinterrupt_raised_by_a_function_is_its_failure(cli_signal_handler, error, words):
    """Not the run's end: exit() inside a reward would end the command with code 0 and no word; a
    KeyboardInterrupt that no Ctrl-C caused (the CLI's handler raises Interrupted for those) would read as one."""
    message = refused(rewards.score, [stopping(error)], [1.0], ["p", "p"], ["a", "b"], {}, row_ids=[3, 3])
    assert message.startswith("reward stops (stop.py:stops) ") and f"{words}on row 3 of the data, completion 0" \
        in message, message


def test_ctrl_c_and_sigterm_inside_a_function_stop_the_run(cli_signal_handler):
    from effitrain.errors import Terminated

    for error in (Interrupted(), Terminated()):
        with pytest.raises(type(error)):
            rewards.score([stopping(error)], [1.0], ["p"], ["a"], {})


def test_without_the_clis_handler_a_keyboardinterrupt_is_left_to_stop_the_program():
    """Python's own handler (the API in a notebook): a KeyboardInterrupt may be the user's key. Set here: a
    process started in the background by a shell inherits SIGINT ignored, and Python then keeps it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            rewards.score([stopping(KeyboardInterrupt())], [1.0], ["p"], ["a"], {})
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_file_raising_keyboardinterrupt_at_import_fails_to_import(tmp_path, cli_signal_handler):
    path = write(tmp_path, "raise KeyboardInterrupt\n")
    assert "my_rewards.py fails to import: KeyboardInterrupt; fix: run `python" in refused(
        rewards.load, [f"{path}:f"])
    interrupted = write(tmp_path, "from effitrain.errors import Interrupted\nraise Interrupted()\n", "pressed.py")
    with pytest.raises(Interrupted):  # Ctrl-C while it imported
        rewards.load([f"{interrupted}:f"])
