"""Dropout whose masks cost less on CPUs: the same dropout, its masks drawn by `keep_mask` instead of `bernoulli_`.

Each element is kept with probability 1 - p and scaled by 1 / (1 - p), as torch's dropout does; only
the way the draw is made differs (torch's CPU `bernoulli_` was ~15% of the default model's fp32
training step, 23% in bf16): `keep_mask` draws 16 random bits per element with numpy's PCG64 on torch's
threads, and compares and scales a cache-sized block at a time, p taken to the nearest multiple of 2^-16
(see benchmarks/speedups/dropout.py).
The mask is kept for the backward as torch's CPU dropout keeps it: scaled floats (a boolean mask
would save memory, but multiplying by booleans measured slower than the draw it saves).

Attention dropout sits inside the attention function, where SDPA on a CPU falls back to its math
path whenever dropout is on (it materialises the probabilities and draws with `bernoulli_`): the
`effitrain_sdpa` attention registered here computes that math path itself with this mask while
training, and is transformers' SDPA otherwise (evaluation, p = 0, GPUs, anything unusual).

On other devices (CUDA's dropout is one fused kernel) nothing changes: torch's dropout is called."""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

ATTENTION = "effitrain_sdpa"
# What the math path here handles; anything else in the call goes to transformers' SDPA. `use_cache`: the
# flag Llama-style models pass down to every layer (the causal-lm task's use_cache=False reaches here).
_PLAIN_KWARGS = {"output_attentions", "head_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                 "max_length_q", "max_length_k", "use_cache"}


class _KeepMask(torch.autograd.Function):
    """y = x * keep / (1 - p), keep ~ Bernoulli(1 - p) drawn as rand >= p; the backward applies the same
    mask, never a second draw."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        mask = keep_mask(x, p)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


CHUNK = 1 << 20  # draws per generator: a fixed split, so the draws do not depend on the thread count
# Draws made, compared and turned into mask values at a time: they stay in cache (128K: under 1 MiB), and
# few enough that each block's numpy calls (which hold the GIL between them) do not make two threads
# wait on each other: 16K blocks made a 3M-value mask 1.5x slower on two threads than on one, 128K
# blocks 2.1x faster than 16K (benchmarks/speedups/dropout_draws.py). A multiple of 4: the draws do not depend on it.
BLOCK = 1 << 17
_POOL = None
# The mask's values written as the bits of x's dtype (numpy has no bf16): a signed integer of its size.
_BITS = {2: (torch.int16, "int16"), 4: (torch.int32, "int32"), 8: (torch.int64, "int64")}


def keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """The dropout mask for x: 1 / (1 - p) in x's dtype where the element's 16-bit draw (`keep_draws`) is at
    least p * 2^16 rounded to the nearest integer, else 0. So p is taken to the nearest multiple of 2^-16
    (0.1 drops with probability 0.100006; the scale 1 / (1 - p) is rounded to x's dtype, 0.16% in bf16,
    as torch's is): 16 random bits per element instead of 32, which halves the draw, most of the mask's
    cost (numpy's generators make ~1.7 ns a 64-bit word here; benchmarks/speedups/dropout_draws.py). Built a BLOCK at a
    time on torch's threads (draw, compare, write in cache) instead of three passes over memory and, for
    bf16, a cast."""
    import numpy as np

    scale = torch.ones((), dtype=x.dtype).mul_(1.0 / (1.0 - p))  # rounded as torch rounds the scaled mask
    if type(x) is not torch.Tensor or torch.compiler.is_compiling() or not x.dtype.is_floating_point \
            or x.dtype.itemsize not in _BITS or sys.byteorder != "little":  # (the draws' quarters' order)
        return uniform(x).ge_(p).to(x.dtype).mul_(scale)
    bits_dtype, numpy_bits = _BITS[x.dtype.itemsize]
    kept_bits = np.array(scale.view(bits_dtype).item(), dtype=numpy_bits)
    threshold = _threshold(p)
    none_kept = threshold >= 2**16  # p rounds to 1: no draw reaches it
    threshold = np.uint16(min(threshold, 2**16 - 1))
    out = np.empty(x.numel(), dtype=numpy_bits)

    def fill(generator, start: int, stop: int) -> None:
        if none_kept:  # still seeded as `keep_draws` is: torch's generator moves on the same way
            out[start:stop] = 0
            return
        keep = np.empty(min(BLOCK, stop - start), bool)
        for block in range(start, stop, BLOCK):  # one generator's stream, a block at a time (BLOCK: 4 k)
            n = min(BLOCK, stop - block)
            np.greater_equal(_draws(generator, n), threshold, out=keep[:n])
            np.multiply(keep[:n], kept_bits, out=out[block:block + n])

    _each_chunk(out.size, fill)
    return torch.from_numpy(out).view(bits_dtype).view(x.dtype).view(x.shape)


def _threshold(p: float) -> int:
    """p * 2^16 to the nearest integer: an element is kept where its 16-bit draw is at least this."""
    return math.floor(min(max(p, 0.0), 1.0) * 2**16 + 0.5)


def _draws(generator, n: int):
    """The generator's next n 16-bit draws: its 64-bit words cut in four, lowest quarter first."""
    import numpy as np

    return generator.bit_generator.random_raw((n + 3) // 4).view(np.uint16)[:n]


def keep_draws(x: torch.Tensor) -> torch.Tensor:
    """The 16-bit draws `keep_mask` compares for x (int32, x's shape): the same streams, so keep_mask(x, p) is
    exactly (keep_draws(x) >= round(p * 2^16)) * 1 / (1 - p) after the same torch.manual_seed."""
    import numpy as np

    out = np.empty(x.numel(), dtype=np.uint16)

    def fill(generator, start: int, stop: int) -> None:
        out[start:stop] = _draws(generator, stop - start)

    _each_chunk(out.size, fill)
    return torch.from_numpy(out.astype(np.int32)).view(x.shape)


def _each_chunk(size: int, fill) -> None:
    """fill(generator, start, stop) for every CHUNK of `size` values, each chunk with its own PCG64
    stream seeded by one draw from torch's generator and the chunk's start, on torch's threads."""
    import numpy as np

    global _POOL
    seed = int(torch.randint(0, 2**62, (1,)))

    def chunk(start: int) -> None:
        generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, start])))
        fill(generator, start, min(start + CHUNK, size))

    starts = range(0, size, CHUNK)
    if len(starts) == 1 or torch.get_num_threads() == 1:
        for start in starts:
            chunk(start)
        return
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=torch.get_num_threads(), thread_name_prefix="effitrain-dropout")
    list(_POOL.map(chunk, starts))


