"""Online RL of a causal LM (--rl grpo | rloo): the causal-lm task on prompts alone, whose answers the model
generates while it trains and learns from by their rewards. The model and what is saved are the causal-lm
task's (model/ stays a plain causal LM); the data is prompts (a `prompt` column, a string or a list of
messages, or a conversation's turns before its last answer, and any other columns, which reach the reward
functions); the rollout, the loss, its counts and the metrics are its objective's (tasks/objectives/grpo.py).

A training micro-batch holds prompts (left-padded ids and each row's index in the data, which keys its
samples); the objective's rollout turns each into prompts x G completions once per step. Evaluation: greedy
completions of the held-out prompts, scored by the same reward functions."""

from __future__ import annotations

import torch

from effitrain.errors import UserError
from effitrain.tasks.causal_lm import CausalLM
from effitrain.tasks.base import TrainLoss, digest
import effitrain.tasks.objectives.completion_batches as completion_batches
from effitrain.tasks.objectives.grpo import Grpo, PromptData, unpadded


class OnlineRL(CausalLM):
    supports_packing = False
    METRICS_HIGHER = ("reward", "exact_match", "end_of_turn_share")

    def __init__(self, name: str, objective: Grpo):
        """Built by tasks.for_config, with the objective of the run's settings."""
        super().__init__(name)
        self.objective = objective
        self.prompt_data: PromptData | None = None  # every split's rows, train's first (their row_index)

    def __repr__(self) -> str:
        return f"<task {self.name} --rl {self.objective.name}>"

    @property
    def supports_distillation(self) -> bool:
        """--distill-from: the teacher of an objective that learns from one (on-policy distillation)."""
        return bool(getattr(self.objective, "teacher", None))

    def check_built_model(self, model, encoded, processor, config) -> None:
        super().check_built_model(model, encoded, processor, config)
        self.objective.check_built_model(self, model, processor)

    def check_config(self, config) -> None:
        if config.loss_on != "completion":
            raise UserError(f"--loss-on does not apply to --rl {config.rl} (its loss is on the completions it "
                            "generates)", "drop --loss-on")
        super().check_config(config)

    # -- data --------------------------------------------------------------------------------------
    def load_data(self, config):
        """Prompts alone (conversations.prompt_only_columns: `prompt` and every other column), or conversations
        (`messages`) split as SFT splits them, then cut into prompts and answers; then the reward functions
        imported and checked against those columns, before any model loads."""
        from effitrain.data import conversations, sources

        self.check_lengths(config)
        loaded = sources.load(config, lambda names, where: conversations.prompt_only_columns(names, where),
                              bad_rows=conversations.bad_prompt_rows)
        loaded.splits, dropped = conversations.conversations_as_prompts(loaded.splits)
        loaded.skipped_rows += dropped
        self.objective.load_rewards(loaded.splits["train"].column_names)
        return loaded

    def preprocess(self, splits, processor, config, base_dir):
        """Each prompt's ids as SFT saw them before an answer (data/prompt_batches.py), its end kept when it
        is longer than --max-length or leaves no room for --max-new-tokens; each row's index across the
        splits, train's first (what keys its samples)."""
        from datasets import Dataset, DatasetDict

        from effitrain.data import answers, conversations, prompt_batches, templates

        fmt = conversations.of_prompts(splits["train"], f"--data {config.data}")
        conversational = fmt == conversations.CHAT_PROMPT_ONLY
        if config.chat_template is not None and not conversational:
            raise UserError(f"--chat-template applies to prompts given as messages; --data {config.data} holds "
                            "them as text", "drop --chat-template, or give each prompt as a list of messages")
        if config.chat_template is not None:
            templates.install(processor, config.chat_template)
        templates.record_format(processor, conversational)  # for predict --prompt
        keep = self.prompt_room(config)
        columns, encoded, start = {}, {}, 0
        for name in ["train", *(name for name in splits if name != "train")]:  # train's rows first: 0, 1, ...
            rows = splits[name].to_dict()
            ids = [row[-keep:] for row in prompt_batches.prompt_ids(processor, rows["prompt"])]
            encoded[name] = Dataset.from_dict({"input_ids": ids, "row_index": list(range(start, start + len(ids)))})
            for column, values in rows.items():
                columns.setdefault(column, []).extend(values)
            start += len(ids)
        self.prompt_data = PromptData(processor, answers.stop_ids(processor), prompt_batches.pad_id(processor),
                                      columns, conversational)
        return DatasetDict(encoded)

    def prompt_room(self, config) -> int:
        """The most prompt tokens kept: --max-length, and the model's positions less --max-new-tokens."""
        from effitrain.models import loading

        source = loading.resolve_source(config.model, config.allow_pickle)
        positions = getattr(self.source_config(source), "max_position_embeddings", None)
        room = config.max_length if positions is None else min(config.max_length, positions - config.max_new_tokens)
        if room < 1:
            raise UserError(f"--max-new-tokens {config.max_new_tokens} leaves no room for a prompt in the model's "
                            f"{positions} positions", f"pass --max-new-tokens below {positions}")
        return room

    def data_description(self, splits, config) -> str:
        from effitrain.data import conversations

        fmt = conversations.of_prompts(splits["train"], f"--data {config.data}")
        template = f", chat template {config.chat_template or 'of the tokenizer'}" \
            if fmt == conversations.CHAT_PROMPT_ONLY else ""
        return f"{fmt}{template}, {self.objective.describe()}"

    def collators(self, processor, config):
        """Prompts padded on the left (as sampling and generation take them), with their row index."""
        from effitrain.data import prompt_batches

        pad = prompt_batches.pad_id(processor)

        def collate(features):
            batch = prompt_batches.left_padded([feature["input_ids"] for feature in features], pad)
            return {**batch, "row_index": torch.tensor([feature["row_index"] for feature in features])}

        return collate, collate

    def before_training(self, model, encoded, processor, config, out_dir, autocast=None, resuming=False):
        """The objective gets the prompts' rows and, with --kl-beta, its reference made from the starting model."""
        self.objective.data = self.prompt_data
        self.objective.before_training(self, model, processor, autocast)
        reference = self.objective.reference
        if reference is not None:
            if autocast is not None:
                reference.autocast = autocast
            reference.prepare(model, encoded, None, config.eval_batch_size, out_dir, None)
        return encoded

    def sequence_length(self, config, processor) -> int:
        return config.max_length + config.max_new_tokens

    # -- the rollout, the loss and its counts: the objective's ----------------------------------------
    def rollout(self, model, group: list, generator: torch.Generator) -> list:
        return self.objective.rollout(model, group, generator)

    def item_count(self, batch) -> torch.Tensor:
        return self.objective.item_count(batch)

    def example_count(self, batch) -> torch.Tensor:
        """Prompts (a trained micro-batch holds each prompt's G completions)."""
        rows = len(batch["input_ids"])
        per_prompt = self.objective.generations if "completion_mask" in batch else 1
        return torch.tensor(rows / per_prompt, dtype=torch.float64, device=batch["input_ids"].device)

    def example_digests(self, batch) -> list[int]:
        """One hash per prompt: its ids without padding and its row index."""
        return [digest({"input_ids": torch.tensor(ids), "row_index": row})
                for ids, row in zip(unpadded(batch), batch["row_index"].cpu())]

    def train_loss(self, model, batch) -> TrainLoss:
        return self.objective.loss(model, batch)

    def loss_sum(self, model, batch) -> torch.Tensor:
        return self.train_loss(model, batch).loss_sum

    def planned_loss_sum(self, model, batch, loss_positions: int | None) -> torch.Tensor:
        """The loss as training runs it under a half precision: accelerate's autocast wraps the model's forward
        only and makes its outputs fp32 (convert_outputs_to_fp32), so the LM head the loss multiplies itself
        (tasks/lm_head.py) runs in fp32 (planning/rl_step.py; measured: benchmarks/planner/rl_step_probe.py)."""
        device = batch["input_ids"].device.type
        if not torch.is_autocast_enabled(device):
            return self.loss_sum(model, batch)
        dtype, forward, own = torch.get_autocast_dtype(device), model.forward, model.__dict__.get("forward")

        def autocast_forward(*args, **kwargs):
            with torch.autocast(device, dtype=dtype):
                out = forward(*args, **kwargs)
            out.logits = out.logits.float()
            return out

        model.forward = autocast_forward
        try:
            with torch.autocast(device, enabled=False):
                return self.loss_sum(model, batch)
        finally:
            if own is None:
                del model.forward  # the class's again
            else:
                model.forward = own

    def train_metric_names(self) -> tuple[str, ...]:
        return self.objective.train_metric_names

    # -- evaluation: greedy completions scored by the rewards --------------------------------------------
    def eval_setting(self, processor, config, split):
        return self.prompt_data

    def eval_outputs(self, model, batch, setting=None) -> tuple[torch.Tensor, ...]:
        return self.objective.eval_outputs(model, batch, setting)

    def metrics(self, outputs: tuple, label_names: list[str] | None) -> dict[str, float]:
        return self.objective.metrics(outputs)

    def metric_names(self, label_names: list[str] | None) -> list[str]:
        return list(self.objective.metric_names)

    def is_higher_better(self, metric: str) -> bool:
        return metric.startswith(self.METRICS_HIGHER)

    def example_batch(self, model_config, batch_size: int, seq_len: int) -> dict:
        """A trained micro-batch of `batch_size` rows (prompts x G completions: the planner's rows, planning/
        rl_step.py) of `seq_len` positions, the last min(max_new_tokens, seq_len - 1) the completion's; each
        prompt's G rows side by side with the same prompt, as the rollout makes them, which the batch also says
        (PLANNED_GROUP_ROWS: fake tensors have no values to compare), so the planned forward runs each prompt
        once as training does. Every row is kept: a non-zero advantage (+1, -1 in turn: a group whose rewards
        differ) and every completion token counted. The worst case, every group with a spread in its rewards:
        a run's step can meet it whatever share of groups has none on average, and the planner's fake tensors
        keep every row anyway (rows_of cannot select by values they do not have)."""
        rows, width = batch_size, min(self.objective.max_new_tokens, seq_len - 1)
        generations, vocab = self.objective.generations, max(getattr(model_config, "vocab_size", 2), 2)
        row = torch.arange(rows)
        # each group's prompt and each row's completion tokens distinct (ids 1..vocab - 1)
        ids = torch.cat([(row // generations % (vocab - 1) + 1)[:, None].expand(rows, seq_len - width),
                         (row % (vocab - 1) + 1)[:, None].expand(rows, width)], dim=1)
        metrics = len(self.objective.train_metric_names) - 1 - int(bool(self.objective.beta))  # clip_ratio, kl
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "position_ids": torch.arange(seq_len).expand(rows, -1), "completion_mask": torch.ones(rows, width),
                 "advantages": 1.0 - 2.0 * (row % 2), "old_logps": torch.zeros(rows, width),
                 "token_weight": torch.zeros(rows, dtype=torch.float64),
                 "completion_sums": torch.zeros(rows, metrics, dtype=torch.float64),
                 completion_batches.PLANNED_GROUP_ROWS: generations}
        batch.update(self.objective.planned_extras(model_config))
        if self.objective.beta:
            batch["ref_logps"] = torch.zeros(rows, width)
            if self.objective.sequence_level:  # RLOO's KL: a reward penalty per completion, made in the rollout
                batch["sequence_kl"] = torch.zeros(rows, dtype=torch.float64)
        return batch
