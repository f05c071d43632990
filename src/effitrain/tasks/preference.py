"""Preference tuning of a causal LM (--preference dpo | orpo): the causal-lm task on pairs of a chosen and
a rejected answer to one prompt (data/preferences.py). The model and what is saved are the causal-lm
task's (model/ stays a plain causal LM); the data is this task's; the loss, its counts and the metrics are
its objective's (tasks/objectives/: DPO, IPO, ORPO, one class each).

Each micro-batch holds whole pairs ([pairs, 2, width]), run as one forward of 2 x pairs rows, as TRL's
concatenated forward; a sequence's log-prob is the sum over its answer tokens, through the LM head
(tasks/lm_head.py: chunked, no whole logits)."""

from __future__ import annotations

import torch

from effitrain.errors import UserError
from effitrain.tasks.base import TrainLoss
from effitrain.tasks.causal_lm import CausalLM
from effitrain.tasks.objectives import pair_logps
from effitrain.tasks.objectives.objective import PAIR_METRICS, Objective


class Preference(CausalLM):
    supports_packing = False
    higher_is_better = ("preference_accuracy", "reward_margin", "rewards_chosen", "log_odds_ratio")
    METRICS = PAIR_METRICS

    def __init__(self, name: str, objective: Objective):
        """Built by tasks.for_config, with the objective of the run's settings."""
        super().__init__(name)
        self.objective = objective
        self.reference = objective.reference  # where DPO reads its reference log-probs; None: no reference

    def __repr__(self) -> str:
        return f"<task {self.name} --preference {self.objective.name}>"

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
        return f"preference pairs ({fmt}{template}), {self.objective.describe()}"

    def collators(self, processor, config):
        from effitrain.data import preferences, text

        collate = preferences.collator(processor.pad_token_id, text.pad_multiple(config))
        return collate, collate

    def before_training(self, model, encoded, processor, config, out_dir, autocast=None, resuming=False):
        """The reference, made from the starting model (dpo); the splits with its column (precompute)."""
        if self.reference is None:
            return encoded
        if autocast is not None:
            self.reference.autocast = autocast
        _, collate = self.collators(processor, config)
        return self.reference.prepare(model, encoded, collate, config.eval_batch_size, out_dir, self.answer_logps)

    # -- log-probs, the loss, evaluation: the objective's ---------------------------------------------
    def answer_logps(self, model, batch) -> torch.Tensor:
        """Each pair's answers' summed log-probs, [pairs, 2] (chosen, rejected)."""
        return pair_logps.answer_logps(model, batch)

    def item_count(self, batch) -> torch.Tensor:
        return self.objective.item_count(batch)

    def example_count(self, batch) -> torch.Tensor:
        return pair_logps.pair_count(batch)

    def example_digests(self, batch) -> list[int]:
        """One hash per pair: its two sequences without padding."""
        from effitrain.tasks.base import digest

        out = []
        for pair in range(batch["input_ids"].shape[0]):
            keep = batch["attention_mask"][pair].bool()
            out.append(digest({f"{key}_{side}": batch[key][pair, side][keep[side]] for key in ("input_ids", "labels")
                               for side in (0, 1)}))
        return out

    def rollout(self, model, group: list, generator: torch.Generator) -> list:
        return self.objective.rollout(model, group, generator)

    def train_loss(self, model, batch) -> TrainLoss:
        return self.objective.loss(model, batch)

    def loss_sum(self, model, batch) -> torch.Tensor:
        return self.train_loss(model, batch).loss_sum

    def planned_loss_sum(self, model, batch, loss_positions: int | None) -> torch.Tensor:
        return self.loss_sum(model, batch)  # the planner plans pairs as causal-LM rows (planner.for_preference)

    def train_metric_names(self) -> tuple[str, ...]:
        return self.objective.train_metric_names

    def eval_setting(self, processor, config, split):
        return None

    def eval_outputs(self, model, batch, setting=None) -> tuple[torch.Tensor, ...]:
        return self.objective.eval_outputs(model, batch)

    def metrics(self, outputs: tuple, label_names: list[str] | None) -> dict[str, float]:
        return self.objective.metrics(outputs)

    def metric_names(self, label_names: list[str] | None) -> list[str]:
        return list(self.objective.metric_names)

    def example_batch(self, model_config, batch_size: int, seq_len: int) -> dict:
        """A micro-batch of `batch_size` pairs: 2 x batch_size rows (the planner's shapes)."""
        ids = torch.zeros(batch_size, 2, seq_len, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
                "reference_logps": torch.zeros(batch_size, 2, dtype=torch.float64)}
