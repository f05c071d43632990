"""Preference pairs in TRL's formats, told apart by their columns and types: `prompt` + `chosen` +
`rejected` as strings, or as message lists, or `chosen` + `rejected` as whole conversations that share
their leading messages (the implicit prompt). Each pair becomes two rows of SFT's data (the prompt with
the chosen answer, the prompt with the rejected one), checked by conversations.py and encoded by
answers.py exactly as SFT encodes prompt-completion data: labels on the answer and its end of turn,
-100 elsewhere. The two are kept side by side in one row (chosen_*, rejected_*), so that every batch,
and every piece of one, holds both sides of its pairs."""

from __future__ import annotations

from effitrain.data import answers, cache, conversations
from effitrain.errors import UserError

STRINGS = "prompt/chosen/rejected"
MESSAGES = "prompt/chosen/rejected messages"
CONVERSATIONS = "chosen/rejected conversations"  # the prompt is their common leading messages
SIDES = ("chosen", "rejected")
OTHER_FORMATS = ("messages", "completion")  # SFT's columns: a file with both is refused


def is_preference(names: list[str]) -> bool:
    """Whether columns (the user's, or the canonical ones after loading) are preference data."""
    return any(side in names for side in SIDES)


def columns(names: list[str], where: str) -> dict[str, str]:
    """The canonical columns of preference data (the names TRL uses; there is no flag to rename them)."""
    missing = next((side for side in SIDES if side not in names), None)
    if missing is not None:
        other = next(side for side in SIDES if side != missing)
        raise UserError(f"{where} has a `{other}` column but no `{missing}` column",
                        "give each preference pair both a `chosen` and a `rejected` answer")
    mixed = next((name for name in OTHER_FORMATS if name in names), None)
    if mixed is not None:
        raise UserError(f"{where} mixes data formats: it has `chosen`/`rejected` and `{mixed}` columns",
                        "keep one format per file: preference pairs (`prompt`, `chosen`, `rejected`) or SFT data")
    return {name: name for name in ("prompt", *SIDES) if name in names}


def of_data(data) -> str:
    """The format of a loaded split of preference data."""
    if "prompt" not in data.column_names:
        return CONVERSATIONS
    return MESSAGES if conversations._is_messages(data.features["prompt"]) else STRINGS


def check_types(data, where: str) -> None:
    """Every column strings, or every column message lists: one format per file."""
    kinds = {name: _kind(data.features[name]) for name in data.column_names}
    other = next((name for name, kind in kinds.items() if kind is None), None)
    if other is not None:
        raise UserError(f"{where}: column `{other}` holds neither text nor lists of {{role, content}} messages",
                        f"give every row's `{other}` as text, or as a list of messages")
    if "prompt" not in kinds and any(kind != "messages" for kind in kinds.values()):
        raise UserError(f"{where}: `chosen` and `rejected` without a `prompt` column must be conversations "
                        "(lists of {role, content} messages) that share their prompt",
                        "add a `prompt` column, or give `chosen` and `rejected` as whole conversations")
    if len(set(kinds.values())) > 1:
        shown = ", ".join(f"`{name}` {kind}" for name, kind in kinds.items())
        raise UserError(f"{where} mixes data formats: its columns hold text or messages ({shown})",
                        "give `prompt`, `chosen` and `rejected` all as text, or all as lists of {role, content} "
                        "messages")


def _kind(feature) -> str | None:
    from datasets import Value

    if conversations._is_messages(feature):
        return "messages"
    if isinstance(feature, Value) and feature.dtype in ("string", "large_string"):
        return "text"
    return None


def as_sft(row: dict, fmt: str) -> tuple[dict, dict, str]:
    """A pair as two SFT rows (prompt + chosen, prompt + rejected) and their SFT format; the implicit
    prompt is the conversations' common leading messages (TRL's extract_prompt)."""
    if fmt == STRINGS:
        return ({"prompt": row["prompt"], "completion": row["chosen"]},
                {"prompt": row["prompt"], "completion": row["rejected"]}, conversations.PROMPT_COMPLETION)
    if fmt == MESSAGES:
        prompt = list(row["prompt"] or [])
        return ({"prompt": prompt, "completion": list(row["chosen"] or [])},
                {"prompt": prompt, "completion": list(row["rejected"] or [])}, conversations.CHAT_PROMPT_COMPLETION)
    chosen, rejected = list(row["chosen"] or []), list(row["rejected"] or [])
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return ({"prompt": chosen[:shared], "completion": chosen[shared:]},
            {"prompt": chosen[:shared], "completion": rejected[shared:]}, conversations.CHAT_PROMPT_COMPLETION)


