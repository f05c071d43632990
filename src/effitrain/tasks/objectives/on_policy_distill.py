"""On-policy distillation of a causal LM (--rl distill --distill-from TEACHER), held by tasks/online_rl.py: once
per optimizer step (`rollout`, GRPO's: tasks/objectives/grpo.py) the student samples G completions of each of the
step's prompts, each from its own stream (tasks/sampling.py: the same whatever the process layout, and again after
a resume); no reward is computed. `loss`: at each completion token, the divergence between the student's and the
teacher's distributions over the whole vocabulary, both at --distill-temperature (TRL GKD's generalized_jsd_loss,
its beta convention: 1, the default, the reverse KL(student || teacher), which on-policy distillation minimises;
0 the forward KL(teacher || student); between, the generalised JSD of that mixture), summed over the step's
completion tokens and divided by their number over the whole step (`item_count`), so 2 processes x accumulation
equal one batch.

The teacher is loaded once before training (a causal LM with the student's tokenizer vocabulary, refused
otherwise), in evaluation mode, its weights frozen, never wrapped by the run's strategy, never trained nor saved;
it scores each micro-batch in `loss`, under no_grad and the run's autocast, so that one micro-batch's teacher
logits are alive at a time (scoring the whole step in the rollout would hold every micro-batch's
completion tokens x vocabulary at once). The planner counts its weights and those logits (planning/rl_step.py).

The step's log line shows, over the step's completion tokens, `kl` (the divergence the loss minimises, a mean per
token), and over its completions `completion_length`, `truncated_share` and `generation_seconds`. Evaluation:
the same divergence on the greedy completions of the held-out prompts (`kl`, also `loss`: lower is better),
their length and the share that ended with the end of turn."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from effitrain.errors import UserError
from effitrain.tasks.base import TrainLoss
import effitrain.tasks.objectives.completion_batches as completion_batches
import effitrain.tasks.objectives.policy_gradient as pg
from effitrain.tasks.objectives.grpo import Grpo, _device, step_token_weight, unpadded

# The example batch's key (tasks/online_rl.py) holding the planner's stand-in for the teacher's logits of one
# micro-batch (fake tensors: there is no teacher to run).
PLANNED_TEACHER_LOGITS = "planned_teacher_logits"


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
               temperature: float = 1.0) -> torch.Tensor:
    """Per position (the last dimension, the vocabulary, summed): TRL GKD's generalised JSD of the two
    distributions at `temperature`. beta 0: KL(teacher || student); 1: KL(student || teacher); between:
    beta KL(teacher || M) + (1 - beta) KL(student || M), M = beta teacher + (1 - beta) student."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(student, teacher, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(teacher, student, reduction="none", log_target=True).sum(-1)
    mixture = torch.logsumexp(torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0)
    return (beta * F.kl_div(mixture, teacher, reduction="none", log_target=True)
            + (1 - beta) * F.kl_div(mixture, student, reduction="none", log_target=True)).sum(-1)


