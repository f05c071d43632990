"""Each example of instruction or chat data as token ids and labels: the labels hold the ids where the
loss applies and -100 elsewhere (the task shifts them: position t predicts label t + 1). By default the
loss covers the answers only (the completion, or the assistant's turns), each with the special token
that ends it, so that the model learns to stop; --loss-on all covers every token.

Conversations are rendered by the tokenizer's chat template and tokenised as `apply_chat_template`
does (add_special_tokens=False), so the ids are those inference gets. The answers are located by the
template's {% generation %} blocks where it has them (transformers' assistant mask), else by rendering
the conversation up to each assistant turn (with and without the generation prompt) and requiring those
texts to be prefixes of the whole."""

from __future__ import annotations

from dataclasses import dataclass

from effitrain.data import cache, chat_render, conversations, templates
from effitrain.errors import UserError

IGNORE = -100  # the label of a position the loss skips


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


class Unlocatable(ValueError):
    """The answers of one conversation cannot be told apart from the rest of its templated ids."""


class Refused(Unlocatable):
    """The chat template itself refuses the conversation (its raise_exception, a sandbox rule)."""


def encode(tokenizer, row: dict, fmt: str, loss_on: str = "completion") -> Encoded:
    """One row of `fmt` data (conversations.PROMPT_COMPLETION or one of conversations.CONVERSATIONAL)
    as token ids and labels, untruncated. Raises Unlocatable, or UserError for a template that drops
    the end of a turn."""
    if fmt == conversations.PROMPT_COMPLETION:
        ids, answer = _prompt_completion(tokenizer, row["prompt"], row["completion"])
    else:
        ids, answer = _conversation(tokenizer, *conversations.as_messages(row, fmt))
    labels = list(ids) if loss_on == "all" else [i if a else IGNORE for i, a in zip(ids, answer)]
    return Encoded(list(ids), labels)


def prompt_ids(tokenizer, ids: list[int]) -> list[int]:
    """A prompt's tokens with the tokenizer's leading special tokens (BOS, [CLS]) but none after it:
    a trailing EOS or [SEP] would tell the model that the text has ended."""
    special = set(tokenizer.all_special_ids)
    while len(ids) > 1 and ids[-1] in special:
        ids = ids[:-1]
    return ids


def end_of_text_id(tokenizer) -> int:
    """What ends a completion of plain prompt-completion data: EOS, else the separator ([SEP])."""
    token = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if token is None:
        raise UserError(f"the tokenizer of {tokenizer.name_or_path} has no EOS (nor [SEP]) token to end each "
                        "completion with, so the model could never learn to stop",
                        "pass a model whose tokenizer has an EOS token, or give the data as messages with "
                        "--chat-template chatml")
    return token


def _prompt_completion(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[bool]]:
    """The prompt tokenised as prediction tokenises it, then the completion and the end-of-text token
    (apart, so that the prompt's ids are a prefix whatever the tokenizer merges across the seam)."""
    before = prompt_ids(tokenizer, tokenizer(prompt)["input_ids"])
    after = tokenizer(completion, add_special_tokens=False)["input_ids"] + [end_of_text_id(tokenizer)]
    return before + after, [False] * len(before) + [True] * len(after)


def _conversation(tokenizer, messages: list[dict], first_answer: int) -> tuple[list[int], list[bool]]:
    template = templates.require(tokenizer, tokenizer.name_or_path)
    if conversations.has_tool_calls(messages) and "tool_calls" not in template:
        raise UserError("the data has tool calls (assistant messages' tool_calls), and the chat template does not "
                        "render them (it never reads `tool_calls`)",
                        "pass a --chat-template that renders tool calls (the model's own, if it was made for tools)")
    marked = templates.has_generation_blocks(template)
    out = _render(tokenizer, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=marked,
                  tokenizer_kwargs={"return_offsets_mapping": True})
    ids, offsets = list(out["input_ids"]), [tuple(pair) for pair in out["offset_mapping"]]
    if marked:
        mask = list(out["assistant_masks"])
        start = _text_before(tokenizer, messages, first_answer) if first_answer else 0
        groups = _runs([m and offsets[i][0] >= start for i, m in enumerate(mask)])
        if not groups:
            raise Unlocatable("the template's {% generation %} blocks mark no token of the answer")
    else:
        spans = _answer_spans(tokenizer, messages, first_answer)
        groups = [[i for i, (a, b) in enumerate(offsets) if b > start and a < end] for start, end in spans]
        if any(not group for group in groups):
            raise Unlocatable("an assistant turn renders as no token")
    special = templates.special_ids(tokenizer)
    answer = [False] * len(ids)
    for group in groups:
        for i in _through_end_of_turn(ids, group, special, marked):
            answer[i] = True
    return ids, answer


PROBE_ANSWER = "effitrain-probe-answer"


