"""Evaluation by generation and prediction of chat models (issue 29, item 6): metrics.json's exact_match
and end_of_turn_share are those of generating each test prompt alone with plain transformers; `effitrain
evaluate` gives them again; `effitrain predict` renders JSONL `messages` with the saved template and stops
at the end of turn. The sms-spam-chat accuracy target is benchmarks/techniques/chat_accuracy.py (8 minutes)."""

import json

import effitrain
import pytest
import torch

TINY_LLAMA = ("llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
              "intermediate_size=64,max_position_embeddings=256")
CONVERSATIONS = [[{"role": "user", "content": f"Is {n} even?"}, {"role": "assistant", "content": ["yes", "no"][n % 2]}]
                 for n in range(40)]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatgen")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    result = effitrain.train({"model": TINY_LLAMA, "task": "causal-lm", "data": str(data), "chat_template": "chatml",
                              "output_dir": str(root / "run"), "batch_size": 8, "max_steps": 12, "lr": 3e-3,
                              "max_length": 32, "eval_batch_size": 3, "precision": "fp32", "test_split": 0.2})
    return root, result


def test_scores_are_those_of_plain_generation_one_prompt_at_a_time(chat_run):
    """Each test example's prompt generated alone (no padding) by plain transformers from model/,
    greedy, stopped at <|im_end|>, at most the longest reference answer's tokens: the same shares as the
    run's left-padded batches of 3."""
    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.data import sources
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, result = chat_run
    model_dir = root / "run" / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == end
    config = TrainConfig(task="causal-lm", data=str(root / "chat.jsonl"), test_split=0.2)
    test = sources.load(config, {"messages": "messages"}).splits["test"]
    answers = [tokenizer(m[-1]["content"], add_special_tokens=False)["input_ids"] + [end] for m in test["messages"]]
    longest = max(len(a) for a in answers)
    exact = stopped = 0
    with torch.no_grad():
        for messages in test["messages"]:
            prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"]
            new = model.generate(prompt, max_new_tokens=longest, do_sample=False)[0, prompt.shape[1]:].tolist()
            stopped += end in new
            exact += tokenizer.decode(new, skip_special_tokens=True).strip() == messages[-1]["content"]
    assert result["test"]["samples"] == len(test) == 8
    assert result["test"]["exact_match"] == exact / len(test)
    assert result["test"]["end_of_turn_share"] == stopped / len(test)
    assert 0 < result["test"]["end_of_turn_share"]  # it learnt to stop
    assert tasks.get("causal-lm").is_higher_better("exact_match")


def test_evaluate_gives_the_runs_test_metrics_again(chat_run, cli_here):
    root, result = chat_run
    out = cli_here("evaluate", "--model", root / "run" / "model", "--data", root / "chat.jsonl", "--precision",
                   "fp32", "--eval-batch-size", 5, "--test-split", 0.2)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads(out.stdout)
    for name in ("exact_match", "end_of_turn_share", "samples", "tokens"):
        assert metrics[name] == result["test"][name], name
    assert metrics["loss"] == pytest.approx(result["test"]["loss"], rel=1e-5)


def test_predict_renders_messages_with_the_saved_template_and_stops_at_the_end_of_turn(chat_run, cli_here):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _ = chat_run
    model_dir = root / "run" / "model"
    asked = [[{"role": "user", "content": f"Is {n} even?"}] for n in (3, 8, 120)]
    (root / "ask.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in asked))
    out = cli_here("predict", "--model", model_dir, "--input", root / "ask.jsonl", "--max-new-tokens", 20)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for line, messages in zip(lines, asked):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
        with torch.no_grad():
            new = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=end)[0, prompt.shape[1]:]
        assert line == {"messages": messages, "generated": tokenizer.decode(new, skip_special_tokens=True)}
        if end in new.tolist():  # stopped there: nothing generated after the end of turn
            assert new.tolist().index(end) == len(new) - 1


def test_text_data_keeps_loss_perplexity_and_token_accuracy(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"text": f"number {n} is {['even', 'odd'][n % 2]}"}) + "\n" for n in range(30)))
    result = effitrain.train({"model": TINY_LLAMA, "task": "causal-lm", "data": str(data), "max_steps": 1,
                              "batch_size": 8, "output_dir": str(tmp_path / "r")})
    assert set(result["test"]) == {"loss", "perplexity", "token_accuracy", "tokens", "samples"}
