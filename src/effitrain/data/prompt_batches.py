"""A batch of prompts alone (conversations.PROMPT_ONLY / CHAT_PROMPT_ONLY) as generation takes it: token
ids padded on the left, so that every row's first new token comes at the same position, with the prompts as
given and every other column, row by row, for the reward functions (TRL's `f(prompts, completions, **columns)`).

A prompt gets the ids a model fine-tuned by `train` saw before its answers: a string is tokenised as SFT
tokenises the prompt of prompt-completion data (answers.prompt_ids: leading special tokens kept, none after);
a message list is rendered by the chat template with its generation prompt, under the bounded renderer
(answers.prompt_render_ids), as `predict` renders a conversation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from effitrain.data import answers, conversations
from effitrain.errors import UserError


@dataclass
class PromptBatch:
    input_ids: torch.Tensor  # (prompts, width), left-padded
    attention_mask: torch.Tensor  # 1 on the prompt's tokens, 0 on the padding before them
    prompts: list  # as given: strings or message lists (what reward functions get as `prompts`)
    columns: dict[str, list]  # every other column, one value per prompt
    truncated: int  # prompts longer than max_length, cut to their last max_length tokens


def encode(tokenizer, rows: list[dict], max_length: int | None = None, device=None) -> PromptBatch:
    """`rows` (dicts with a `prompt`, e.g. a split's rows) as one batch ready for `model.generate`. The prompts'
    kind (strings or message lists) is read from the rows; a prompt longer than `max_length` keeps its end
    (what the model answers)."""
    prompts = [row["prompt"] for row in rows]
    if not prompts:
        raise ValueError("no prompts to encode")
    ids = prompt_ids(tokenizer, prompts)
    truncated = sum(max_length is not None and len(row) > max_length for row in ids)
    if max_length is not None:
        ids = [row[-max_length:] for row in ids]
    columns = {name: [row[name] for row in rows] for name in rows[0] if name != "prompt"}
    return PromptBatch(**left_padded(ids, pad_id(tokenizer), device), prompts=prompts, columns=columns,
                       truncated=truncated)


def prompt_ids(tokenizer, prompts: list) -> list[list[int]]:
    """Each prompt's token ids: strings tokenised in one call, message lists rendered one by one."""
    fmt = format_of(prompts)
    if fmt == conversations.PROMPT_ONLY:
        return [answers.prompt_ids(tokenizer, ids) for ids in tokenizer(prompts)["input_ids"]]
    answers.check_generation_prompt(tokenizer, tokenizer.name_or_path)  # a template, and one that marks the answer
    return [answers.prompt_render_ids(tokenizer, messages) for messages in prompts]


def format_of(prompts: list) -> str:
    """PROMPT_ONLY for strings, CHAT_PROMPT_ONLY for message lists. A split's column has one type, so a mix
    is a caller's mistake."""
    if all(isinstance(prompt, str) for prompt in prompts):
        return conversations.PROMPT_ONLY
    if all(isinstance(prompt, list) for prompt in prompts):
        return conversations.CHAT_PROMPT_ONLY
    raise ValueError("prompts must be all strings or all message lists")


def pad_id(tokenizer) -> int:
    """The pad token, else EOS (masked out either way)."""
    token = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise UserError(f"the tokenizer of {tokenizer.name_or_path} has no pad token (nor an EOS token to pad with)",
                        "set one and save it: tokenizer.pad_token = ...; tokenizer.save_pretrained(DIR)")
    return token


def left_padded(rows: list[list[int]], pad: int, device=None) -> dict:
    """Rows padded on the left, so that every row's next token is generated at the same position."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
