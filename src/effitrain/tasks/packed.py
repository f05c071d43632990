"""The forward of packed text-classification rows (data/packing.py): per example, the logits the padded
batch gives, to float rounding.

Three things make it exact: attention is block-diagonal (a token attends only to its own example's
tokens; padding only to padding, so that no softmax row is empty, and nothing attends to padding);
positions restart at each example; and the head, which reads the first token of a row, reads the
first token of each example instead: a hook on the encoder hands on only those tokens, one per
example, so the pooler and classifier that follow give one row of logits per example.

Verified (tests/unit/test_packing.py) for the model types below only, whose heads read the first token and
whose embeddings take position ids; others are refused rather than trained on a different function."""

from __future__ import annotations

import torch

from effitrain.data import packing
from effitrain.errors import UserError

# model type -> (the base model's encoder attribute, whether positions start after the padding index)
ENCODERS = {"bert": ("encoder", False), "electra": ("encoder", False), "distilbert": ("transformer", False),
            "roberta": ("encoder", True), "xlm-roberta": ("encoder", True)}


def check_model(model_config) -> None:
    """A model type whose packed forward is verified exact, or a one-line refusal."""
    if model_config.model_type not in ENCODERS:
        raise UserError(f"--packing for sequence classification is verified exact only for model types "
                        f"{', '.join(sorted(ENCODERS))}, not `{model_config.model_type}`",
                        "drop --packing (--group-by-length also cuts padding), or pass a model of those types")
    if getattr(model_config, "is_decoder", False):  # causal attention, which the block mask would not keep
        raise UserError(f"--packing for sequence classification needs a bidirectional encoder, and this "
                        f"{model_config.model_type} model is configured as a decoder (is_decoder)",
                        "drop --packing, or pass an encoder model")


def logits(model, batch: dict) -> torch.Tensor:
    """[examples, labels]: the classification logits of a packed batch, in label order."""
    base = _pretrained(model)
    encoder_name, after_padding = ENCODERS[base.config.model_type]
    positions = batch["position_ids"]
    if after_padding:  # RoBERTa counts positions from padding_idx + 1
        positions = positions + base.config.pad_token_id + 1
    inputs = {key: value for key, value in batch.items() if key in packing.TOKEN_KEYS}
    mask = block_diagonal(packing.segments(batch), base.config._attn_implementation,
                          base.get_input_embeddings().weight.dtype)
    hook = getattr(base.base_model, encoder_name).register_forward_hook(_keep_first(packing.first_tokens(batch)))
    try:
        return model(**inputs, attention_mask=mask, position_ids=positions).logits
    finally:
        hook.remove()


def block_diagonal(segments: torch.Tensor, implementation: str | None, dtype: torch.dtype) -> torch.Tensor:
    """The [rows, 1, width, width] mask, ready-made (transformers passes a 4D mask on as it is), of the
    kind the attention implementation's own masks are: booleans (True: attend) where transformers builds
    SDPA's masks for it (sdpa, and effitrain_sdpa of speedups/dropout.py), 0 or the dtype's minimum added to
    the scores where it builds eager ones. Others (flash attention takes no 4D mask) are refused."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        eager_mask,
        sdpa_mask,
    )

    kind = ALL_MASK_ATTENTION_FUNCTIONS.get(implementation)
    if kind not in (sdpa_mask, eager_mask):
        raise UserError(f"--packing builds its attention mask for sdpa or eager attention; this model uses "
                        f"{implementation}", "drop --packing")
    allowed = (segments[:, :, None] == segments[:, None, :]).unsqueeze(1)
    if kind is sdpa_mask:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                      torch.finfo(dtype).min)


def _keep_first(index: torch.Tensor):
    """A forward hook that replaces the encoder's last hidden state [rows, width, hidden] with the states
    of the tokens at the flat `index`, as [examples, 1, hidden]: a sequence of one token per example."""

    def hook(module, args, output):
        states = output[0]
        picked = states.reshape(-1, states.shape[-1])[index].unsqueeze(1)
        if isinstance(output, tuple):
            return (picked, *output[1:])
        output[next(iter(output.keys()))] = picked  # a ModelOutput: its first field is last_hidden_state
        return output

    return hook


def _pretrained(model):
    """The transformers model inside DDP, FSDP or PEFT wrappers (the outermost PreTrainedModel)."""
    from transformers import PreTrainedModel

    return next(module for module in model.modules() if isinstance(module, PreTrainedModel))
