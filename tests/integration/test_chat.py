"""Chat fine-tuning of a causal LM end to end (issue 29): the format said in the first line, the template
saved with the tokenizer so that model/ renders exactly the ids trained on, the built-in sms-spam-chat."""

import json

import effitrain
import pytest
import torch
from effitrain.data import answers, templates

from conftest import run_cli

TINY_LLAMA = ("llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
              "intermediate_size=64,max_position_embeddings=256")
CONVERSATIONS = [
    [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": f"Is {n} even?"},
     {"role": "assistant", "content": ["yes", "no"][n % 2]}, {"role": "user", "content": "Sure?"},
     {"role": "assistant", "content": f"Certain, {n} is {['even', 'odd'][n % 2]}."}]
    for n in range(24)
]


class Batches:
    """Keeps the training micro-batches (on_step_begin)."""

    def __init__(self):
        self.seen = []

    def on_step_begin(self, state, group):
        self.seen += [batch for batch in group if batch is not None]


def test_model_folder_renders_the_ids_trained_on(tmp_path):
    """Every training example's ids are what `apply_chat_template` on the saved tokenizer gives for its
    conversation, and its labels are its assistant turns with <|im_end|>."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    watch = Batches()
    effitrain.train({"model": TINY_LLAMA, "task": "causal-lm", "data": str(data), "chat_template": "chatml",
                     "output_dir": str(tmp_path / "run"), "batch_size": 4, "max_steps": 3, "lr": 1e-3,
                     "max_length": 96, "validation_split": 0.2, "test_split": 0.2}, callbacks=[watch])
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tmp_path / "run" / "model")
    end = saved.convert_tokens_to_ids("<|im_end|>")
    assert saved.eos_token == "<|im_end|>" and (tmp_path / "run" / "model" / "chat_template.jinja").is_file()
    assert templates.trained_on_conversations(saved)  # predict --prompt renders a prompt as a user message
    rendered = {tuple(saved.apply_chat_template(c)["input_ids"]): c for c in CONVERSATIONS}
    examples = 0
    for batch in watch.seen:
        for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
            ids, labels = ids[mask.bool()].tolist(), labels[mask.bool()].tolist()
            conversation = rendered[tuple(ids)]  # a KeyError is an example the saved template renders otherwise
            wanted = [saved(m["content"], add_special_tokens=False)["input_ids"] + [end]
                      for m in conversation if m["role"] == "assistant"]
            assert [label for label in labels if label != answers.IGNORE] == [t for w in wanted for t in w]
            examples += 1
    assert examples == 3 * 4
    from effitrain.commands.evaluate import evaluate

    csv = tmp_path / "spam.csv"  # classification data: a chat model's loss on it would be of raw text
    csv.write_text("text,label\n" + "".join(f"message {n},{['ham', 'spam'][n % 2]}\n" for n in range(10)))
    with pytest.raises(effitrain.UserError, match="the model was trained on conversations, and --data .* holds text"):
        evaluate(str(tmp_path / "run" / "model"), {"data": str(csv)})


def test_first_line_names_the_format_and_answer_cut_away_is_skipped(tmp_path):
    """sms-spam-chat, the built-in chat data: trains end to end; the first line says the format; with
    --skip-bad-rows the messages too long for any answer token are counted and left out."""
    result = run_cli("train", "--model", TINY_LLAMA, "--task", "causal-lm", "--data", "sms-spam-chat",
                     "--chat-template", "chatml", "--max-train-samples", 64, "--max-eval-samples", 16, "--max-steps",
                     2, "--batch-size", 8, "--max-length", 48, "--skip-bad-rows", "--output-dir", tmp_path / "run",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    first = result.stdout.splitlines()[0]
    assert "on sms-spam-chat (messages, chat template chatml, loss on the assistant turns)" in first
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.data import builtins, sources
    from effitrain.models.loading import default_model_dir
    from transformers import AutoTokenizer

    config = TrainConfig(task="causal-lm", data="sms-spam-chat", max_train_samples=64, max_eval_samples=16,
                         chat_template="chatml", max_length=48, skip_bad_rows=True)
    splits = sources.load(config, {"messages": "messages"}).splits
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    encoded = tasks.get("causal-lm").preprocess(splits, tokenizer, config, None)
    cut = sum(not answers.has_answer(labels) for split in encoded.values() for labels in split["labels"])
    assert cut > 0 and f"{cut} bad rows skipped" in first
    assert metrics["test"]["samples"] == 16 - sum(not answers.has_answer(x) for x in encoded["test"]["labels"])
    assert builtins.SPAM_QUESTION in splits["train"][0]["messages"][0]["content"]


def test_prompt_completion_strings_train_on_the_completion(tmp_path):
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Is {n} even?", "completion": ["yes", "no"][n % 2]}) + "\n"
                            for n in range(30)))
    watch = Batches()
    effitrain.train({"model": TINY_LLAMA, "task": "causal-lm", "data": str(data), "output_dir": str(tmp_path / "r"),
                     "batch_size": 8, "max_steps": 2}, callbacks=[watch])
    from effitrain.models.loading import default_model_dir
    from transformers import AutoTokenizer

    bert = AutoTokenizer.from_pretrained(str(default_model_dir()))  # a model from a config: the default tokenizer
    yes, no = (bert(word, add_special_tokens=False)["input_ids"] + [bert.sep_token_id] for word in ("yes", "no"))
    for batch in watch.seen:
        for labels in batch["labels"].tolist():
            assert [label for label in labels if label != answers.IGNORE] in (yes, no)
    assert torch.cat([b["labels"] for b in watch.seen]).ne(answers.IGNORE).sum() == sum(
        b["input_ids"].shape[0] for b in watch.seen) * 2


@pytest.mark.parametrize("loss_on, answer_only", [("completion", True), ("all", False)])
def test_loss_on_all_learns_every_token(tmp_path, loss_on, answer_only):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    watch = Batches()
    effitrain.train({"model": TINY_LLAMA, "task": "causal-lm", "data": str(data), "chat_template": "chatml",
                     "output_dir": str(tmp_path / "r"), "batch_size": 4, "max_steps": 1, "loss_on": loss_on},
                    callbacks=[watch])
    batch = watch.seen[0]
    learnt = batch["labels"] != answers.IGNORE
    assert bool((learnt == batch["attention_mask"].bool()).all()) is not answer_only
