"""Online RL with verifiable rewards (--rl grpo | rloo), held by tasks/online_rl.py: once per optimizer step
(`rollout`), every prompt of this process's micro-batches gets G completions sampled at once
(tasks/sampling.py: row (prompt's index in the data, sample) drawn from its own stream of the step's seed, so
the completions do not depend on the processes, micro-batches or a resume), scored by the reward functions
(tasks/objectives/rewards/), turned into advantages within each group (a prompt's G completions are made on
one process; `--scale-rewards batch` gathers the step's rewards over the processes first); each prompt
micro-batch comes back as a micro-batch of its prompts x G completions. `loss`: the completion tokens'
log-probs of the policy's forward and policy_gradient.py's arithmetic (TRL 1.16's), summed, over step-global
counts (`item_count`).

With one update per generation the ratio to the generating policy is the forward's own log-probs detached
(TRL's own choice then): exactly 1, so the gradient is the group-advantage REINFORCE gradient. The sampling
forward's log-probs travel with the batch (`old_logps`) for RLOO's KL penalty.

The step's log line shows, over the step's completions: the reward (weighted, and each function's), the
share of groups with no spread, the completion length, the share cut at --max-new-tokens; over the
completion tokens: the clipped share and the KL (with --kl-beta); and the seconds generation took (a mean
over the processes). Evaluation: greedy completions of the held-out prompts, scored by the same functions."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import effitrain.tasks.sampling as sampling
import effitrain.tasks.reference as references
from effitrain.tasks.base import TrainLoss
import effitrain.tasks.objectives.completion_batches as completion_batches
import effitrain.tasks.objectives.policy_gradient as pg
import effitrain.tasks.objectives.rewards as rewards
from effitrain.tasks.objectives.objective import Objective


@dataclass
class PromptData:
    """What the task tells its objective about the data: the tokenizer, the ids that end a completion, the
    pad id, and a split's rows by their index (the `prompt` column as given, and every other column)."""

    tokenizer: object
    stop_ids: list[int]
    pad_id: int
    columns: dict[str, list]
    conversational: bool  # prompts are message lists: completions reach the rewards as assistant messages

    def prompts(self, rows: list[int]) -> list:
        return [self.columns["prompt"][row] for row in rows]

    def others(self, rows: list[int]) -> dict[str, list]:
        return {name: [values[row] for row in rows] for name, values in self.columns.items() if name != "prompt"}

    def texts(self, completions: list[list[int]]) -> list:
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return [[{"role": "assistant", "content": text}] for text in texts] if self.conversational else texts



def step_token_weight(batches: list[dict], device) -> tuple[float, float]:
    """(the step's completions / its completion tokens, counted over every process; the step's completions per
    process): a per-completion token sum x the first, summed over completions / completions, is the step's mean
    per token; seconds x the second, over completions, the processes' mean. Every process calls it (a
    collective), with or without micro-batches."""
    completions = sum(len(batch["input_ids"]) for batch in batches)
    tokens = sum(float(batch["completion_mask"].sum()) for batch in batches)
    step = _summed(torch.tensor([completions, tokens], dtype=torch.float64, device=device))
    processes = torch.distributed.get_world_size() if _distributed() else 1
    return (float(step[0] / step[1]) if step[1] > 0 else 0.0), float(step[0]) / processes

