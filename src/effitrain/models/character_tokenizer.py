"""`--tokenizer characters`: one token a character, for a model built from a config. A tiny vocabulary
(381 tokens instead of the default WordPiece's 30,522) makes the embedding and the LM head a few
thousand weights: on toy tasks such as `addition` most of the step otherwise goes into a 30,522-way
softmax, and each sampled token is drawn from 30,522 choices.

It is BERT's tokenizer (transformers' BertTokenizer: same special tokens, same pre-tokenizer, same
decoding) with a WordPiece vocabulary of single characters, so everything that works with the default
tokenizer works with it: spaces separate words and are not tokens ("4 4 + 7 2 =" is six tokens, as with
WordPiece), a word is its characters ("116" is `1 ##1 ##6` and decodes back to "116"), case is kept.
Printable ASCII and Latin-1 have a token; a word with another character is [UNK] whole (WordPiece's
rule)."""
from __future__ import annotations

from effitrain.config import CHARACTER_TOKENIZER as NAME  # noqa: F401 (loading.py reads it here)
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # BERT's, in BertTokenizer's default order
# Printable ASCII without the space, then Latin-1's printable characters without the soft hyphen (which
# BERT's normaliser drops).
CHARACTERS = tuple(chr(code) for code in (*range(0x21, 0x7F), *range(0xA1, 0x100)) if code != 0xAD)


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens, each character starting a word, each character inside one (##c)."""
    tokens = [*SPECIAL_TOKENS, *CHARACTERS, *(f"##{c}" for c in CHARACTERS)]
    return {token: index for index, token in enumerate(tokens)}


def character_tokenizer():
    from transformers import BertTokenizer

    return BertTokenizer(vocab=vocabulary(), do_lower_case=False, tokenize_chinese_chars=False, strip_accents=False)
