"""The formats of causal-LM data, as TRL defines them, told apart by their columns: `text` (language
modelling), `prompt` + `completion` strings, `messages` (a conversation: a list of {role, content}), and
`prompt` + `completion` as message lists. Rows of the last two are checked here, with the file's row
numbers, before any template sees them. Prompts alone (a `prompt` string or message list, for the model to
answer while it trains: online RL) are a format only where the caller asks for them (`prompts_only`)."""

from __future__ import annotations

from effitrain.errors import UserError

TEXT = "text"
PROMPT_COMPLETION = "prompt-completion"
MESSAGES = "messages"
CHAT_PROMPT_COMPLETION = "prompt-completion messages"
CONVERSATIONAL = (MESSAGES, CHAT_PROMPT_COMPLETION)  # the formats a chat template renders
PROMPT_ONLY = "prompt-only"
CHAT_PROMPT_ONLY = "prompt-only messages"  # prompts as message lists, rendered with the generation prompt
ROLES = ("system", "user", "assistant", "tool")
ANSWER = "assistant"


def columns(names: list[str], text_column: str, where: str, prompts_only: bool = False) -> dict[str, str]:
    """The canonical columns (name -> the user's column) of the format the column names show; a file
    holding the columns of two formats is refused (each row must be read one way). `prompts_only`: the
    caller generates the answers (online RL), so only a `prompt` is needed (prompt_only_columns)."""
    if prompts_only:
        return prompt_only_columns(names, where)
    found = [fmt for fmt, wanted in ((MESSAGES, ("messages",)), (PROMPT_COMPLETION, ("prompt", "completion")),
                                     (TEXT, (text_column,))) if any(name in names for name in wanted)]
    if len(found) > 1:
        shown = {MESSAGES: "`messages`", PROMPT_COMPLETION: "`prompt`/`completion`", TEXT: f"`{text_column}`"}
        raise UserError(f"{where} mixes data formats: it has {' and '.join(shown[f] for f in found)} columns",
                        "keep one format per file: `text`, `prompt` + `completion`, or `messages`")
    if found == [MESSAGES]:
        return {"messages": "messages"}
    if found == [PROMPT_COMPLETION]:
        missing = next((name for name in ("prompt", "completion") if name not in names), None)
        if missing is not None:
            other = "completion" if missing == "prompt" else "prompt"
            raise UserError(f"{where} has a `{other}` column but no `{missing}` column",
                            "give each row both a `prompt` and a `completion`")
        return {"prompt": "prompt", "completion": "completion"}
    return {"text": text_column}  # absent: sources names the missing column and the flag to fix it


def prompt_only_columns(names: list[str], where: str) -> dict[str, str]:
    """Prompts to generate answers to: the `prompt` column, else a `messages` conversation (its prompt the turns
    before its last, the assistant's answer: conversations_as_prompts), and every other column kept under its own
    name (TRL passes them to the reward functions: an `answer` to compare with, a `completion` as a reference)."""
    source = next((name for name in ("prompt", "messages") if name in names), None)
    if source is None:
        raise UserError(f"{where} has no `prompt` column (columns: {', '.join(names)})",
                        "give each row a `prompt`: a string, or a list of {role, content} messages ending on the "
                        "turn the model answers (or a `messages` conversation ending on the assistant's answer)")
    return {name: name for name in [source, *(name for name in names if name != source)]}


def detect(names: list[str]) -> str:
    """The format of splits whose columns have their canonical names (after sources.load)."""
    if "messages" in names:
        return MESSAGES
    if "prompt" in names:
        return PROMPT_COMPLETION  # or CHAT_PROMPT_COMPLETION: told apart by the columns' types (of_data)
    return TEXT


def of_data(data) -> str:
    """The format of a loaded split, telling string prompts from message lists by the column's type."""
    fmt = detect(data.column_names)
    if fmt == PROMPT_COMPLETION and _is_messages(data.features["prompt"]):
        return CHAT_PROMPT_COMPLETION
    return fmt


