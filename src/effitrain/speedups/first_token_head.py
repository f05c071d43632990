"""A sequence-classification head reads one row of the encoder's output: the first token's (BERT's pooler,
RoBERTa's and ELECTRA's classification heads). The last layer's other rows are computed and thrown away:
its keys and values need every token, but its queries, attention output, feed-forward and layer norms
need only the first. `apply` makes the last layer compute only that row: the same logits and loss (to
float rounding: the matrix products see fewer rows), the same dropout probabilities on what is kept,
~1/6 of a 6-layer encoder's arithmetic less per step, forward and backward.

The encoder's output (last_hidden_state) then holds the first token only: done for training runs, where
nothing else reads it. Verified (tests/unit/test_first_token_head.py) for the layer structure below, BERT's,
which RoBERTa, XLM-RoBERTa and ELECTRA copy; other models are left as they are."""

from __future__ import annotations

import sys
import types

import torch

# model type -> the base model's attribute holding the layers (all of BERT's layer structure)
ENCODERS = {"bert": "encoder", "roberta": "encoder", "xlm-roberta": "encoder", "electra": "encoder"}
# Those whose functions take queries shorter than keys with a [batch, 1, queries, keys] mask.
ATTENTION = {"sdpa", "eager", "effitrain_sdpa"}


def apply(model: torch.nn.Module) -> bool:
    """The last layer of a sequence classifier computes only the first token's row. Returns whether it
    did (a model of another type, decoder or attention implementation is left as it is)."""
    config = model.config
    if (config.model_type not in ENCODERS or getattr(config, "is_decoder", False)
            or config._attn_implementation not in ATTENTION
            or not type(model).__name__.endswith("SequenceClassification")):
        return False
    layers = getattr(model.base_model, ENCODERS[config.model_type]).layer
    last = layers[-1]
    if getattr(last, "add_cross_attention", False) or getattr(last, "chunk_size_feed_forward", 0):
        return False
    last.forward = types.MethodType(_first_token_forward, last)  # a bound method: deepcopy rebinds it
    return True


def _first_token_forward(layer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         *args, **kwargs) -> torch.Tensor:
    """BertLayer.forward for the first token's row: queries from it, keys and values from every token."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = layer.attention.self
    rows, width = hidden_states.shape[:2]
    first = hidden_states[:, :1]
    size = attention.attention_head_size
    query = attention.query(first).view(rows, 1, -1, size).transpose(1, 2)
    key = attention.key(hidden_states).view(rows, width, -1, size).transpose(1, 2)
    value = attention.value(hidden_states).view(rows, width, -1, size).transpose(1, 2)
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-2] > 1:
        attention_mask = attention_mask[:, :, :1]  # the first query's row of [batch, 1, queries, keys]
    eager = sys.modules[type(attention).__module__].eager_attention_forward  # as the layer's own forward picks
    function = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, eager)
    context, _ = function(attention, query, key, value, attention_mask,
                          dropout=attention.dropout.p if attention.training else 0.0, scaling=attention.scaling)
    context = context.reshape(rows, 1, -1).contiguous()
    return layer.feed_forward_chunk(layer.attention.output(context, first))
