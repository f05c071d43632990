"""speedups/adapter_step.py: peft's LoRA function computed without wasted passes, on tiny modules."""

import pytest
import torch
from effitrain.speedups import adapter_step, dropout


class Attention(torch.nn.Module):
    """Three projections of one input (as q, k and v), then a fourth of their sum."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (torch.nn.Linear(64, 64) for _ in range(3))
        self.output = torch.nn.Linear(64, 48)

    def forward(self, x):
        return self.output(self.query(x) + self.key(x) * self.value(x))


def adapted(p: float, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(Attention(), LoraConfig(r=4, lora_alpha=8, lora_dropout=p,
                                                   target_modules=["query", "key", "value", "output"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: made non-zero so that every product is tested
            torch.nn.init.normal_(parameter, std=0.1)
    return model.train()


def run(model, x, precision="fp32"):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = model(x)
    out.float().square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    if x.grad is not None:  # the input's gradient too
        grads["input"] = x.grad.clone()
    return out, grads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_without_dropout_it_is_peft(precision):
    """Dropout 0: the output and every adapter's gradient are peft's (its forward on the same weights)."""
    x = torch.randn(3, 10, 64, requires_grad=True)
    reference, fast = adapted(0.0), adapted(0.0)
    assert adapter_step.apply(fast) == 4
    want, want_grads = run(reference, x, precision)
    x.grad = None
    got, got_grads = run(fast, x, precision)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == 9  # A and B of each adapter, the input
    if precision == "fp32":
        for a, b in ((got, want), *((got_grads[name], want_grads[name]) for name in want_grads)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:  # bf16 sums round differently in another order: compared as a whole, each tensor within 1%
        for a, b in ((got, want), *((got_grads[name], want_grads[name]) for name in want_grads)):
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


def test_with_dropout_it_is_peft_over_the_same_masks():
    """Dropout 0.3: the same function and gradients as peft's forward whose dropout draws the same masks
    (speedups/dropout.py's, from the same generator state, in the same order); masks drawn once."""
    x = torch.randn(3, 10, 64)
    reference, fast = adapted(0.3), adapted(0.3)
    for module in reference.modules():  # peft's forward, its dropout drawing effitrain's masks
        for name, layer in getattr(module, "lora_dropout", {}).items():
            module.lora_dropout[name] = dropout.Dropout(layer.p)
    adapter_step.apply(fast)
    torch.manual_seed(5)
    want, want_grads = run(reference, x.clone().requires_grad_())
    torch.manual_seed(5)
    drawn = []
    original = adapter_step.keep_mask
    adapter_step.keep_mask = lambda x, p: drawn.append(x.shape) or original(x, p)
    try:
        got, got_grads = run(fast, x.clone().requires_grad_())
    finally:
        adapter_step.keep_mask = original
    assert len(drawn) == 4  # one mask per adapter, none drawn again in the backward
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-6)


def masks_of(model, x):
    """The mask each adapter drew in one training forward, in call order."""
    masks = []
    original = adapter_step.keep_mask

    def recording(x, p):
        masks.append(original(x, p))
        return masks[-1]

    adapter_step.keep_mask = recording
    try:
        run(model, x)
    finally:
        adapter_step.keep_mask = original
    return masks


def test_the_masks_keep_1_minus_p_scaled_and_are_independent_between_adapters():
    """As torch's dropout: each element kept with probability 1 - p and scaled by 1 / (1 - p); q, k and v,
    fed the same input, draw independent masks (their agreement is that of independent draws)."""
    p = 0.25
    model, x = adapted_model(p), torch.randn(8, 256, 64)
    masks = masks_of(model, x)
    query, key, value = masks[:3]
    for mask in masks:
        assert mask.unique().tolist() == [0.0, pytest.approx(1 / (1 - p))]
        assert (mask > 0).float().mean().item() == pytest.approx(1 - p, abs=0.01)  # 131k draws: sd 0.0012
    agreement = p * p + (1 - p) * (1 - p)  # two independent draws agree this often
    for a, b in ((query, key), (query, value), (key, value)):
        assert ((a > 0) == (b > 0)).float().mean().item() == pytest.approx(agreement, abs=0.01)
    assert not torch.equal(masks_of(model, x)[0], query)  # a new draw every step


def adapted_model(p):
    model = adapted(p)
    adapter_step.apply(model)
    return model


def test_out_of_training_it_is_peft_exactly():
    """Evaluation and no-grad forwards run peft's own forward: the very same logits."""
    x = torch.randn(2, 5, 64)
    reference, fast = adapted(0.3).eval(), adapted(0.3).eval()
    adapter_step.apply(fast)
    with torch.no_grad():
        assert torch.equal(fast(x), reference(x))
    assert torch.equal(fast(x), reference(x))