def _is_messages(feature) -> bool:
    """A list of messages: of structs with a role and a content or tool calls, or of JSON objects (datasets'
    type for messages whose keys differ between rows: tool calls, a tool's `name`), each checked by `_problem`."""
    from datasets import Json

    inner = getattr(feature, "feature", None)  # datasets' List (or Sequence) of structs
    if isinstance(inner, Json):
        return True
    return isinstance(inner, dict) and "role" in inner and bool({"content", "tool_calls"} & set(inner))


def _is_text(feature) -> bool:
    from datasets import Value

    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


def check_types(data, where: str) -> None:
    """Each column of the format holds what it must: strings, or lists of {role, content}."""
    fmt = detect(data.column_names)
    if fmt == MESSAGES and not _is_messages(data.features["messages"]):
        raise UserError(f"{where}: column `messages` is not a list of {{role, content}} messages",
                        'give each row a list like [{"role": "user", "content": "..."}, {"role": "assistant", '
                        '"content": "..."}]')
    if fmt == PROMPT_COMPLETION:
        kinds = [("messages" if _is_messages(data.features[c]) else "text" if _is_text(data.features[c]) else None)
                 for c in ("prompt", "completion")]
        if None in kinds or kinds[0] != kinds[1]:
            raise UserError(f"{where}: columns `prompt` and `completion` must both be text, or both lists of "
                            f"{{role, content}} messages", "convert them to one of the two")


def bad_rows(data, where: str, skip: bool) -> list[int]:
    """Conversations that cannot be trained on (an unknown role, an empty turn, no answer to learn,
    a conversation ending on a user turn): the first refused with its row number, or, with
    --skip-bad-rows, all of their indices returned to be left out."""
    check_types(data, where)
    fmt = of_data(data)
    if fmt not in CONVERSATIONAL:
        return []
    return rows_with_problems(data.select_columns(list(data.column_names)).to_list(),
                              lambda row: _problem(row, fmt), where, skip)


def of_prompts(data, where: str) -> str:
    """The format of prompts alone (prompts_only): PROMPT_ONLY for strings, CHAT_PROMPT_ONLY for message
    lists; a `prompt` column of anything else (numbers, objects) is refused."""
    feature = data.features["prompt"]
    if _is_messages(feature):
        return CHAT_PROMPT_ONLY
    if _is_text(feature):
        return PROMPT_ONLY
    raise UserError(f"{where}: column `prompt` holds neither text nor lists of {{role, content}} messages",
                    'give each prompt as a string, or as a list like [{"role": "user", "content": "..."}]')


def bad_prompt_rows(data, where: str, skip: bool) -> list[int]:
    """Prompts the model cannot be asked (an empty one; messages that are no conversation to answer, or that
    end on the assistant's turn): the first refused with its row number, or with --skip-bad-rows all of their
    indices returned to be left out. The `bad_rows` of sources.load for prompts alone. Conversations (`messages`,
    no `prompt`) get SFT's check (bad_rows) and, unless skipped, their prompts' (conversation_prompt_problem);
    skipped, only SFT's rows are left out before the split, so that the held-out rows are SFT's, and
    conversations_as_prompts leaves the others out after it."""
    if "prompt" not in data.column_names:
        bad = bad_rows(data, where, skip)
        if not skip:
            has_answer = has_answer_column(data.column_names)
            rows_with_problems(data.select_columns(["messages"]).to_list(),
                               lambda row: conversation_prompt_problem(row["messages"], has_answer), where, skip)
        return bad
    fmt = of_prompts(data, where)
    return rows_with_problems(data.select_columns(["prompt"]).to_list(),
                              lambda row: prompt_row_problem(row["prompt"], fmt), where, skip)


# The columns the answer-checking rewards read (tasks/objectives/rewards/builtin_rewards.py): a conversation's
# last turn becomes the `answer` only where the data has neither, so that it never shadows the user's.
ANSWER_COLUMNS = ("answer", "solution")


