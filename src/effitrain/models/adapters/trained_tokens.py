"""Tokens the vocabulary gained (a chat template's `<|im_start|>`, `<|im_end|>` added to a base without them):
new rows of the input embeddings and of an untied output layer, trained in full through peft's
`trainable_token_indices` (left frozen, the model could never learn to end a turn)."""

from __future__ import annotations

from effitrain.errors import UserError
from effitrain.models.adapters.model_parts import module_name, tied


NEW_TOKENS = "effitrain_new_tokens"  # on a model: {token id: token} of the rows its vocabulary gained


def mark_new_tokens(model, tokens: dict[int, str]) -> None:
    """Record on the model the rows its vocabulary gained (tasks/causal_lm.py, after resizing for a chat
    template's special tokens; the planner's model too), for `apply` to train them."""
    setattr(model, NEW_TOKENS, dict(tokens))


def new_tokens(model) -> dict[int, str]:
    return dict(getattr(model, NEW_TOKENS, None) or {})


def token_rows(model, lora_targets: list[str]) -> dict[str, list[int]] | None:
    """peft's trainable_token_indices: the rows of the new tokens in the input embeddings and, when it is
    not tied to them, the output layer (whose rows make the new tokens' logits: left at their initial
    values, `<|im_end|>` would never be the likeliest token). A tied output layer follows the input
    embeddings' rows (peft ties them). peft cannot train rows of a layer that has a LoRA adapter."""
    ids = sorted(new_tokens(model))
    if not ids:
        return None
    rows = {module_name(model, model.get_input_embeddings()): ids}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and not tied(model, output):
        name = module_name(model, output)
        if name in lora_targets:
            raise UserError(f"--lora-target-modules names `{name.rsplit('.', 1)[-1]}`, the output layer, and the "
                            f"chat template added {len(ids)} token(s) ({', '.join(new_tokens(model).values())}) "
                            "whose output rows must be trained in full, which peft cannot do under a LoRA adapter",
                            f"leave `{name.rsplit('.', 1)[-1]}` out of --lora-target-modules (the new tokens' rows "
                            "of it are trained anyway)")
        rows[name] = ids
    return rows


def keep_chunked_loss(model) -> None:
    """peft's trainable tokens wrap the output layer and multiply by its effective weight themselves (the
    wrapped layer's forward never runs): the wrapper, whose `weight` is that effective weight (the trained
    rows in it, differentiably), becomes the layer the chunked loss reads (speedups/chunked_lm_loss.py)."""
    from peft.utils.other import TrainableTokensWrapper

    from effitrain.speedups import chunked_lm_loss

    output = model.get_base_model().get_output_embeddings()
    if isinstance(output, TrainableTokensWrapper) and chunked_lm_loss.prepared(output.token_adapter.get_base_layer()):
        chunked_lm_loss.pass_through(output)