def test_it_keeps_no_more_for_the_backward_than_peft():
    """The mask and the dropped input per adapter, as peft's dropout keeps them; nothing more."""
    def saved_bytes(model):
        storages = {}
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in weights:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(torch.randn(4, 32, 64, requires_grad=True))
        return sum(storages.values())

    assert saved_bytes(adapted_model(0.1)) <= saved_bytes(adapted(0.1))


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_a_frozen_base_and_its_adapter_are_one_node_with_the_separate_nodes_gradients(p):
    """LoRA's frozen base: the layer's output comes from one autograd node, whose gradients (the input's,
    A's and B's) equal those of the base and adapter products as separate nodes over the same masks."""
    x = torch.randn(3, 10, 64)
    one, separate = adapted(p), adapted(p)
    adapter_step.apply(one)
    adapter_step.apply(separate, one_node=False)
    node = one.base_model.model.query(x).grad_fn  # the view of its 2-d output back to 3-d, then the node
    assert type(node.next_functions[0][0]).__name__ == "_AdaptedLinearBackward"
    torch.manual_seed(5)
    want, want_grads = run(separate, x.clone().requires_grad_())
    torch.manual_seed(5)
    got, got_grads = run(one, x.clone().requires_grad_())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-6)


def quantised(compute_dtype, p: float, seed: int = 0):
    """`adapted`'s model with q, k and v as bitsandbytes 4-bit (nf4) layers, as QLoRA loads them."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = Attention()
    for name in ("query", "key", "value"):
        linear = getattr(model, name)
        layer = bnb.nn.Linear4bit(64, 64, compute_dtype=compute_dtype, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type="nf4").to("cpu")
        layer.bias = torch.nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        setattr(model, name, layer)
    model.is_loaded_in_4bit = True  # what peft reads to wrap them in its Linear4bit
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=p,
                                             target_modules=["query", "key", "value", "output"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    return model.train()


@pytest.mark.parametrize("precision,p", [("fp32", 0.0), ("fp32", 0.3), ("bf16", 0.0)])
def test_qlora_layers_are_peft_without_its_copy_of_the_output(precision, p):
    """peft's Linear4bit forward copies the base's output, scales the adapter's and adds it (three passes);
    here one addmm: the same output and gradients as peft's forward over the same masks."""
    from peft.tuners.lora.bnb import Linear4bit

    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    reference, fast = quantised(compute, p), quantised(compute, p)
    for module in reference.modules():  # peft's forward, its dropout drawing effitrain's masks
        for name, layer in getattr(module, "lora_dropout", {}).items():
            if isinstance(layer, torch.nn.Dropout):
                module.lora_dropout[name] = dropout.Dropout(layer.p)
    assert type(fast.base_model.model.query) is Linear4bit and adapter_step.apply(fast) == 4
    x = torch.randn(3, 10, 64)
    torch.manual_seed(5)
    want, want_grads = run(reference, x.clone().requires_grad_(), precision)
    torch.manual_seed(5)
    got, got_grads = run(fast, x.clone().requires_grad_(), precision)
    assert got.dtype == want.dtype and got_grads.keys() == want_grads.keys() and len(got_grads) == 9
    for a, b in ((got, want), *((got_grads[name], want_grads[name]) for name in want_grads)):
        if precision == "fp32":  # the scaling applied to a instead of the output: rounding apart
            torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
        else:  # bf16 sums round differently in another order: each tensor within 1% as a whole
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


def test_half_precision_casts_of_the_frozen_base_are_kept_and_equal_autocasts():
    """Under bf16 the frozen bases' casts are made once and kept across steps: the outputs and gradients of
    three steps (A and B changing in between) equal, bit for bit, those of casting every step as autocast
    does; a changed base weight (in place, or its .data swapped) is cast again; fp32 keeps nothing; a deep
    copy of the model (a frozen reference) copies none of them."""
    import copy
    import gc

    kept, each_step = adapted(0.0), adapted(0.0)
    adapter_step.apply(kept)
    adapter_step.apply(each_step, keep_half_casts=False)
    bases = [m.base_layer for m in kept.modules() if hasattr(m, "keep_half_casts")]
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-4) for m in (kept, each_step)]
    x = torch.randn(3, 10, 64)

    def step(model, optimizer):
        out, grads = run(model, x.clone().requires_grad_(), "bf16")
        optimizer.step()
        optimizer.zero_grad()
        return out, grads

    for turn in range(5):
        if turn == 3:  # the base changed in place: the kept cast is made again
            with torch.no_grad():
                for model in (kept, each_step):
                    model.base_model.model.query.base_layer.weight.mul_(2)
        if turn == 4:  # ... or given new storage
            for model in (kept, each_step):
                layer = model.base_model.model.key.base_layer
                layer.weight.data = layer.weight.data * 3
        (got, got_grads), (want, want_grads) = step(kept, optimizers[0]), step(each_step, optimizers[1])
        assert torch.equal(got, want)
        assert got_grads.keys() == want_grads.keys()
        assert all(torch.equal(got_grads[name], want_grads[name]) for name in want_grads)
        assert all(base.weight in adapter_step._KEPT_CASTS for base in bases)
    assert not any(base.weight in adapter_step._KEPT_CASTS for base in each_step.modules()
                   if isinstance(base, torch.nn.Linear))
    gc.collect()  # entries of weights that earlier tests left for the collector go now, not during the copy
    before = len(adapter_step._KEPT_CASTS)
    reference = copy.deepcopy(kept)
    assert len(adapter_step._KEPT_CASTS) == before
    assert not any(p in adapter_step._KEPT_CASTS for p in reference.parameters())
    fp32 = adapted(0.0)
    adapter_step.apply(fp32)
    run(fp32, x)
    assert not any(p in adapter_step._KEPT_CASTS for p in fp32.parameters())