def check_generation_prompt(tokenizer, model: str) -> None:
    """The template (`templates.require`d) renders an assistant turn as its generation prompt promised: nothing
    but the answer after the text `add_generation_prompt=True` gives. A template that ignores the flag would
    put the assistant's header ("<|im_start|>assistant") inside every answer: the loss would train the model
    to write it, and `predict` would print it."""
    templates.require(tokenizer, model)
    user = {"role": "user", "content": "Hi"}
    try:
        prompted = _render(tokenizer, [user], tokenize=False, add_generation_prompt=True)
        whole = _render(tokenizer, [user, {"role": conversations.ANSWER, "content": PROBE_ANSWER}], tokenize=False)
    except Unlocatable:  # the template refuses the probe (a system turn it requires, say): the data's own
        return  # conversations are rendered, and checked, one by one
    if not whole.startswith(prompted) or PROBE_ANSWER not in whole[len(prompted):]:
        return  # templates that render otherwise are checked per conversation (Unlocatable)
    header = whole[len(prompted):].split(PROBE_ANSWER)[0]
    if header.strip():
        raise UserError(f"the chat template of {model} ignores add_generation_prompt: the assistant's turn starts "
                        f"with {header.strip()[:80]!r}, which the generation prompt does not give, so every answer "
                        "would include it", "add {% if add_generation_prompt %}...{% endif %} with that header at "
                        "the template's end, or pass --chat-template chatml")


def prompt_render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation to answer, as generation sees it: rendered with the generation prompt, under the same
    limits as training's renders."""
    try:
        return list(_render(tokenizer, messages, add_generation_prompt=True, tokenize=True,
                            return_dict=True)["input_ids"])
    except Unlocatable as err:
        raise UserError(f"a conversation cannot be rendered by the model's chat template: {err}",
                        "give conversations the template accepts (roles, order), or use another model") from None


def _render(tokenizer, messages: list[dict], **options):
    import jinja2

    try:
        return chat_render.render(tokenizer, messages, **options)
    except jinja2.TemplateError as err:  # a template's raise_exception, e.g. roles that must alternate
        raise Refused(f"the chat template refuses it: {str(err)[:200]}")
    except chat_render.TemplateLimit as err:  # the template (--chat-template's, or the model folder's) named
        raise UserError(f"the chat template was stopped on a conversation: {err}", TEMPLATE_FIX) from None
    except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError, MemoryError) as err:
        # the template's own code failing (the sandbox's range limit, an {% include %} with no loader, ...)
        message = str(err).splitlines()[0][:200] if str(err) else ""
        raise UserError("the chat template fails on a conversation "
                        f"({type(err).__name__}: {message})", TEMPLATE_FIX) from None


# Said for a template's own failure, by train (where --chat-template replaces it), predict and evaluate (where
# the template is the model folder's chat_template.jinja).
TEMPLATE_FIX = "fix the template (--chat-template's file, or the model folder's chat_template.jinja); train can " \
               "pass --chat-template chatml instead"


def unlocatable_fix(err: Unlocatable, template) -> str:
    """What to do about a conversation whose answers cannot be located: a refusal by the template is about the
    conversation; under ChatML, so is anything else; else the template's way of marking answers."""
    if isinstance(err, Refused) or template == templates.CHATML:
        return "correct that conversation (what the template accepts: its roles and their order), or remove it"
    return "use a template with {% generation %} blocks, or pass --chat-template chatml"


def _text_before(tokenizer, messages: list[dict], index: int) -> int:
    """Where message `index` starts in the rendered conversation: the length of the text of the messages
    before it with the generation prompt, checked to be a prefix of the whole."""
    whole = _render(tokenizer, messages, tokenize=False)
    before = _render(tokenizer, messages[:index], tokenize=False, add_generation_prompt=True)
    if not whole.startswith(before):
        raise Unlocatable(f"the template does not render the conversation up to message {index + 1} (with the "
                          "generation prompt) as the start of the whole conversation")
    return len(before)


