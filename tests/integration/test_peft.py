"""LoRA and QLoRA (--peft): what trains, what is saved, equivalences and resume under adapters."""

import json
import shutil
import signal
import sys

import effitrain
import pytest
import torch
from effitrain.commands.evaluate import evaluate
from effitrain.commands.predict import predict
from effitrain.errors import UserError
from effitrain.models import adapters
from effitrain.models.adapters import base_record
from test_distributed import TINY_GPT2, torchrun
from test_resume import read_log, resumed_here, train

from conftest import read_jsonl, read_weights, tiny_run


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A tiny BERT 64 wide: bitsandbytes' CPU 4-bit kernels need input widths that are multiples of 64."""
    from effitrain.models.loading import default_model_dir
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("tiny-bert-64")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def small(model, out, **overrides):
    values = dict(model=str(model), output_dir=str(out), max_train_samples=48, max_eval_samples=16, batch_size=8,
                  max_steps=4, log_every=1, lr=1e-2, warmup_ratio=0.0, precision="fp32", peft="lora",
                  lora_dropout=0.0)
    values.update(overrides)
    return values


def adapter_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_lora_trains_the_adapters_and_the_head_only_and_saves_both_forms(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    metrics = effitrain.train(small(tiny_model_dir, tmp_path / "o", max_steps=6))
    out = tmp_path / "o"
    counts = metrics["parameters"]
    head = 32 * 2 + 2  # the tiny BERT's classifier
    lora = 2 * (4 * 2 * 8 * 32 + 2 * 8 * (32 + 64)) + 8 * 64  # per layer q,k,v,o and the MLP's two; the pooler
    assert counts["trainable"] == head + lora and counts["total"] > 10 * counts["trainable"]
    # AdamW's two fp32 moments per trainable parameter (and a step counter per tensor): nothing for the body.
    assert 8 * counts["trainable"] <= metrics["optimizer_state_bytes"] <= 8 * counts["trainable"] + 4 * 64
    assert metrics["adapter_bytes"] == sum(t.numel() * 4 for t in adapter_weights(out).values())
    assert {p.name for p in out.iterdir()} >= {"model", "adapter", "metrics.json"}
    # The body's weights did not move; the head and every adapter did.
    before = read_weights_of(tiny_model_dir)
    merged = read_weights(out)
    assert torch.equal(merged["bert.embeddings.word_embeddings.weight"], before["bert.embeddings.word_embeddings.weight"])
    assert not torch.equal(merged["classifier.weight"], before["classifier.weight"])
    assert all(t.abs().sum() > 0 for name, t in adapter_weights(out).items() if "lora_B" in name)

    # model/ (merged, plain transformers) and PeftModel(base, adapter/) compute the same logits.
    inputs = {"input_ids": torch.randint(1000, 2000, (3, 12)), "attention_mask": torch.ones(3, 12, dtype=torch.long)}
    plain = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs).logits, adapted(**inputs).logits, rtol=1e-4, atol=1e-4)
    texts = [f"message {i} win a prize now" if i % 2 else f"see you at {i}" for i in range(12)]
    from_model = predict(str(out / "model"), texts)
    from_adapter = predict(str(out / "adapter"), texts)
    assert [p["label"] for p in from_model] == [p["label"] for p in from_adapter]
    for a, b in zip(from_model, from_adapter):
        assert a["score"] == pytest.approx(b["score"], abs=1e-4)


