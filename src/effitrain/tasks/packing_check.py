"""The start-up check of --packing for causal LMs: two training examples through the model packed in one
row and padded in two, the per-token logits compared; a model whose packed examples see each other is
refused with one line, never trained silently wrong.

Packing (data/text.packing_collator) relies on the model: the position ids restart at each example and
no attention mask is given, from which transformers builds a block-causal mask (masking_utils: sdpa,
eager, flex, and effitrain_sdpa, which takes sdpa's masks) or flash attention's variable-length calls.
Layers that read neither, such as linear attention, convolutions and state-space layers (Mamba, RWKV,
LFM2's convolutions, Qwen3-Next's gated delta rule), carry the first example's state into the second.

The first example of a packed row comes first, so a causal model cannot let it see the second: its
difference from the padded forward is the arithmetic's own (other shapes, other kernels). The second
example's difference may be no more than 10x that, or a floor (FLOOR, of the logits' largest magnitude)
where the arithmetic happened to agree bit for bit."""

from __future__ import annotations

import torch

from effitrain.errors import UserError

CHECK_TOKENS = 32  # of each example: past a short convolution's reach (3-4 tokens); two short forwards cost little
# The difference allowed whatever the first example shows, as a share of the logits' largest magnitude (at
# least 1): above what packed and padded forwards of a random 8-layer, 512-wide Llama differ by (fp32: 5e-6
# of it, bf16: 9e-3).
FLOOR = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def examples(dataset, count: int = 2) -> list[dict]:
    """The first `count` examples of a preprocessed split, each cut to CHECK_TOKENS tokens (the first one
    again where the split has only one)."""
    rows = [dataset[min(i, len(dataset) - 1)] for i in range(count)]
    return [{key: list(value[:CHECK_TOKENS]) for key, value in row.items()
             if key in ("input_ids", "attention_mask", "labels")} for row in rows]


def differences(model, features: list[dict], packed_collate, padded_collate) -> tuple[float, float, float]:
    """(the first example's largest logit difference packed vs padded, the second's, the largest logit
    magnitude of the padded forward), in eval mode without gradients; the model's mode is restored."""
    device = next(model.parameters()).device
    packed = {k: v.to(device) for k, v in packed_collate([dict(f) for f in features]).items() if k != "labels"}
    padded = {k: v.to(device) for k, v in padded_collate([dict(f) for f in features]).items() if k != "labels"}
    lengths = [len(f["input_ids"]) for f in features]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = model(**padded, use_cache=False).logits
            row = model(**packed, use_cache=False).logits[0]  # no cache: transformers reads packing only without one
    finally:
        model.train(was_training)
    starts = [0, lengths[0]]
    gaps = [(row[start:start + n] - whole[i, :n]).abs().max().float().item()
            for i, (start, n) in enumerate(zip(starts, lengths))]
    scale = max(whole[i, :n].abs().max().float().item() for i, n in enumerate(lengths))
    return gaps[0], gaps[1], scale


def check(model, features: list[dict], packed_collate, padded_collate) -> None:
    """Refuse --packing with one line when the second example of a packed row gives other logits than
    the same example padded, beyond what the arithmetic alone gives the first one."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    try:
        arithmetic, leak, scale = differences(model, features, packed_collate, padded_collate)
    except (TypeError, ValueError, RuntimeError) as err:
        raise UserError(f"--packing: model type `{model_type}` cannot run a packed row (position ids restarting "
                        f"at each example, no attention mask): {type(err).__name__}: {str(err).splitlines()[0]}",
                        "drop --packing")
    dtype = next(model.parameters()).dtype
    allowed = max(10 * arithmetic, FLOOR.get(dtype, FLOOR[torch.bfloat16]) * max(scale, 1.0))
    if not leak <= allowed:  # NaN too
        raise UserError(f"--packing: with model type `{model_type}` the second example of a packed row gets other "
                        f"outputs than the same example padded (largest logit difference {leak:.3g}, against "
                        f"{allowed:.3g} allowed for arithmetic): some of its layers let packed examples see each "
                        "other (linear attention, convolutions or state-space layers ignore the position ids that "
                        "keep them apart)", "drop --packing (length grouping, on by default, also keeps padding low)")
