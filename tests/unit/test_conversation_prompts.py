"""Conversations as online RL's prompts (issue 44: `--rl` on sms-spam-chat): each row's prompt its turns before
its last (the assistant's answer), that answer's text its `answer` unless the data has one; conversations that
end otherwise refused by row; the held-out rows SFT's on the same data and seed; RL's prompt ids never SFT's
cached encoding (data/conversations.py, tasks/online_rl.py)."""

import json
import re

import pytest
from effitrain import tasks
from effitrain.config import TrainConfig
from effitrain.data import conversations
from effitrain.errors import UserError

from test_answers import TEMPLATES, bpe, with_template  # noqa: F401 (fixture)

TINY_LLAMA = ("llama:hidden_size=16,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2,"
              "intermediate_size=16,max_position_embeddings=512")
SYSTEM = {"role": "system", "content": "Answer with one word."}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def conversation(n: int) -> list[dict]:
    """Row n: a system turn on even rows, a first exchange on rows divisible by 3, then the question and its answer."""
    head = ([SYSTEM] if n % 2 == 0 else []) + ([user(f"Hi {n}"), assistant(f"Hello {n}")] if n % 3 == 0 else [])
    return head + [user(f"Is {n} even?"), assistant(["yes", "no"][n % 2])]


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def rl_config(data, **more) -> TrainConfig:
    return TrainConfig(model=TINY_LLAMA, task="causal-lm", rl="grpo", data=data, validation_split=0.2,
                       test_split=0.2, max_new_tokens=8, **more)


def load_rl(config):
    return tasks.for_config(config).load_data(config)


def by_id(splits) -> dict:
    return {row["id"]: row for split in splits.values() for row in split.to_list()}


def test_prompts_and_answers_cut_from_conversations_equal_hand_written_ones(tmp_path):
    data = write(tmp_path / "chat.jsonl", [{"messages": conversation(n), "id": n} for n in range(10)])
    loaded = load_rl(rl_config(data))
    assert loaded.splits["train"].column_names == ["prompt", "id", "answer"]  # the other columns kept
    assert loaded.skipped_rows == 0
    rows = by_id(loaded.splits)
    assert sorted(rows) == list(range(10))
    # written out by hand: row 0 has all three parts, row 3 the exchange, row 4 the system turn, row 1 neither
    assert rows[0] == {"id": 0, "answer": "yes",
                       "prompt": [SYSTEM, user("Hi 0"), assistant("Hello 0"), user("Is 0 even?")]}
    assert rows[3] == {"id": 3, "answer": "no", "prompt": [user("Hi 3"), assistant("Hello 3"), user("Is 3 even?")]}
    assert rows[4] == {"id": 4, "answer": "yes", "prompt": [SYSTEM, user("Is 4 even?")]}
    assert rows[1] == {"id": 1, "answer": "no", "prompt": [user("Is 1 even?")]}
    assert conversations.of_prompts(loaded.splits["train"], "d") == conversations.CHAT_PROMPT_ONLY


def test_an_answer_column_of_the_data_is_kept_not_replaced(tmp_path):
    data = write(tmp_path / "chat.jsonl", [{"messages": conversation(n), "answer": f"A{n}", "id": n}
                                           for n in range(10)])
    rows = by_id(load_rl(rl_config(data)).splits)
    assert {n: row["answer"] for n, row in rows.items()} == {n: f"A{n}" for n in range(10)}
    assert rows[1]["prompt"] == [user("Is 1 even?")]


def test_a_prompt_column_wins_over_messages_which_reach_the_rewards_as_they_are():
    assert conversations.prompt_only_columns(["messages", "prompt", "answer"], "d") == {
        "prompt": "prompt", "messages": "messages", "answer": "answer"}
    assert conversations.prompt_only_columns(["id", "messages"], "d") == {"messages": "messages", "id": "id"}


