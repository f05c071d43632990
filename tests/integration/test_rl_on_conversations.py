"""Online RL on chat data (issue 44: `--rl` on sms-spam-chat's format, a `messages` column): one `--rl grpo` run
whose reward functions are given each conversation's turns before its answer as the prompt and that answer as
`answer` (the default exact-match reward scoring against it), and one `--rl distill --distill-from TEACHER` run
whose student samples from exactly those prompts, in process, with tiny Llamas from configs."""

import json

import effitrain
import pytest
import torch
from test_online_rl import TINY_LLAMA, step_records

from conftest import read_weights

# Records what it was given (the prompts and the `answer` column) and rewards the completion's length, so that
# groups have a spread.
RECORDER = '''
import json
from pathlib import Path

def seen(prompts, completions, answer, **kwargs):
    with open(Path(__file__).parent / "seen.jsonl", "a") as out:
        for prompt, expected in zip(prompts, answer):
            out.write(json.dumps([prompt, expected]) + "\\n")
    return [len(str(c)) / 10 for c in completions]
'''


def conversation(n: int) -> list[dict]:
    """sms-spam-chat's shape; a system turn on even rows and a first exchange on every third."""
    head = ([{"role": "system", "content": "Answer spam or ham."}] if n % 2 == 0 else []) + \
        ([{"role": "user", "content": f"hi {n}"}, {"role": "assistant", "content": "hello"}] if n % 3 == 0 else [])
    return head + [{"role": "user", "content": f"win {n} pounds now\n\nIs this message spam or ham?"},
                   {"role": "assistant", "content": ["spam", "ham"][n % 2]}]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": conversation(n)}) + "\n" for n in range(15)))
    return path


def expected_pairs() -> set[str]:
    return {json.dumps([conversation(n)[:-1], conversation(n)[-1]["content"]]) for n in range(15)}


def common(data, **more) -> dict:
    return {**dict(task="causal-lm", data=str(data), num_generations=2, max_new_tokens=3, batch_size=3, epochs=1,
                   lr=2e-3, warmup_ratio=0.0, log_every=1, precision="fp32", eval_batch_size=3, seed=1,
                   validation_split=0.2, test_split=0.2), **more}


def test_grpo_on_conversations_scores_each_prompt_against_its_last_turn(tmp_path, chat_data):
    """9 training rows, 3 a step: each is sampled twice and scored; validation and test (3 each) once greedily.
    Every (prompt, answer) a reward saw is a conversation less its answer, and that answer."""
    folder = tmp_path / "rewards"
    folder.mkdir()
    (folder / "record.py").write_text(RECORDER)
    metrics = effitrain.train(common(chat_data, model=TINY_LLAMA, rl="grpo", chat_template="chatml",
                                     reward=f"exact-match,{folder / 'record.py'}:seen",
                                     output_dir=str(tmp_path / "run")))
    lines = (folder / "seen.jsonl").read_text().splitlines()
    assert set(lines) <= expected_pairs() and len(set(lines)) == 15  # every row once somewhere, as cut by hand
    assert len(lines) == 9 * 2 + 3 + 3
    assert len(step_records(tmp_path / "run")) == 3
    assert {"exact_match", "reward_exact-match", "reward_seen"} <= set(metrics["test"])


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    """A 2-layer student and a 3-layer teacher (random weights) sharing one tokenizer with ChatML installed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from effitrain.data import templates
    from effitrain.models import loading

    tokenizer = loading.load_text_tokenizer(loading.resolve_source(TINY_LLAMA))
    templates.install(tokenizer, "chatml")
    folders = {}
    for name, layers, seed in (("student", 2, 5), ("teacher", 3, 11)):
        torch.manual_seed(seed)
        folders[name] = tmp_path_factory.mktemp(name)
        LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=layers,
                                     num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                                     max_position_embeddings=128, initializer_range=0.2)).save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


def test_on_policy_distillation_on_conversations_samples_their_prompts(tmp_path, chat_data, chat_models, monkeypatch):
    """The student's rollouts sample from the prompts cut from the conversations (what the objective holds), the
    teacher scores them (a positive kl each step), and the student moves."""
    from safetensors.torch import load_file

    from effitrain.tasks.online_rl import OnlineRL

    held = {}
    before_training = OnlineRL.before_training

    def spy(self, *args, **kwargs):
        held.update(self.prompt_data.columns)
        return before_training(self, *args, **kwargs)

    monkeypatch.setattr(OnlineRL, "before_training", spy)
    effitrain.train(common(chat_data, model=str(chat_models["student"]), rl="distill",
                           distill_from=str(chat_models["teacher"]), output_dir=str(tmp_path / "run")))
    assert {json.dumps([prompt, answer]) for prompt, answer in zip(held["prompt"], held["answer"])} == expected_pairs()
    records = step_records(tmp_path / "run")
    assert len(records) == 3 and all(record["kl"] > 0 for record in records)
    start, trained = load_file(str(chat_models["student"] / "model.safetensors")), read_weights(tmp_path / "run")
    assert any(not torch.equal(start[name], trained[name]) for name in trained)
