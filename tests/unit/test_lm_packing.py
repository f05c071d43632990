"""--packing for causal LMs (data/text.packing_collator, tasks/packing_check.py): on chat data with labels
on the answers, a packed step's per-answer-token loss and gradients equal the padded step's (fp32, 1e-5)
for a Llama-shaped and a GPT-2-shaped model; the start-up check passes such models and refuses one
whose layers let packed examples see each other."""

import copy

import pytest
import torch
from effitrain import tasks
from effitrain.data import answers, conversations, templates, text
from effitrain.errors import UserError
from effitrain.models import transforms
from effitrain.speedups import dropout
from effitrain.tasks import packing_check
from transformers import AutoConfig, AutoModelForCausalLM

LM = tasks.get("causal-lm")
CONVERSATIONS = [
    [{"role": "system", "content": "Answer spam or ham."}, {"role": "user", "content": "win a free prize now"},
     {"role": "assistant", "content": "spam"}],
    [{"role": "user", "content": "are we still meeting for lunch tomorrow at noon near the station"},
     {"role": "assistant", "content": "ham, a friend asking"}, {"role": "user", "content": "and this one: call now"},
     {"role": "assistant", "content": "spam"}],
    [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ham"}],
    [{"role": "user", "content": "urgent! your account is locked, reply with your password"},
     {"role": "assistant", "content": "spam, it asks for a password"}],
]
SHAPES = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    chat = copy.deepcopy(tokenizer)
    templates.install(chat, "chatml")
    return chat


@pytest.fixture(scope="module")
def features(chat_tokenizer):
    """The conversations' ids and labels on the assistant turns, as training gets them."""
    encoded = [answers.encode(chat_tokenizer, {"messages": m}, conversations.MESSAGES) for m in CONVERSATIONS]
    return [{"input_ids": e.input_ids, "labels": e.labels} for e in encoded]


def tiny_lm(kind, vocabulary, attention="sdpa", seed=0, **overrides):
    config = AutoConfig.for_model(kind, vocab_size=vocabulary, **{**SHAPES[kind], **overrides})
    config._attn_implementation = attention
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def as_training_builds(model):
    """Through the transform pipeline as a packed training run builds it (effitrain_sdpa attention, the
    chunked loss, oneDNN linear layers where preferred)."""
    model, applied = transforms.apply_all(model, transforms.Settings(LM, packing=True))
    assert "chunked-lm-loss" in applied
    return model.train()


def step(model, batch):
    """The per-answer-token loss of a micro-batch that is a whole step, and its gradients."""
    model.zero_grad()
    loss = LM.loss_sum(model, batch) / LM.item_count(batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_answers_labels_survive_packing(features):
    """Each example's labels stand in the packed row at its tokens; only its first label becomes -100,
    which no position of the padded batch predicts either (position t predicts label t + 1)."""
    packed = text.packing_collator()([dict(f) for f in features])
    padded = answers.collator(0)([dict(f) for f in features])
    expected = [label for f in features for label in [-100] + f["labels"][1:]]
    assert packed["labels"][0].tolist() == expected
    assert packed["position_ids"][0].tolist() == [i for f in features for i in range(len(f["input_ids"]))]
    assert "attention_mask" not in packed  # transformers reads packing from the positions only without a mask
    assert int(LM.item_count(packed)) == int(LM.item_count(padded)) == sum(
        sum(label != -100 for label in f["labels"]) for f in features) > 8
    assert int(LM.example_count(packed)) == len(features)


@pytest.mark.parametrize("kind", SHAPES)
def test_a_packed_step_equals_the_padded_step(chat_tokenizer, features, kind):
    model = as_training_builds(tiny_lm(kind, len(chat_tokenizer)))
    padded = answers.collator(chat_tokenizer.pad_token_id)([dict(f) for f in features])
    packed = text.packing_collator()([dict(f) for f in features])
    loss, grads = step(model, padded)
    packed_loss, packed_grads = step(model, packed)
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # Sensitive: the same row without restarting positions lets the examples see each other.
    crossing_loss, _ = step(model, {k: v for k, v in packed.items() if k != "position_ids"})
    assert abs(float(crossing_loss) - float(loss)) > 1e-3


def test_effitrain_sdpa_math_path_keeps_packed_examples_apart(chat_tokenizer, features, monkeypatch):
    """With attention dropout on, effitrain_sdpa computes attention itself from the packed mask: with its
    dropout masks made all-keep, packed equals padded there too."""
    calls = []
    monkeypatch.setattr(dropout._KeepMask, "apply", staticmethod(lambda x, p: calls.append(p) or x))
    model = as_training_builds(tiny_lm("llama", len(chat_tokenizer), attention_dropout=0.5))
    assert model.config._attn_implementation == dropout.ATTENTION
    padded = answers.collator(chat_tokenizer.pad_token_id)([dict(f) for f in features])
    loss, grads = step(model, padded)
    packed_loss, packed_grads = step(model, text.packing_collator()([dict(f) for f in features]))
    assert calls == [0.5] * 4  # the math path ran: 2 layers, 2 forwards (before the fix, SDPA took use_cache)
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def collators(tokenizer):
    """causal-lm's (packed training, padded evaluation) collators, as a --packing run makes them."""
    from effitrain.config import TrainConfig

    return LM.collators(tokenizer, TrainConfig(task="causal-lm", packing=True))


@pytest.mark.parametrize("kind, attention", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"),
                                             ("gpt2", "eager")])
def test_the_check_passes_models_that_keep_packed_examples_apart(chat_tokenizer, features, kind, attention):
    model = tiny_lm(kind, len(chat_tokenizer), attention).train()
    packing_check.check(model, features[:2], *collators(chat_tokenizer))
    arithmetic, leak, scale = packing_check.differences(model, features[:2], *collators(chat_tokenizer))
    assert leak <= 1e-5 * max(scale, 1) and arithmetic <= 1e-5 * max(scale, 1)
    assert model.training  # its mode given back


def mixing_layer(model):
    """A hook that adds to each position of the first layer's output the mean of the positions before it:
    what a linear-attention or state-space layer does, blind to the position ids."""
    def mix(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        counts = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
        mixed = hidden + hidden.cumsum(1) / counts
        return (mixed, *output[1:]) if isinstance(output, tuple) else mixed
    return model.model.layers[0].register_forward_hook(mix)


def test_the_check_refuses_a_model_whose_layers_mix_packed_examples(chat_tokenizer, features):
    model = tiny_lm("llama", len(chat_tokenizer))
    packing_check.check(model, features[:2], *collators(chat_tokenizer))
    mixing_layer(model)
    with pytest.raises(UserError, match=r"--packing: with model type `llama` the second example of a packed row "
                                        r"gets other outputs than the same example padded") as refused:
        packing_check.check(model, features[:2], *collators(chat_tokenizer))
    assert "drop --packing" in refused.value.fix


@pytest.mark.parametrize("kind, settings", [
    ("mamba", dict(hidden_size=16, num_hidden_layers=1, state_size=4)),
    ("lfm2", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, layer_types=["conv", "full_attention"], initializer_range=0.2)),
])
def test_the_check_refuses_state_space_and_convolution_layers(chat_tokenizer, features, kind, settings):
    """Mamba (a state-space model) and LFM2 (short convolutions beside attention) take the position ids
    and ignore them where their state crosses from one example into the next."""
    config = AutoConfig.for_model(kind, vocab_size=len(chat_tokenizer), **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserError, match=f"with model type `{kind}` the second example"):
        packing_check.check(model, features[:2], *collators(chat_tokenizer))


def test_the_examples_checked_are_the_first_two_cut_short():
    from datasets import Dataset

    long = Dataset.from_dict({"input_ids": [list(range(100)), [1, 2, 3]], "labels": [list(range(100)), [-100, 2, 3]]})
    got = packing_check.examples(long)
    assert [len(f["input_ids"]) for f in got] == [packing_check.CHECK_TOKENS, 3]
    assert got[1]["labels"] == [-100, 2, 3]
    one = Dataset.from_dict({"input_ids": [[5, 6]]})
    assert packing_check.examples(one) == [{"input_ids": [5, 6]}, {"input_ids": [5, 6]}]
