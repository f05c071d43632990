import shutil

import pytest
import torch
from effitrain import tasks
from effitrain.errors import UserError
from effitrain.models import loading

CLASSIFY = tasks.get("sequence-classification")


def load_classifier(path, labels):
    """A pretrained directory with a head sized for `labels`: the builder `effitrain train` uses."""
    return CLASSIFY.build_model(loading.ModelSource(path), labels, processor=None)


def test_default_resolves_to_the_packaged_checkpoint():
    path = loading.resolve("default")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_local_directory_resolves(tiny_model_dir):
    assert loading.resolve(str(tiny_model_dir)) == tiny_model_dir


@pytest.mark.parametrize("name, needle", [
    ("./no/such/dir", "is not a directory"),
    ("nobody/no-such-model", "not a local directory nor in the Hugging Face cache"),
])
def test_unknown_models_are_user_errors(name, needle):
    with pytest.raises(UserError, match=needle):
        loading.resolve(name)


def test_directory_without_safetensors_is_refused(tiny_model_dir, tmp_path):
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match="only pickle weights"):
        loading.resolve(str(tmp_path))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        loading.resolve(str(tmp_path))


def test_head_is_sized_and_named_from_the_labels(tiny_model_dir):
    model = load_classifier(tiny_model_dir, ["neg", "neu", "pos"])
    assert model.config.num_labels == 3
    assert model.config.id2label == {0: "neg", 1: "neu", 2: "pos"}
    assert model.config.label2id == {"neg": 0, "neu": 1, "pos": 2}
    assert model.classifier.out_features == 3


def test_parameter_counts(tiny_model_dir):
    model = load_classifier(tiny_model_dir, ["a", "b"])
    model.bert.pooler.dense.weight.requires_grad_(False)
    counts = loading.parameter_counts(model)
    emb = model.bert.embeddings
    expected_embedding = sum(m.weight.numel() for m in (emb.word_embeddings, emb.position_embeddings,
                                                        emb.token_type_embeddings))
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["trainable"] == counts["total"] - 32 * 32
    assert counts["embedding"] == expected_embedding


def test_meta_model_has_the_real_shapes_without_memory(tiny_model_dir):
    meta = CLASSIFY.build_on_meta(loading.load_config(tiny_model_dir))
    real = load_classifier(tiny_model_dir, ["a", "b"])
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert loading.parameter_counts(meta) == loading.parameter_counts(real)


def test_model_without_a_classification_head_is_refused(tmp_path):
    from transformers import ViTConfig

    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1).save_pretrained(tmp_path / "vit")
    with pytest.raises(UserError, match="model type `vit` has no sequence-classification head"):
        load_classifier(tmp_path / "vit", ["a", "b"])


def test_pickle_weights_are_refused_unless_allowed_and_then_load(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    torch.save(load_file(str(tiny_model_dir / "model.safetensors")), tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match="only pickle weights .*--allow-pickle"):
        loading.resolve(str(tmp_path))
    source = loading.resolve_source(str(tmp_path), allow_pickle=True)
    tokenizer = CLASSIFY.load_processor(loading.ModelSource(tiny_model_dir))
    model = CLASSIFY.build_model(source, ["a", "b"], tokenizer)
    expected = load_file(str(tiny_model_dir / "model.safetensors"))
    torch.testing.assert_close(model.bert.embeddings.word_embeddings.weight,
                               expected["bert.embeddings.word_embeddings.weight"])


def test_inspect_builds_the_model_of_the_task_it_is_asked_for(tmp_path, capsys):
    """`inspect --task causal-lm` shows a causal LM (it used to build a classifier whatever the task)."""
    import json

    from effitrain.cli import main
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "lm")
    assert main(["inspect", str(tmp_path / "lm"), "--task", "causal-lm", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    expected = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100))
    assert shown["parameters"] == loading.parameter_counts(expected)
    assert main(["inspect", str(tmp_path / "lm"), "--task", "sequence-classification", "--json"]) == 0
    classifier = json.loads(capsys.readouterr().out)["parameters"]
    assert classifier["total"] != shown["parameters"]["total"]


@pytest.mark.parametrize("spec, needle", [
    ("bert:hidden_size=abc", "`hidden_size` must be a whole number, got 'abc'"),
    ("bert:hidden_size=2.5", "`hidden_size` must be a whole number, got 2.5"),
    ("bert:num_hidden_layers=-1", "`num_hidden_layers` must be > 0, got -1"),  # would build zero layers
    ("bert:num_attention_heads=0", "`num_attention_heads` must be > 0"),
    ("nosuchtype:a=1", "unknown model type `nosuchtype`"),
])
def test_model_specs_with_bad_values_are_refused(spec, needle):
    with pytest.raises(UserError, match=needle):
        loading.resolve_source(spec)


def test_shapes_that_do_not_fit_are_refused_before_building():
    config = loading.resolve_source("bert:hidden_size=30,num_attention_heads=4").config
    with pytest.raises(UserError, match="does not build a BertForSequenceClassification: The hidden size \\(30\\)"):
        CLASSIFY.check_supported(config)


