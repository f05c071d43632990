"""The optimizers of the `optimizers` extra (GaLore, APOLLO, schedule-free AdamW) and torch's Muon:
planned state bytes equal to their state tensors, bitwise resume, DDP equal to one process,
schedule-free's evaluated and saved weights, and a missing package said in one line."""

import json

import effitrain
import pytest
import torch
from effitrain import optimizers
from effitrain.models import blocks
from effitrain.optimizers import measured_state
from effitrain.planning import planner as plan
from test_distributed import torchrun

from conftest import as_flags, read_weights, tiny_bert, tiny_run

NEW = ["galore-adamw", "apollo-adamw", "muon", "schedule-free-adamw"]


def read_weights_of(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def steps(model, optimizer, count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


@pytest.mark.parametrize("name", NEW)
def test_state_bytes_equal_the_plan_and_survive_a_save(name):
    """The planner's arithmetic equals the bytes of the optimizer's own tensors (projections included);
    the state dict saved as accelerate does (weights_only load) continues bitwise."""
    import io

    model = tiny_bert(hidden_size=64, intermediate_size=128, vocab_size=500)
    optimizer = optimizers.build(name, model, 1e-3, 0.01, blocks=blocks.blocks(model))
    steps(model, optimizer, 2)
    shapes = [tuple(p.shape) for p in model.parameters()]
    matrices = [tuple(p.shape) for b in blocks.blocks(model) for p in b.parameters() if p.ndim == 2]
    assert plan.optimizer_state_bytes(name, shapes, matrices) == measured_state.state_bytes(optimizer)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    copy = tiny_bert(hidden_size=64, intermediate_size=128, vocab_size=500)
    copy.load_state_dict(model.state_dict())
    resumed = optimizers.build(name, copy, 1e-3, 0.01, blocks=blocks.blocks(copy))
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    steps(model, optimizer, 3, seed=2)
    steps(copy, resumed, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), copy.parameters()))


def test_low_rank_state_is_a_small_share_of_adamws_on_the_default_model():
    shapes = plan.model_shapes("sequence-classification", "default", num_labels=5)
    planner = plan.Planner(shapes, 128)
    adamw = planner.model_states("adamw")[2]
    for name in ("galore-adamw", "apollo-adamw"):
        assert planner.model_states(name)[2] <= 0.35 * adamw


class StopAt:
    """Ends a run after step `step` (its checkpoint written), as a kill would."""

    def __init__(self, step):
        self.step = step

    def on_save(self, state, path):
        if state.step == self.step:
            raise KeyboardInterrupt


@pytest.mark.parametrize("name", NEW)
def test_resumed_equals_uninterrupted_with_accumulation(tiny_model_dir, tmp_path, name):
    """6 steps of 4 x accumulation 2, validated every 2 steps (schedule-free switches its weights there):
    stopped after the checkpoint of step 3 and resumed, the weights equal the uninterrupted run's."""
    settings = lambda out: tiny_run(tiny_model_dir, out, optim=name, batch_size=4, grad_accum=2,  # noqa: E731
                                    save_every=3, eval_every=2, seed=3)
    effitrain.train(settings(tmp_path / "straight"))
    with pytest.raises(KeyboardInterrupt):
        effitrain.train(settings(tmp_path / "stopped"), callbacks=[StopAt(3)])
    effitrain.train({**settings(tmp_path / "stopped"), "resume": "auto"})
    straight, resumed = read_weights(tmp_path / "straight"), read_weights(tmp_path / "stopped")
    assert all(torch.equal(straight[key], resumed[key]) for key in straight)
    metrics = json.loads((tmp_path / "stopped" / "metrics.json").read_text())
    assert metrics["optimizer"] == name and metrics["steps"] == 6


# Muon orthogonalises each block matrix's update by Newton-Schulz in bf16: gradients equal to fp32 rounding
# (one process's sum vs all-reduced halves) round to bf16 alike but for a few elements, and each such flip
# (2^-8 of an element) moves the step's update by about one bf16 rounding of it. Over tiny_run's 6 steps the
# matrices may differ by ~6 x 2^-8 of their total movement; twice that is allowed (measured: at most 1.8%,
# EPYC with AVX-512 and under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, 2026-12-06). Steps on half
# the examples each, as without the all-reduce, put them 85-121% of their movement apart.
MUON_NEWTON_SCHULZ = 2 * 6 * 2**-8


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_two_processes_and_accumulation_equal_one(tiny_model_dir, tmp_path, name):
    """2 processes x 4 and 1 x 4 x accumulation 2 equal 1 x 8 to float tolerance (Muon's block matrices to
    bf16's, MUON_NEWTON_SCHULZ). GaLore: its projection is the SVD of the gradient,
    whose singular vectors turn within a group of close singular values at the gradients' rounding (one
    process's sum vs two all-reduced halves): the runs differ in the low digits of every matrix after 6
    steps (measured: 7e-3 on weights of 7e-2), so only its test loss is compared."""
    common = tiny_run(tiny_model_dir, tmp_path / "one", optim=name, warmup_ratio=0.0)
    start = read_weights_of(tiny_model_dir)
    result = torchrun(2, "train", *as_flags({**common, "batch_size": 4, "output_dir": tmp_path / "two"}))
    assert result.returncode == 0, result.stderr[-3000:]
    effitrain.train(common)
    effitrain.train({**common, "batch_size": 4, "grad_accum": 2, "output_dir": str(tmp_path / "accum")})
    one = read_weights(tmp_path / "one")
    for other in ("two", "accum"):
        if name == "galore-adamw":
            losses = [json.loads((tmp_path / d / "metrics.json").read_text())["test"]["loss"] for d in ("one", other)]
            assert losses[1] == pytest.approx(losses[0], rel=1e-2)
            continue
        weights = read_weights(tmp_path / other)
        for key in one:
            if name == "muon" and ".encoder.layer." in key and one[key].ndim == 2:
                moved, apart = (one[key] - start[key]).norm(), (weights[key] - one[key]).norm()
                assert apart <= MUON_NEWTON_SCHULZ * moved, (key, apart / moved)
            else:
                torch.testing.assert_close(weights[key], one[key], rtol=1e-5, atol=1e-5)