@pytest.mark.parametrize("bad, problem", [
    ([user("Is 4 even?")], "row 5 ends on a user turn (nothing for the model to answer there)"),
    ([SYSTEM, user("Is 4 even?"), assistant("yes"), user("Sure?")], "row 5 ends on a user turn"),
    ([assistant("yes")], "row 5 has no turn before its assistant answer (no prompt for the model to answer)"),
    ([user("Is 4 even?"), assistant("yes"), assistant("yes!")], "row 5 ends on two assistant turns"),
    ([user("Is 4 even?"), assistant("")], "row 5 has an empty completion"),
])
def test_a_conversation_that_is_no_prompt_and_answer_is_refused_with_its_row(tmp_path, bad, problem):
    rows = [{"messages": bad if n == 4 else conversation(n), "id": n} for n in range(10)]
    with pytest.raises(UserError, match=f"^--data .*: {re.escape(problem)}.*or pass --skip-bad-rows"):
        load_rl(rl_config(write(tmp_path / "chat.jsonl", rows)))


def test_skipped_bad_conversations_leave_the_held_out_rows_sfts(tmp_path):
    """A lone assistant turn SFT trains on (kept through the split, so the split is SFT's) and a conversation
    ending on the user that SFT refuses too: both left out, counted; every other row in SFT's split."""
    rows = [{"messages": conversation(n), "id": n} for n in range(20)]
    rows[5]["messages"], rows[11]["messages"] = [assistant("yes")], [user("Is 11 even?")]
    data = write(tmp_path / "chat.jsonl", rows)
    sft_config = TrainConfig(model=TINY_LLAMA, task="causal-lm", data=data, validation_split=0.2, test_split=0.2,
                             skip_bad_rows=True, seed=3)
    sft = tasks.for_config(sft_config).load_data(sft_config)
    loaded = load_rl(rl_config(data, skip_bad_rows=True, seed=3))
    assert loaded.skipped_rows == 2 and sft.skipped_rows == 1
    for name in ("train", "validation", "test"):
        wanted = [messages[:-1] for messages in sft.splits[name]["messages"] if messages != [assistant("yes")]]
        assert loaded.splits[name]["prompt"] == wanted, name


def test_the_held_out_rows_of_sms_spam_chat_are_sfts():
    """SFT on sms-spam-chat then RL on it (same seed) never trains on a held-out message: row for row."""
    sft_config = TrainConfig(task="causal-lm", data="sms-spam-chat", seed=7)
    sft = tasks.for_config(sft_config).load_data(sft_config).splits
    rl = load_rl(TrainConfig(model=TINY_LLAMA, task="causal-lm", rl="distill", distill_from="teacher",
                             data="sms-spam-chat", seed=7)).splits
    for name in ("train", "validation", "test"):
        assert rl[name]["prompt"] == [messages[:-1] for messages in sft[name]["messages"]], name
        assert rl[name]["answer"] == [messages[-1]["content"] for messages in sft[name]["messages"]], name
    assert set(rl["train"]["answer"]) == {"spam", "ham"}


def test_rl_prompt_ids_are_the_rendered_prompts_never_sfts_cached_encoding(tmp_path, bpe, monkeypatch):  # noqa: F811
    """SFT preprocesses the conversations first (its cached encoding written); RL's ids are each prompt rendered
    with the generation prompt, and RL reads nothing through the cache of preprocessed splits."""
    from effitrain.data import cache

    tokenizer = with_template(bpe, TEMPLATES["chatml"])
    data = write(tmp_path / "chat.jsonl", [{"messages": conversation(n)} for n in range(10)])
    sft_config = TrainConfig(model=TINY_LLAMA, task="causal-lm", data=data, validation_split=0.2, test_split=0.2)
    sft_task = tasks.for_config(sft_config)
    sft = sft_task.preprocess(sft_task.load_data(sft_config).splits, tokenizer, sft_config, None)
    config = rl_config(data)
    task = tasks.for_config(config)
    splits = task.load_data(config).splits
    monkeypatch.setattr(cache, "map_splits", lambda *args, **kwargs: pytest.fail("RL used the preprocessing cache"))
    encoded = task.preprocess(splits, tokenizer, config, None)
    for name in ("train", "validation", "test"):
        wanted = [tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"]
                  for prompt in splits[name]["prompt"]]
        assert encoded[name]["input_ids"] == wanted, name
        assert all(len(a) > len(b) for a, b in zip(sft[name]["input_ids"], encoded[name]["input_ids"]))
