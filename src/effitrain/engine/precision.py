"""Which precision to train in, and why: decided from the hardware, never a silent trap.

bf16 autocast on a CPU without native bf16 units (AVX-512 BF16, AMX) is emulated: 80-350x slower
matmuls were measured on AVX2 machines. fp16 needs a GPU (and a gradient scaler)."""

from __future__ import annotations

import warnings

from effitrain.errors import UserError


def choose(requested: str) -> tuple[str, str]:
    """(accelerate's mixed_precision: no | bf16 | fp16, the reason in words)."""
    import torch

    from effitrain.runtime.devices import bf16_matmul_speedup, has_accelerator

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
    return auto_on_cpu()


AUTO_ON_CPU = "EFFITRAIN_CPU_AUTO_PRECISION"  # fp32 pins auto to fp32 on CPUs (the test suite's 1e-5 checks)


def auto_on_cpu() -> tuple[str, str]:
    """bf16 autocast where the CPU has native bf16 units, decided on measurement: the default job and
    bbc-news over 3 seeds kept their test accuracy within fp32's seed-to-seed spread in bf16, 1.4-1.5x
    faster (README, "Precision on CPUs"). Decided from the CPU's flags, never from a timing, so that
    the same machine always makes the same choice."""
    import os

    from effitrain.runtime.devices import cpu_has_fast_bf16

    if os.environ.get(AUTO_ON_CPU) == "fp32":
        return "no", f"auto: fp32 ({AUTO_ON_CPU}=fp32)"
    if cpu_has_fast_bf16():
        return "bf16", ("auto: bf16 autocast on this CPU (native bf16 units; fp32 master weights; test accuracy "
                        "measured within fp32's seed-to-seed spread, 1.4x faster); --precision fp32 for fp32")
    return "no", ("auto: fp32 on a CPU without native bf16 units (bf16 would be emulated, many times slower than "
                  "fp32)")
