"""Preference tuning of a causal LM (--preference dpo | orpo): the causal-lm task on pairs of a chosen and
a rejected answer to one prompt (data/preferences.py). The model and what is saved are the causal-lm
task's (model/ stays a plain causal LM); the data, the loss and the metrics are these.

Each micro-batch holds whole pairs ([pairs, 2, width]), run as one forward of 2 x pairs rows, as TRL's
concatenated forward. A sequence's log-prob is the sum over its answer tokens, through the chunked head
(speedups/chunked_lm_loss.token_log_probs: no whole logits).

- DPO (TRL's DPOTrainer, loss_type sigmoid): with r = beta x (log p - log p_ref) of each answer, the loss
  of a pair is -log sigmoid(r_chosen - r_rejected) (with --dpo-label-smoothing e, the conservative
  -(1 - e) log sigmoid(x) - e log sigmoid(-x)); --dpo-loss ipo: (the per-token log-ratio margin -
  1 / (2 beta))^2, the IPO paper's (TRL 1.16 also weighs it by the answers' probabilities: not here).
  The item is the pair: a step's loss is the mean over its pairs, whatever the processes, micro-batches
  and accumulation.
- ORPO (TRL's ORPOTrainer): the chosen sequences' NLL, a mean over their tokens (prompt and answer, as TRL
  computes it), minus beta x the mean over pairs of log sigmoid(log-odds ratio) of the answers' mean
  token log-probs. Two terms, each a mean over its own items: loss_sum and item_count are vectors, and the
  step divides each by its own count over the whole step (engine/step.py), so the step is exact too (a
  mean of micro-batch means, as TRL with accumulation computes, is not)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from effitrain.errors import UserError
from effitrain.speedups import chunked_lm_loss
from effitrain.tasks import reference as references
from effitrain.tasks.causal_lm import CausalLM


@dataclass(frozen=True)
class Objective:
    kind: str  # dpo | orpo
    beta: float
    reference: str | None = None  # dpo: precompute | copy | adapters
    loss: str = "sigmoid"  # dpo: sigmoid | ipo
    smoothing: float = 0.0  # dpo sigmoid: the share of pairs assumed flipped

    @classmethod
    def of(cls, config) -> "Objective":
        return cls(config.preference, config.beta, config.reference, config.dpo_loss, config.dpo_label_smoothing)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (TRL's ORPO)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class Preference(CausalLM):
    supports_packing = False
    higher_is_better = ("preference_accuracy", "reward_margin", "rewards_chosen", "log_odds_ratio")
    METRICS = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy")

    def __init__(self, name: str, objective: Objective):
        super().__init__(name)
        self.objective = objective
        # A config not yet resolved (config.resolved fills it in) gets train's default without adapters.
        self.reference = references.MODES[objective.reference or "precompute"]() if objective.kind == "dpo" else None

    def __repr__(self) -> str:
        return f"<task {self.name} --preference {self.objective.kind}>"

    def check_config(self, config) -> None:
        if config.packing:
            raise UserError("--packing does not apply to --preference (each pair's two answers are scored apart)",
                            "drop --packing")
        for flag, name, default in (("--max-new-tokens", "max_new_tokens", None), ("--loss-on", "loss_on", "completion")):
            if getattr(config, name) != default:
                raise UserError(f"{flag} does not apply to --preference (its loss is on the answers of each pair)",
                                f"drop {flag}")
        super().check_config(config)

    # -- data --------------------------------------------------------------------------------------
    def load_data(self, config):
        from effitrain.data import preferences, sources

        self.check_lengths(config)

        def columns(names, where):
            if not preferences.is_preference(names):
                raise UserError(f"--preference {config.preference} trains on preference pairs, and {where} has no "
                                f"`chosen`/`rejected` columns (columns: {', '.join(names)})",
                                "give each row a `prompt`, a `chosen` and a `rejected` answer, or drop --preference")
            return preferences.columns(names, where)

        return sources.load(config, columns, bad_rows=preferences.bad_rows)

    def preprocess(self, splits, processor, config, base_dir):
        from effitrain.data import answers, preferences, templates

        fmt = preferences.of_data(splits["train"])
        if config.chat_template is not None and fmt == preferences.STRINGS:
            raise UserError(f"--chat-template applies to conversations, and --data {config.data} holds its pairs "
                            "as text", "drop --chat-template, or give prompt, chosen and rejected as messages")
        if config.chat_template is not None:
            templates.install(processor, config.chat_template)
        if fmt != preferences.STRINGS:
            answers.check_generation_prompt(processor, config.model)
        return preferences.encode_splits(splits, processor, config.max_length)

    UNTRAINABLE = "pair(s) of --data {data} keep no token of the chosen or the rejected answer"

    def trainable_flags(self, split) -> list[bool]:
        """Per pair: whether both answers keep a token within --max-length."""
        from effitrain.data import preferences

        return [preferences.has_answers(row) for row in split.select_columns(["chosen_labels", "rejected_labels"])]

    def data_description(self, splits, config) -> str:
        from effitrain.data import preferences

        fmt = preferences.of_data(splits["train"])
        template = "" if fmt == preferences.STRINGS else f", chat template {config.chat_template or 'of the tokenizer'}"
        objective = self.objective
        said = f"{objective.kind} beta {objective.beta:g}"
        if objective.kind == "dpo":
            said += f" ({objective.loss}), reference {objective.reference}"
        return f"preference pairs ({fmt}{template}), {said}"

    def collators(self, processor, config):
        from effitrain.data import preferences, text

        collate = preferences.collator(processor.pad_token_id, text.pad_multiple(config))
        return collate, collate

    def before_training(self, model, encoded, processor, config, out_dir, autocast=None):
        """The reference, made from the starting model (dpo); the splits with its column (precompute)."""
        if self.reference is None:
            return encoded
        if autocast is not None:
            self.reference.autocast = autocast
        _, collate = self.collators(processor, config)
        return self.reference.prepare(model, encoded, collate, config.eval_batch_size, out_dir, self.answer_logps)

    # -- log-probs ---------------------------------------------------------------------------------
    def token_logps(self, model, batch, whole_chosen: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(each position's log-prob of the next token, [pairs, 2, width - 1], 0 where it does not count;
        the positions that count: the answers, and with `whole_chosen` every real token of the chosen
        sequences, as ORPO's NLL takes them)."""
        ids, mask, labels = (batch[key].flatten(0, 1) for key in ("input_ids", "attention_mask", "labels"))
        targets = labels[:, 1:]
        if whole_chosen:
            every = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
            targets = torch.where(torch.arange(len(ids), device=ids.device)[:, None] % 2 == 0, every, targets)
        inputs = {"input_ids": ids, "attention_mask": mask}
        head = chunked_lm_loss.output_layer(model)
        if head is not None:
            with chunked_lm_loss.hidden_states_of(head):
                hidden = model(**inputs, use_cache=False).logits[:, :-1]
            logps = chunked_lm_loss.token_log_probs(hidden, *chunked_lm_loss.weight_and_bias(head), targets)
        else:  # an output layer the chunked loss cannot take (an adapter on it, soft-capped logits)
            logits = model(**inputs, use_cache=False).logits[:, :-1].float()
            logps = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
            logps = logps * (targets != -100)
        return logps.view(*batch["input_ids"].shape[:2], -1), targets.view(*batch["input_ids"].shape[:2], -1)

    def answer_logps(self, model, batch) -> torch.Tensor:
        """Each pair's answers' summed log-probs, [pairs, 2] (chosen, rejected)."""
        return self.token_logps(model, batch)[0].sum(-1)

    def answer_mask(self, batch) -> torch.Tensor:
        return batch["labels"][..., 1:] != -100

    # -- the loss ----------------------------------------------------------------------------------
    def item_count(self, batch) -> torch.Tensor:
        """dpo: the pairs; orpo: [the chosen sequences' predicted tokens, the pairs]."""
        pairs = torch.tensor(batch["input_ids"].shape[0], device=batch["input_ids"].device)
        if self.objective.kind == "dpo":
            return pairs
        return torch.stack([batch["attention_mask"][:, 0, 1:].sum(), pairs])

    def example_count(self, batch) -> torch.Tensor:
        return torch.tensor(batch["input_ids"].shape[0], device=batch["input_ids"].device)

    def example_digests(self, batch) -> list[int]:
        """One hash per pair: its two sequences without padding."""
        from effitrain.tasks.base import digest

        out = []
        for pair in range(batch["input_ids"].shape[0]):
            keep = batch["attention_mask"][pair].bool()
            out.append(digest({f"{key}_{side}": batch[key][pair, side][keep[side]] for key in ("input_ids", "labels")
                               for side in (0, 1)}))
        return out

    def loss_sum(self, model, batch) -> torch.Tensor:
        if self.objective.kind == "orpo":
            nll, logps, counts = self.orpo_parts(model, batch)
            ratio = F.logsigmoid(self.log_odds(logps, counts))
            self.record_rewards(self.objective.beta * logps.detach() / counts.clamp(min=1), ratio.detach().sum())
            return torch.stack([nll.sum(), -self.objective.beta * ratio.sum()])
        # The reference first: its forward's activations are freed before the policy's are kept for the backward.
        reference = self.reference.logps(model, batch, self.answer_logps)
        policy = self.answer_logps(model, batch)
        self.record_rewards(self.objective.beta * (policy.detach() - reference.to(policy.dtype)))
        return self.dpo_losses(policy, reference, self.answer_mask(batch).sum(-1)).sum()

    def train_metric_names(self) -> tuple[str, ...]:
        return (*self.METRICS[1:], *(("log_odds_ratio",) if self.objective.kind == "orpo" else ()))

    def record_rewards(self, rewards: torch.Tensor, log_odds_ratio: torch.Tensor | None = None) -> None:
        """The step's log line's sums over this micro-batch's pairs (`rewards`: [pairs, 2]), as `metrics`
        computes them at evaluations, and the pairs."""
        rewards = rewards.double()
        margin = rewards[:, 0] - rewards[:, 1]
        sums = [rewards[:, 0].sum(), rewards[:, 1].sum(), margin.sum(), (margin > 0).double().sum()]
        if log_odds_ratio is not None:
            sums.append(log_odds_ratio.double())
        self.record_train_sums(torch.stack([*sums, rewards.new_tensor(float(len(rewards)))]))

    def dpo_losses(self, policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each pair's DPO loss from the [pairs, 2] log-probs of the policy and the reference."""
        objective = self.objective
        ratios = policy - reference.to(policy.dtype)
        if objective.loss == "ipo":
            per_token = ratios / counts.clamp(min=1)
            return (per_token[:, 0] - per_token[:, 1] - 1 / (2 * objective.beta)) ** 2
        margin = objective.beta * (ratios[:, 0] - ratios[:, 1])
        return -(1 - objective.smoothing) * F.logsigmoid(margin) - objective.smoothing * F.logsigmoid(-margin)

    def orpo_parts(self, model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each chosen sequence's NLL summed over its tokens, [pairs]; the answers' summed log-probs and
        token counts, [pairs, 2])."""
        logps, targets = self.token_logps(model, batch, whole_chosen=True)
        answers = self.answer_mask(batch)
        return -logps[:, 0].sum(-1), (logps * answers).sum(-1), answers.sum(-1)

    @staticmethod
    def log_odds(logps: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """ORPO's log odds ratio of each pair, from the answers' mean token log-probs."""
        mean = (logps / counts.clamp(min=1)).float()
        return (mean[:, 0] - mean[:, 1]) - (log1mexp(mean[:, 0]) - log1mexp(mean[:, 1]))

    # -- evaluation --------------------------------------------------------------------------------
    def eval_setting(self, processor, config, split):
        return None

    def eval_outputs(self, model, batch, setting=None) -> tuple[torch.Tensor, ...]:
        """Per pair: the policy's and the reference's answer log-probs ([pairs, 2] each), the answers' token
        counts, and the chosen sequence's NLL sum and token count (orpo)."""
        counts = self.answer_mask(batch).sum(-1)
        if self.objective.kind == "orpo":
            nll, policy, _ = self.orpo_parts(model, batch)
            reference = torch.zeros_like(policy)
        else:
            policy = self.answer_logps(model, batch)
            reference = self.reference.logps(model, batch, self.answer_logps)
            nll = torch.zeros_like(policy[:, 0])
        return (policy.double(), reference.double(), counts, nll.double(), batch["attention_mask"][:, 0, 1:].sum(-1))

    def metrics(self, outputs: tuple, label_names: list[str] | None) -> dict[str, float]:
        policy, reference, counts, nll, tokens = outputs
        beta, pairs = self.objective.beta, max(len(policy), 1)
        if self.objective.kind == "orpo":
            ratio = F.logsigmoid(self.log_odds(policy.double(), counts).double())
            rewards = beta * policy / counts.clamp(min=1)  # TRL's ORPO rewards: beta x mean token log-prob
            nll_mean = float(nll.sum()) / max(int(tokens.sum()), 1)
            extra = {"nll": nll_mean, "log_odds_ratio": float(ratio.mean()) if len(ratio) else 0.0}
            loss = nll_mean - beta * extra["log_odds_ratio"]
        else:
            rewards = beta * (policy - reference)
            loss, extra = float(self.dpo_losses(policy, reference, counts).sum()) / pairs, {}
        return {"loss": loss, "rewards_chosen": float(rewards[:, 0].sum()) / pairs,
                "rewards_rejected": float(rewards[:, 1].sum()) / pairs,
                "reward_margin": float((rewards[:, 0] - rewards[:, 1]).sum()) / pairs,
                "preference_accuracy": float((rewards[:, 0] > rewards[:, 1]).double().sum()) / pairs,
                **extra, "samples": len(policy)}

    def metric_names(self, label_names: list[str] | None) -> list[str]:
        return [*self.METRICS, *(("nll", "log_odds_ratio") if self.objective.kind == "orpo" else ())]

    def example_batch(self, model_config, batch_size: int, seq_len: int) -> dict:
        """A micro-batch of `batch_size` pairs: 2 x batch_size rows (the planner's shapes)."""
        ids = torch.zeros(batch_size, 2, seq_len, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
                "reference_logps": torch.zeros(batch_size, 2, dtype=torch.float64)}
