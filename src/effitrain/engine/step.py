"""One optimizer step: the forward/backward of a step's micro-batches, each run as `pieces` smaller
pieces, the out-of-memory retry, clipping, and the non-finite skip.

The loss of a step is the sum of per-item losses over all micro-batches of all processes divided by
the number of items in all of them, so the step is the same whatever W, the micro-batch and the
accumulation are (a mean of per-micro-batch means is not, when micro-batches hold different numbers
of items). A process that lacks a micro-batch at the end of an epoch runs a zero-weight stand-in,
so that every process runs the same passes and DDP's collectives match.

A task whose loss has several terms, each a mean over its own items (ORPO: the chosen answers' tokens
and the pairs), gives loss_sum and item_count as vectors, one entry per term: each term is divided by its
own count over the step, and the step's loss is their sum (logged as a mean over the window's steps).

An objective that generates during the step (GRPO, on-policy distillation) does it in the task's
`rollout`, which the runner calls once per optimizer step, before the step's forwards, with the step's RNG
(step_generator): the micro-batches it returns are those the step counts and trains on
(tasks/objectives/objective.py)."""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch

from effitrain.engine import communication, memory_fit
from effitrain.engine.strategies import Single, Strategy
from effitrain.speedups import process_tuning


@dataclass
class StepResult:
    finite: bool  # False: the step was skipped (non-finite loss or gradient)
    grad_norm: torch.Tensor | None
    window: torch.Tensor  # this process's loss sum and items of the step, then the task's train sums (if any)
    totals: torch.Tensor  # this process's examples and tokens of the step


def window_size(task) -> int:
    """The loss sum and its items, then the task's train sums and their count (engine/state.py keeps them)."""
    names = task.train_metric_names()
    return 2 + (len(names) + 1 if names else 0)


def step_generator(seed: int, step: int, device) -> torch.Generator:
    """The RNG of optimizer step `step`, seeded from (seed, step) only: the same on every process, whatever
    the layout, and again when a resumed run reaches the step."""
    mixed = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(mixed, "little") >> 1)


