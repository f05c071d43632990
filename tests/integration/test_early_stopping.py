"""Evaluation during training: the best evaluation's weights in best/, early stopping after exactly
`patience` evaluations without improvement, the same with 2 processes and after a kill + resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import effitrain
import pytest
import torch
from safetensors.torch import load_file
from test_distributed import HOOKED_CLI, torchrun

from conftest import as_flags, read_jsonl

WORDS = [("free cash prize now", "spam"), ("see you at lunch", "ham"), ("win a car text win", "spam"),
         ("ok thanks see you", "ham"), ("claim your reward now", "spam"), ("call me later at home", "ham")]


@pytest.fixture(scope="module")
def data(tiny_model_dir, tmp_path_factory):
    """Validation labels are the training labels inverted, and training starts from a model fitted to
    the validation labels (trained on the inverted data first): the more it learns the training data,
    the higher its validation loss, so the first evaluation is the best and every later one is worse
    (checked in the test, not assumed)."""
    root = tmp_path_factory.mktemp("early")
    flip = {"spam": "ham", "ham": "spam"}
    write = lambda name, rows: (root / name).write_text(  # noqa: E731
        "text,label\n" + "".join(f"{text},{label}\n" for text, label in rows))
    write("train.csv", WORDS * 6)
    write("inverted.csv", [(text, flip[label]) for text, label in WORDS] * 6)
    write("validation.csv", [(text, flip[label]) for text, label in WORDS] * 2)
    write("test.csv", WORDS * 2)
    effitrain.train({"model": str(tiny_model_dir), "data": str(root / "inverted.csv"),
                     "validation_file": str(root / "validation.csv"), "test_file": str(root / "test.csv"),
                     "batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.0, "max_steps": 60, "seed": 3,
                     "output_dir": str(root / "fitted")})
    return root


def settings(data, out, **overrides) -> dict:
    return {"model": str(data / "fitted" / "model"), "data": str(data / "train.csv"),
            "validation_file": str(data / "validation.csv"), "test_file": str(data / "test.csv"),
            "batch_size": 4, "lr": 1e-3, "warmup_ratio": 0.0, "max_steps": 30, "eval_every": 2,
            "early_stopping_patience": 2, "log_every": 1, "seed": 3, "output_dir": str(out), **overrides}


def validation_losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "log.jsonl") if r.get("split") == "validation"}


def best_weights(out) -> dict:
    return load_file(str(out / "best" / "model.safetensors"))


@pytest.fixture(scope="module")
def stopped(data, tmp_path_factory):
    """The run of the default settings (it stops early), for the tests that only read it: (folder, metrics)."""
    out = tmp_path_factory.mktemp("stopped") / "stopped"
    return out, effitrain.train(settings(data, out))


def test_stops_after_patience_evaluations_and_best_holds_that_evaluations_weights(data, stopped, tmp_path):
    out, metrics = stopped
    losses = validation_losses(out)
    assert list(losses) == [2, 4, 6]
    assert losses[2] < losses[4] < losses[6]  # the construction: worse after the first evaluation
    assert metrics["stopped_early"] and metrics["steps"] == 6
    assert metrics["best"] == {"metric": "loss", "value": losses[2], "step": 2, "kept_in_model": False}
    assert metrics["validation"]["loss"] == losses[6]  # model/ holds the final weights

    # The same run without early stopping, checkpointed at step 2: best/ is bitwise those weights.
    effitrain.train(settings(data, tmp_path / "straight", early_stopping_patience=None,
                             eval_every=None, save_every=2, keep_last=None))
    at_step_2 = load_file(str(tmp_path / "straight" / "checkpoints" / "step-2" / "model.safetensors"))
    best = best_weights(out)
    assert set(best) <= set(at_step_2)
    assert all(torch.equal(best[name], at_step_2[name]) for name in best)
    final = load_file(str(out / "model" / "model.safetensors"))
    assert not all(torch.equal(best[name], final[name]) for name in best)


def test_keep_best_puts_the_best_weights_in_model(data, tmp_path):
    metrics = effitrain.train(settings(data, tmp_path / "o", keep="best"))
    model = load_file(str(tmp_path / "o" / "model" / "model.safetensors"))
    best = best_weights(tmp_path / "o")
    assert metrics["best"]["kept_in_model"] and metrics["best"]["step"] == 2
    assert all(torch.equal(best[name], model[name]) for name in best)


def test_a_higher_is_better_metric_and_a_threshold(data, tmp_path):
    """Validation accuracy: larger is better; with a threshold of 1 nothing counts as an improvement."""
    metrics = effitrain.train(settings(data, tmp_path / "o", metric_for_best="accuracy",
                                       early_stopping_threshold=1.0))
    assert metrics["best"]["step"] == 2 and metrics["steps"] == 6 and metrics["best"]["metric"] == "accuracy"


def test_a_target_stops_at_the_first_evaluation_that_reaches_it(data, stopped, tmp_path, capsys):
    """--early-stopping-target without patience: the patience run's first validation loss as the target (loss:
    at most it) stops the same run at that evaluation, step 2, with model/ holding step 2's weights."""
    losses = validation_losses(stopped[0])
    metrics = effitrain.train(settings(data, tmp_path / "o", early_stopping_patience=None,
                                       early_stopping_target=losses[2]))
    assert metrics["stopped_early"] and metrics["steps"] == 2 and metrics["validation"]["loss"] == losses[2]
    assert f"early stopping at step 2: validation loss {losses[2]:.4f} reached --early-stopping-target" in \
        capsys.readouterr().out
    best = best_weights(stopped[0])  # the patience run's step-2 weights
    model = load_file(str(tmp_path / "o" / "model" / "model.safetensors"))
    assert all(torch.equal(best[name], model[name]) for name in best)


def test_two_processes_take_the_same_decisions(data, stopped, tmp_path):
    one_dir, single = stopped  # the same settings on one process
    values = settings(data, tmp_path / "two", batch_size=2)
    result = torchrun(2, "train", *as_flags(values))
    assert result.returncode == 0, result.stderr[-3000:]
    double = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert double["world_size"] == 2 and double["steps"] == single["steps"] == 6
    assert double["best"]["step"] == single["best"]["step"] == 2
    one, two = best_weights(one_dir), best_weights(tmp_path / "two")
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)


def test_a_killed_run_resumes_with_its_best_value_step_and_patience(data, tmp_path):
    """Killed after step 5: the evaluation at step 4 was no improvement (patience count 1), best at 2.
    The resumed run stops at 6 with the same best/ as the run never stopped, bitwise."""
    straight = effitrain.train(settings(data, tmp_path / "straight", save_every=1))
    out = tmp_path / "killed"
    values = settings(data, out, save_every=1)
    job = subprocess.Popen([sys.executable, HOOKED_CLI, "--save-pause", "0.5", "--", "train", *as_flags(values)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "checkpoints" / "step-5" / "trainer_state.json").exists():
        assert job.poll() is None and time.time() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.02)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert not (out / "metrics.json").exists()
    saved = json.loads((out / "checkpoints" / "step-5" / "trainer_state.json").read_text())
    assert (saved["best_step"], saved["evals_without_improvement"]) == (2, 1)

    resumed = effitrain.train({**values, "resume": "auto"})
    assert resumed["steps"] == straight["steps"] == 6 and resumed["stopped_early"]
    assert resumed["best"] == straight["best"]
    a, b = best_weights(tmp_path / "straight"), best_weights(out)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert validation_losses(out) == validation_losses(tmp_path / "straight")
