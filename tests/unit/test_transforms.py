"""models/transforms.py: the one ordered pipeline. The model `train` builds (engine set-up) and the model
the memory planner simulates (meta device, fake tensors) come out of it with the same modules and the
same parameters, for every combination of the settings its conditions read."""

from __future__ import annotations

import itertools

import pytest
import torch
from effitrain import config as cfg
from effitrain import tasks
from effitrain.engine import setup
from effitrain.errors import UserError
from effitrain.models import adapters, loading, transforms
from effitrain.planning import planner, simulate

# What the planner leaves out by design: oneDNN linear layers (a CPU path for real tensors; on fake ones the
# same layer runs plain), and compile, which fake tensors do not run. The other speed-ups are simulated: they
# change which tensors a step holds (the default model's activations by -15%).
NOT_SIMULATED = ["onednn-linear", "compile"]
SPEED_UP_TYPES: dict = {}


def test_every_entry_says_why_it_sits_where_it_does_and_names_are_unique():
    names = [transform.name for transform in transforms.PIPELINE]
    assert len(names) == len(set(names)) and names[-1] == "compile"
    assert all(transform.why for transform in transforms.PIPELINE)


def test_skip_leaves_out_named_entries_and_refuses_unknown_names(tiny_model_dir):
    settings = transforms.Settings(tasks.get("sequence-classification"), gradient_checkpointing=True)
    model = tasks.get("sequence-classification").build_model(loading.ModelSource(tiny_model_dir), ["a", "b"], None)
    model, applied = transforms.apply_all(model, settings, skip={"first-token-head"})
    assert applied[0] == "fast-dropout" and "first-token-head" not in applied and "gradient-checkpointing" in applied
    assert "forward" not in vars(model.bert.encoder.layer[-1]) and model.is_gradient_checkpointing
    with pytest.raises(ValueError, match="no transform named"):
        transforms.apply_all(model, settings, skip={"fast dropout"})


def modules(model) -> list[tuple[str, str]]:
    return [(name, SPEED_UP_TYPES.get(type(module), type(module)).__qualname__)
            for name, module in model.named_modules()]


def parameters(model) -> list[tuple[str, tuple, bool]]:
    return [(name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()]


GRID = list(itertools.product(["fp32", "bf16"], [False, True], ["none", "lora"], [False, True], [False, True]))


@pytest.mark.parametrize("precision, checkpointing, peft, packing, compiled", GRID,
                         ids=["-".join(map(str, combination)) for combination in GRID])
def test_training_and_the_planner_build_the_same_model(tiny_model_dir, monkeypatch, precision, checkpointing, peft,
                                                       packing, compiled):
    try:
        config = cfg.build(None, {"model": str(tiny_model_dir), "precision": precision, "peft": peft,
                                  "gradient_checkpointing": checkpointing, "packing": packing, "compile": compiled})
    except UserError:
        pytest.skip("config validation refuses this combination")
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: None)  # the tree, not the graphs
    task, source, device = tasks.get(config.task), loading.resolve_source(config.model), torch.device("cpu")
    plan = setup.RunPlan(1, gradient_checkpointing=checkpointing, precision={"fp32": "no"}.get(precision, precision))
    trained, applied = setup.build_model(task, source, setup.Data(None, None, None, ["ham", "spam"]), plan, config, device)
    shapes = planner.model_shapes(config.task, config.model, 2, peft=adapters.Peft.of(config), packing=config.packing)
    _mode, planned = simulate._fake_model(config.task, shapes.config, checkpointing, shapes.peft, precision,
                                          shapes.packing)

    assert modules(trained) == modules(planned)
    assert parameters(trained) == parameters(planned)
    assert getattr(trained, "is_gradient_checkpointing", False) == planned.is_gradient_checkpointing == checkpointing
    assert ("compile" in applied) == compiled and ("adapters" in applied) == (peft != "none")
    simulated = transforms.chosen(simulate.settings(config.task, checkpointing, shapes.peft, shapes.packing))
    assert [t.name for t in simulated] == [name for name in applied if name not in NOT_SIMULATED]


def test_only_the_transforms_that_changed_the_model_are_listed():
    """The first-token head's condition holds on a decoder, which it leaves as it is: metrics.json's
    `transforms` does not name it there, and does on a sequence classifier."""
    from transformers import GPT2Config, GPT2LMHeadModel

    decoder = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    settings = transforms.Settings(tasks.get("causal-lm"))
    assert "first-token-head" in [t.name for t in transforms.chosen(settings)]
    _, applied = transforms.apply_all(decoder, settings)
    assert "first-token-head" not in applied and "fast-dropout" in applied
    from conftest import tiny_bert

    _, applied = transforms.apply_all(tiny_bert(), transforms.Settings(tasks.get("sequence-classification")))
    assert applied[:2] == ["fast-dropout", "first-token-head"]
