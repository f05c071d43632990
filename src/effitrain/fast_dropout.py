"""Dropout whose masks cost less on CPUs: the same dropout, its uniforms drawn by `uniform` instead of `bernoulli_`.

Each element is kept with probability 1 - p and scaled by 1 / (1 - p), as torch's dropout does; only
the way the uniform draw is made differs (torch's CPU `bernoulli_` was ~15% of the default model's
fp32 training step, 23% in bf16; `uniform(x) >= p` makes the same mask at a fraction of its cost,
`uniform` drawing with numpy's PCG64 on torch's threads; see benchmarks/dropout.py).
The mask is kept for the backward as torch's CPU dropout keeps it: scaled floats (a boolean mask
would save memory, but multiplying by booleans measured slower than the draw it saves).

Attention dropout sits inside the attention function, where SDPA on a CPU falls back to its math
path whenever dropout is on (it materialises the probabilities and draws with `bernoulli_`): the
`effitrain_sdpa` attention registered here computes that math path itself with this mask while
training, and is transformers' SDPA otherwise (evaluation, p = 0, GPUs, anything unusual).

On other devices (CUDA's dropout is one fused kernel) nothing changes: torch's dropout is called."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTENTION = "effitrain_sdpa"
# What the math path here handles; anything else in the call goes to transformers' SDPA.
_PLAIN_KWARGS = {"output_attentions", "head_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                 "max_length_q", "max_length_k"}


class _KeepMask(torch.autograd.Function):
    """y = x * keep / (1 - p), keep ~ Bernoulli(1 - p) drawn as rand >= p; the backward applies the same
    mask, never a second draw."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        # Drawn in fp32 whatever x is: bf16 uniforms are rounded, which would move the keep probability.
        mask = uniform(x).ge_(p).to(x.dtype)
        mask.mul_(1.0 / (1.0 - p))  # in place: 1 / (1 - p) where kept, else 0
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


CHUNK = 1 << 20  # uniforms per generator: a fixed split, so the draws do not depend on the thread count
_POOL = None


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
    global _POOL
    seed = int(torch.randint(0, 2**62, (1,)))
    out = np.empty(x.numel(), dtype=np.float32)
    starts = range(0, out.size, CHUNK)

    def fill(start: int) -> None:
        generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, start])))
        generator.random(out=out[start:start + CHUNK], dtype=np.float32)

    if len(starts) == 1 or torch.get_num_threads() == 1:
        for start in starts:
            fill(start)
    else:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(max_workers=torch.get_num_threads(), thread_name_prefix="effitrain-dropout")
        list(_POOL.map(fill, starts))
    return torch.from_numpy(out).view(x.shape)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training), with the CPU mask drawn from `uniform`."""
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
    transformers' SDPA attention moves to `effitrain_sdpa` (`attention`; benchmarks/dropout.py measures
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
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, attention)
        AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature. While training with dropout on a CPU: softmax(q k^T
    scale + mask) with dropout, times v (what SDPA's math path computes); otherwise SDPA itself."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

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
