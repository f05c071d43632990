"""A LoRA layer's training forward without wasted passes: peft's arithmetic, peft's modules and weights.

peft's `lora.Linear.forward` computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`, with on the
way a cast of x to the adapter's dtype (under bf16 autocast: an fp32 copy of a bf16 input, cast back
by the matmul), torch's dropout (its CPU `bernoulli_` draw), and two more passes over the layer's
output (the scaling, then the sum). Here, for the plain case only (one active adapter, not merged,
no LoRA variant such as DoRA, nn.Linear underneath), the same function is computed as:

    dropped = x * keep_mask(x, p)            speedups/dropout.py's mask: the fast draw, kept for the backward
    a = dropped @ A^T                        in the compute dtype (autocast's), no cast of x to fp32
    (x W^T + b).addmm_(a * scaling, B^T)     the adapter's product added into the base output in place

With a frozen base (LoRA's case) the whole layer is one autograd node (`_AdaptedLinear`), whose backward
adds the adapter's input gradient into the base's in place and computes B's gradient as (a^T g)^T, the
fast orientation of that product (g^T a reads g by columns; the figures: docs/adapters.md). Its results
agree with peft's to float rounding (the sums run in another order), not bit for bit.

Under half precision the frozen base's weight and bias are cast to the compute dtype once and kept across
steps (autocast casts a frozen weight again every step: it only caches casts of weights that require
gradients, and only until it exits), the same values `.to(dtype)` gives: 2 bytes per adapted frozen
weight, which a step holds anyway from its forward to its backward (saved for it), so the peak does not
move. Not kept where it would: a run that checkpoints (the step then holds one block's casts at a time),
or whose weights are sharded (fsdp, deepspeed: they would be held whole); nor compiled (the graph casts).

Each adapter still draws its own mask (peft's semantics: q, k and v, fed the same input, drop
different elements). The mask is drawn once and kept (scaled floats: multiplying by booleans measured
slower than the draw), never drawn again in the backward. `scaling` moves from the output to the
r-wide `a` (the same product; bit for bit when scaling is a power of two, as alpha 16 / r 8).
Anything else (evaluation, other layer types, several adapters, GPUs, whose dropout is one fused
kernel already) runs peft's own forward."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from effitrain.speedups import onednn_linear
from effitrain.speedups.autocast_dtype import compute_dtype
from effitrain.speedups.dropout import keep_mask


class _DroppedProjection(torch.autograd.Function):
    """a = (x * mask) @ A^T, with mask = keep_mask(x, p); keeps the mask and the dropped input (or x, with
    `lean`: the dropped input is then recomputed in the backward, one multiply instead of a copy kept)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: float, lean: bool) -> torch.Tensor:
        mask = keep_mask(x, p)
        dropped = x * mask
        ctx.lean = lean
        ctx.save_for_backward(x if lean else dropped, mask, weight)
        return F.linear(dropped, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        kept, mask, weight = ctx.saved_tensors
        dropped = kept * mask if ctx.lean else kept
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = F.linear(grad, weight.t()).mul_(mask)
        if ctx.needs_input_grad[1]:
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().mm(dropped.reshape(-1, dropped.shape[-1]))
        return grad_x, grad_weight, None, None


def plain(layer) -> bool:
    """The case this forward handles: one active adapter of plain LoRA on an nn.Linear, not merged."""
    from peft.tuners.lora import Linear

    return type(layer) is Linear and isinstance(layer.base_layer, torch.nn.Linear) and _one_plain_adapter(layer) \
        and not getattr(layer, "fan_in_fan_out", False)


def four_bit(layer) -> bool:
    """QLoRA's case: one active adapter of plain LoRA on a bitsandbytes 4-bit linear, not merged."""
    from peft.tuners.lora import bnb

    return type(layer) is getattr(bnb, "Linear4bit", None) and _one_plain_adapter(layer)


def _one_plain_adapter(layer) -> bool:
    active = layer.active_adapters
    return (len(active) == 1 and active[0] in layer.lora_A and active[0] not in layer.lora_variant
            and not layer.merged and not layer.disable_adapters)


class _AdaptedLinear(torch.autograd.Function):
    """out = x W^T + b + ((x * mask) A^T * scaling) B^T for a frozen W and b, as one autograd node whose
    backward picks the fast form of each product: the adapter's input gradient added into the base's in
    place (one addmm), B's gradient as (a^T g)^T, which reads g by rows (faster than g^T a, which reads it
    by columns). Inputs are 2-D and in the compute dtype; autocast is off inside."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_a, weight_b, scaling: float, p: float, lean: bool):
        with torch.autocast(x.device.type, enabled=False):
            mask = keep_mask(x, p) if p > 0 else None
            dropped = x if mask is None else x * mask
            a = dropped.mm(weight_a.t()).mul_(scaling)
            out = torch.addmm(bias, x, weight.t()) if bias is not None else x.mm(weight.t())
            out.addmm_(a, weight_b.t())
        ctx.scaling, ctx.lean = scaling, lean and mask is not None
        ctx.save_for_backward(x if ctx.lean else dropped, mask, a, weight, weight_a, weight_b)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        kept, mask, a, weight, weight_a, weight_b = ctx.saved_tensors
        dropped = kept * mask if ctx.lean else kept
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.to(a.dtype)
            grad_a = grad.mm(weight_b).mul_(ctx.scaling)  # the gradient of a before its scaling
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = grad.mm(weight)
                if mask is None:
                    grad_x.addmm_(grad_a, weight_a)
                else:
                    grad_x.addcmul_(grad_a.mm(weight_a), mask)
            grad_weight_a = grad_a.t().mm(dropped) if ctx.needs_input_grad[3] else None
            grad_weight_b = a.t().mm(grad).t() if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_weight_a, grad_weight_b, None, None, None


def forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's lora.Linear.forward, computed as the module docstring says while training the plain case."""
    quantised = four_bit(layer)
    if args or kwargs or not (layer.training and torch.is_grad_enabled()) or x.device.type != "cpu" \
            or not (quantised or plain(layer)):
        return type(layer).forward(layer, x, *args, **kwargs)
    name = layer.active_adapters[0]
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    dropout = layer.lora_dropout[name]
    p = dropout.p if isinstance(dropout, torch.nn.Dropout) else 0.0
    dtype = compute_dtype(x)
    if quantised:
        return _four_bit_forward(layer, x, lora_a, lora_b, p, layer.scaling[name], dtype)
    inputs = x.to(dtype)  # cast once, for both products (autocast would cast x again for the base layer)
    weight_a = lora_a.weight.to(dtype)
    base = layer.base_layer
    if layer.adapter_one_node and _plain_linear(base, dtype) and not base.weight.requires_grad \
            and (base.bias is None or not base.bias.requires_grad):
        # The frozen base and the adapter in one node (cast as autocast casts them for F.linear).
        weight, bias = _frozen_cast(base, dtype, layer.keep_half_casts)
        out = _AdaptedLinear.apply(inputs.reshape(-1, inputs.shape[-1]), weight, bias, weight_a,
                                   lora_b.weight.to(dtype), layer.scaling[name], p, layer.lean_adapter_dropout)
        return out.view(*x.shape[:-1], out.shape[-1])
    a = _scaled_projection(layer, inputs, weight_a, p, layer.scaling[name])
    weight_b = lora_b.weight.to(dtype).t()
    if _plain_linear(base, dtype):  # the base product computed here, and the adapter's added into it in place
        flat = inputs.reshape(-1, inputs.shape[-1])
        out = torch.addmm(base.bias, flat, base.weight.t()) if base.bias is not None else flat.mm(base.weight.t())
        if out.dtype == dtype:
            return out.addmm_(a, weight_b).view(*x.shape[:-1], out.shape[-1])
        return torch.addmm(out.to(dtype), a, weight_b).view(*x.shape[:-1], out.shape[-1]).to(out.dtype)
    result = layer.base_layer(inputs)  # a base with its own forward (onednn-linear's) or hooks: its output copied
    summed = torch.addmm(result.reshape(-1, result.shape[-1]).to(dtype), a, weight_b)
    return summed.view(result.shape).to(result.dtype)


# A frozen base weight -> (what its casts were made from, the weight and the bias in the compute dtype). Weak
# keys: an entry goes with its weight, and a deep copy of the model (a frozen reference) does not copy it.
_KEPT_CASTS = WeakIdKeyDictionary()


def _frozen_cast(base, dtype, keep: bool):
    """The frozen base's weight and bias in `dtype`, as autocast casts them (`.to`): kept across steps where
    `keep`, made again when the weight or bias changed (its version: a state dict loaded into it; its
    storage: a `.data` swapped)."""
    weight, bias = base.weight, base.bias
    if not keep or weight.dtype == dtype or torch.compiler.is_compiling():
        return weight.to(dtype), None if bias is None else bias.to(dtype)
    origin = tuple((t._version, None if is_fake(t) else t.data_ptr()) for t in (weight, bias) if t is not None)
    kept = _KEPT_CASTS.get(weight)
    if kept is None or kept[0] != (dtype, origin):
        with torch.no_grad():
            kept = _KEPT_CASTS[weight] = ((dtype, origin), weight.to(dtype), None if bias is None else bias.to(dtype))
    return kept[1], kept[2]


def keeps_half_casts(sharded: bool, checkpointing: bool) -> bool:
    """Whether a run keeps its frozen bases' half-precision casts across steps: only where its peak stays as it
    is (not when checkpointing: the step would hold every block's casts, not one's; not when the weights are
    sharded: the casts would be held whole). Training's transforms and the planner's simulated step ask here."""
    return not (sharded or checkpointing)


def keep_half_casts(model, keep: bool) -> None:
    """From now on `model`'s adapted layers keep their frozen bases' half-precision casts across steps, or
    do not (`keep`); those kept so far are dropped (the planner's simulated step makes its own)."""
    for module in model.modules():
        if hasattr(module, "keep_half_casts"):
            module.keep_half_casts = keep
    for parameter in model.parameters():
        _KEPT_CASTS.pop(parameter, None)


def _four_bit_forward(layer, x, lora_a, lora_b, p: float, scaling: float, dtype) -> torch.Tensor:
    """peft's Linear4bit forward (base(x), a defensive copy of it, the adapter's output scaled, then added:
    three passes over the output) as base(x) + (scaled a) B^T in one addmm, the base's output left as it is."""
    if not torch.is_autocast_enabled(x.device.type) and not x.dtype == lora_a.weight.dtype == dtype:
        return type(layer).forward(layer, x)  # peft casts x to the adapter's dtype there: its own forward
    result = layer.base_layer(x)  # bitsandbytes' 4-bit product, called as peft calls it
    a = _scaled_projection(layer, x.to(dtype), lora_a.weight.to(dtype), p, scaling)
    with torch.autocast(x.device.type, enabled=False):  # summed in the base output's dtype, as peft's `+`
        summed = torch.addmm(result.reshape(-1, result.shape[-1]), a.to(result.dtype),
                             lora_b.weight.to(result.dtype).t())
    return summed.view(result.shape)


def _scaled_projection(layer, inputs, weight_a, p: float, scaling: float) -> torch.Tensor:
    """The adapter's r-wide a = (inputs * mask) A^T * scaling, 2-D, as its own autograd nodes."""
    a = _DroppedProjection.apply(inputs, weight_a, p, layer.lean_adapter_dropout) if p > 0 else F.linear(inputs, weight_a)
    return (a * scaling).reshape(-1, a.shape[-1])


def _plain_linear(module, dtype: torch.dtype) -> bool:
    """F.linear(x, weight, bias) for an input in `dtype`, which this module may compute itself: nn.Linear's
    own forward, or onednn-linear's outside fp32 (F.linear there: the same step on every x86 CPU), no hooks."""
    own = "forward" not in vars(module) or (dtype != torch.float32 and onednn_linear.routed(module))
    return type(module) is torch.nn.Linear and own and not module._forward_hooks and not module._forward_pre_hooks


def apply(model, lean: bool = False, one_node: bool = True, keep_half_casts: bool = True) -> int:
    """Every peft lora.Linear of `model` trains through `forward` (peft's own forward where it does not
    apply), and every adapter's nn.Dropout draws speedups/dropout.py's mask (the layers `forward` does
    not handle: GPT-2's Conv1D, say). `keep_half_casts`: the frozen bases' half-precision casts kept
    across steps (off where the weights are sharded or the step checkpoints). Returns the number of layers
    changed."""
    from peft.tuners.lora import Linear, LoraLayer, bnb

    from effitrain.speedups import dropout

    changed = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name, layer in list(module.lora_dropout.items()):
            if type(layer) is torch.nn.Dropout:
                module.lora_dropout[name] = dropout.Dropout(layer.p).train(layer.training)
        if type(module) in (Linear, getattr(bnb, "Linear4bit", None)):
            module.lean_adapter_dropout = lean
            module.adapter_one_node = one_node  # False: the base and adapter products as separate autograd nodes
            module.keep_half_casts = keep_half_casts
            module.forward = types.MethodType(forward, module)
        changed += 1
    return changed
