"""Prompts alone (online RL's data): a format only when the caller asks for it (data/conversations.py), its
row checks, and its batches (data/prompt_batches.py): the ids SFT put before an answer, padded on the left so
that batched greedy generation equals each prompt's alone, the other columns kept for the reward functions."""

import json

import pytest
import torch
from effitrain.config import TrainConfig
from effitrain.data import answers, conversations, prompt_batches, sources
from effitrain.errors import UserError

from test_answers import CONVERSATION, TEMPLATES, bpe, with_template  # noqa: F401 (fixture)
from test_generation import tiny_llama

USER = {"role": "user", "content": "What is two plus two?"}


# -- the format ------------------------------------------------------------------------------------------
def test_a_prompt_alone_is_refused_unless_the_caller_asks_for_prompts_only():
    with pytest.raises(UserError, match="has a `prompt` column but no `completion` column"):
        conversations.columns(["prompt", "answer"], "text", "d")
    assert conversations.columns(["prompt", "answer", "id"], "text", "d", prompts_only=True) == {
        "prompt": "prompt", "answer": "answer", "id": "id"}  # every column reaches the rewards
    assert conversations.columns(["answer", "prompt", "completion"], "text", "d", prompts_only=True) == {
        "prompt": "prompt", "answer": "answer", "completion": "completion"}
    with pytest.raises(UserError, match=r"^d has no `prompt` column \(columns: question, answer\)"):
        conversations.columns(["question", "answer"], "text", "d", prompts_only=True)


def test_prompts_are_strings_or_message_lists():
    from datasets import Dataset

    assert conversations.of_prompts(Dataset.from_dict({"prompt": ["1+1="]}), "d") == conversations.PROMPT_ONLY
    chat = Dataset.from_dict({"prompt": [[USER]]})
    assert conversations.of_prompts(chat, "d") == conversations.CHAT_PROMPT_ONLY
    with pytest.raises(UserError, match="column `prompt` holds neither text nor lists of {role, content}"):
        conversations.of_prompts(Dataset.from_dict({"prompt": [3]}), "d")


@pytest.mark.parametrize("prompt, problem", [
    ("  ", "row 2 has an empty prompt"),
    ([USER, {"role": "assistant", "content": "Four."}], "row 2 ends on an assistant turn"),
    ([{"role": "robot", "content": "Hi"}], "row 2 message 1 has the unknown role `robot`"),
    ([USER, {"role": "user", "content": " "}], "row 2 message 2 has no text content"),
    ([], r"row 2 is not a non-empty list of {role, content} messages.*give `prompt` as a list"),
])
def test_a_prompt_the_model_cannot_answer_is_refused_with_its_row_or_skipped(prompt, problem):
    from datasets import Dataset

    good = "1+1=" if isinstance(prompt, str) else [USER]
    data = Dataset.from_dict({"prompt": [good, prompt, good], "answer": ["2", "4", "2"]})
    with pytest.raises(UserError, match=problem + ".*or pass --skip-bad-rows"):
        conversations.bad_prompt_rows(data, "d", skip=False)
    assert conversations.bad_prompt_rows(data, "d", skip=True) == [1]


def test_prompts_alone_load_from_a_file_with_their_other_columns(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [USER], "answer": str(n), "level": n} for n in range(10)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = TrainConfig(task="causal-lm", data=str(path), validation_split=0.2, test_split=0.2)

    def columns(names, where):
        return conversations.columns(names, "text", where, prompts_only=True)

    splits = sources.load(config, columns, bad_rows=conversations.bad_prompt_rows).splits
    assert splits["train"].column_names == ["prompt", "answer", "level"]
    assert sorted(level for split in splits.values() for level in split["level"]) == list(range(10))
    path.write_text("".join(json.dumps({**row, "prompt": row["prompt"] + [{"role": "assistant", "content": "x"}]
                                        if row["level"] == 4 else row["prompt"]}) + "\n" for row in rows))
    with pytest.raises(UserError, match=f"--data {path}: row 5 ends on an assistant turn"):
        sources.load(config, columns, bad_rows=conversations.bad_prompt_rows)