def _answer_spans(tokenizer, messages: list[dict], first_answer: int) -> list[tuple[int, int]]:
    """The characters of each assistant turn from `first_answer` on: from the end of the text before it
    (with the generation prompt) to the end of the text through it."""
    whole = _render(tokenizer, messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if index < first_answer or message["role"] != conversations.ANSWER:
            continue
        if index == 0:
            raise Unlocatable("the conversation starts with an assistant turn, which has no prompt before it")
        start = _text_before(tokenizer, messages, index)
        through = _render(tokenizer, messages[:index + 1], tokenize=False)
        if not whole.startswith(through) or len(through) <= start:
            raise Unlocatable(f"the template does not render the conversation through message {index + 1} as the "
                              "start of the whole conversation")
        spans.append((start, len(through)))
    return spans


def _runs(flags: list[bool]) -> list[list[int]]:
    """The indices of each run of True."""
    runs, current = [], []
    for i, flag in enumerate(flags):
        if flag:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _through_end_of_turn(ids: list[int], group: list[int], special: set[int], marked: bool) -> list[int]:
    """An answer's token indices up to and including its last special token (the end of the turn: what
    makes generation stop); what the template writes after it (a newline) is not the answer's to learn.
    An answer with no special token is refused: trained on it, the model would never stop."""
    ends = [position for position, i in enumerate(group) if ids[i] in special]
    if not ends:
        where = "inside its {% generation %} blocks" if marked else "at the end of each assistant turn"
        raise UserError(f"the chat template puts no special token (end of turn, e.g. <|im_end|> or <|eot_id|>) "
                        f"{where}, so the loss would never teach the model to stop",
                        "use a template that closes each assistant turn with a special token inside the answer, "
                        "or pass --chat-template chatml")
    return group[:ends[-1] + 1]


def encode_splits(splits, tokenizer, fmt: str, loss_on: str, max_length: int):
    """input_ids, attention_mask and labels per example, truncated to `max_length` (the start kept),
    unpadded. A conversation whose answers cannot be located is refused with its row in the data file."""
    template = getattr(tokenizer, "chat_template", None)

    def encode_batch(batch, indices, split):
        rows = data_rows(split)
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        for offset, values in enumerate(zip(*batch.values())):
            try:
                example = encode(tokenizer, dict(zip(batch, values)), fmt, loss_on)
            except Unlocatable as err:
                raise UserError(f"the assistant turns of the conversation in row {rows(indices[offset]) + 1} of the "
                                f"data cannot be located in its templated token ids: {err}",
                                unlocatable_fix(err, template)) from None
            out["input_ids"].append(example.input_ids[:max_length])
            out["labels"].append(example.labels[:max_length])
            out["attention_mask"].append([1] * len(out["input_ids"][-1]))
        return out

    key = ["answers", cache.tokenizer_key(tokenizer), max_length, fmt, loss_on, str(template)]
    return cache.map_splits(splits, encode_batch, key, per_split=True, batched=True, with_indices=True,
                            remove_columns=next(iter(splits.values())).column_names)


def data_rows(split):
    """Row i of a split -> its row in the data as read (0-based): the split and every selection before it
    (bad rows dropped, the seeded shuffle, the samples kept) are an indices mapping over the table read."""
    mapping = getattr(split, "_indices", None)
    if mapping is None:
        return lambda i: i
    column = mapping.column(0)
    return lambda i: column[i].as_py()


def end_of_turn_id(tokenizer, fmt: str) -> int:
    """The token that ends an answer in `fmt` data, what generation should stop at: the last label of a
    probe example (<|im_end|> for ChatML, <|eot_id|> for Llama 3, EOS for prompt-completion strings)."""
    if fmt == conversations.PROMPT_COMPLETION:
        return end_of_text_id(tokenizer)
    probe = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    return [label for label in encode(tokenizer, probe, conversations.MESSAGES).labels if label != IGNORE][-1]


def has_answer(labels: list[int]) -> bool:
    """Whether an example teaches anything: a label after its first position (which nothing predicts)."""
    return any(label != IGNORE for label in labels[1:])


def collator(pad_id: int, multiple: int | None = None):
    """Pads a batch on the right to its longest example (rounded up to `multiple`): ids with `pad_id`,
    labels with -100, whatever the pad token is (it may be the end-of-turn token, which stays learnt)."""
    import torch

    def collate(features: list[dict]) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        if multiple:
            width = -(-width // multiple) * multiple
        ids = torch.full((len(features), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE, dtype=torch.long)
        for row, feature in enumerate(features):
            size = len(feature["input_ids"])
            ids[row, :size] = torch.as_tensor(feature["input_ids"])
            mask[row, :size] = 1
            labels[row, :size] = torch.as_tensor(feature["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def last_answer(labels: list[int]) -> tuple[int, int] | None:
    """The positions [start, end) of an example's last answer (the last run of labelled positions, its
    end of turn included), None when it has none. What comes before `start` is the prompt that
    evaluation by generation gives the model: the conversation up to the last assistant turn's
    first token, the template's generation prompt included."""
    end = len(labels)
    while end > 1 and labels[end - 1] == IGNORE:
        end -= 1
    if end <= 1:  # position 0 is predicted by nothing
        return None
    start = end - 1
    while start > 1 and labels[start - 1] != IGNORE:
        start -= 1
    return start, end


def stop_ids(tokenizer) -> list[int]:
    """The tokens generation stops at: EOS (or [SEP]), and the chat template's end of turn where the
    tokenizer has a template that ends turns with a special token (<|im_end|>, <|eot_id|>)."""
    found = [token for token in (tokenizer.eos_token_id if tokenizer.eos_token_id is not None
                                 else tokenizer.sep_token_id,) if token is not None]
    if getattr(tokenizer, "chat_template", None):
        try:
            found.append(end_of_turn_id(tokenizer, conversations.MESSAGES))
        except (UserError, Unlocatable):  # a template that cannot end a turn: text data never needs it
            pass
    return list(dict.fromkeys(found))