class StepRunner:
    """Runs steps for one model and optimizer. `synced`: one loss over all processes (DDP); False
    for one process or local SGD (each process minimises its own loss). `budgeted`: --memory-budget,
    where an out-of-memory error is retried with pieces twice smaller. `strategy`: the run's (None: one
    process's, for a runner built alone). `seed`: the run's, for the steps' RNG (step_generator)."""

    def __init__(self, accelerator, task, model, optimizer, scheduler, *, pieces: int = 1, batch_size: int,
                 max_grad_norm: float = 0.0, synced: bool = False, budgeted: bool = False,
                 strategy: Strategy | None = None, stand_in: dict | None = None,
                 wire: communication.Counter | None = None, on_retry=None, seed: int = 0):
        self.accelerator, self.task, self.model = accelerator, task, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.pieces, self.batch_size, self.max_grad_norm = pieces, batch_size, max_grad_norm
        self.synced, self.stand_in, self.seed = synced, stand_in, seed
        self.strategy = strategy or Single(accelerator)
        self.wire = wire or communication.Counter()
        # DDP with a budget: no piece syncs; the processes first agree that none ran out of memory.
        self.agree = synced and budgeted and self.strategy.resplits_steps
        # An out-of-memory error can be retried where no collective is left waiting for this process.
        self.retry = budgeted and (self.agree or not synced)
        self.on_retry = on_retry or (lambda step, pieces: None)

    def run(self, group: list, step: int) -> StepResult:
        """Step `step` (1-based, for messages) over `group`, this process's micro-batches (None where it
        has none); the optimizer and scheduler step unless the step is skipped."""
        group = self.task.rollout(self.model, group, step_generator(self.seed, step, self.accelerator.device))
        step_items = self._step_items(group)
        while True:  # once, or again with smaller pieces after an out-of-memory error
            window, totals = self._zeros(window_size(self.task)), self._zeros()
            out_of_memory = self._forward_backward(group, step_items, window, totals)
            if self.agree:
                out_of_memory = self._agree_and_sync(out_of_memory)
            if not out_of_memory:
                break
            self.optimizer.zero_grad(set_to_none=True)
            process_tuning.give_back(self.accelerator.device)
            self.pieces = memory_fit.halve(self.pieces, self.batch_size, self.strategy)
            self.on_retry(step, self.pieces)
        finite, grad_norm = self._clip_and_step()
        return StepResult(finite, grad_norm, window, totals)

    def _zeros(self, size: int = 2) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.float64, device=self.accelerator.device)

    def _step_items(self, group) -> torch.Tensor:
        # Zero items of the shape every process reduces (a vector for several terms), even on a process
        # that has no micro-batch in this step: shapes that differ would hang the all-reduce.
        shaped = [batch for batch in group if batch is not None] or [self.stand_in]
        zero = torch.zeros_like(self.task.item_count(shaped[0])) if shaped[0] is not None else \
            torch.zeros((), dtype=torch.long, device=self.accelerator.device)
        items = sum((self.task.item_count(batch) for batch in group if batch is not None), zero)
        return self.accelerator.reduce(items, "sum") if self.synced else items

    def _forward_backward(self, group, step_items, window, totals) -> bool:
        """Every piece of every micro-batch; gradients all-reduced by DDP on the last piece (unless
        `agree`: the caller syncs). Returns True on an out-of-memory error that may be retried."""
        pieces = [piece for batch in group
                  for piece in ([None] if batch is None else memory_fit.split_batch(batch, self.pieces))]
        scale = self.accelerator.num_processes if self.synced else 1  # DDP averages over W processes
        try:
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1 and not self.agree
                with contextlib.nullcontext() if last else self._no_sync():
                    if piece is None:  # this process has no micro-batch here: a zero-weight stand-in
                        stand_in = self.task.train_loss(self.model, self.stand_in).loss_sum
                        self.accelerator.backward((stand_in * 0.0).sum())
                        continue  # its train sums are not the run's
                    loss, sums = self.task.train_loss(self.model, piece)
                    self.accelerator.backward((loss * scale / step_items).sum())
                self._count(piece, loss, sums, window, totals, step_items)
            if step_items.dim():  # several terms: the window counts steps, 1 over the processes of one
                window[1] += 1.0 / scale
        except Exception as err:
            if self.retry and memory_fit.is_out_of_memory(err):
                return True
            raise
        return False

    def _no_sync(self):
        """Gradients not reduced on this piece (accumulated for the step's last one)."""
        return self.strategy.no_sync(self.model)

    def _count(self, piece, loss, sums, window, totals, step_items) -> None:
        count = self.task.item_count(piece).double()
        if count.dim():  # several terms: this piece's share of the step's loss (the step is counted once)
            loss, count = (loss.detach().double() / step_items.double()).sum(), count.new_tensor(0.0)
        tokens = self.task.token_count(piece)
        window[:2] += torch.stack([loss.detach().double(), count])
        if sums is not None:
            window[2:] += sums.detach().double().to(window.device)
        totals += torch.stack([self.task.example_count(piece).double(),
                               count.new_tensor(0.0) if tokens is None else tokens.double()])

    def _agree_and_sync(self, out_of_memory: bool) -> bool:
        """Every process learns whether one ran out, before any gradient crosses the wire."""
        flag = torch.tensor([float(out_of_memory)], device=self.accelerator.device)
        out_of_memory = bool(self.accelerator.reduce(flag, "sum") > 0)
        if not out_of_memory:
            communication.allreduce_gradients(self.model, self.accelerator.num_processes, self.wire)
        return out_of_memory

    def _clip_and_step(self) -> tuple[bool, torch.Tensor | None]:
        # The norm is needed even without clipping (max_norm inf): it is how a non-finite loss or
        # gradient is seen, the same on every process since gradients are already all-reduced.
        finite, grad_norm = self.strategy.clip_gradients(self.model.parameters(), self.max_grad_norm or float("inf"))
        if finite or self.accelerator.scaler is not None:  # an fp16 scaler skips the step and backs off itself
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return finite, grad_norm