class Grpo(Objective):
    """GRPO (TRL's GRPOTrainer): per-token clipped loss, its normalisation by --loss-type."""

    name = "grpo"
    sequence_level = False  # RLOO's loss is per sequence

    def __init__(self, *, generations: int = 8, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, epsilon: float = 0.2, epsilon_high: float | None = None,
                 loss_type: str = "dapo", scale_rewards: str = "group", beta: float = 0.0,
                 mask_truncated: bool = False, reward: list[str] | None = None,
                 reward_weights: list[float] | None = None, reference: str = "copy"):
        super().__init__(beta)
        self.generations, self.temperature, self.top_p = generations, temperature, top_p
        self.max_new_tokens, self.epsilon, self.epsilon_high = max_new_tokens, epsilon, epsilon_high
        self.loss_type, self.scale_rewards, self.mask_truncated = loss_type, scale_rewards, mask_truncated
        self.reward_texts, self.reward_weights = reward, reward_weights
        self.reference = references.MODES[reference]() if beta > 0 else None
        self.functions: list = []
        self.weights: list[float] = []
        self.data: PromptData | None = None  # the training split's, given by the task before training

    @classmethod
    def of(cls, config) -> "Grpo":
        from effitrain.models import adapters

        return cls(generations=config.num_generations, temperature=config.temperature, top_p=config.top_p,
                   max_new_tokens=config.max_new_tokens, epsilon=config.clip_epsilon,
                   epsilon_high=config.clip_epsilon_high, loss_type=cls.loss_of(config),
                   scale_rewards=config.scale_rewards, beta=config.kl_beta, mask_truncated=config.mask_truncated,
                   reward=config.reward, reward_weights=config.reward_weights,
                   reference=adapters.form_of(config).reference)

    @staticmethod
    def loss_of(config) -> str:
        return config.loss_type

    def describe(self) -> str:
        kl = f", KL beta {self.beta:g} (reference: {self.reference_name()})" if self.beta else ""
        return (f"{self.name}: {self.generations} completions per prompt of at most {self.max_new_tokens} tokens, "
                f"temperature {self.temperature:g}, {self.loss_type} loss, rewards scaled by {self.scale_rewards}"
                f"{kl}; rewards {', '.join(f.source for f in self.functions)}")

    def reference_name(self) -> str:
        return {references.FrozenCopy: "a frozen copy", references.AdaptersOff: "the adapters switched off"}.get(
            type(self.reference), "none")

    # -- what the step's log shows ------------------------------------------------------------------
    @property
    def reward_names(self) -> list[str]:
        return [f"reward_{function.name}" for function in self.functions]

    @property
    def train_metric_names(self) -> tuple[str, ...]:
        """Sums over the step's completions (their count last): the first PER_COMPLETION ones are rollout's."""
        kl = ("kl",) if self.beta else ()
        return ("reward", *self.reward_names, "zero_spread_share", "completion_length", "truncated_share",
                "generation_seconds", "clip_ratio", *kl)

    # -- what the run gives it before and beside the steps ----------------------------------------------
    def check_built_model(self, task, model, processor) -> None:
        """What the objective checks once the model is built, before the run folder is claimed (nothing here)."""

    def before_training(self, task, model, processor, autocast=None) -> None:
        """What the objective holds through the steps beside the model (GRPO: nothing; tasks/online_rl.py makes
        its reference)."""

    def planned_extras(self, model_config) -> dict:
        """What the planner's example micro-batch adds for this objective (tasks/online_rl.py's example_batch)."""
        return {}

    # -- the rewards --------------------------------------------------------------------------------
    def load_rewards(self, columns: list[str]) -> None:
        """The reward functions imported (a user's file once) and checked against the data's columns; with no
        --reward, exact-match where the data has an answer (else refused: catalog's default needs one)."""
        from effitrain.errors import UserError
        from effitrain.tasks.objectives.rewards import builtin_rewards

        texts = self.reward_texts
        if texts is None:
            if not set(builtin_rewards.ANSWER_COLUMNS) & set(columns):
                raise UserError(f"--rl {self.name} needs a reward function, and the data has no `answer` or "
                                f"`solution` column for the default exact-match (it has {', '.join(columns)})",
                                "pass --reward path.py:name (or a built-in: exact-match, number-match, ends-turn), "
                                "or add an `answer` column")
            texts = ["exact-match"]
        self.functions, self.weights = rewards.load(texts, self.reward_weights)
        rewards.check_columns(self.functions, columns)

    def score(self, data: PromptData, rows: list[int], ids: list[list[int]], ended: list[bool]):
        """The completions `ids` of the data's `rows` (a row per completion) scored: RewardScores."""
        return rewards.score(self.functions, self.weights, data.prompts(rows), data.texts(ids), data.others(rows),
                             row_ids=rows, completion_ids=ids, completion_ended=ended)

    # -- the rollout: sampling, rewards, advantages ------------------------------------------------------
    def rollout(self, model, group: list, generator: torch.Generator) -> list:
        started = time.perf_counter()
        present = [batch for batch in group if batch is not None]
        rows, made = self.sample(model, present, generator)
        repeated = [row for row in rows for _ in range(self.generations)]
        device = present[0]["input_ids"].device if present else _device(model)
        lengths = made.lengths.tolist() if made is not None else []
        ids = [row[:length] for row, length in zip(made.ids.tolist(), lengths)] if made is not None else []
        ended = made.stopped.tolist() if made is not None else []
        scores = self.score(self.data, repeated, ids, ended) if ids else None
        mask = made.mask if made is not None else None
        if mask is not None and self.mask_truncated:
            mask = pg.mask_truncated(mask, ~made.stopped)
        batches = self._micro_batches(model, present, made, mask, device)
        rewards_now = self._rewards(scores, batches, len(rows), device)
        advantages = self._advantages(rewards_now)
        seconds = time.perf_counter() - started
        self._attach(batches, scores, made, advantages, rewards_now, seconds, device)
        done = iter(batches)
        return [None if batch is None else next(done) for batch in group]

    def sample(self, model, present: list, generator: torch.Generator) -> tuple[list[int], object]:
        """The data rows of this process's prompts, and G completions of each (sampling.Completions, None
        without prompts), each drawn from the stream of (the step's seed, its row, its sample index)."""
        prompts = [prompt for batch in present for prompt in unpadded(batch)]
        rows = [int(row) for batch in present for row in batch["row_index"].tolist()]
        if not prompts:
            return rows, None
        return rows, sampling.sample(model, [p for p in prompts for _ in range(self.generations)],
                                     [(row, sample) for row in rows for sample in range(self.generations)],
                                     max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                     top_p=self.top_p, stop_ids=self.data.stop_ids, pad_id=self.data.pad_id,
                                     seed=generator.initial_seed())

    def _micro_batches(self, model, present: list, made, mask, device) -> list[dict]:
        """Each prompt micro-batch as its prompts x G completions (the reference's log-probs with --kl-beta)."""
        out, start = [], 0
        for batch in present:
            count = len(batch["input_ids"]) * self.generations
            repeat = (lambda t: t.repeat_interleave(self.generations, dim=0))
            part = slice(start, start + count)
            micro = completion_batches.sequences(repeat(batch["input_ids"]), repeat(batch["attention_mask"]),
                                                 made.ids[part], mask[part])
            micro["row_index"] = repeat(batch["row_index"])
            micro["completion_mask"] = mask[part].to(device)
            micro["old_logps"] = made.logps[part].to(device)
            if self.reference is not None:
                micro["ref_logps"] = self.reference.logps(model, micro, self._logps).to(device)
            out.append(micro)
            start += count
        return out

    def _logps(self, model, batch) -> torch.Tensor:
        return completion_batches.completion_logps(model, batch, self.temperature)

    def _rewards(self, scores, batches: list[dict], prompts: int, device) -> torch.Tensor:
        """[prompts, G] float64: the weighted rewards of this process's groups (NaN: unscored)."""
        if scores is None:
            return torch.zeros((0, self.generations), dtype=torch.float64, device=device)
        return scores.weighted.double().view(prompts, self.generations).to(device)

    def _advantages(self, rewards_now: torch.Tensor) -> torch.Tensor:
        """[prompts, G] of this process: within each group, or over the step's rewards gathered from every
        process (--scale-rewards batch) in process order, the same whatever the layout up to rounding."""
        if self.scale_rewards != "batch" or not _distributed():
            return pg.advantages(rewards_now, self.scale_rewards, rloo=self.sequence_level)
        everyone = _gather(rewards_now.cpu())
        rank = torch.distributed.get_rank()
        start = sum(len(part) for part in everyone[:rank])
        whole = pg.advantages(torch.cat(everyone), self.scale_rewards, rloo=self.sequence_level)
        return whole[start:start + len(rewards_now)].to(rewards_now.device)

    def _attach(self, batches, scores, made, advantages, rewards_now, seconds: float, device) -> None:
        """Advantages per completion and the per-completion terms of the log's sums: token means are made
        from per-completion sums x (the step's completions / its completion tokens), counted over processes."""
        per_token, per_process = step_token_weight(batches, device)
        if not batches:
            return
        flat_advantages = advantages.flatten().float()
        spread = pg.zero_spread(rewards_now).repeat_interleave(self.generations)
        values = torch.cat([torch.nan_to_num(scores.weighted)[:, None], torch.nan_to_num(scores.per_function),
                            spread[:, None].float().cpu(), made.lengths[:, None].float().cpu(),
                            (~made.stopped)[:, None].float().cpu()], dim=1).double()
        seconds_column = torch.zeros(len(values), 1, dtype=torch.float64)
        seconds_column[0] = seconds * per_process  # / completions: the processes' mean
        values = torch.cat([values, seconds_column], dim=1).to(device)
        start = 0
        for batch in batches:
            count = len(batch["input_ids"])
            batch["advantages"] = flat_advantages[start:start + count].to(device)
            batch["completion_sums"] = values[start:start + count]
            batch["token_weight"] = torch.full((count,), per_token, dtype=torch.float64, device=device)
            start += count

    # -- the loss -----------------------------------------------------------------------------------
    def item_count(self, batch) -> torch.Tensor:
        if "completion_mask" not in batch:  # the stand-in of a process without a micro-batch: nothing counts
            return torch.zeros((), dtype=torch.long, device=batch["input_ids"].device)
        return pg.item_count(batch["completion_mask"], self.loss_type, self.max_new_tokens)

    def loss(self, model, batch) -> TrainLoss:
        if "completion_mask" not in batch:  # the stand-in: weighted zero by the step runner
            return TrainLoss(completion_batches.prompt_only_logps(model, batch).sum() * 0.0)
        trained = self._contributing(batch)
        logps = self._logps(model, trained)
        loss, found = self.policy_loss(logps, trained)
        clipped, kl = self.clip_and_kl(found, batch)
        mask = batch["completion_mask"]
        sums = torch.cat([batch["completion_sums"].sum(0), torch.stack([clipped, *kl]),
                          torch.tensor([float(len(mask))], dtype=torch.float64, device=mask.device)])
        return TrainLoss(pg.loss_sum(loss, trained["completion_mask"], self.loss_type), sums)

    def _contributing(self, batch) -> dict:
        """The rows the forward needs: those whose loss has a gradient (pg.contributing), unless the loss has a
        KL term, which every row's has. The loss sum, its gradient and the clipped share (a zero advantage is
        never clipped) are the whole micro-batch's; the counts (`item_count`) and the log's per-completion sums
        stay the whole micro-batch's. Groups with no reward spread, most of them while few answers are right
        (or while most are), then cost no forward or backward."""
        if self.beta and not self.sequence_level:
            return batch
        return completion_batches.rows_of(batch, pg.contributing(batch["advantages"], batch["completion_mask"]))

    def policy_loss(self, logps: torch.Tensor, batch) -> tuple[torch.Tensor, dict]:
        return pg.token_loss(logps, logps.detach(), batch["advantages"], batch["completion_mask"], self.epsilon,
                             self.epsilon_high, batch.get("ref_logps"), self.beta)

    def clip_and_kl(self, found: dict, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The clipped tokens' and the KL's sums as per-completion terms (x completions / tokens)."""
        weight = batch["token_weight"][0]
        return found["clip_ratio_region"] * weight, [found["kl"] * weight] if self.beta else []

    # -- evaluation ---------------------------------------------------------------------------------
    def eval_outputs(self, model, batch, setting=None) -> tuple[torch.Tensor, ...]:
        """Per prompt: the weighted reward of its greedy completion, each function's (NaN: unscored), its
        length and whether it ended with a stop id."""
        import effitrain.tasks.generation as generation

        data, rows = setting, [int(row) for row in batch["row_index"].tolist()]
        made = generation.generate(model, unpadded(batch), generation.AnswerGeneration(
            data.tokenizer, data.stop_ids, self.max_new_tokens))
        ended = [bool(ids) and ids[-1] in data.stop_ids for ids in made]
        scores = self.score(data, rows, made, ended)
        device = batch["input_ids"].device
        return (scores.weighted.to(device), scores.per_function.to(device),
                torch.tensor([len(ids) for ids in made], device=device), torch.tensor(ended, device=device).long())

    @property
    def metric_names(self) -> tuple[str, ...]:
        exact = ("exact_match",) if "exact-match" in [f.name for f in self.functions] else ()
        return ("loss", "reward", *self.reward_names, *exact, "completion_length", "end_of_turn_share")

    def metrics(self, outputs: tuple) -> dict[str, float]:
        """Means over the prompts a function scored (0 where none was); `loss` is minus the reward, what the
        best weights' choice minimises by default; exact_match: the share exact-match scored 1."""
        weighted, per_function, lengths, ended = outputs
        reward = _nanmean(weighted)
        result = {"loss": 0.0 - reward if reward else 0.0, "reward": reward}
        for index, name in enumerate(self.reward_names):
            result[name] = _nanmean(per_function[:, index])
        if "exact_match" in self.metric_names:
            result["exact_match"] = result["reward_exact-match"]
        samples = max(len(lengths), 1)
        result.update(completion_length=float(lengths.double().sum()) / samples,
                      end_of_turn_share=float(ended.double().sum()) / samples, samples=len(lengths))
        return result


class Rloo(Grpo):
    """RLOO (TRL's RLOOTrainer): advantages against the mean of the group's others, one clipped ratio per
    completion, the mean over the step's completions; its KL is a penalty on the rewards."""

    name = "rloo"
    sequence_level = True

    @staticmethod
    def loss_of(config) -> str:
        return "rloo"

    def _rewards(self, scores, batches, prompts, device) -> torch.Tensor:
        """Minus beta x each completion's KL to the reference (the generating policy's log-ratio, summed)."""
        values = super()._rewards(scores, batches, prompts, device)
        if self.reference is None or not batches:
            return values
        kl = torch.cat([pg.sequence_kl(b["old_logps"], b["ref_logps"], b["completion_mask"]) for b in batches])
        for batch, part in zip(batches, kl.split([len(b["input_ids"]) for b in batches])):
            batch["sequence_kl"] = part.double()
        return values - self.beta * kl.double().view(prompts, self.generations)

    def policy_loss(self, logps, batch):
        return pg.sequence_loss(logps, logps.detach(), batch["advantages"], batch["completion_mask"], self.epsilon,
                                self.epsilon_high)

    def clip_and_kl(self, found, batch):
        kl = [(batch["sequence_kl"] * batch["token_weight"]).sum()] if self.beta else []
        return found["clip_ratio_region"], kl


def unpadded(batch: dict) -> list[list[int]]:
    """A left-padded prompt micro-batch's prompts, each without its padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def _gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, tensor)
    return parts


def _summed(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over the processes (every process calls it, with or without completions)."""
    if _distributed():
        torch.distributed.all_reduce(tensor)
    return tensor


def _nanmean(values: torch.Tensor) -> float:
    scored = values[~torch.isnan(values)]
    return float(scored.double().mean()) if len(scored) else 0.0

