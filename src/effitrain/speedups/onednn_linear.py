"""fp32 linear layers on CPUs through oneDNN instead of MKL, on the CPUs where MKL runs its generic code.

torch multiplies fp32 matrices on a CPU with MKL's sgemm (bf16 ones already go through oneDNN). On a CPU
that is not Intel's, MKL takes its generic code path (MKL_VERBOSE names no instruction set: "Intel(R)
Architecture processors"); on this project's AMD EPYC (AVX-512) oneDNN's fp32 linear is 1.08-1.17x
MKL's for the forward product and for the input's gradient, and no faster for the weight's gradient (a
sum over every token, which stays on MKL): 3-7% of the default model's fp32 training step
(benchmarks/speedups/onednn_linear.py).

The arithmetic is the same, fp32 products summed in fp32, in another order: results agree with MKL's to
float rounding, not bit for bit, and a run stays deterministic on its machine. `apply` gives every
torch.nn.Linear (that class exactly: LoRA's and 4-bit layers are left alone, a LoRA layer's base is not)
the forward below: oneDNN for fp32 CPU tensors outside autocast, torch's F.linear for anything else (GPUs,
bf16 autocast, fake tensors, --compile's tracing, DTensors)."""

from __future__ import annotations

import functools
import os
import platform
import types

import torch
import torch.nn.functional as F

SWITCH = "EFFITRAIN_FP32_MATMUL"  # "mkl": torch's own; "onednn": oneDNN on any CPU (to measure)


class _Linear(torch.autograd.Function):
    """y = x W^T + b for a 2-d x; the backward's dx = dy W on oneDNN, dW = dy^T x and db on torch (MKL),
    saving what torch's linear saves (the input and the weight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.mkldnn._linear_pointwise(grad, weight.t(), None, "none", [], "")
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().mm(x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def _forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = layer.weight, layer.bias
    if (type(x) is not torch.Tensor or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() == 0
            or type(weight.data) is not torch.Tensor or weight.dtype != torch.float32
            or (bias is not None and bias.dtype != torch.float32)
            or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling()):
        return F.linear(x, weight, bias)
    # Reshaped outside the Function: a view made inside one could not be modified in place (wav2vec2's
    # SpecAugment writes into its projection's output).
    out = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


@functools.cache
def preferred() -> bool:
    """oneDNN for fp32 products on this machine: an x86 CPU that is not Intel's (MKL's generic path
    there; on Intel's, MKL is its makers' own best and stays), unless SWITCH says otherwise."""
    choice = os.environ.get(SWITCH, "").strip().lower()
    if choice in ("mkl", "onednn"):
        return choice == "onednn" and available()
    if platform.machine().lower() not in ("x86_64", "amd64") or not available():
        return False
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            vendor = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("vendor_id")), "")
    except OSError:
        return False
    return vendor not in ("", "GenuineIntel")


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def routed(layer: torch.nn.Module) -> bool:
    """Whether `layer` has this module's forward (which is torch's F.linear for anything but fp32)."""
    return getattr(vars(layer).get("forward"), "__func__", None) is _forward


def apply(model: torch.nn.Module) -> int:
    """Every torch.nn.Linear of `model` computes through oneDNN where `_forward` allows it; the number of
    layers changed (0 where oneDNN is not preferred here). The weights, state_dict and config are
    unchanged: only the instance's forward is (a bound method: deepcopy rebinds it)."""
    if not preferred():
        return 0
    layers = [module for module in model.modules() if type(module) is torch.nn.Linear]
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
    return len(layers)
