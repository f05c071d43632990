"""Chat templates: the tokenizer's own, the built-in ChatML, or a Jinja file. A template is installed on
the tokenizer with the special tokens it uses, so that model/ saves it beside the vocabulary and
`apply_chat_template` on model/ gives the very token ids training saw."""

from __future__ import annotations

import re
from pathlib import Path

from effitrain.errors import UserError

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# name -> (template, its special tokens, the one that ends a turn)
BUILTIN = {"chatml": (CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>")}
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def read(value: str) -> str:
    """--chat-template's text: a built-in's, or a Jinja file's, checked to parse."""
    if value in BUILTIN:
        return BUILTIN[value][0]
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserError(f"--chat-template {value} is neither a built-in template ({', '.join(BUILTIN)}) nor a file",
                        "pass --chat-template chatml, or the path of a Jinja template file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--chat-template {value} cannot be read ({type(err).__name__})",
                        "pass a readable UTF-8 Jinja file")
    if not text.strip():
        raise UserError(f"--chat-template {value} is an empty file", "write the template into it, or pass "
                        "--chat-template chatml")
    check_parses(text, f"--chat-template {value}")
    return text


def check_parses(text: str, where: str) -> None:
    """Compiled as transformers compiles chat templates (its {% generation %} tag included), within
    chat_render's limits (Jinja's compiler computes constant expressions)."""
    import jinja2

    from effitrain.data import chat_render

    try:
        chat_render.compile_template(text)
    except jinja2.TemplateError as err:
        line = f"line {err.lineno}: " if getattr(err, "lineno", None) else ""
        raise UserError(f"{where} does not parse as a Jinja template ({line}{err.message or type(err).__name__})",
                        "fix the template's syntax ({{ ... }} for values, {% ... %} for statements)")
    except chat_render.TemplateLimit as err:
        raise UserError(f"{where} was stopped while it compiled: {err}", "fix the template (the constants it "
                        "computes), or pass --chat-template chatml") from None


def install(tokenizer, value: str) -> None:
    """--chat-template on the tokenizer; a built-in adds its special tokens where the tokenizer lacks
    them, and its end-of-turn token becomes the EOS of a tokenizer without one (generation stops there)."""
    tokenizer.chat_template = read(value)
    if value in BUILTIN:
        _, tokens, end_of_turn = BUILTIN[value]
        tokenizer.add_special_tokens({"extra_special_tokens": list(tokens)}, replace_extra_special_tokens=False)
        if tokenizer.eos_token is None:
            tokenizer.eos_token = end_of_turn


def require(tokenizer, model: str) -> str:
    """The tokenizer's template (one that conversations can be rendered with)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise UserError(f"the tokenizer of {model} has no chat template to render conversations with",
                        "pass --chat-template chatml (or the path of a Jinja template)")
    return template


def has_generation_blocks(template: str) -> bool:
    """Whether the template marks the assistant's tokens itself ({% generation %} ... {% endgeneration %})."""
    return bool(GENERATION_BLOCK.search(template))


def special_ids(tokenizer) -> set[int]:
    """The ids of special tokens: those an end of turn may be (<|im_end|>, <|eot_id|>, EOS)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


# Saved in tokenizer_config.json: the model learnt conversations, so `predict --prompt` renders a bare prompt as
# one user message (training never saw a prompt outside the template).
TRAINED_ON = "effitrain_trained_on"


def record_format(tokenizer, conversational: bool) -> None:
    """What the tokenizer (saved with model/, adapter/, best/) says the model was trained on: conversations,
    or not (a tokenizer from a model effitrain trained on conversations loses the mark)."""
    if conversational:
        tokenizer.init_kwargs[TRAINED_ON] = "conversations"
    else:
        tokenizer.init_kwargs.pop(TRAINED_ON, None)


def trained_on_conversations(tokenizer) -> bool:
    return getattr(tokenizer, "init_kwargs", {}).get(TRAINED_ON) == "conversations"