def uniform(x: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1) of x's shape, on the CPU. torch's CPU generator (a Mersenne Twister) fills
    serially; numpy's PCG64 draws 1.6x faster and its fills release the GIL, so chunks of CHUNK run on
    torch's threads. Seeded by one draw from torch's generator: torch.manual_seed, a checkpoint's RNG
    state and gradient checkpointing's RNG restore give the same uniforms, as they would rand_like's."""
    import numpy as np

    if type(x) is not torch.Tensor or torch.compiler.is_compiling():
        # Fake tensors (the memory planner) hold no values, and --compile traces torch ops, not numpy's
        # threads: torch's own draw there.
        return torch.rand_like(x, dtype=torch.float32)
    out = np.empty(x.numel(), dtype=np.float32)

    def fill(generator, start: int, stop: int) -> None:
        generator.random(out=out[start:stop], dtype=np.float32)

    _each_chunk(out.size, fill)
    return torch.from_numpy(out).view(x.shape)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training), with the CPU mask of `keep_mask`."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, training=True)
    return _KeepMask.apply(x, p)


class Dropout(torch.nn.Dropout):
    """torch.nn.Dropout (same p, same state: none) with the mask of `dropout`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


def apply(model: torch.nn.Module, layers: bool = True, attention: bool = True) -> int:
    """Every plain torch.nn.Dropout of `model` becomes a `Dropout` (`layers`), and a model on
    transformers' SDPA attention moves to `effitrain_sdpa` (`attention`; benchmarks/speedups/dropout.py measures
    each alone). Returns the number of dropout layers swapped."""
    swapped = 0
    for parent in list(model.modules()) if layers else []:
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Dropout:  # subclasses may do more than drop
                replacement = Dropout(child.p, child.inplace)
                replacement.train(child.training)
                setattr(parent, name, replacement)
                swapped += 1
    for module in model.modules() if attention else []:
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) == "sdpa":
            register()
            config._attn_implementation = ATTENTION  # not saved: config.json never holds it
    return swapped


def register() -> None:
    """`effitrain_sdpa` in transformers' attention (and attention-mask) registries: SDPA's masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, attention)
        AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature. While training with dropout on a CPU: softmax(q k^T
    scale + mask) with dropout, times v (what SDPA's math path computes); otherwise SDPA itself."""
    from transformers.integrations.sdpa_attention import (
        repeat_kv,
        sdpa_attention_forward,
    )

    unusual = any(v is not None and k not in _PLAIN_KWARGS for k, v in kwargs.items())
    if not dropout or not module.training or query.device.type != "cpu" or unusual:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(-1, -2))
    scores = scores.mul_(scaling if scaling is not None else query.shape[-1] ** -0.5)  # not saved: in place
    lowest = torch.finfo(scores.dtype).min  # not -inf: a row with nothing to attend gives no NaN
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and query.shape[-2] > 1:
        queries, keys = query.shape[-2], key.shape[-2]  # the last queries of the keys (a cache before them)
        attention_mask = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril_(keys - queries)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        scores = scores.masked_fill_(~mask, lowest) if mask.dtype == torch.bool else scores.add_(mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(_KeepMask.apply(probs, dropout), value)
    return output.transpose(1, 2).contiguous(), None
