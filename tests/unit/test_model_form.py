"""The model's form (models/adapters/model_form.py): chosen once from --peft, and what the engine and the model
card call instead of asking whether a model is adapted: what model/ and best/ hold, what they put back, the
size of the adapter, the advice when training diverged, the card's words."""

import types

import pytest
import torch

from effitrain import tasks
from effitrain.config import TrainConfig
from effitrain.models import adapters
from effitrain.models.adapters import AdaptedModel, PlainModel, form_of

from conftest import tiny_bert


@pytest.mark.parametrize("settings, form", [
    (TrainConfig(), PlainModel()), (TrainConfig(peft="lora"), AdaptedModel("lora")),
    ({"peft": "qlora"}, AdaptedModel("qlora")), ({"peft": "none"}, PlainModel()), ({}, PlainModel()),
    (adapters.Peft("lora"), AdaptedModel("lora")), (None, PlainModel()),
])
def test_the_form_is_chosen_from_the_settings(settings, form):
    assert form_of(settings) == form


@pytest.mark.parametrize("peft", ["none", "lora", "qlora"])
def test_a_run_is_adapted_exactly_when_the_adapters_transform_applies(peft):
    config = TrainConfig(peft=peft)
    assert isinstance(form_of(config), AdaptedModel) == (adapters.Peft.of(config) is not None)


def card_config(**values) -> dict:
    return {**TrainConfig(**values).to_dict()}


def test_the_card_words_and_the_divergence_advice():
    plain, lora, qlora = PlainModel(), AdaptedModel("lora"), AdaptedModel("qlora")
    assert plain.card_tags() == [] and plain.card_technique(card_config()) is None and plain.card_note({}) == ""
    assert lora.card_tags() == ["lora"] and qlora.card_tags() == ["qlora"]
    assert lora.card_technique(card_config(peft="lora")) == "lora (r 8, alpha 16.0, dropout 0.0, targets all-linear)"
    note = lora.card_note(card_config(peft="lora"))
    assert note.startswith("These weights are the lora adapter merged into the base;")
    assert "4-bit NF4 base" in qlora.card_note(card_config(peft="qlora"))
    config = TrainConfig(peft="lora", lr=2e-4)
    assert plain.non_finite_fix(config, "") == "lower --lr, use --precision fp32, or check the data for extreme values"
    assert lora.non_finite_fix(config, " or --beta (x)").startswith(
        "lower --lr (0.0002 now) or --beta (x) or --lora-alpha (alpha/r = 16/8 scales the adapters' updates)")


def fake_run(model):
    """What the form reads of the engine's Run: one process, the strategy's base methods."""
    from effitrain.engine.strategies.strategy import Strategy

    accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True, device=torch.device("cpu"))
    whole = Strategy.load_full_state_dict  # uses nothing of the strategy object
    strategy = types.SimpleNamespace(module_state_dict=lambda m: None,
                                     load_full_state_dict=lambda m, state: whole(None, m, state))
    return types.SimpleNamespace(accelerator=accelerator, model=model, strategy=strategy,
                                 task=tasks.get("sequence-classification"))


def test_an_adapted_models_trained_part_is_the_adapter_alone_and_comes_back(tmp_path):
    torch.manual_seed(0)
    model = adapters.apply(tiny_bert(), tasks.get("sequence-classification"), adapters.Peft("lora", lora_r=2))
    form, run = AdaptedModel("lora"), fake_run(model)
    form.write_trained(run, tmp_path)
    assert {path.name for path in tmp_path.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                         "config.json", "README.md"}
    saved = {name: value.clone() for name, value in adapters.adapter_state(model).items()}
    assert form.adapter_bytes(model) == sum(value.numel() * 4 for value in saved.values())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.add_(1.0)
    form.load_trained(run, tmp_path)
    assert all(torch.equal(value, saved[name]) for name, value in adapters.adapter_state(model).items())


def test_a_plain_models_trained_part_is_the_whole_model_and_comes_back(tmp_path):
    model = tiny_bert()
    run = fake_run(model)
    run.strategy.save_pretrained = lambda wrapped, folder: wrapped.save_pretrained(folder, safe_serialization=True)
    form = PlainModel()
    form.write_trained(run, tmp_path)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        model.classifier.weight.add_(1.0)
    form.load_trained(run, tmp_path)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert form.adapter_bytes(model) is None and form.folders_beside_model == ()