def read_weights_of(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("task, train_samples", [("sequence-classification", 18), ("causal-lm", 18)])
def test_lora_two_processes_and_accumulation_equal_one_big_batch(tiny_model_dir, tmp_path, task, train_samples):
    """(2 processes x 4 x accumulation 2) == (1 x 4 x 4) == (1 x 16) under LoRA, adapter dropout 0."""
    model = str(tiny_model_dir) if task == "sequence-classification" else TINY_GPT2
    common = dict(model=model, task=task, max_train_samples=train_samples, max_eval_samples=16, epochs=2, lr=1e-2,
                  warmup_ratio=0.0, log_every=1, eval_batch_size=16, peft="lora", lora_dropout=0.0, lora_r=4)
    flags = [arg for key, value in common.items() for arg in (f"--{key.replace('_', '-')}", value)]
    result = torchrun(2, "train", *flags, "--batch-size", 4, "--grad-accum", 2, "--output-dir", tmp_path / "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    effitrain.train({**common, "batch_size": 4, "grad_accum": 4, "output_dir": str(tmp_path / "accum")})
    effitrain.train({**common, "batch_size": 16, "output_dir": str(tmp_path / "single")})
    single, single_adapter = read_weights(tmp_path / "single"), adapter_weights(tmp_path / "single")
    assert any("lora_B" in name and t.abs().sum() > 0 for name, t in single_adapter.items())
    # AdamW divides each update by its own running gradient size: at the few weights whose gradient is near
    # zero, the rounding of another summation order grows to ~1e-6 (GPT-2's c_attn: 1.15e-6 on a Xeon with
    # AMX, 2026-12-04); a wrong accumulation moves every adapted weight by about the learning rate (1e-2).
    atol = 5e-6 if task == "causal-lm" else 1e-6
    for other in ("ddp", "accum"):
        weights, adapter = read_weights(tmp_path / other), adapter_weights(tmp_path / other)
        for name in single:
            torch.testing.assert_close(weights[name], single[name], rtol=1e-5, atol=atol)
        for name in single_adapter:
            torch.testing.assert_close(adapter[name], single_adapter[name], rtol=1e-5, atol=atol)
    runs = {d: json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("ddp", "single")}
    assert runs["ddp"]["world_size"] == 2 and runs["ddp"]["parameters"] == runs["single"]["parameters"]
    assert runs["ddp"]["test"]["loss"] == pytest.approx(runs["single"]["test"]["loss"], rel=1e-5)


def test_lora_with_gradient_checkpointing_trains_and_gives_the_same_losses(tiny_model_dir, tmp_path):
    """The trap of peft #137: with a frozen body, reentrant checkpointing trains nothing. Non-reentrant
    checkpointing gives the very losses of a run without it, and the adapters move."""
    effitrain.train(small(tiny_model_dir, tmp_path / "plain"))
    metrics = effitrain.train(small(tiny_model_dir, tmp_path / "ckpt", gradient_checkpointing=True))
    assert metrics["gradient_checkpointing"] is True
    plain, ckpt = (read_jsonl(tmp_path / d / "log.jsonl") for d in ("plain", "ckpt"))
    losses = [(a["loss"], b["loss"]) for a, b in zip(plain, ckpt) if "split" not in a]
    assert len(losses) == 4 and losses[0][0] != losses[-1][0]  # it learned
    for a, b in losses:
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    first, second = adapter_weights(tmp_path / "plain"), adapter_weights(tmp_path / "ckpt")
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=1e-5, atol=1e-6)
    assert all(t.abs().sum() > 0 for name, t in second.items() if "lora_B" in name)


def test_the_adapter_step_trains_as_peft_over_the_same_masks(tiny_model_dir, tmp_path, monkeypatch):
    """speedups/adapter_step.py's forward against peft's own, whose dropout draws the same masks (the
    transform gives every adapter speedups/dropout.py's Dropout): after 10 steps with adapter dropout,
    the same losses and adapter weights (float tolerance: the sums are made in another order)."""
    from effitrain.speedups import adapter_step

    values = dict(lora_dropout=0.3, max_steps=10, max_train_samples=80)
    fast = effitrain.train(small(tiny_model_dir, tmp_path / "fast", **values))
    monkeypatch.setattr(adapter_step, "forward", lambda layer, x, *args, **kwargs: type(layer).forward(layer, x))
    reference = effitrain.train(small(tiny_model_dir, tmp_path / "peft", **values))
    assert fast["steps"] == reference["steps"] == 10
    losses = [[r["loss"] for r in read_jsonl(tmp_path / d / "log.jsonl") if "split" not in r] for d in ("fast", "peft")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and len(set(losses[0])) > 1
    first, second = adapter_weights(tmp_path / "fast"), adapter_weights(tmp_path / "peft")
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=1e-5, atol=1e-6)


def test_a_killed_lora_run_resumes_bitwise(tiny_model_dir, tmp_path, cli_here):
    common = ["--model", tiny_model_dir, "--max-train-samples", 40, "--max-eval-samples", 16, "--batch-size", 4,
              "--epochs", 1, "--lr", 1e-2, "--log-every", 1, "--save-every", 3, "--seed", 7, "--peft", "lora",
              "--lora-dropout", 0.1]  # adapter dropout on: resuming must restore the RNG
    straight = cli_here("train", *common, "--output-dir", tmp_path / "straight")  # in this process
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "killed"
    job = train(*common, "--output-dir", out)  # a process of its own, to be killed
    import time

    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 5 for r in read_log(out)):
        assert job.poll() is None and time.time() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert "resumed from" in resumed_here(cli_here, *common, "--output-dir", out)  # in this process
    for read in (read_weights, adapter_weights):
        straight, resumed = read(tmp_path / "straight"), read(out)
        assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)

    # The checkpoint is of a LoRA run: resuming it without --peft is refused, nothing changed.
    (out / "metrics.json").unlink()
    before = (out / "config.yaml").read_text()
    no_peft = [a for a in common if a not in ("--peft", "lora", "--lora-dropout", 0.1)]
    refused = cli_here("train", *no_peft, "--output-dir", out, "--resume", "auto")  # in this process
    assert refused.returncode == 2 and "was made with peft='lora', this run has 'none'" in refused.stderr, \
        refused.stderr
    assert (out / "config.yaml").read_text() == before