def test_muon_trains_a_model_whose_only_trained_tensors_are_block_matrices():
    """LoRA on a causal LM trains its adapters' matrices alone: Muon takes them all, and no empty AdamW is
    built (torch refuses one: "optimizer got an empty parameter list")."""
    model = tiny_bert()
    inside = {id(p) for b in blocks.blocks(model) for p in b.parameters() if p.ndim == 2}
    for p in model.parameters():
        p.requires_grad_(id(p) in inside)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = optimizers.build("muon", model, 1e-2, 0.0, blocks=blocks.blocks(model))
    steps(model, optimizer, 2)
    moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
    assert moved == [p.requires_grad for p in model.parameters()]


def test_schedule_free_evaluates_its_averaged_weights_and_trains_on_exactly_its_own():
    model = tiny_bert()
    optimizer = optimizers.build("schedule-free-adamw", model, 1e-2, 0.0)
    steps(model, optimizer, 3)
    y = [p.detach().clone() for p in model.parameters()]
    z = [optimizer.state[p]["z"] for p in model.parameters()]
    beta1 = optimizer.param_groups[0]["betas"][0]
    with optimizers.get("schedule-free-adamw").evaluated_weights(optimizer):
        for p, y_, z_ in zip(model.parameters(), y, z):
            assert torch.equal(p, torch.lerp(y_, z_, 1 - 1 / beta1))  # x, as schedulefree's eval() makes it
    assert all(torch.equal(p, y_) for p, y_ in zip(model.parameters(), y))  # y again, bit for bit
    assert optimizer.param_groups[0]["train_mode"]


def test_schedule_free_keeps_the_peak_lr_after_warm_up(tiny_model_dir, tmp_path):
    effitrain.train(tiny_run(tiny_model_dir, tmp_path, optim="schedule-free-adamw", warmup_ratio=0.5, log_every=1))
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines()) if "lr" in r]
    assert lrs == [pytest.approx(1e-3 * f) for f in (1 / 3, 2 / 3, 1, 1, 1, 1)]


def test_a_missing_package_is_one_line(cli_here, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "galore_torch" else real(name, *a))
    result = cli_here("train", "--optim", "galore-adamw", "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "effitrain: error: --optim galore-adamw needs the galore-torch package, which is not installed; "
        "fix: pip install 'effitrain[optimizers]'"]
    assert not (tmp_path / "run").exists()


# A new optimizer is one spec registered: here a test's own, before effitrain's config is imported (as a
# spec of optimizers/catalogue.py is), in a fresh process; nothing else is edited.
FAKE_OPTIMIZER = r'''
import contextlib, io, json, sys
from effitrain import optimizers
from effitrain.optimizers import state_sizes


def build(model, lr, weight_decay, betas, blocks):
    import torch

    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.5)


optimizers.register(optimizers.OptimizerSpec("fake-sgd", "fake-sgd (a test's own: SGD, momentum 0.5)", build=build,
                                             state_bytes=state_sizes.sgd, cpu_speed=0.5))
from effitrain import cli

shown = io.StringIO()
with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
    cli.main(["train", "--help"])
planned = io.StringIO()
with contextlib.redirect_stdout(planned):
    plan_code = cli.main(["plan", "--model", sys.argv[1], "--memory", "4GiB", "--json", "--precision", "fp32",
                          "--optim", "sgd", "--optim", "fake-sgd"])
train_code = cli.main(["train", *sys.argv[2:]])
print("RESULT", json.dumps({"help": " ".join(shown.getvalue().split()), "plan": json.loads(planned.getvalue()),
                            "plan_code": plan_code, "train_code": train_code}))
'''


def test_a_registered_spec_is_an_optimizer_that_train_plan_and_help_know(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    run = tiny_run(tiny_model_dir, tmp_path / "run", optim="fake-sgd", max_steps=2)
    out = subprocess.run([sys.executable, "-c", FAKE_OPTIMIZER, str(tiny_model_dir), *as_flags(run)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert "fake-sgd (a test's own: SGD, momentum 0.5)" in result["help"]  # --optim's help
    assert result["plan_code"] == 0 and result["train_code"] == 0
    rows = {(r["optimizer"], r["checkpointing"]): r for r in result["plan"]["rows"]}
    for checkpointing in (False, True):  # its state bytes (sgd's arithmetic) and its speed, from its spec
        fake, sgd = rows[("fake-sgd", checkpointing)], rows[("sgd", checkpointing)]
        assert fake["optimizer_states"] == sgd["optimizer_states"] > 0
        assert fake["relative_speed"] == pytest.approx(sgd["relative_speed"] * 0.5, abs=1e-3)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["optimizer"] == "fake-sgd" and metrics["steps"] == 2
    assert metrics["optimizer_state_bytes_per_param"] == 4.0  # the momentum the engine's built optimizer holds