# -- the batches -----------------------------------------------------------------------------------------
def test_string_prompts_get_the_ids_sft_put_before_the_completion_padded_on_the_left(tokenizer):
    """The default (WordPiece) tokenizer: [CLS] and the prompt, no [SEP] after it (it would say the text has
    ended); the shorter prompt padded with [PAD] on the left, its mask 0 there."""
    cls, pad = tokenizer.cls_token_id, tokenizer.pad_token_id
    first = [cls] + tokenizer.convert_tokens_to_ids(["23", "+", "45", "="])
    batch = prompt_batches.encode(tokenizer, [{"prompt": "23+45=", "answer": "68"}, {"prompt": "7=", "answer": "7"}])
    short = [cls] + tokenizer.convert_tokens_to_ids(["7", "="])
    assert batch.input_ids.tolist() == [first, [pad] * (len(first) - len(short)) + short]
    assert batch.attention_mask.tolist() == [[1] * 5, [0] * (5 - len(short)) + [1] * len(short)]
    assert batch.prompts == ["23+45=", "7="] and batch.columns == {"answer": ["68", "7"]} and batch.truncated == 0
    sft = answers.encode(tokenizer, {"prompt": "23+45=", "completion": "68"}, conversations.PROMPT_COMPLETION)
    start, _ = answers.last_answer(sft.labels)
    assert sft.input_ids[:start] == first  # what SFT trained the model to answer after


def test_message_prompts_are_rendered_with_the_generation_prompt_as_chat_sft_saw_them(bpe):  # noqa: F811
    tokenizer = with_template(bpe, TEMPLATES["chatml"])
    prompts = [CONVERSATION[:2], CONVERSATION[:4]]
    batch = prompt_batches.encode(tokenizer, [{"prompt": p, "id": i} for i, p in enumerate(prompts)])
    rendered = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    assert all(text.endswith("<|im_start|>assistant\n") for text in rendered)
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    width = len(ids[1])
    assert len(ids[0]) < width
    assert batch.input_ids.tolist() == [[tokenizer.pad_token_id] * (width - len(ids[0])) + ids[0], ids[1]]
    assert batch.attention_mask.sum(1).tolist() == [len(ids[0]), len(ids[1])]
    assert batch.prompts == prompts and batch.columns == {"id": [0, 1]}
    sft = answers.encode(tokenizer, {"prompt": CONVERSATION[:4], "completion": [CONVERSATION[4]]},
                         conversations.CHAT_PROMPT_COMPLETION)
    start, _ = answers.last_answer(sft.labels)
    assert sft.input_ids[:start] == ids[1]


def test_a_long_prompt_keeps_its_end_and_is_counted(bpe):  # noqa: F811
    long, short = "What is two plus two? And three plus three?", "Six"
    batch = prompt_batches.encode(bpe, [{"prompt": long}, {"prompt": short}], max_length=4)
    whole = bpe(long)["input_ids"]
    assert len(whole) > 4 and batch.input_ids[0].tolist() == whole[-4:] and batch.truncated == 1
    assert batch.attention_mask[1].tolist()[-len(bpe(short)["input_ids"]):] == [1] * len(bpe(short)["input_ids"])


def test_message_prompts_need_a_chat_template(bpe):  # noqa: F811
    with pytest.raises(UserError, match="chat template"):
        prompt_batches.encode(bpe, [{"prompt": [USER]}])
    with pytest.raises(ValueError, match="all strings or all message lists"):
        prompt_batches.encode(with_template(bpe, TEMPLATES["chatml"]), [{"prompt": "Hi"}, {"prompt": [USER]}])


@pytest.mark.parametrize("kind", ["strings", "messages"])
def test_a_batch_generates_for_each_prompt_what_it_generates_alone(bpe, kind):  # noqa: F811
    """Ready for generation: greedy continuations of the padded batch are each prompt's own."""
    tokenizer = with_template(bpe, TEMPLATES["chatml"])
    prompts = ([m["content"] for m in CONVERSATION[1:4]] if kind == "strings"
               else [CONVERSATION[:2], CONVERSATION[:4], CONVERSATION[1:2]])
    batch = prompt_batches.encode(tokenizer, [{"prompt": p} for p in prompts])
    assert len(set(batch.attention_mask.sum(1).tolist())) == 3  # three lengths: real padding
    model = tiny_llama(len(tokenizer))
    model.generation_config.eos_token_id = None  # five new tokens in every row: no stop to cut at
    options = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.inference_mode():
        together = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **options)
        width = batch.input_ids.shape[1]
        for row, mask, out in zip(batch.input_ids, batch.attention_mask, together):
            alone = row[mask.bool()].unsqueeze(0)
            assert model.generate(input_ids=alone, **options)[0, alone.shape[1]:].tolist() == out[width:].tolist()
