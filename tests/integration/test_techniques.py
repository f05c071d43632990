"""Efficiency techniques: optimizer state sizes, checkpointing, precision, accumulation, and every pair."""

import itertools
import json
import warnings

import effitrain
import pytest
import torch
from effitrain import tasks
from effitrain import optimizers
from effitrain.engine import precision
from effitrain.optimizers import measured_state
from effitrain.errors import UserError
from effitrain.runtime import devices

from conftest import read_jsonl, read_weights


def fake_step(optimizer, model):
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()


@pytest.fixture(scope="module")
def default_model():
    from effitrain.models import loading

    source = loading.ModelSource(loading.resolve("default"))
    return tasks.get("sequence-classification").build_model(source, ["ham", "spam"], None)


@pytest.mark.parametrize("name, low, high", [("adamw", 8.0, 8.01), ("adamw-8bit", 1.9, 2.2), ("adam-8bit", 1.9, 2.2),
                                             ("adafactor", 0.0, 1.0), ("sgd", 4.0, 4.0)])
def test_optimizer_state_bytes_per_parameter_on_the_default_model(default_model, name, low, high):
    optimizer = optimizers.build(name, default_model, 1e-5, 0.01)
    fake_step(optimizer, default_model)
    per_param = measured_state.state_bytes(optimizer) / sum(p.numel() for p in default_model.parameters())
    assert low <= per_param <= high


def test_torchao_is_the_8bit_fallback(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_bitsandbytes(name, *args, **kwargs):
        if name.startswith("bitsandbytes"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bitsandbytes)
    model = torch.nn.Linear(256, 256)
    optimizer = optimizers.build("adamw-8bit", model, 1e-3, 0.0)
    assert type(optimizer).__module__.startswith("torchao")
    fake_step(optimizer, model)
    assert measured_state.state_bytes(optimizer) / 256 / 257 <= 2.2  # codes are 1 byte, plus block scales


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_precision_on_a_cpu_is_bf16_where_it_has_native_bf16_and_says_why(monkeypatch, native_bf16):
    if torch.cuda.is_available() or devices.has_accelerator():
        pytest.skip("GPU machine")
    monkeypatch.delenv(precision.AUTO_ON_CPU, raising=False)
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: native_bf16)
    mixed, reason = precision.choose("auto")
    if native_bf16:
        assert mixed == "bf16" and reason.startswith("auto: bf16 autocast on this CPU") and "--precision fp32" in reason
    else:
        assert mixed == "no" and reason.startswith("auto: fp32 on a CPU without native bf16")
    monkeypatch.setenv(precision.AUTO_ON_CPU, "fp32")  # what the suite sets (conftest)
    assert precision.choose("auto") == ("no", f"auto: fp32 ({precision.AUTO_ON_CPU}=fp32)")


def test_fp16_on_a_cpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("GPU machine")
    with pytest.raises(UserError, match="--precision fp16 needs a CUDA GPU"):
        precision.choose("fp16")


def test_bf16_on_a_cpu_without_fast_bf16_warns_with_the_slowdown(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("GPU machine")
    monkeypatch.setattr(devices, "bf16_matmul_speedup", lambda: 1 / 80)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert precision.choose("bf16")[0] == "bf16"
    assert any("measured 80x slower than fp32" in str(w.message) for w in caught)


def small(tiny_model_dir, out, **overrides):
    values = dict(model=str(tiny_model_dir), output_dir=str(out), max_train_samples=48, max_eval_samples=16,
                  batch_size=8, max_steps=4, log_every=1, lr=1e-3, warmup_ratio=0.0, precision="fp32")
    values.update(overrides)
    return values


def test_gradient_checkpointing_leaves_every_step_loss_unchanged(tiny_model_dir, tmp_path):
    effitrain.train(small(tiny_model_dir, tmp_path / "plain"))
    metrics = effitrain.train(small(tiny_model_dir, tmp_path / "ckpt", gradient_checkpointing=True))
    assert metrics["gradient_checkpointing"] is True
    plain, ckpt = (read_jsonl(tmp_path / d / "log.jsonl") for d in ("plain", "ckpt"))
    for a, b in zip(plain, ckpt):
        if "split" not in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    first, second = read_weights(tmp_path / "plain"), read_weights(tmp_path / "ckpt")
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=1e-5, atol=1e-6)