class OnPolicyDistill(Grpo):
    """The student's samples scored by a teacher: GRPO's rollout without rewards, a divergence for the loss."""

    name = "distill"

    def __init__(self, *, teacher: str | None = None, divergence_beta: float = 1.0, distill_temperature: float = 1.0,
                 allow_pickle: bool = False, **sampling_settings):
        sampling_settings.update(beta=0.0, loss_type="dapo")  # no reference model; the step's tokens normalise
        super().__init__(**sampling_settings)
        self.teacher, self.divergence_beta, self.distill_temperature = teacher, divergence_beta, distill_temperature
        self.allow_pickle = allow_pickle
        self.teacher_model = None  # loaded by before_training, held through the steps
        self.autocast = None  # the run's autocast (a context manager factory), for the teacher's forwards

    @classmethod
    def of(cls, config) -> "OnPolicyDistill":
        from effitrain.config import distill_temperature_of

        return cls(generations=config.num_generations, temperature=config.temperature, top_p=config.top_p,
                   max_new_tokens=config.max_new_tokens, mask_truncated=config.mask_truncated,
                   teacher=config.distill_from, divergence_beta=config.distill_beta,
                   distill_temperature=distill_temperature_of(config), allow_pickle=config.allow_pickle)

    @staticmethod
    def loss_of(config) -> str:
        return "dapo"

    def describe(self) -> str:
        kind = {1.0: "reverse KL(student || teacher)", 0.0: "forward KL(teacher || student)"}.get(
            float(self.divergence_beta), f"generalised JSD beta {self.divergence_beta:g}")
        return (f"{self.name}: {self.generations} completions per prompt of at most {self.max_new_tokens} tokens, "
                f"temperature {self.temperature:g}; loss: the {kind} at temperature {self.distill_temperature:g} "
                f"per completion token; teacher {self.teacher}")

    @property
    def train_metric_names(self) -> tuple[str, ...]:
        return ("kl", "completion_length", "truncated_share", "generation_seconds")

    def load_rewards(self, columns: list[str]) -> None:
        """No rewards: the teacher is what the completions are learnt from."""

    # -- the teacher --------------------------------------------------------------------------------
    def teacher_source(self, task):
        """The teacher folder's model source, refused when it holds no causal LM."""
        from effitrain.tasks.teacher_outputs import teacher_source

        return teacher_source(self.teacher, self.allow_pickle, task, "a causal LM", "pass a causal LM folder (e.g. "
                              "an effitrain SFT run's model/) with the student's tokenizer")[0]

    def check_built_model(self, task, model, processor) -> None:
        """The teacher reads the student's token ids and predicts over the same vocabulary (before the run folder
        is claimed)."""
        from effitrain.models import loading

        source = self.teacher_source(task)
        theirs = loading.load_text_tokenizer(source)
        outputs = getattr(task.source_config(source), "vocab_size", None)
        if theirs.get_vocab() != processor.get_vocab() or outputs != model.config.vocab_size:
            raise UserError(f"--distill-from {self.teacher} has another vocabulary than the model trained "
                            f"({len(theirs)} tokens, {outputs} outputs vs {len(processor)} tokens, "
                            f"{model.config.vocab_size} outputs): its distribution is over other tokens",
                            "pass a teacher with the student's tokenizer and vocabulary size")

    def before_training(self, task, model, processor, autocast=None) -> None:
        """The teacher loaded once, on the student's device, in evaluation mode with frozen weights."""
        if self.teacher_model is None:
            teacher = task.build_model(self.teacher_source(task), None, processor)
            self.teacher_model = teacher.to(_device(model)).eval().requires_grad_(False)
        self.autocast = autocast

    def teacher_logits(self, batch: dict) -> torch.Tensor:
        """[rows, completion width, vocabulary] fp32: the teacher's logits at the completion tokens, no gradient."""
        import contextlib

        if self.teacher_model is None:  # the planner's fake micro-batch: logits as large as the teacher's, made here
            mask = batch["completion_mask"]
            return mask.new_zeros((*mask.shape, batch[PLANNED_TEACHER_LOGITS]), dtype=torch.float32)
        with torch.no_grad(), self.autocast() if self.autocast is not None else contextlib.nullcontext():
            return completion_batches.completion_logits(self.teacher_model, batch).float()

    def planned_extras(self, model_config) -> dict:
        """What the planner's example micro-batch adds (tasks/online_rl.py): the width of the teacher's logits."""
        return {PLANNED_TEACHER_LOGITS: int(model_config.vocab_size)}

    # -- the rollout: GRPO's sampling, no rewards ------------------------------------------------------
    def rollout(self, model, group: list, generator: torch.Generator) -> list:
        started = time.perf_counter()
        present = [batch for batch in group if batch is not None]
        _, made = self.sample(model, present, generator)
        device = present[0]["input_ids"].device if present else _device(model)
        mask = None if made is None else made.mask
        if mask is not None and self.mask_truncated:
            mask = pg.mask_truncated(mask, ~made.stopped)
        batches = self._micro_batches(model, present, made, mask, device) if present else []
        self._attach_sums(batches, made, time.perf_counter() - started, device)
        done = iter(batches)
        return [None if batch is None else next(done) for batch in group]

    def _attach_sums(self, batches: list[dict], made, seconds: float, device) -> None:
        """The log's per-completion sums (length, cut, the generation's seconds: a mean over the processes) and
        each completion's token weight, the step's completions / its completion tokens over every process (a
        token sum x it, summed over completions / completions, is the mean per token)."""
        per_token, per_process = step_token_weight(batches, device)
        if not batches:
            return
        values = torch.cat([made.lengths[:, None].double().cpu(), (~made.stopped)[:, None].double().cpu(),
                            torch.zeros(len(made.lengths), 1, dtype=torch.float64)], dim=1)
        values[0, 2] = seconds * per_process
        values, start = values.to(device), 0
        for batch in batches:
            count = len(batch["input_ids"])
            batch["completion_sums"] = values[start:start + count]
            batch["token_weight"] = torch.full((count,), per_token, dtype=torch.float64, device=device)
            start += count

    # -- the loss -----------------------------------------------------------------------------------
    def loss(self, model, batch) -> TrainLoss:
        if "completion_mask" not in batch:  # the stand-in of a process without a micro-batch: weighted zero
            return TrainLoss(completion_batches.prompt_only_logps(model, batch).sum() * 0.0)
        mask = batch["completion_mask"]
        trained = completion_batches.rows_of(batch, mask.bool().any(dim=1))  # rows with a counted token
        # The teacher first: its forward's transients come and go before the student's activations are held.
        teacher = self.teacher_logits(trained)
        student = completion_batches.completion_logits(model, trained)
        per_token = divergence(student, teacher, self.divergence_beta, self.distill_temperature)
        loss_sum = (per_token * trained["completion_mask"]).sum()
        kl = loss_sum.detach().double() * batch["token_weight"][0]
        sums = torch.cat([kl[None], batch["completion_sums"].sum(0),
                          torch.tensor([float(len(mask))], dtype=torch.float64, device=mask.device)])
        return TrainLoss(loss_sum, sums)

    # -- evaluation: the divergence on greedy completions ----------------------------------------------
    def eval_outputs(self, model, batch, setting=None) -> tuple[torch.Tensor, ...]:
        """Per prompt: its greedy completion's summed divergence to the teacher, its counted tokens, its length,
        whether it ended with a stop id."""
        import effitrain.tasks.generation as generation

        data, device = setting, batch["input_ids"].device
        made = generation.generate(model, unpadded(batch), generation.AnswerGeneration(
            data.tokenizer, data.stop_ids, self.max_new_tokens))
        lengths = torch.tensor([len(ids) for ids in made], device=device)
        ended = torch.tensor([bool(ids) and ids[-1] in data.stop_ids for ids in made], device=device).long()
        sums = torch.zeros(len(made), dtype=torch.float64, device=device)
        width = int(lengths.max()) if len(made) else 0
        if width and self.teacher_model is not None:
            ids = torch.tensor([row + [data.pad_id] * (width - len(row)) for row in made], device=device)
            mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
            micro = completion_batches.sequences(batch["input_ids"], batch["attention_mask"], ids, mask)
            micro["completion_mask"] = mask
            with torch.no_grad():
                per_token = divergence(completion_batches.completion_logits(model, micro), self.teacher_logits(micro),
                                       self.divergence_beta, self.distill_temperature)
            sums = (per_token * mask).sum(1).double()
        return sums, lengths, lengths, ended

    @property
    def metric_names(self) -> tuple[str, ...]:
        return ("loss", "kl", "completion_length", "end_of_turn_share")

    def metrics(self, outputs: tuple) -> dict[str, float]:
        """`kl`: the divergence per greedy completion token over the split (also `loss`: lower is better)."""
        sums, tokens, lengths, ended = outputs
        kl = float(sums.double().sum()) / max(float(tokens.double().sum()), 1.0)
        samples = max(len(lengths), 1)
        return {"loss": kl, "kl": kl, "completion_length": float(lengths.double().sum()) / samples,
                "end_of_turn_share": float(ended.double().sum()) / samples, "samples": len(lengths)}