def test_negative_sizes_in_a_config_file_are_refused(tiny_model_dir, tmp_path):
    import json

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": -2}))
    with pytest.raises(UserError, match="`num_hidden_layers: -2`, which must be >= 0"):
        CLASSIFY.check_supported(loading.load_config(tmp_path / "m"))


def test_unknown_model_type_in_a_directory_is_named_before_any_tokenizer(tiny_model_dir, tmp_path):
    import json

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "nosuchmodel"}))
    with pytest.raises(UserError, match="model_type `nosuchmodel`, which transformers .* does not know"):
        loading.resolve(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="is not a valid JSON file"):
        loading.resolve(str(tmp_path / "m"))


def test_a_model_of_another_kind_is_named_before_its_processor(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification

    ViTForImageClassification(ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                        intermediate_size=8)).save_pretrained(tmp_path / "vit")
    with pytest.raises(UserError, match="model type `vit` has no sequence-classification head"):
        CLASSIFY.load_processor(loading.ModelSource(tmp_path / "vit"))  # not "has no tokenizer"


def test_a_local_path_typo_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "runs" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="model path runs/modle does not exist \\(the folder runs does\\).*model"):
        loading.resolve("runs/modle")


@pytest.mark.parametrize("spec, limit", [
    ("bert:max_position_embeddings=64", 64),
    ("gpt2:n_positions=32", 32),
    ("roberta:max_position_embeddings=66", 64),  # positions start after the padding index
    ("llama:max_position_embeddings=16", None),  # rotary: no hard limit
])
def test_position_limits(spec, limit):
    config = loading.resolve_source(spec).config
    assert loading.position_limit(config) == limit
    if limit is not None:
        loading.check_length(config, limit, "--max-length")
        with pytest.raises(UserError, match=f"--max-length {limit + 1} is longer than the {limit} positions"):
            loading.check_length(config, limit + 1, "--max-length")


@pytest.mark.skipif(__import__("os").geteuid() == 0, reason="root reads folders whatever their mode")
def test_unreadable_model_folder_is_named(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m").chmod(0)
    try:
        with pytest.raises(UserError, match="cannot be read \\(permission denied\\)"):
            loading.resolve(str(tmp_path / "m"))
    finally:
        (tmp_path / "m").chmod(0o755)


def test_lora_on_gpt2_conv1d_warns_only_under_debug_and_its_gradients_are_right():
    """peft warns that it sets fan_in_fan_out for GPT-2's Conv1D (weights stored in x out); effitrain
    silences that message (runtime/libraries.KNOWN_HARMLESS) because the adapted layer computes
    x W + b + alpha/r x A^T B^T, with the gradients of that, as checked here against the formula."""
    import warnings
    from types import SimpleNamespace

    from effitrain.models import adapters
    from effitrain.runtime import libraries
    from transformers import GPT2Config, GPT2ForSequenceClassification

    def adapted(quiet: bool):
        torch.manual_seed(0)
        model = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=50,
                                                         pad_token_id=0))
        settings = SimpleNamespace(lora_r=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules="c_attn")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if quiet:
                libraries.quiet_known_warnings()
            model = adapters.apply(model, tasks.get("sequence-classification"), settings)
        return model, [str(w.message) for w in seen if "fan_in_fan_out" in str(w.message)]

    assert len(adapted(quiet=False)[1]) == 1  # what --debug shows
    model, said = adapted(quiet=True)
    assert said == []
    layer = model.base_model.model.transformer.h[0].attn.c_attn
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # (r, in), (out, r)
    with torch.no_grad():
        B.normal_()  # peft starts B at zero, which would hide a transposed update
    x, upstream = torch.randn(2, 5, 16), torch.randn(2, 5, 48)
    (layer(x) * upstream).sum().backward()
    a, b = A.detach().clone().requires_grad_(), B.detach().clone().requires_grad_()
    W, bias = layer.base_layer.weight, layer.base_layer.bias  # Conv1D: (in, out)
    expected = x @ W + bias + (8.0 / 4) * (x @ a.T @ b.T)
    torch.testing.assert_close(layer(x), expected)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(A.grad, a.grad)
    torch.testing.assert_close(B.grad, b.grad)
    assert A.grad.abs().sum() > 0 and B.grad.abs().sum() > 0


def test_only_the_known_harmless_library_warnings_are_silenced():
    """FSDP2's view-tensor warning: effitrain's step does no in-place op on a module's output, and FSDP
    training equals one process (tests/integration/test_sharding.py::
    test_fsdp_with_accumulation_equals_one_process_with_the_whole_batch, with and without LoRA)."""
    import warnings

    from effitrain.runtime import libraries

    view = ("FSDP2-wrapped module (GPT2Block) returned a view tensor. An in-place op on this view (e.g., `x += y`) "
            "will silently drop the pre-backward hook")
    peft = "fan_in_fan_out is set to False but the target module is `Conv1D`. Setting fan_in_fan_out to True."
    other = "fan_in_fan_out is set to True but the target module is `torch.nn.Linear`. Setting fan_in_fan_out to False."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        libraries.quiet_known_warnings()
        for message in (view, peft, other):
            warnings.warn(message, UserWarning)
    assert [str(w.message) for w in seen] == [other]
