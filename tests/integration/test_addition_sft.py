"""SFT on the built-in `addition` end to end (issue 43, item 7): a tiny Llama from a config trains on its
prompt-completion rows, and evaluation by generation reports exact match on the held-out sums, the same
numbers a greedy generation from the saved model over data/prompt_batches.py's batch of those prompts gives."""

import json

import effitrain
import torch
from effitrain.config import TrainConfig
from effitrain.data import answers, prompt_batches, sources

TINY_LLAMA = ("llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
              "intermediate_size=64,max_position_embeddings=64")


def test_sft_on_addition_reports_the_exact_match_of_its_greedy_answers(tmp_path):
    settings = {"task": "causal-lm", "data": "addition", "max_eval_samples": 12}
    effitrain.train({**settings, "model": TINY_LLAMA, "output_dir": str(tmp_path / "run"), "batch_size": 8,
                     "max_steps": 3, "lr": 3e-3, "precision": "fp32"})
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 3
    for split in ("validation", "test"):
        assert {"exact_match", "end_of_turn_share"} <= set(metrics[split]) and metrics[split]["samples"] == 12

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model").eval()
    test = sources.load(TrainConfig(**settings), {"prompt": "prompt", "completion": "completion"}).splits["test"]
    # Each answer is its digits, one WordPiece token each ("6 8"), and [SEP]; evaluation generates as many
    # new tokens as the longest answer holds.
    answer_lengths = [len(completion.split()) + 1 for completion in test["completion"]]
    assert metrics["test"]["tokens"] == sum(answer_lengths)
    batch = prompt_batches.encode(tokenizer, test.to_list())
    stops = answers.stop_ids(tokenizer)
    assert stops == [tokenizer.sep_token_id]
    with torch.inference_mode():
        out = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             max_new_tokens=max(answer_lengths), do_sample=False, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_token_id)
    new = [row[:row.index(stops[0]) + 1] if stops[0] in row else row
           for row in out[:, batch.input_ids.shape[1]:].tolist()]
    texts = [text.strip() for text in tokenizer.batch_decode(new, skip_special_tokens=True)]
    assert metrics["test"]["exact_match"] == sum(a == b for a, b in zip(texts, batch.columns["completion"])) / 12
    assert metrics["test"]["end_of_turn_share"] == sum(bool(row) and row[-1] in stops for row in new) / 12
