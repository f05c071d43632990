"""Evaluation by generation (tasks/generation.py): each example's prompt and reference answer read from
its labels, batched left-padded greedy generation equal to one prompt at a time, the scores, and the
metrics over gathered outputs; over token ids, with the ChatML, Llama-3 and Qwen templates as data."""

import pytest
import torch
from effitrain import tasks
from effitrain.data import answers, conversations
from effitrain.tasks import generation

from test_answers import CONVERSATION, END_OF_TURN, TEMPLATES, bpe, with_template  # noqa: F401 (fixture)


def test_the_last_answer_is_the_last_run_of_labels():
    i = answers.IGNORE
    assert answers.last_answer([i, i, 5, 6, i, i, 7, 8, 9, i]) == (6, 9)
    assert answers.last_answer([i, 4, 5]) == (1, 3)
    assert answers.last_answer([3, 4, 5]) == (1, 3)  # position 0 is predicted by nothing
    assert answers.last_answer([i, i, i]) is None
    assert answers.last_answer([7, i]) is None


@pytest.mark.parametrize("name", TEMPLATES)
def test_prompt_is_the_conversation_before_the_last_answer_with_the_generation_prompt(bpe, name):
    """What generation is given is exactly what the template renders for the conversation without its
    last answer, with the generation prompt (what `predict` gives the model); the reference is that
    answer's tokens and its end of turn."""
    tokenizer = with_template(bpe, TEMPLATES[name])
    short = CONVERSATION[:3]
    rows = [answers.encode(tokenizer, {"messages": m}, conversations.MESSAGES) for m in (CONVERSATION, short)]
    batch = answers.collator(tokenizer.pad_token_id)([{"input_ids": r.input_ids, "labels": r.labels} for r in rows])
    prompts, references = generation.prompts_and_references(batch)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN[name])
    for messages, prompt, reference in zip((CONVERSATION, short), prompts, references):
        wanted = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=True)
        assert prompt == list(wanted["input_ids"])
        answer = messages[-1]["content"]
        assert tokenizer.decode(reference[:-1]).strip() == answer and reference[-1] == end
    assert answers.stop_ids(tokenizer) == [tokenizer.eos_token_id, end]


def test_scores_compare_texts_and_stops(bpe):
    tokenizer = with_template(bpe, TEMPLATES["chatml"])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    setting = generation.AnswerGeneration(tokenizer, [end], 8)
    four = tokenizer("It is four.", add_special_tokens=False)["input_ids"]
    six = tokenizer("Six, of course.", add_special_tokens=False)["input_ids"]
    generated = [four + [end], four, six + [end], tokenizer(" It is four. ", add_special_tokens=False)["input_ids"]]
    exact, stopped = generation.scores(generated, [four + [end]] * 4, setting)
    assert exact.tolist() == [True, True, False, True]  # special tokens skipped, spaces stripped
    assert stopped.tolist() == [True, False, True, False]
    assert generation.until_stop([5, 6, end, 9, end], [end]) == [5, 6, end]


def tiny_llama(vocabulary: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocabulary, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=128)).eval()


def test_left_padded_batch_generates_what_each_prompt_generates_alone(bpe):
    """Batched generation (prompts of different lengths, padded on the left) gives each prompt the
    tokens it gets alone, cut after the first stop id."""
    tokenizer = with_template(bpe, TEMPLATES["chatml"])
    model = tiny_llama(len(tokenizer))
    prompts = [list(tokenizer.apply_chat_template(CONVERSATION[:k], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]) for k in (2, 4, 1)]
    stops = [int(model(torch.tensor([prompts[0]])).logits[0, -1].argmax())]  # the first prompt stops at once
    setting = generation.AnswerGeneration(tokenizer, stops, 6)
    with torch.inference_mode():
        batched = generation.generate(model, prompts, setting)
        alone = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=stops,
                                pad_token_id=tokenizer.pad_token_id)[0, len(p):].tolist() for p in prompts]
    assert batched == [generation.until_stop(row, stops) for row in alone]
    assert batched[0] == stops and all(len(row) <= 6 for row in batched)


def test_metrics_are_shares_of_the_gathered_examples():
    task = tasks.get("causal-lm")
    outputs = (torch.tensor([2.0, 4.0, 6.0, 0.0]), torch.tensor([1, 2, 3, 2]), torch.tensor([1, 1, 3, 0]),
               torch.tensor([True, False, True, True]), torch.tensor([True, True, False, True]))
    metrics = task.metrics(outputs, None)
    assert metrics["loss"] == 12.0 / 8 and metrics["token_accuracy"] == 5 / 8 and metrics["samples"] == 4
    assert metrics["exact_match"] == 0.75 and metrics["end_of_turn_share"] == 0.75
    assert "exact_match" not in task.metrics(outputs[:3], None)  # text data: no answers generated


def test_a_prompt_is_one_user_message_for_a_model_trained_on_conversations(bpe, tmp_path):  # noqa: F811
    """predict --prompt: raw, as prompt-completion training tokenised prompts, unless the saved tokenizer
    records that the model learnt conversations; then rendered by the template as one user message with
    the generation prompt (what training put before every answer). The record survives save and load."""
    import types

    from effitrain.data import templates
    from transformers import AutoTokenizer

    task, options = tasks.get("causal-lm"), types.SimpleNamespace(max_length=None)
    tokenizer = with_template(bpe, TEMPLATES["chatml"])
    prompt = CONVERSATION[1]["content"]
    raw = [answers.prompt_ids(tokenizer, tokenizer(prompt)["input_ids"])]
    as_message = [list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"])]
    assert raw != as_message
    assert task.prediction_encodings([{"prompt": prompt}], tokenizer, options) == raw
    templates.record_format(tokenizer, conversational=True)
    tokenizer.save_pretrained(tmp_path / "chat")
    saved = AutoTokenizer.from_pretrained(tmp_path / "chat")
    assert templates.trained_on_conversations(saved)
    assert task.prediction_encodings([{"prompt": prompt}], saved, options) == as_message
    templates.record_format(saved, conversational=False)  # retrained on prompt-completion: raw again
    saved.save_pretrained(tmp_path / "plain")
    again = AutoTokenizer.from_pretrained(tmp_path / "plain")
    assert task.prediction_encodings([{"prompt": prompt}], again, options) == raw
