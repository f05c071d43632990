"""onednn_linear: torch.nn.Linear's forward and gradients through oneDNN, against torch's own (MKL)
to fp32 rounding, for every input shape and layout a model gives it, and left to torch where it must be."""

from __future__ import annotations

import copy

import pytest
import torch
from effitrain.speedups import onednn_linear

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def onednn_everywhere(monkeypatch):
    """oneDNN whatever this CPU's maker (apply() decides by it)."""
    monkeypatch.setenv(onednn_linear.SWITCH, "onednn")
    onednn_linear.preferred.cache_clear()
    yield
    onednn_linear.preferred.cache_clear()


def both(bias: bool = True, inputs: int = 48, outputs: int = 40):
    torch.manual_seed(0)
    plain = torch.nn.Linear(inputs, outputs, bias=bias)
    ours = copy.deepcopy(plain)
    assert onednn_linear.apply(ours) == 1
    return plain, ours


def routed(y: torch.Tensor) -> bool:
    """Whether y came out of onednn_linear's autograd Function (through the view that reshapes it)."""
    node = y.grad_fn
    while node is not None and type(node).__name__ == "ViewBackward0":
        node = node.next_functions[0][0]
    return node is not None and "_Linear" in type(node).__name__


@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48), (2, 3, 4, 48), (0, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_output_and_every_gradient_match_torchs_linear(shape, bias):
    plain, ours = both(bias)
    torch.manual_seed(1)
    x = torch.randn(shape)
    outputs, grads = [], []
    for layer in (plain, ours):
        leaf = x.clone().requires_grad_()
        y = layer(leaf)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        outputs.append(y)
        grads.append([leaf.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    for theirs, mine in zip(*grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert routed(outputs[1]) and not routed(outputs[0])


def test_strided_inputs_and_frozen_parts():
    """A slice (first_token_head's first row), a transposed input, a frozen weight or input."""
    plain, ours = both()
    x = torch.randn(4, 6, 48)
    for view in (x[:, :1], x.transpose(0, 1), x[:, ::2]):
        torch.testing.assert_close(ours(view), plain(view), rtol=1e-5, atol=1e-5)
    ours.weight.requires_grad_(False)
    leaf = x.clone().requires_grad_()
    ours(leaf).sum().backward()
    plain.weight.requires_grad_(False)
    reference = x.clone().requires_grad_()
    plain(reference).sum().backward()
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-5, atol=1e-5)
    assert ours.weight.grad is None
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad)


def test_the_output_can_be_written_in_place():
    """wav2vec2's SpecAugment writes masked frames into its feature projection's output."""
    plain, ours = both()
    x = torch.randn(2, 5, 48)
    outputs = []
    for layer in (plain, ours):
        y = layer(x)
        y[:, 1] = 0.5
        (y * y).sum().backward()
        outputs.append((y, layer.weight.grad))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], rtol=1e-5, atol=1e-5)


def test_fp32_gradients_match_torchs_in_float64():
    """gradcheck needs float64, which goes to torch: the fp32 path is checked against float64 arithmetic."""
    plain, ours = both(inputs=8, outputs=5)
    x = torch.randn(3, 8, requires_grad=True)
    y = ours(x)
    y.pow(2).sum().backward()
    x64 = x.detach().double().requires_grad_()
    w64, b64 = plain.weight.detach().double().requires_grad_(), plain.bias.detach().double().requires_grad_()
    torch.nn.functional.linear(x64, w64, b64).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x64.grad.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, w64.grad.float(), rtol=1e-5, atol=1e-5)


def test_left_to_torch_outside_fp32_cpu_tensors():
    plain, ours = both()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(torch.randn(3, 48))
    assert y.dtype == torch.bfloat16 and not routed(y)
    y = ours.double()(torch.randn(3, 48, dtype=torch.float64))
    assert y.dtype == torch.float64
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # the memory planner's tensors hold no values
        fake = torch.nn.Linear(48, 40)
        onednn_linear.apply(fake)
        assert fake(torch.randn(3, 48)).shape == (3, 40)


def test_a_bert_classifier_trains_the_same_and_keeps_its_state_dict():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    plain = BertForSequenceClassification(config)
    ours = copy.deepcopy(plain)
    assert onednn_linear.apply(ours) == 2 * 6 + 2  # q, k, v, out, up, down per layer; pooler, classifier
    assert ours.state_dict().keys() == plain.state_dict().keys()
    twin = copy.deepcopy(ours)  # deepcopy rebinds the forward to the copy's own layers
    assert twin.classifier.forward.__self__ is twin.classifier
    torch.manual_seed(1)
    batch = {"input_ids": torch.randint(5, 100, (3, 9)), "labels": torch.tensor([0, 1, 1])}
    losses = []
    for model in (plain, ours):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(plain.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_preferred_follows_the_switch_and_the_cpus_maker(monkeypatch):
    monkeypatch.setenv(onednn_linear.SWITCH, "mkl")
    onednn_linear.preferred.cache_clear()
    assert not onednn_linear.preferred() and onednn_linear.apply(torch.nn.Linear(2, 2)) == 0
    monkeypatch.delenv(onednn_linear.SWITCH)
    onednn_linear.preferred.cache_clear()
    vendor = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")),
                  None)
    if vendor is not None:
        assert onednn_linear.preferred() == (vendor != "GenuineIntel")
