"""The built-in `addition` (data/builtins.py): two-digit sums made in code, the same rows everywhere, each
unordered pair once, digit by digit (one WordPiece token a digit), and held-out splits that share no pair with
training, for SFT and for prompts alone."""

import hashlib
import json
import re

import pytest
from effitrain import tasks
from effitrain.config import TrainConfig
from effitrain.data import answers, builtins, conversations, sources
from effitrain.tasks.objectives.rewards import builtin_rewards

# sha256 of the rows as JSON: a change of the rows or their order anywhere changes it (and every split).
ROWS_SHA256 = "111c65f715ab757d1db09f68b51e185a4cab19f95f60f3ddc3a448b842a24bb3"


@pytest.fixture(scope="module")
def rows():
    return builtins.addition()["all"].to_dict()


def numbers(prompt: str) -> tuple[int, int]:
    first, second = re.fullmatch(r"(\d \d) \+ (\d \d) =", prompt).groups()
    return int(first.replace(" ", "")), int(second.replace(" ", ""))


def pair(prompt: str) -> frozenset:
    return frozenset(numbers(prompt))


def test_the_rows_are_the_same_everywhere(rows):
    assert hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest() == ROWS_SHA256
    assert list(rows) == ["prompt", "completion", "answer"]


def test_every_unordered_pair_once_with_its_sum(rows):
    assert len(rows["prompt"]) == 90 * 91 // 2  # {a, b} with 10 <= a <= b <= 99
    assert {pair(p) for p in rows["prompt"]} == {frozenset((a, b)) for a in range(10, 100) for b in range(a, 100)}
    for prompt, completion, answer in zip(rows["prompt"], rows["completion"], rows["answer"]):
        assert completion == answer == " ".join(str(sum(numbers(prompt))))  # "6 8", like the prompt's digits
    assert rows["prompt"][:2] == ["4 4 + 7 2 =", "2 1 + 7 1 ="] and rows["completion"][:2] == ["1 1 6", "9 2"]
    smaller_first = sum(a < b for a, b in map(numbers, rows["prompt"]))
    assert 0.45 < smaller_first / (len(rows["prompt"]) - 90) < 0.55  # both orders, 90 doubles aside
    assert rows["prompt"] != sorted(rows["prompt"])  # shuffled: --max-train-samples takes no low numbers only


def test_with_the_default_wordpiece_tokenizer_each_digit_is_one_token_and_sep_ends_the_answer(rows, tokenizer):
    """As SFT encodes each row (answers.encode): [CLS], the prompt's 6 tokens (4 digits, +, =), then the sum's
    digits one token each and [SEP], the loss on those alone: at most 4 new tokens. Decoded, the answer tokens
    are the `answer` text, so the exact-match reward on a right completion gives 1."""
    digit_ids = {tokenizer.convert_tokens_to_ids(str(d)): str(d) for d in range(10)}
    assert len(digit_ids) == 10 and tokenizer.unk_token_id not in digit_ids
    plus, equals = tokenizer.convert_tokens_to_ids(["+", "="])
    lengths = set()
    for prompt, completion, answer in zip(rows["prompt"], rows["completion"], rows["answer"]):
        encoded = answers.encode(tokenizer, {"prompt": prompt, "completion": completion},
                                 conversations.PROMPT_COMPLETION)
        ids = encoded.input_ids
        assert (ids[0], ids[3], ids[6], ids[-1]) == (tokenizer.cls_token_id, plus, equals, tokenizer.sep_token_id)
        first, second = numbers(prompt)
        assert "".join(digit_ids[i] for i in ids[1:3] + ids[4:6]) == f"{first}{second}"
        answer_ids = ids[7:]
        assert encoded.labels == [answers.IGNORE] * 7 + answer_ids  # the loss on the digits and [SEP] only
        assert "".join(digit_ids[i] for i in answer_ids[:-1]) == str(first + second)
        lengths.add(len(answer_ids))
        decoded = tokenizer.decode(answer_ids, skip_special_tokens=True)
        assert builtin_rewards.exact_match([decoded], answer=[answer]) == [1.0]
    assert lengths == {3, 4}  # 2 or 3 digits and [SEP]
    assert answers.stop_ids(tokenizer) == [tokenizer.sep_token_id]


@pytest.mark.parametrize("seed", [0, 42])
def test_held_out_pairs_are_never_trained_on_by_sft_nor_by_prompts_alone(seed):
    """The seeded split (--seed) puts each pair in one split; SFT's splits (prompt, completion) and those of
    prompts alone (every column kept, the `answer` for rewards) hold the same rows, so RL after SFT never
    trains on an SFT held-out pair either."""
    config = TrainConfig(task="causal-lm", data="addition", seed=seed)
    sft = tasks.get("causal-lm").load_data(config).splits
    assert sft["train"].column_names == ["prompt", "completion"]
    assert (len(sft["train"]), len(sft["validation"]), len(sft["test"])) == (3275, 410, 410)
    held = {name: {pair(p) for p in sft[name]["prompt"]} for name in sft}
    assert sum(map(len, held.values())) == 4095  # no pair twice within a split, none in two
    prompts = sources.load(config, lambda names, where: conversations.columns(names, "text", where, prompts_only=True),
                           bad_rows=conversations.bad_prompt_rows).splits
    assert prompts["train"].column_names == ["prompt", "completion", "answer"]
    assert conversations.of_prompts(prompts["train"], "addition") == conversations.PROMPT_ONLY
    for name in sft:
        assert list(prompts[name]["prompt"]) == list(sft[name]["prompt"])
        assert list(prompts[name]["answer"]) == list(sft[name]["completion"])