def test_effective_batch_size_sets_the_accumulation(tiny_model_dir, tmp_path):
    by_size = effitrain.train(small(tiny_model_dir, tmp_path / "size", batch_size=4, effective_batch_size=8))
    effitrain.train(small(tiny_model_dir, tmp_path / "accum", batch_size=4, grad_accum=2))
    assert by_size["grad_accum"] == 2
    a, b = read_weights(tmp_path / "size"), read_weights(tmp_path / "accum")
    assert all(torch.equal(a[name], b[name]) for name in a)


TECHNIQUES = {
    "grad-accum": {"grad_accum": 2, "batch_size": 4},
    "checkpointing": {"gradient_checkpointing": True},
    "bf16": {"precision": "bf16"},
    "adafactor": {"optim": "adafactor"},
    "adamw-8bit": {"optim": "adamw-8bit"},
}


@pytest.mark.parametrize("pair", [p for p in itertools.combinations(TECHNIQUES, 2)
                                  if not {"adafactor", "adamw-8bit"} <= set(p)], ids="+".join)
def test_every_pair_of_techniques_trains(tiny_model_dir, tmp_path, pair):
    values = {}
    for technique in pair:
        values.update(TECHNIQUES[technique])
    metrics = effitrain.train(small(tiny_model_dir, tmp_path / "o", max_steps=3, **values))
    assert metrics["steps"] == 3 and metrics["train_loss"] is not None
    assert all(torch.isfinite(t).all() for t in read_weights(tmp_path / "o").values())
    assert json.loads((tmp_path / "o" / "metrics.json").read_text())["optimizer_state_bytes"] > 0


def nan_at(calls: set[int], monkeypatch):
    """Make the training loss non-finite on the given micro-batch calls (1-based)."""
    task = tasks.get("sequence-classification")
    real, seen = task.loss_sum, {"n": 0}

    def loss_sum(model, batch):
        loss = real(model, batch)
        if model.training:
            seen["n"] += 1
            if seen["n"] in calls:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(task, "loss_sum", loss_sum)


def test_a_nan_loss_is_skipped_counted_and_training_ends_normally(tiny_model_dir, tmp_path, monkeypatch):
    nan_at({3}, monkeypatch)
    metrics = effitrain.train(small(tiny_model_dir, tmp_path / "o", max_steps=5))
    assert metrics["skipped_steps"] == 1 and metrics["steps"] == 5
    records = read_jsonl(tmp_path / "o" / "log.jsonl")
    assert [r["step"] for r in records if r.get("skipped")] == [3]
    train = [r for r in records if "loss" in r and "split" not in r]
    assert all(r["loss"] == r["loss"] for r in train)  # no NaN reached the logged losses
    assert all(torch.isfinite(t).all() for t in read_weights(tmp_path / "o").values())


def test_too_many_bad_steps_in_a_row_stop_the_run_without_a_model(tiny_model_dir, tmp_path, monkeypatch):
    """The weights when it stops are those that gave the non-finite losses: not handed out as model/;
    the run's log and checkpoints stay to look at."""
    nan_at({3, 4, 5}, monkeypatch)
    with pytest.raises(UserError, match="3 steps in a row had a non-finite loss .* no model was saved"):
        effitrain.train(small(tiny_model_dir, tmp_path / "o", max_steps=8, max_bad_steps=3, save_every=2))
    assert not (tmp_path / "o" / "model").exists() and (tmp_path / "o" / "checkpoints" / "step-2").is_dir()
    assert sum("skipped" in r for r in read_jsonl(tmp_path / "o" / "log.jsonl")) == 3