def has_answer_column(names: list[str]) -> bool:
    return any(name in names for name in ANSWER_COLUMNS)


def conversation_prompt_problem(messages: list[dict], has_answer: bool) -> tuple[str, str] | None:
    """What makes a conversation that SFT trains on (bad_rows passed it) unfit as a prompt and its answer: no
    turn before its last assistant turn, two assistant turns at its end (the prompt would end on the
    assistant's), or, where its last turn becomes the `answer`, a last turn with tool calls and no text."""
    prompt, last = messages[:-1], messages[-1]
    if not prompt:
        return ("has no turn before its assistant answer (no prompt for the model to answer)",
                "give each conversation the turns its answer replies to")
    if prompt[-1]["role"] == ANSWER:
        return ("ends on two assistant turns (its prompt, all but the last turn, would end on the assistant's)",
                "end each conversation with one assistant answer after the turn it replies to")
    if not has_answer and not (last.get("content") or "").strip():
        return ("ends on an assistant turn of tool calls with no text (no answer to compare with)",
                "end each conversation with a text answer, or give an `answer` column")
    return None


def conversations_as_prompts(splits) -> tuple[object, int]:
    """Conversations (a `messages` column, checked by bad_prompt_rows) as prompts alone: each row's `prompt` its
    turns before the last (the assistant's answer), that answer's text its `answer` unless the data has an
    `answer` or `solution` column already (kept); `messages` dropped. Run on the splits sources.load made of the
    conversations, so that they hold out SFT's rows; rows left in by --skip-bad-rows whose prompt is unfit are
    left out here, and counted. Returns (the splits, the rows left out)."""
    from datasets import DatasetDict, Features, Value

    first = next(iter(splits.values()))
    if "messages" not in first.column_names or "prompt" in first.column_names:
        return splits, 0
    has_answer = has_answer_column(first.column_names)
    converted, dropped = {}, 0
    for name, split in splits.items():
        rows = split.select_columns(["messages"]).to_list()
        bad = {i for i, row in enumerate(rows) if conversation_prompt_problem(row["messages"], has_answer)}
        fit = split.select([i for i in range(len(split)) if i not in bad]) if bad else split
        dropped += len(bad)
        features = {"prompt": split.features["messages"],
                    **{column: split.features[column] for column in split.column_names if column != "messages"},
                    **({} if has_answer else {"answer": Value("string")})}

        def cut(row):
            answer = {} if has_answer else {"answer": row["messages"][-1]["content"]}
            return {"prompt": row["messages"][:-1], **answer}

        converted[name] = fit.map(cut, remove_columns=["messages"], features=Features(features)) \
            .select_columns(list(features))
    return DatasetDict(converted), dropped


