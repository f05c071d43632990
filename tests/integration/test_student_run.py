"""`train --student-layers`: a run trains the student, saves it as a plain model of that many layers, and resumes
it only with the same student (a must-match setting), bitwise."""

from __future__ import annotations

import json

import effitrain
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification


def test_a_student_run_saves_a_model_of_its_layers_and_resumes_only_as_the_same_student(tiny_model_dir, tmp_path,
                                                                                         cli_here):
    common = ["--model", tiny_model_dir, "--max-train-samples", 16, "--max-eval-samples", 8, "--batch-size", 4,
              "--max-steps", 4, "--save-every", 2, "--student-layers", 1]
    whole = cli_here("train", *common, "--output-dir", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    metrics = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert metrics["transforms"][0] == "student"
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "whole" / "model")
    assert saved.config.num_hidden_layers == 1 and len(saved.bert.encoder.layer) == 1
    teacher = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir)
    assert not torch.equal(saved.bert.encoder.layer[0].output.dense.weight,
                           teacher.bert.encoder.layer[0].output.dense.weight)  # trained from the teacher's layer 0

    stopped = cli_here("train", *common, "--output-dir", tmp_path / "stopped")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    (tmp_path / "stopped" / "metrics.json").unlink()  # as if killed after its step-2 checkpoint
    other = cli_here("train", *common[:-2], "--output-dir", tmp_path / "stopped", "--resume", "auto")
    assert other.returncode == 2 and "student_layers" in other.stderr, other.stderr[-3000:]
    resumed = cli_here("train", *common, "--output-dir", tmp_path / "stopped", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours, theirs = (load_file(tmp_path / run / "model" / "model.safetensors") for run in ("stopped", "whole"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)


def test_inspect_and_plan_show_the_student_train_builds(tiny_model_dir, cli_here):
    from effitrain import tasks
    from effitrain.models import loading, student

    built = student.make_student(tasks.get("sequence-classification").build_model(
        loading.ModelSource(tiny_model_dir), ["ham", "spam"], None), 1)
    count = sum(p.numel() for p in built.parameters())
    shown = cli_here("inspect", tiny_model_dir, "--student-layers", 1, "--json")
    assert shown.returncode == 0, shown.stderr[-3000:]
    inspected = json.loads(shown.stdout)
    assert inspected["student_layers"] == [0] and inspected["config"]["num_hidden_layers"] == 1
    assert inspected["parameters"]["total"] == count
    planned = cli_here("plan", "--model", tiny_model_dir, "--student-layers", 1, "--memory", "8GiB", "--json")
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert json.loads(planned.stdout)["parameters"] == count
    text = cli_here("inspect", tiny_model_dir, "--student-layers", 1)
    assert "student: 1 layer, the teacher's 0 (--student-layers)" in text.stdout


def test_a_causal_lm_student_trains_and_generates(tmp_path):
    """A 4-layer Llama teacher (one SFT step from a config) and its 2-layer student, evaluated by greedy
    generation through the KV cache (which each kept layer indexes by its new depth)."""
    settings = {"task": "causal-lm", "data": "addition", "max_train_samples": 16, "max_eval_samples": 4,
                "batch_size": 8, "precision": "fp32"}
    effitrain.train({**settings, "model": "llama:hidden_size=32,num_hidden_layers=4,num_attention_heads=2,"
                     "num_key_value_heads=2,intermediate_size=64,max_position_embeddings=64",
                     "output_dir": str(tmp_path / "teacher"), "max_steps": 1})
    effitrain.train({**settings, "model": str(tmp_path / "teacher" / "model"), "student_layers": 2,
                     "output_dir": str(tmp_path / "student"), "max_steps": 2})
    metrics = json.loads((tmp_path / "student" / "metrics.json").read_text())
    assert metrics["transforms"][0] == "student" and "exact_match" in metrics["test"]
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "student" / "model")
    assert saved.config.num_hidden_layers == 2 and len(saved.model.layers) == 2
