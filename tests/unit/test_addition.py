"""The built-in `addition` (data/builtins.py): two-digit sums made in code, the same rows everywhere, each
unordered pair once, and held-out splits that share no pair with training, for SFT and for prompts alone."""

import hashlib
import json
import re

import pytest
from effitrain import tasks
from effitrain.config import TrainConfig
from effitrain.data import builtins, conversations, sources

# sha256 of the rows as JSON: a change of the rows or their order anywhere changes it (and every split).
ROWS_SHA256 = "ccb954a595ddc18360676406cfe2156688a4c6cc8618ab423713dafd7cc0bd7f"


@pytest.fixture(scope="module")
def rows():
    return builtins.addition()["all"].to_dict()


def pair(prompt: str) -> frozenset:
    first, second = re.fullmatch(r"(\d\d)\+(\d\d)=", prompt).groups()
    return frozenset((int(first), int(second)))


def test_the_rows_are_the_same_everywhere(rows):
    assert hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest() == ROWS_SHA256
    assert list(rows) == ["prompt", "completion", "answer"]


def test_every_unordered_pair_once_with_its_sum(rows):
    assert len(rows["prompt"]) == 90 * 91 // 2  # {a, b} with 10 <= a <= b <= 99
    assert {pair(p) for p in rows["prompt"]} == {frozenset((a, b)) for a in range(10, 100) for b in range(a, 100)}
    for prompt, completion, answer in zip(rows["prompt"], rows["completion"], rows["answer"]):
        assert completion == answer == str(int(prompt[:2]) + int(prompt[3:5]))
    smaller_first = sum(int(p[:2]) < int(p[3:5]) for p in rows["prompt"])
    assert 0.45 < smaller_first / (len(rows["prompt"]) - 90) < 0.55  # both orders, 90 doubles aside
    assert rows["prompt"] != sorted(rows["prompt"])  # shuffled: --max-train-samples takes no low numbers only


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
