"""model/README.md as the Hub reads it: metadata, model-index, the training procedure (no training here)."""

import pytest
from effitrain.config import TrainConfig
from effitrain.engine import model_card
from huggingface_hub import ModelCard


def result(**overrides) -> dict:
    values = {"test": {"loss": 3.2, "perplexity": 24.5, "token_accuracy": 0.31, "samples": 40, "tokens": 900},
              "validation": {"loss": 3.3, "perplexity": 27.1, "token_accuracy": 0.30, "samples": 40, "tokens": 880},
              "best": {"metric": "loss", "value": 3.3, "step": 20, "kept_in_model": True}, "grad_accum": 2,
              "world_size": 2, "steps": 20, "epochs": 1.5, "labels": None, "optimizer": "adamw", "precision": "bf16",
              "gradient_checkpointing": True, "parameters": {"trainable": 1000, "total": 100000},
              "trainable_share": 0.01, "device": "cpu", "wall_seconds": 12.5, "train_seconds": 9.0,
              "train_samples_per_second": 35.5, "peak_memory_bytes": 2**30, "pieces_per_micro_batch": 2,
              "examples": {"train": 300, "validation": 40, "test": 40}}
    return {**values, **overrides}


def facts() -> dict:
    return {"pipeline_tag": "text-generation", "is_text": True, "hardware": "Some CPU"}


@pytest.mark.parametrize("model, expected", [("default", "sentence-transformers/all-MiniLM-L6-v2"),
                                             ("gpt2", "gpt2"), ("org/name", "org/name"),
                                             ("gpt2:n_layer=2", None), ("./runs/x/model", None),
                                             ("/abs/model", None), ("a/b/c", None), ("config.json", None)])
def test_base_model_is_a_hub_id_or_nothing(model, expected):
    assert model_card.base_model(model) == expected


def test_a_lora_causal_lm_card():
    config = TrainConfig(model="gpt2", task="causal-lm", data="bbc-news", output_dir="runs/news", peft="qlora",
                         gradient_checkpointing=True, lr=1e-3).to_dict()
    card = ModelCard(model_card.render(config, result(), facts()))
    assert card.data.base_model == "gpt2" and card.data.pipeline_tag == "text-generation"
    assert card.data.datasets == ["SetFit/bbc-news"] and card.data.tags == ["effitrain", "qlora"]
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == {
        "Loss": 3.2, "Perplexity": 24.5, "Token accuracy": 0.31}  # counts are not metrics
    text = card.text
    assert "20 (1.5 epochs) of 16 x 2 x 2 process(es) = 64 examples per step" in text
    assert "gradient checkpointing" in text and "qlora (r 8, alpha 16.0" in text and "in 2 pieces" in text
    assert "NF4 base the adapter was trained over, dequantised to fp32" in text and "best validation loss (3.3000, step 20)" in text
    assert "| Perplexity | 27.1000 | 24.5000 |" in text and "max length 128" in text


def test_data_from_a_file_names_no_hub_dataset():
    config = TrainConfig(data="/data/mine.csv", output_dir="o").to_dict()
    card = ModelCard(model_card.render(config, result(test={"accuracy": 0.9}, validation={}, best={}),
                                       {**facts(), "pipeline_tag": "text-classification"}))
    assert card.data.datasets is None and card.data.eval_results[0].dataset_type == "mine.csv"
    assert "techniques: gradient checkpointing" in card.text and "| Accuracy | 0.9000 |" in card.text


def test_words_from_the_data_are_escaped_as_the_report_escapes_them():
    """Label names, the run's folder and file names come from the user's data: no HTML gets through, and
    Markdown's marks in them are taken literally (issue 28, item 8)."""
    config = TrainConfig(data="/data/we`ird <b>.csv", output_dir="runs/<i>x", model="./m_1").to_dict()
    labels = ["<script>alert(1)</script>", "a|b"]
    metrics = {"accuracy": 0.5, **{f"f1_{label}": 0.25 for label in labels}, "loss": 0.7, "samples": 4}
    card = ModelCard(model_card.render(config, result(test=metrics, validation={}, best={}, labels=labels),
                                       {**facts(), "pipeline_tag": "text-classification"}))
    text = card.text
    assert "<script>" not in text and "<i>" not in text
    assert "labels &lt;script&gt;alert(1)&lt;/script&gt;, a\\|b" in text and "# &lt;i&gt;x" in text
    assert "| F1 (a\\|b) | 0.2500 |" in text  # one cell, not two
    assert "- data: ``/data/we`ird <b>.csv``:" in text  # a code span shows HTML literally
    assert all(line.count("|") - line.count("\\|") == 3 for line in text.splitlines() if line.startswith("| F1"))