def bad_rows(data, where: str, skip: bool) -> list[int]:
    """Pairs that cannot be trained on: identical answers, an empty answer or prompt, no shared prompt, an
    unknown role, an answer that is not the assistant's; the first refused with its row number, or, with
    --skip-bad-rows, all of their indices returned to be left out."""
    check_types(data, where)
    fmt = of_data(data)
    return conversations.rows_with_problems(data.to_list(), lambda row: problem_of(row, fmt), where, skip)


def problem_of(row: dict, fmt: str) -> tuple[str, str] | None:
    if row["chosen"] == row["rejected"]:
        return "has the same chosen and rejected answer (nothing to prefer)", "give the pair two different answers"
    chosen, rejected, sft = as_sft(row, fmt)
    if fmt == STRINGS:
        empty = next((side for side in ("prompt", *SIDES) if not (row[side] or "").strip()), None)
        if empty:
            return f"has an empty {empty}", f"give every pair a {empty}"
        return None
    if not chosen["prompt"]:
        what = "share no leading message (no prompt)" if fmt == CONVERSATIONS else "has an empty prompt"
        return (f"{'its chosen and rejected conversations ' if fmt == CONVERSATIONS else ''}{what}",
                "start both conversations with the same prompt messages" if fmt == CONVERSATIONS
                else "give every pair its prompt messages")
    for side, sft_row in zip(SIDES, (chosen, rejected)):
        if not sft_row["completion"]:
            return f"has an empty {side} answer", f"give every pair a {side} answer"
        other = next((m for m in sft_row["completion"]
                      if isinstance(m, dict) and m.get("role") != conversations.ANSWER), None)
        if fmt == CONVERSATIONS and other is not None:  # the implicit prompt ends where the two first differ
            number = len(chosen["prompt"]) + 1
            return (f"its chosen and rejected conversations differ from message {number} on, and the {side} one has "
                    f"a {other.get('role')} turn after that: only the final assistant answer may differ",
                    "make the two conversations the same up to their last answer, or give the pair a `prompt` "
                    "column of its shared messages")
        problem = conversations._problem(sft_row, sft)
        if problem is not None:
            return f"({side}) {problem[0]}", problem[1]
    return None


def encode(tokenizer, row: dict, fmt: str, max_length: int) -> dict:
    """One pair as chosen_/rejected_ input_ids and labels, each truncated to `max_length` (its start kept)."""
    out = {}
    for side, sft_row in zip(SIDES, as_sft(row, fmt)[:2]):
        encoded = answers.encode(tokenizer, sft_row, as_sft(row, fmt)[2], "completion")
        out[f"{side}_input_ids"] = encoded.input_ids[:max_length]
        out[f"{side}_labels"] = encoded.labels[:max_length]
    return out


def encode_splits(splits, tokenizer, max_length: int):
    """Every split's pairs encoded (cached as SFT's data is); a conversation whose answers cannot be
    located is refused with its index."""
    fmt = of_data(splits["train"])
    template = getattr(tokenizer, "chat_template", None)

    def encode_batch(batch, indices, split):
        rows = answers.data_rows(split)
        out = {f"{side}_{key}": [] for side in SIDES for key in ("input_ids", "labels")}
        for offset, values in enumerate(zip(*batch.values())):
            try:
                pair = encode(tokenizer, dict(zip(batch, values)), fmt, max_length)
            except answers.Unlocatable as err:
                raise UserError(f"the assistant turns of the pair in row {rows(indices[offset]) + 1} of the data "
                                f"cannot be located in its templated token ids: {err}",
                                answers.unlocatable_fix(err, template)) from None
            for key, value in pair.items():
                out[key].append(value)
        return out

    key = ["preferences", cache.tokenizer_key(tokenizer), max_length, fmt, str(template)]
    return cache.map_splits(splits, encode_batch, key, per_split=True, batched=True, with_indices=True,
                            remove_columns=next(iter(splits.values())).column_names)


def has_answers(row: dict) -> bool:
    """Whether both answers keep a token within --max-length."""
    return all(answers.has_answer(row[f"{side}_labels"]) for side in SIDES)


def collator(pad_id: int, multiple: int | None = None):
    """Pairs as [pairs, 2, width] tensors (chosen at [:, 0], rejected at [:, 1]), padded on the right to the
    longest answer of the batch as answers.collator pads; the precomputed reference log-probs, where the
    data has them, as [pairs, 2]."""
    import torch

    sides = answers.collator(pad_id, multiple)

    def collate(features: list[dict]) -> dict:
        rows = [{key: feature[f"{side}_{key}"] for key in ("input_ids", "labels")}
                for feature in features for side in SIDES]
        batch = {key: value.view(len(features), 2, -1) for key, value in sides(rows).items()}
        if "reference_logps" in features[0]:
            batch["reference_logps"] = torch.tensor([feature["reference_logps"] for feature in features],
                                                    dtype=torch.float64)
        return batch

    return collate
