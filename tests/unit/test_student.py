"""models/student.py: a student of its teacher, DistilBERT's way (--student-layers). Its layer i is the teacher's
layer round(i * L / N) tensor for tensor, the rest is the teacher's, it computes what a model built by hand
from those tensors computes, plain transformers loads it back, and the planner plans exactly it."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
from effitrain import config as cfg
from effitrain import tasks
from effitrain.engine import setup
from effitrain.errors import UserError
from effitrain.models import loading, student, transforms
from effitrain.planning import planner
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, BertConfig,
                          BertForSequenceClassification, DistilBertConfig, DistilBertForSequenceClassification,
                          GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM)


def test_kept_layers_are_round_i_times_l_over_n_halves_up():
    assert student.kept_layers(6, 3) == [0, 2, 4]  # DistilBERT's choice
    assert student.kept_layers(12, 6) == [0, 2, 4, 6, 8, 10]
    assert student.kept_layers(6, 4) == [0, 2, 3, 5]  # 1.5 -> 2, 4.5 -> 5 (Python's round would give 4)
    assert student.kept_layers(7, 2) == [0, 4]  # 3.5 -> 4
    assert student.kept_layers(6, 1) == [0]
    assert student.kept_layers(5, 5) == [0, 1, 2, 3, 4]  # N = L: a copy
    for teacher in range(1, 25):
        for layers in range(1, teacher + 1):
            kept = student.kept_layers(teacher, layers)
            assert kept == [int(Fraction(i * teacher, layers) + Fraction(1, 2)) for i in range(layers)]
            assert kept == sorted(set(kept)) and kept[-1] < teacher
    for teacher, layers in ((3, 0), (3, 4)):
        with pytest.raises(ValueError):
            student.kept_layers(teacher, layers)


def bert(layers=6):
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=layers,
                                                    num_attention_heads=2, intermediate_size=32, num_labels=3)).eval()


def llama(layers=6):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1,
                         layer_types=["full_attention", "sliding_attention"] * (layers // 2), sliding_window=4)
    return LlamaForCausalLM(config).eval()


def gpt2(layers=5):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=layers, n_head=2, bos_token_id=0,
                                      eos_token_id=0)).eval()


def distilbert(layers=6):  # its own name for the count (n_layers), no _no_split_modules
    torch.manual_seed(0)
    return DistilBertForSequenceClassification(DistilBertConfig(vocab_size=50, dim=16, n_layers=layers, n_heads=2,
                                                                hidden_dim=32, num_labels=3)).eval()


# (the teacher, the prefix of its layers' parameter names, the student's layers)
MODELS = {"bert": (bert, "bert.encoder.layer.", 3), "llama": (llama, "model.layers.", 4),
          "gpt2": (gpt2, "transformer.h.", 2), "distilbert": (distilbert, "distilbert.transformer.layer.", 3)}
INPUT = torch.tensor([[1, 7, 3, 9, 4, 2, 8, 5]])


def teacher_name(name: str, prefix: str, kept: list[int]) -> str:
    """A student parameter's name in its teacher: layer i is the teacher's layer kept[i]."""
    if not name.startswith(prefix):
        return name
    index, _, rest = name[len(prefix):].partition(".")
    return f"{prefix}{kept[int(index)]}.{rest}"


@pytest.mark.parametrize("kind", MODELS)
def test_each_layer_is_its_teachers_and_the_rest_is_the_teachers(kind):
    make, prefix, layers = MODELS[kind]
    teacher = make()
    kept = student.kept_layers(teacher.config.num_hidden_layers, layers)
    made = student.make_student(copy.deepcopy(teacher), layers)
    theirs = dict(teacher.named_parameters())
    ours = dict(made.named_parameters())
    assert {teacher_name(name, prefix, kept) for name in ours} == \
        {name for name in theirs if not name.startswith(prefix) or int(name[len(prefix):].split(".")[0]) in kept}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[teacher_name(name, prefix, kept)]), name
    assert made.config.num_hidden_layers == layers and len(student.layer_list(made)[2]) == layers


def by_hand(teacher, layers: int):
    """The student built without models/student.py: the teacher's config with `layers` layers (and each kept
    layer's type), a fresh model from it, and the teacher's tensors copied in by name."""
    config = copy.deepcopy(teacher.config)
    kept = student.kept_layers(config.num_hidden_layers, layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[index] for index in kept]
    config.num_hidden_layers = layers
    model = type(teacher)(config).eval()
    prefix = next(prefix for _, prefix, _ in MODELS.values() if any(n.startswith(prefix) for n, _ in
                                                                     model.named_parameters()))
    state = teacher.state_dict()
    model.load_state_dict({name: state[teacher_name(name, prefix, kept)] for name in model.state_dict()})
    return model


@pytest.mark.parametrize("kind", MODELS)
def test_the_student_computes_what_a_truncated_model_built_by_hand_computes(kind):
    make, _, layers = MODELS[kind]
    teacher = make()
    expected = by_hand(teacher, layers)(INPUT).logits
    made = student.make_student(teacher, layers)
    assert torch.equal(made(INPUT).logits, expected)
    assert not torch.equal(make()(INPUT).logits, expected)  # the cut layers did change what it computes


@pytest.mark.parametrize("kind", MODELS)
def test_plain_transformers_loads_the_saved_student_back(kind, tmp_path):
    make, _, layers = MODELS[kind]
    made = student.make_student(make(), layers)
    made.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.num_hidden_layers == layers
    auto = AutoModelForSequenceClassification if "bert" in kind else AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path).eval()
    if kind == "distilbert":  # its own teacher, saved and loaded back, differs at float rounding too
        torch.testing.assert_close(loaded(INPUT).logits, made(INPUT).logits, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(loaded(INPUT).logits, made(INPUT).logits)
    if "bert" not in kind:  # generation through the KV cache, which each layer indexes by its (renumbered) depth
        assert [layer.layer_idx for layer in loaded.modules() if hasattr(layer, "layer_idx")] == \
            [layer.layer_idx for layer in made.modules() if hasattr(layer, "layer_idx")]
        generated = made.generate(INPUT, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(generated, loaded.generate(INPUT, max_new_tokens=4, do_sample=False, pad_token_id=0))
    if kind == "llama":
        # teacher layers 0, 2, 3, 5 of full, sliding, full, sliding, full, sliding
        assert config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]


def test_student_config_builds_the_students_shapes():
    teacher = llama()
    config = student.student_config(teacher.config, 4)
    assert teacher.config.num_hidden_layers == 6  # a copy
    built = LlamaForCausalLM(config)
    made = student.make_student(teacher, 4)
    assert [(n, p.shape) for n, p in built.named_parameters()] == [(n, p.shape) for n, p in made.named_parameters()]
    assert built.config.layer_types == made.config.layer_types


def test_refusals():
    with pytest.raises(UserError, match=r"--student-layers 7 is more than the 6 layers"):
        student.make_student(bert(), 7)
    scaled = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2,
                                        scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(UserError, match="scale_attn_by_inverse_layer_idx"):
        student.make_student(scaled, 1)

    class NoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = BertConfig(num_hidden_layers=2)
            self.linear = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match="are not one list of blocks"):
        student.make_student(NoLayers(), 1)
    with pytest.raises(UserError, match=r"--student-layers must be > 0, got 0"):
        cfg.check_value("student_layers", 0)
    source = loading.resolve_source("bert:num_hidden_layers=2,hidden_size=16,num_attention_heads=2")
    with pytest.raises(UserError, match="takes the layers of a pretrained model"):
        student.check_source(source, 1, tasks.get("sequence-classification").build_on_meta)


def test_the_pipeline_makes_the_student_first_before_the_adapters(tiny_model_dir):
    """LoRA's layers only on the student's layers: the student comes before every other entry."""
    task = tasks.get("sequence-classification")
    config = cfg.build(None, {"model": str(tiny_model_dir), "peft": "lora", "student_layers": 1})
    settings = transforms.of_run(config, setup.RunPlan(1, gradient_checkpointing=True), torch.device("cpu"), task)
    model = task.build_model(loading.ModelSource(tiny_model_dir), ["a", "b"], None)
    model, applied = transforms.apply_all(model, settings)
    assert applied[0] == "student" and "adapters" in applied and "gradient-checkpointing" in applied
    layers = model.get_base_model().bert.encoder.layer
    assert len(layers) == 1 and any("lora_A" in name for name, _ in layers[0].named_parameters())


def test_the_planner_plans_the_student_train_builds(tiny_model_dir):
    config = cfg.build(None, {"model": str(tiny_model_dir), "student_layers": 1})
    task, source = tasks.get(config.task), loading.resolve_source(config.model)
    trained, applied = setup.build_model(task, source, setup.Data(None, None, None, ["ham", "spam"]),
                                         setup.RunPlan(1), config, torch.device("cpu"))
    shapes = planner.model_shapes(config.task, config.model, 2, student_layers=1)
    assert applied[0] == "student" and trained.config.num_hidden_layers == shapes.config.num_hidden_layers == 1
    assert shapes.parameters == sum(p.numel() for p in trained.parameters())
    assert shapes.parameters < planner.model_shapes(config.task, config.model, 2).parameters
    with pytest.raises(UserError, match="more than the 2 layers"):
        planner.model_shapes(config.task, config.model, 2, student_layers=3)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_planner_plans_a_causal_lm_student(kind, tmp_path):
    make, _, layers = MODELS[kind]
    teacher = make()
    teacher.save_pretrained(tmp_path)
    shapes = planner.model_shapes("causal-lm", str(tmp_path), student_layers=layers)
    made = student.make_student(teacher, layers)
    assert shapes.parameters == sum(p.numel() for p in made.parameters())
    assert shapes.config.num_hidden_layers == layers
    assert getattr(shapes.config, "layer_types", None) == getattr(made.config, "layer_types", None)
