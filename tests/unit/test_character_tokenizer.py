"""--tokenizer characters (models/character_tokenizer.py): BERT's tokenizer with one WordPiece token a
character, so that a model built from a config has a vocabulary of 381 instead of 30,522 tokens."""

import pytest
from effitrain.errors import UserError
from effitrain.models import character_tokenizer, loading

LLAMA = "llama:hidden_size=16,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2,intermediate_size=32"


@pytest.fixture(scope="module")
def tokenizer():
    return character_tokenizer.character_tokenizer()


def test_one_token_a_character_of_printable_ascii_and_latin_1(tokenizer):
    assert len(tokenizer) == 5 + 2 * 188 == 381  # specials, then each character at a word's start and inside one
    assert len(set(character_tokenizer.CHARACTERS)) == 188 and " " not in character_tokenizer.CHARACTERS
    assert tokenizer.convert_ids_to_tokens(tokenizer("Café 116").input_ids) == \
        ["[CLS]", "C", "##a", "##f", "##é", "1", "##1", "##6", "[SEP]"]


def test_addition_written_digit_by_digit_is_one_token_a_digit_as_with_wordpiece(tokenizer):
    default = loading.load_text_tokenizer(loading.ModelSource(None))
    for text in ("4 4 + 7 2 =", "1 1 6"):
        ids = tokenizer(text).input_ids
        assert tokenizer.convert_ids_to_tokens(ids) == default.convert_ids_to_tokens(default(text).input_ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_decoding_gives_the_text_back_up_to_bert_spacing_and_unknown_characters(tokenizer):
    assert tokenizer.decode(tokenizer("Hello, World! 42x").input_ids, skip_special_tokens=True) == "Hello, World! 42x"
    assert tokenizer.convert_ids_to_tokens(tokenizer("a b€c d").input_ids)[1:-1] == ["a", "[UNK]", "d"]
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id) == \
        (0, 1, 2, 3)


def test_a_model_from_a_config_takes_it_and_a_pretrained_model_refuses_it(tmp_path):
    source = loading.resolve_source(LLAMA, tokenizer="characters")
    assert len(loading.load_text_tokenizer(source)) == 381
    saved = tmp_path / "tok"
    character_tokenizer.character_tokenizer().save_pretrained(saved)
    from_folder = loading.load_text_tokenizer(loading.resolve_source(LLAMA, tokenizer=str(saved)))
    assert len(from_folder) == 381 and from_folder("116").input_ids == [2, 5 + 16, 5 + 188 + 16, 5 + 188 + 21, 3]
    with pytest.raises(UserError, match="--model default is pretrained"):
        loading.resolve_source("default", tokenizer="characters")


def test_plan_counts_its_vocabulary(capsys):
    """plan --tokenizer: the embedding and head of 381 rows, not the config's default 32,000."""
    from effitrain import cli

    for extra, vocabulary in (([], 32000), (["--tokenizer", "characters"], 381)):
        assert cli.main(["plan", "--task", "causal-lm", "--model", LLAMA, "--json", "--optim", "adamw", *extra]) == 0
        import json

        parameters = json.loads(capsys.readouterr().out)["parameters"]
        blocks = 16 * 16 * 4 + 3 * 16 * 32 + 2 * 16 + 16  # attention, MLP, the two norms, the final norm
        assert parameters == blocks + 2 * vocabulary * 16  # untied embedding and head
