"""Evaluation: gathered metrics over a whole split, and (during training) when to evaluate, which
evaluation was best, and when to stop early."""

from __future__ import annotations

import torch

from effitrain.data import text


def evaluate(accelerator, task, model, dataloader, label_names, in_pieces: bool = True,
             setting=None) -> dict[str, float]:
    """The task's metrics over the whole split, the same on every process whatever their number.
    `setting`: the task's eval_setting for the split."""
    return task.metrics(gather_outputs(accelerator, task, model, dataloader, in_pieces, setting), label_names)


def gather_outputs(accelerator, task, model, dataloader, in_pieces: bool = True, setting=None) -> tuple:
    """The task's per-example eval outputs over the whole split, on the CPU of every process;
    gather_for_metrics drops the samples padded in to even out shards. Eager even where --compile compiled
    the blocks: inference-mode graphs would be compiled apart, and on a CPU they measured no faster than
    eager (benchmarks/techniques/compile.py), so they would only add compile seconds. `in_pieces`: the strategy's
    `evaluates_in_pieces` (see batch_outputs)."""
    was_training = model.training
    model.eval()
    gathered = []
    with torch.inference_mode(), torch.compiler.set_stance("force_eager"):
        for batch in dataloader:
            outputs = accelerator.gather_for_metrics(batch_outputs(accelerator, task, model, batch, in_pieces,
                                                                   setting))
            gathered.append([t.cpu() for t in outputs])
    model.train(was_training)
    return tuple(torch.cat(column) for column in zip(*gathered))


def batch_outputs(accelerator, task, model, batch, in_pieces: bool = True, setting=None) -> tuple:
    """The task's eval outputs for one batch, in its order. On a CPU a text batch runs as pieces padded
    to their own longest rows (data/text.trimmed_pieces): the batch is the loader's, as accelerate
    shards and gathers it; only the padding computed is less. Not where the strategy says no (FSDP, whose
    every forward is a collective: the processes' pieces would not pair up), nor on accelerators, where
    padding costs little until the device is full (not measured there)."""
    if accelerator.device.type != "cpu" or not in_pieces:
        return task.eval_outputs(model, batch, setting)
    pieces, order = text.trimmed_pieces(batch)
    if len(pieces) == 1 and order is None:
        return task.eval_outputs(model, pieces[0], setting)
    outputs = tuple(torch.cat(column) for column in zip(*(task.eval_outputs(model, piece, setting) for piece in pieces)))
    if order is None:
        return outputs
    places = torch.argsort(order)  # where each row of the batch sits among the pieces' rows
    return tuple(column[places.to(column.device)] for column in outputs)


class Evaluator:
    """Evaluation during training: validation every `eval_every` steps (None: at the end of each
    epoch) and at the last step; the best value of `metric` (its direction from the task); early
    stopping after `patience` evaluations without an improvement larger than `threshold`, or as soon as
    `metric` reaches `target`. The
    metrics are gathered, so every process takes the same decisions. `in_pieces`: the strategy's
    evaluates_in_pieces (see batch_outputs). `setting`: the task's eval_setting for the split."""

    def __init__(self, accelerator, task, label_names, dataloader, *, steps_per_epoch: int, total_steps: int,
                 eval_every: int | None = None, metric: str = "loss", patience: int | None = None,
                 threshold: float = 0.0, target: float | None = None, in_pieces: bool = True, setting=None):
        self.accelerator, self.task, self.label_names, self.dataloader = accelerator, task, label_names, dataloader
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.every = eval_every or steps_per_epoch
        self.metric, self.patience, self.threshold, self.target = metric, patience, threshold, target
        self.higher_is_better = task.is_higher_better(metric)
        self.in_pieces, self.setting = in_pieces, setting

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total_steps

    def validate(self, model, state) -> bool:
        """Evaluate; update the state's best value (any improvement) and patience count (reset only
        by an improvement larger than the threshold, as the Trainer's early stopping). True if this
        evaluation is the best so far."""
        state.validation = evaluate(self.accelerator, self.task, model, self.dataloader, self.label_names,
                                    self.in_pieces, self.setting)
        value = state.validation[self.metric]
        if self.improves(value, state.best_value, self.threshold):
            state.evals_without_improvement = 0
        else:
            state.evals_without_improvement += 1
        if self.improves(value, state.best_value, 0.0):
            state.best_value, state.best_step = value, state.step
            return True
        return False

    def improves(self, value: float, best: float | None, threshold: float) -> bool:
        if best is None:
            return value == value  # a NaN never becomes the best
        gain = value - best if self.higher_is_better else best - value
        return gain > threshold

    def should_stop(self, state) -> bool:
        """Early: never at the last step, where the run ends anyway."""
        return (self.patience is not None and state.evals_without_improvement >= self.patience
                or self.reached_target(state)) and state.step < self.total_steps

    def reached_target(self, state) -> bool:
        if self.target is None:
            return False
        value = state.validation[self.metric]
        return value >= self.target if self.higher_is_better else value <= self.target
