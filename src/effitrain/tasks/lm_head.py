"""A causal LM's output layer and what the losses read from it: the summed loss, each position's log-prob of
its target, and evaluation's per-position loss and hits. Chunked (speedups/chunked_lm_loss.py: the whole
logits never exist) where the chunked loss prepared the model's output layer, plain logits otherwise (an
adapter on the output layer, soft-capped logits): the choice is made here, once, for every task that reads
a causal LM's outputs (causal-lm, the preference objectives)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from effitrain.speedups import chunked_lm_loss


class LMHead:
    """The head of `model`. Every method takes the model's inputs and the targets of positions 0..n-2
    (position t predicts token t+1; -100: no loss there) and runs the model's forward itself.
    `planned_per_row`: for the planner's fake tensors, which have no targets to select by, the positions
    with a loss per row (answer-only data); None: every position."""

    def __init__(self, model, planned_per_row: int | None = None):
        self.model, self.planned_per_row = model, planned_per_row
        self.layer = chunked_lm_loss.output_layer(model)  # None: the plain logits

    @property
    def chunked(self) -> bool:
        return self.layer is not None

    def run(self, inputs: dict, **options):
        """The model's forward on `inputs` with `options` (a cache, logits_to_keep): its output, whose `logits`
        are what the positions hold for the head once `held`."""
        if self.layer is None:
            return self.model(**inputs, **options)
        with chunked_lm_loss.hidden_states_of(self.layer):
            return self.model(**inputs, **options)

    def held(self, logits: torch.Tensor) -> torch.Tensor:
        """What positions of `run`'s logits hold for the head: the final hidden states (chunked), else fp32 logits."""
        return logits if self.layer is not None else logits.float()

    def _outputs(self, inputs: dict) -> torch.Tensor:
        """What the positions that predict hold (`held`)."""
        return self.held(self.run(inputs, use_cache=False).logits[:, :-1])  # no cache: packed masks need None

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return chunked_lm_loss.weight_and_bias(self.layer)  # read after the forward (FSDP: gathered then)

    def loss_sum(self, inputs: dict, targets: torch.Tensor) -> torch.Tensor:
        """The cross-entropy summed over the positions whose target counts (fp32 scalar)."""
        outputs = self._outputs(inputs)
        if self.layer is not None:
            return chunked_lm_loss.loss_sum(outputs, *self._weights(), targets, planned_per_row=self.planned_per_row)
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), reduction="sum",
                               ignore_index=-100)

    def token_log_probs(self, inputs: dict, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Each position's log-prob of its target, shaped as `targets`, 0 where it does not count; at a
        `temperature`, the log-softmax of the logits divided by it (online RL's, as TRL's)."""
        return self.log_probs_of(self._outputs(inputs), targets, temperature)

    def log_probs_of(self, outputs: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """token_log_probs from what the positions hold (`held`, of a forward the caller ran), `targets` one per
        position of `outputs`."""
        if self.layer is not None:
            weight, bias = self._weights()
            if temperature != 1.0:  # (h W^T + b) / T, without the whole logits: h / T and b / T
                outputs, bias = outputs / temperature, None if bias is None else bias / temperature
            return chunked_lm_loss.token_log_probs(outputs, weight, bias, targets,
                                                   planned_per_row=self.planned_per_row)
        outputs = outputs / temperature if temperature != 1.0 else outputs
        logps = torch.log_softmax(outputs, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        return logps * (targets != -100)

    def logits_of(self, outputs: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary from what the positions hold (`held`): the output layer applied
        where the chunked path kept the hidden states (a distribution over the vocabulary is what is asked)."""
        if self.layer is None:
            return outputs
        weight, bias = self._weights()
        return F.linear(outputs, weight, bias).float()

    def per_position(self, inputs: dict, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation's view: each position's loss (0 where ignored) and whether its arg-max is the target."""
        outputs = self._outputs(inputs)
        if self.layer is not None:
            return chunked_lm_loss.per_position(outputs, *self._weights(), targets)
        losses = F.cross_entropy(outputs.transpose(1, 2), targets, reduction="none", ignore_index=-100)
        return losses, outputs.argmax(-1) == targets