def test_a_path_with_line_breaks_stays_inside_its_code_span():
    """A blank line would end the code span's paragraph and let the rest be read as HTML (a live <img onerror>
    in model/README.md): line breaks and control characters are shown as escapes, on the span's one line."""
    config = TrainConfig(data="x\n\n<img src=x onerror=alert(1)>\r\x1b.csv", output_dir="o",
                         model="m\u2028<b>").to_dict()
    card = model_card.render(config, result(test={"accuracy": 0.9}, validation={}, best={}),
                             {**facts(), "pipeline_tag": "text-classification"})
    assert "- data: `x\\n\\n<img src=x onerror=alert(1)>\\r\\x1b.csv`:" in card
    assert "- base model: `m\\u2028<b>`" in card
    assert not any(line.lstrip().startswith("<") for line in ModelCard(card).text.split("\n"))


def test_an_online_rl_card_states_every_setting_and_the_final_reward():
    config = TrainConfig(model="gpt2", task="causal-lm", data="addition", output_dir="runs/rl", rl="rloo",
                         num_generations=4, max_new_tokens=8, temperature=0.7, top_p=0.9, clip_epsilon_high=0.28,
                         kl_beta=0.04, mask_truncated=True, reward=["my_rewards.py:f`1", "exact-match"],
                         reward_weights=[2.0, 0.5]).to_dict()
    config["scale_rewards"] = None  # as a config built but not resolved: the objective's default (rloo's: none)
    rl = {"train_metrics": {"reward": 0.61234, "completion_length": 3.0},
          "test": {"loss": -0.5, "reward": 0.5, "samples": 40}, "validation": {"loss": -0.45, "reward": 0.45}}
    text = ModelCard(model_card.render(config, result(**rl), facts())).text
    assert ("- task: causal-lm, online RL: rloo, 4 completions per prompt of at most 8 tokens at temperature 0.7, "
            "top-p 0.9, rewards scaled by none, clip 0.2 (high 0.28), KL beta 0.04, truncated completions masked; "
            "rewards ``my_rewards.py:f`1`` x 2, `exact-match` x 0.5\n") in text  # rloo: no --loss-type
    assert ("Final reward (weighted): 0.6123 on the last logged window's sampled completions, 0.4500 greedy on "
            "the validation prompts, 0.5000 greedy on the test prompts.") in text
    sft = ModelCard(model_card.render({**config, "rl": None}, result(**rl), facts())).text
    assert "online RL" not in sft and "Final reward" not in sft


def test_a_students_card_says_it_is_one():
    config = TrainConfig(output_dir="o", student_layers=3).to_dict()
    card = ModelCard(model_card.render(config, result(test={"accuracy": 0.9}, validation={}, best={}),
                                       {**facts(), "pipeline_tag": "text-classification"}))
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"  # what it was made from
    assert "base model: `default` (sentence-transformers/all-MiniLM-L6-v2); trained as a student of 3 of its " \
        "layers" in card.text
    assert "student" not in ModelCard(model_card.render(TrainConfig(output_dir="o").to_dict(), result(test={
        "accuracy": 0.9}, validation={}, best={}), {**facts(), "pipeline_tag": "text-classification"})).text


def test_a_distilled_students_card_names_its_teacher_and_how_many_layers_of_how_many():
    config = {**TrainConfig(output_dir="o", student_layers=3).to_dict(), "distill_from": "runs/spam/model",
              "distill_alpha": 0.3, "distill_temperature": 4.0}
    made = {"layers": 3, "of": 6, "kept": [0, 2, 4]}
    card = ModelCard(model_card.render(config, result(test={"accuracy": 0.9}, validation={}, best={}, student=made),
                                       {**facts(), "pipeline_tag": "text-classification"}))
    assert "trained as a student of 3 of its 6 layers (layers 0, 2, 4), evenly spaced" in card.text
    assert "- distilled from the teacher `runs/spam/model` (--distill-from): " in card.text
    assert "alpha 0.3, T 4;" in card.text
    plain = ModelCard(model_card.render(TrainConfig(output_dir="o").to_dict(), result(test={"accuracy": 0.9},
                                        validation={}, best={}), {**facts(), "pipeline_tag": "text-classification"}))
    assert "distilled" not in plain.text
