"""Which precision to train in, and why: decided from the hardware, never a silent trap.

bf16 autocast on a CPU without native bf16 units (AVX-512 BF16, AMX) is emulated: 80-350x slower
matmuls were measured on AVX2 machines. fp16 needs a GPU (and a gradient scaler)."""

from __future__ import annotations

import warnings

from effitrain.errors import UserError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def choose(requested: str) -> tuple[str, str]:
    """(accelerate's mixed_precision: no | bf16 | fp16, the reason in words)."""
    import torch

    from effitrain.devices import bf16_matmul_speedup, has_accelerator

    cuda = torch.cuda.is_available()
    if requested == "fp16" and not cuda:
        raise UserError("--precision fp16 needs a CUDA GPU (fp16 autocast with a gradient scaler)",
                        "use --precision fp32 or bf16 on this machine")
    if requested == "fp32":
        return "no", "fp32 as asked"
    if requested == "fp16":
        return "fp16", "fp16 as asked, with a gradient scaler"
    if requested == "bf16":
        if not cuda and not has_accelerator():
            speedup = bf16_matmul_speedup()
            if speedup < 1:
                warnings.warn(f"bf16 on this CPU: matmuls measured {1 / speedup:.0f}x slower than fp32 (no native "
                              "bf16 units); --precision fp32 will train faster", stacklevel=2)
            return "bf16", f"bf16 as asked (bf16 matmul {speedup:.1f}x the speed of fp32 on this CPU)"
        return "bf16", "bf16 as asked"
    # auto
    if cuda:
        if torch.cuda.is_bf16_supported():
            return "bf16", "auto: bf16 (the GPU has bf16 tensor cores; no gradient scaler needed)"
        return "fp16", "auto: fp16 with a gradient scaler (the GPU has no bf16)"
    if has_accelerator():
        return "no", "auto: fp32 (no mixed precision on this accelerator type yet)"
    speedup = bf16_matmul_speedup()
    return "no", (f"auto: fp32 on a CPU (bf16 matmul measured {speedup:.1f}x the speed of fp32 here; bf16 "
                  "changes the arithmetic, so it is opt-in with --precision bf16)")