def test_keep_best_under_lora_puts_the_best_adapter_back(tiny_model_dir, tmp_path):
    metrics = effitrain.train(small(tiny_model_dir, tmp_path / "o", max_steps=6, eval_every=2, keep="best",
                                    metric_for_best="loss"))
    best = metrics["best"]
    assert (tmp_path / "o" / "best" / "adapter_config.json").is_file()
    assert all(torch.equal(a, b) for a, b in zip(adapter_weights(tmp_path / "o").values(),
                                                 load_file_values(tmp_path / "o" / "best")))
    evaluated = evaluate(str(tmp_path / "o" / "model"), {"data": "sms-spam", "max_eval_samples": 16},
                                   split="validation")
    assert evaluated["loss"] == pytest.approx(best["value"], rel=1e-4)


def load_file_values(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors")).values()


def test_qlora_base_is_4bit_and_model_dir_is_the_function_that_was_trained(wide_model_dir, tmp_path):
    """QLoRA: the frozen linear layers are bitsandbytes 4-bit NF4 (double quantised), the head is not;
    model/ (the adapters merged into the dequantised base) gives the test loss the run measured."""
    metrics = effitrain.train(small(wide_model_dir, tmp_path / "q", peft="qlora", max_steps=6))
    assert metrics["peft"] == "qlora"
    evaluated = evaluate(str(tmp_path / "q" / "model"), {"data": "sms-spam", "max_eval_samples": 16})
    assert evaluated["loss"] == pytest.approx(metrics["test"]["loss"], rel=1e-4)
    config = json.loads((tmp_path / "q" / "model" / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model
    merged, full = read_weights(tmp_path / "q"), read_weights_of(wide_model_dir)
    query = "bert.encoder.layer.0.attention.self.query"
    adapter = adapter_weights(tmp_path / "q")
    update = 16 / 8 * (adapter[f"base_model.model.{query}.lora_B.weight"] @ adapter[f"base_model.model.{query}.lora_A.weight"])
    # merged = dequantised base + update: it differs from the full-precision merge by the 4-bit rounding
    # alone (NF4's widest gap between levels is 0.3 of a block's largest value).
    error = (merged[f"{query}.weight"] - full[f"{query}.weight"] - update).abs().max()
    assert 0 < error <= 0.16 * full[f"{query}.weight"].abs().max()


def test_qlora_loads_linear_layers_in_4bit(wide_model_dir):
    from bitsandbytes.nn import Linear4bit
    from effitrain import config as cfg
    from effitrain import tasks
    from effitrain.engine import setup
    from effitrain.models import loading

    config = cfg.build(None, {"model": str(wide_model_dir), "peft": "qlora"})
    task = tasks.get(config.task)
    source = loading.resolve_source(config.model)
    processor = task.load_processor(source)
    data = setup.Data(processor, None, None, ["ham", "spam"])
    plan = setup.RunPlan(1)
    model, _ = setup.build_model(task, source, data, plan, config, torch.device("cpu"))
    inner = model.get_base_model()
    assert isinstance(inner.bert.encoder.layer[0].attention.self.query.base_layer, Linear4bit)
    quant = inner.bert.encoder.layer[0].attention.self.query.base_layer.weight.quant_state
    assert quant.quant_type == "nf4" and quant.nested  # double quantisation
    assert not isinstance(inner.classifier.modules_to_save["default"], Linear4bit)
    assert all(p.requires_grad == ("lora_" in n or "modules_to_save" in n) for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def wide_gpt2_dir(tmp_path_factory):
    """A saved GPT-2 64 wide (its Conv1D layers: attn.c_proj square, 64 x 64), with the default tokenizer."""
    from effitrain.models.loading import default_model_dir
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("tiny-gpt2-64")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_embd=64, n_head=2, n_positions=64,
                               resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("task", ["causal-lm", "sequence-classification"])
def test_qlora_on_gpt2_trains_and_model_dir_is_the_function_that_was_trained(wide_gpt2_dir, tmp_path, task):
    """GPT-2's Conv1D layers (weight: inputs x outputs) are quantised by transformers as 4-bit linear layers
    (outputs x inputs). Was a traceback at the first step of a causal LM (the start-up check of the chunked
    loss ran the model in eval mode, which repacked the 4-bit weights for inference), and model/ held the
    square attn.c_proj transposed. Now model/ gives the test loss the run measured, and each merged Conv1D
    weight is the base plus the adapter's update in Conv1D's layout, off only by the 4-bit rounding."""
    out = tmp_path / "q"
    metrics = effitrain.train(small(wide_gpt2_dir, out, peft="qlora", task=task, max_length=32))
    evaluated = evaluate(str(out / "model"), {"data": "sms-spam", "max_eval_samples": 16, "precision": "fp32",
                                              "max_length": 32})
    assert evaluated["loss"] == pytest.approx(metrics["test"]["loss"], rel=1e-5)
    merged, full, adapter = read_weights(out), read_weights_of(wide_gpt2_dir), adapter_weights(out)
    for layer in ("transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_proj", "transformer.h.1.mlp.c_proj"):
        prefix = f"base_model.model.{layer}"
        update = 16 / 8 * (adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"])  # outputs x inputs
        base = full[f"{layer}.weight"]
        error = (merged[f"{layer}.weight"] - base - update.T).abs().max()
        assert update.abs().max() > 1e-3 and 0 < error <= 0.16 * base.abs().max(), layer  # NF4's widest gap: 0.3


def test_qlora_gradients_are_those_of_the_dequantised_model(wide_gpt2_dir):
    """The model training gets (after the start-up checks that run it in eval mode: chunked-lm-loss's)
    keeps bitsandbytes' training layout, so the gradient reaching a layer's input goes through the frozen
    4-bit weights too. Reference: the plain GPT-2 holding the merged weights (the adapters' B is zero at
    the start, so the same function); repacked for inference, the gradient missed the base's path."""
    from effitrain import config as cfg
    from effitrain import tasks
    from effitrain.engine import setup
    from effitrain.models import loading

    config = cfg.build(None, {"model": str(wide_gpt2_dir), "peft": "qlora", "task": "causal-lm", "lora_dropout": 0.0})
    task, source = tasks.get(config.task), loading.resolve_source(config.model)
    data = setup.Data(task.load_processor(source), None, None, None)
    model, applied = setup.build_model(task, source, data, setup.RunPlan(1), config, torch.device("cpu"))
    assert "chunked-lm-loss" in applied
    assert not any(getattr(getattr(m.weight, "quant_state", None), "packing_format_for_cpu", False)
                   for m in model.modules() if hasattr(m, "weight"))
    plain = task.auto_class.from_config(adapters.plain_config(model))
    plain.load_state_dict(adapters.merged_state_dict(model))
    ids = torch.randint(5, 1000, (2, 12))
    grads = []
    for net in (model, plain):
        net.train()
        embeds = net.get_input_embeddings()(ids).detach().requires_grad_()
        net(inputs_embeds=embeds, labels=ids).loss.backward()
        grads.append(embeds.grad)
    assert grads[1].abs().max() > 1e-4
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)


# -- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, needle", [
    ({"peft": "lora", "lora_r": 0}, "--lora-r must be >= 1"),
    ({"lora_r": 4}, "--lora-r applies to adapters, and --peft is none"),
    ({"lora_target_modules": "query"}, "--lora-target-modules applies to adapters"),
    ({"peft": "lora", "lora_dropout": 1.0}, "--lora-dropout must be in [0, 1)"),
    ({"peft": "lora", "lora_alpha": 0}, "--lora-alpha must be > 0"),
    ({"peft": "dora"}, "unknown --peft `dora`"),
])
def test_bad_peft_settings_are_refused_before_anything_loads(values, needle):
    from effitrain import config as cfg

    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        cfg.build(None, values)


def test_an_unknown_target_module_lists_the_linear_modules(tiny_model_dir, tmp_path):
    with pytest.raises(UserError) as err:
        effitrain.train(small(tiny_model_dir, tmp_path / "o", lora_target_modules="query,q_proj"))
    assert "`q_proj` is not a linear module of BertForSequenceClassification" in str(err.value)
    assert "pass some of dense, key, query, value" in str(err.value)
    with pytest.raises(UserError, match="`classifier` is the task's head, which is trained in full"):
        effitrain.train(small(tiny_model_dir, tmp_path / "o2", lora_target_modules="classifier"))
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()


def test_qlora_without_bitsandbytes_4bit_is_one_line(wide_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails, as where it is not installed
    with pytest.raises(UserError, match="--peft qlora needs bitsandbytes' 4-bit layers"):
        effitrain.train(small(wide_model_dir, tmp_path / "o", peft="qlora"))


def test_qlora_on_a_cpu_refuses_widths_its_kernels_get_wrong(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match=r"multiple of 64 \(bert.encoder.layer.0.attention.self.query: 32\)"):
        effitrain.train(small(tiny_model_dir, tmp_path / "o", peft="qlora"))
    assert not (tmp_path / "o").exists()


def test_qlora_on_a_model_built_from_a_config_is_refused(tmp_path):
    with pytest.raises(UserError, match="--peft qlora quantises pretrained weights"):
        effitrain.train(small(TINY_GPT2, tmp_path / "o", peft="qlora", task="causal-lm"))


def test_an_adapter_folder_names_the_task_class_not_the_base_class(tiny_model_dir):
    """A base checkpoint's config names its bare model (all-MiniLM's: BertModel); the adapter folder's
    config must name the task's class, or predict and evaluate cannot tell the task."""
    from effitrain import config as cfg
    from effitrain import tasks
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    model.config.architectures = ["BertModel"]
    adapted = adapters.apply(model, tasks.get("sequence-classification"), cfg.build(None, {"peft": "lora"}))
    assert adapters.plain_config(adapted).architectures == ["BertForSequenceClassification"]


def test_target_names_resolve_to_the_body_only(tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    head = adapters.head_modules(model)
    assert head == ["classifier"]
    every = adapters.targets(model, "all-linear", head)
    assert "classifier" not in every and "bert.pooler.dense" in every and len(every) == 2 * 6 + 1
    assert adapters.targets(model, "query,value", head) == [
        f"bert.encoder.layer.{i}.attention.self.{n}" for n in ("query", "value") for i in range(2)]


def random_llama_dir(path, hidden: int):
    """A Llama-shaped causal LM with random weights and an untied output layer, saved with the default
    model's tokenizer."""
    from effitrain.models.loading import default_model_dir
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                 max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_an_untied_lm_head_can_take_an_adapter_and_merges_into_model(tmp_path):
    """A causal LM's output layer is left out of all-linear (peft's rule) but may be named when it is
    not tied to the input embeddings; model/ then holds the merged output layer: the same logits as
    the base with the adapter through peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = random_llama_dir(tmp_path / "base", hidden=32)
    effitrain.train(small(base_dir, tmp_path / "o", task="causal-lm", lora_target_modules="q_proj,lm_head",
                          max_length=32))
    out = tmp_path / "o"
    assert any(".lm_head.lora_A" in key for key in adapter_weights(out))
    ids = torch.randint(5, 1000, (2, 12))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "model").eval()(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out / "adapter").eval()
        through_peft = adapted(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base_dir).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, through_peft, rtol=0, atol=1e-4)
    assert (merged - plain).abs().max() > 1e-3  # the adapters changed the function


def test_a_tied_lm_head_is_refused_as_a_target(tmp_path):
    with pytest.raises(UserError, match="`lm_head` shares its weight with the input embeddings"):
        effitrain.train(small(TINY_GPT2, tmp_path / "o", task="causal-lm", lora_target_modules="c_attn,lm_head"))
    assert not (tmp_path / "o").exists()


def test_a_causal_lm_from_a_config_learns_under_lora(tmp_path):
    """Issue 13's bar: LoRA alone (the output layer's adapter included) halves a random Llama-shaped
    model's validation perplexity on a real text set in a short run. Over all-linear only it cannot:
    the frozen random output layer bounds the logits (benchmarks/techniques/peft_causal_lm.py)."""
    base_dir = random_llama_dir(tmp_path / "base", hidden=64)
    data = {"data": "bbc-news", "max_eval_samples": 32, "max_length": 32}
    before = evaluate(base_dir, data, split="validation")["perplexity"]
    after = effitrain.train(small(base_dir, tmp_path / "o", task="causal-lm", data="bbc-news", max_length=32,
                                  max_train_samples=192, max_eval_samples=32, batch_size=16, max_steps=12,
                                  lora_r=16, lora_alpha=32, lora_target_modules="q_proj,v_proj,down_proj,lm_head",
                                  log_every=10))
    print(f"perplexity {before:.0f} -> {after['validation']['perplexity']:.0f}")
    assert after["validation"]["perplexity"] <= before / 2, (before, after["validation"]["perplexity"])
    # adapters only: r x (64 + vocabulary) on the output layer is most of it in a model this small
    assert after["parameters"]["trainable"] == sum(v.numel() for v in adapter_weights(tmp_path / "o").values())


# -- an adapter is applied to its own base only (issue 28, item 1) -------------------------------------
TEXTS = [f"message {i} win a prize now" if i % 2 else f"see you at {i}" for i in range(8)]


@pytest.fixture
def relative_run(tiny_model_dir, tmp_path, monkeypatch):
    """A LoRA run trained in work/ with `--model base --output-dir run`: paths relative to the working folder,
    as peft records them; its predictions through adapter/ before anything moves."""
    shutil.copytree(tiny_model_dir, tmp_path / "work" / "base")
    monkeypatch.chdir(tmp_path / "work")
    effitrain.train(small("base", "run", lora_dropout=0.0))
    return tmp_path / "work", predict("run/adapter", TEXTS)


def test_an_adapter_records_its_base(relative_run):
    import hashlib

    work, _ = relative_run
    base = (work / "base").resolve()
    assert json.loads((work / "run" / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    record = json.loads((work / "run" / "adapter" / base_record.RECORD).read_text())
    assert record["path"] == str(base) and record["path_from_run"] == "../base" and record["model_type"] == "bert"
    assert record["sha256"] == {"model.safetensors": hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()}
    assert record["shapes"]["bert.encoder.layer.0.intermediate.dense.weight"] == "64x32"
    assert len(record["shapes"]) == len(read_weights_of(base))


def test_a_moved_run_read_from_another_folder_predicts_identically(relative_run, tmp_path, monkeypatch):
    """The run moved elsewhere, its base left where it was trained, predict run from another folder: the
    same predictions to the bit, from adapter/ and from the merged model/ alike."""
    work, before = relative_run
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    shutil.move(work / "run", tmp_path / "elsewhere" / "deep" / "run")
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    assert predict(str(tmp_path / "elsewhere" / "deep" / "run" / "adapter"), TEXTS) == before
    assert predict("../elsewhere/deep/run/adapter", TEXTS) == before
    merged = predict("../elsewhere/deep/run/model", TEXTS)
    assert [p["label"] for p in merged] == [p["label"] for p in before]
    assert [p["score"] for p in merged] == pytest.approx([p["score"] for p in before], abs=1e-5)


def test_a_run_moved_with_its_base_finds_the_base_beside_it(relative_run, tmp_path, monkeypatch):
    """The absolute path is gone; the base's path from the run folder (../base) still leads to it."""
    work, before = relative_run
    monkeypatch.chdir(tmp_path)
    shutil.move(work, tmp_path / "moved")
    assert predict(str(tmp_path / "moved" / "run" / "adapter"), TEXTS) == before


def test_an_adapter_without_a_record_loads_as_before_but_never_over_a_base_of_other_shapes(relative_run, tmp_path):
    """Inside an effitrain run an adapter without its record had it removed: refused (the digest check would
    be bypassed). Out of a run (peft's own folders, or saved before the record): peft's base path as it is;
    a base that does not fit is refused (it loaded as random weights, exit 0, with ignore_mismatched_sizes):
    2 layers x the intermediate weight and bias and the output weight."""
    from transformers import BertConfig, BertForSequenceClassification

    work, before = relative_run
    (work / "run" / "adapter" / base_record.RECORD).unlink()
    with pytest.raises(UserError, match=r"the adapter in run/adapter is in an effitrain run but has no "
                                        r"effitrain_base.json .* fix: use the merged model run/model"):
        predict("run/adapter", TEXTS)
    shutil.copytree(work / "run" / "adapter", work / "loose")
    assert predict("loose", TEXTS) == before
    config = BertConfig.from_pretrained(work / "base")
    config.intermediate_size = 48
    BertForSequenceClassification(config).save_pretrained(work / "base")
    with pytest.raises(UserError, match=r"the base model .*base does not fit the adapter in loose: 6 of another "
                                        r"shape \(bert.encoder.layer.0.intermediate.dense.bias, "):
        predict("loose", TEXTS)


def test_predict_evaluate_and_train_treat_an_adapter_folder_alike(relative_run):
    """predict and evaluate apply adapter/ to its base (the same function as model/); train refuses it."""
    work, _ = relative_run
    data = dict(data="sms-spam", max_eval_samples=24, seed=0)
    from_adapter, from_model = evaluate("run/adapter", data), evaluate("run/model", data)
    assert from_adapter["accuracy"] == from_model["accuracy"] and from_adapter["samples"] == 24
    assert from_adapter["loss"] == pytest.approx(from_model["loss"], abs=1e-5)
    with pytest.raises(UserError, match="run/adapter is an adapter folder .* pass the merged model run/model"):
        effitrain.train(tiny_run("run/adapter", "again"))
    assert not (work / "again").exists()


# -- tokens a chat template adds to the base's vocabulary (issue 29) -----------------------------------
def chat_data(tmp_path):
    from test_chat import CONVERSATIONS

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    return data


def chat_run(base_dir, out, data, **overrides):
    return effitrain.train(small(base_dir, out, task="causal-lm", data=str(data), chat_template="chatml", max_length=96,
                                 validation_split=0.2, test_split=0.2, max_eval_samples=None, max_new_tokens=4,
                                 **overrides))


def test_lora_over_a_base_without_the_templates_tokens_trains_their_rows_and_saves_both_forms(tmp_path):
    """ChatML's two tokens are new rows of the base's embeddings and untied output layer: LoRA trains those
    rows in full (peft's trainable tokens), the base's own rows stay as they were; adapter/ holds the rows
    alone and loads over its base grown as in training; model/ computes what PeftModel(base, adapter/) does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = random_llama_dir(tmp_path / "base", hidden=32)
    vocabulary = len(AutoTokenizer.from_pretrained(base_dir))
    metrics = chat_run(base_dir, tmp_path / "o", chat_data(tmp_path), max_steps=3)
    out = tmp_path / "o"
    saved = adapter_weights(out)
    rows = {key: value for key, value in saved.items() if "trainable_tokens_delta" in key}
    assert sorted(rows) == ["base_model.model.lm_head.token_adapter.trainable_tokens_delta",
                            "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"]
    assert all(value.shape == (2, 32) for value in rows.values())
    assert metrics["parameters"]["trainable"] == sum(value.numel() for value in saved.values())
    settings = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert settings["trainable_token_indices"] == {"lm_head": [vocabulary, vocabulary + 1],
                                                   "model.embed_tokens": [vocabulary, vocabulary + 1]}
    before, merged = read_weights_of(base_dir), read_weights(out)
    for key, name in (("model.embed_tokens.weight", "embed_tokens"), ("lm_head.weight", "lm_head")):
        assert merged[key].shape[0] == vocabulary + 2
        assert torch.equal(merged[key][:vocabulary], before[key])  # the base's rows did not move
        trained = next(value for k, value in rows.items() if f".{name}." in k)
        assert torch.equal(merged[key][vocabulary:], trained)  # the new rows are the trained ones
    ids = torch.tensor([[vocabulary, 2000, 1500, vocabulary + 1, vocabulary, 1700]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(out / "model").eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        base.resize_token_embeddings(vocabulary + 2, mean_resizing=False)  # rows the adapter replaces
        through_peft = PeftModel.from_pretrained(base, out / "adapter").eval()(input_ids=ids).logits
    torch.testing.assert_close(plain, through_peft, rtol=0, atol=1e-5)
    # effitrain reads adapter/ over its base as model/: the same answers to a conversation.
    ask = tmp_path / "ask.jsonl"
    ask.write_text(json.dumps({"messages": [{"role": "user", "content": "Is 4 even?"}]}) + "\n")
    assert predict(str(out / "adapter"), input_file=str(ask)) == predict(str(out / "model"), input_file=str(ask))


def test_an_adapter_missing_the_new_rows_is_refused_over_its_base(tmp_path):
    base_dir = random_llama_dir(tmp_path / "base", hidden=32)
    chat_run(base_dir, tmp_path / "o", chat_data(tmp_path), max_steps=1)
    marked = tmp_path / "o" / "adapter" / "adapter_config.json"
    settings = json.loads(marked.read_text())
    settings["trainable_token_indices"] = None
    marked.write_text(json.dumps(settings))
    with pytest.raises(UserError, match="the adapter does not hold the rows of the tokens between"):
        predict(str(tmp_path / "o" / "adapter"), prompts=["hi"])


def test_qlora_over_a_base_without_the_templates_tokens_trains_their_rows(tmp_path):
    """The new rows sit in the embeddings and the output layer, which QLoRA keeps in full precision:
    model/ gives the run's own test loss."""
    base_dir = random_llama_dir(tmp_path / "base", hidden=64)
    data = chat_data(tmp_path)
    metrics = chat_run(base_dir, tmp_path / "o", data, max_steps=2, peft="qlora")
    assert any("trainable_tokens_delta" in key for key in adapter_weights(tmp_path / "o"))
    again = evaluate(str(tmp_path / "o" / "model"), {"data": str(data), "validation_split": 0.2, "test_split": 0.2,
                                                     "max_length": 96}, split="test")
    assert again["loss"] == pytest.approx(metrics["test"]["loss"], rel=1e-4)