def prompt_row_problem(prompt, fmt: str) -> tuple[str, str] | None:
    """What makes one prompt of `fmt` (PROMPT_ONLY or CHAT_PROMPT_ONLY) unfit to be answered; None where it is fit."""
    if fmt == CHAT_PROMPT_ONLY:
        return prompt_problem(prompt, column="prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return "has an empty prompt", "give every prompt some text"
    return None


def rows_with_problems(rows: list[dict], problem_of, where: str, skip: bool) -> list[int]:
    """The indices of the rows `problem_of` finds a (problem, fix) in; without `skip`, the first refused
    with its row number."""
    bad = []
    for index, row in enumerate(rows):
        problem = problem_of(row)
        if problem is not None:
            if not skip:
                raise UserError(f"{where}: row {index + 1} {problem[0]}", f"{problem[1]}, or pass --skip-bad-rows "
                                "to leave such rows out")
            bad.append(index)
    return bad


def _problem(row: dict, fmt: str) -> tuple[str, str] | None:
    messages, first_answer = as_messages(row, fmt)
    if not messages:
        return "has no messages", "give it a conversation ending with the assistant's answer"
    if fmt == CHAT_PROMPT_COMPLETION and not row["completion"]:
        return "has an empty completion", "give it the assistant's answer"
    for number, message in enumerate(messages, 1):
        problem = _message_problem(number, message)
        if problem is not None:
            return problem
        if message.get("tool_calls") and not message.get("content"):
            continue  # a call is the answer of that turn
        role, content = message["role"], message.get("content")
        if content is not None and not isinstance(content, str):  # a number, a list of parts, an object
            return (f"message {number} has content that is {_kind(content)}, not text",
                    'give each message\'s "content" as a string')
        if not (content or "").strip():
            what = "an empty completion" if role == ANSWER else f"an empty {role} message"
            return f"has {what} (message {number})", "give every message some content"
    if fmt == CHAT_PROMPT_COMPLETION and any(m["role"] != ANSWER for m in messages[first_answer:]):
        return "has a completion with a turn that is not the assistant's", "keep only assistant turns in completions"
    if messages[-1]["role"] != ANSWER:
        return (f"ends on a {messages[-1]['role']} turn (nothing for the model to answer there)",
                "end each conversation with the assistant's answer")
    return None


def _message_problem(number: int, message) -> tuple[str, str] | None:
    """What is wrong with one message itself: not an object, an unknown role, tool calls that are not the
    assistant's list of calls (TRL's and transformers' format); None where it is sound."""
    if not isinstance(message, dict):
        return f"message {number} is {_kind(message)}, not a {{role, content}} object", \
            'give each message as {"role": ..., "content": ...}'
    role = message.get("role")
    if role not in ROLES:
        return f"message {number} has the unknown role `{role}`", f"use the roles {', '.join(ROLES)}"
    calls = message.get("tool_calls")
    if calls not in (None, []) and (role != ANSWER or not _are_tool_calls(calls)):  # [] : no call (OpenAI's)
        return (f"message {number} has tool_calls that are not the assistant's list of {{type, function: "
                "{name, arguments}}", "give tool calls as TRL's and transformers' formats do")
    return None


def _are_tool_calls(calls) -> bool:
    return isinstance(calls, list) and bool(calls) and all(
        isinstance(call, dict) and isinstance(call.get("function"), dict)
        and isinstance(call["function"].get("name"), str) for call in calls)


def has_tool_calls(messages: list[dict]) -> bool:
    return any(isinstance(m, dict) and m.get("tool_calls") for m in messages)


def _kind(value) -> str:
    kinds = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return next((kind for cls, kind in kinds.items() if isinstance(value, cls)), type(value).__name__)


def as_messages(row: dict, fmt: str) -> tuple[list[dict], int]:
    """A conversational row as one message list, and the index of the first message the loss may
    cover (its answers are the assistant messages from there on): 0 for `messages`, the completion's
    first message for prompt-completion messages."""
    if fmt == MESSAGES:
        return list(row["messages"] or []), 0
    prompt = list(row["prompt"] or [])
    return prompt + list(row["completion"] or []), len(prompt)


def prompt_problem(messages, column: str = "messages") -> tuple[str, str] | None:
    """What makes `messages` unfit as a conversation for the model to answer (predict, prompts alone): not a
    list of {role, content}, an unknown role, an empty message, or a last turn that is already the assistant's."""
    shape = 'a list like [{"role": "user", "content": "..."}]'
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return "is not a non-empty list of {role, content} messages", f"give `{column}` as {shape}"
    for number, message in enumerate(messages, 1):
        problem = _message_problem(number, message)
        if problem is not None:
            return problem
        if message.get("tool_calls") and not message.get("content"):
            continue  # a call is the answer of that turn
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"message {number} has no text content", "give every message some content"
    if messages[-1]["role"] == ANSWER:
        return ("ends on an assistant turn (nothing left for the model to answer)",
                "end each conversation with the turn the model answers (e.g. the user's)")
    return None
