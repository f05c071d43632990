"""An objective is one class registered in tasks/objectives: a fake one that generates during the step
(as GRPO and on-policy distillation will) trains through tasks.for_config and the step runner with no
other edit; its rollout hook runs once per optimizer step, before the micro-batches, with an RNG that
depends on (seed, step) only, and what it returns is what the micro-batches' loss reads."""

from __future__ import annotations

import pytest
import torch
from effitrain import tasks
from effitrain.config import TrainConfig
from effitrain.engine.step import StepRunner, step_generator
from effitrain.tasks import objectives
from effitrain.tasks.base import TrainLoss
from effitrain.tasks.objectives.objective import Objective


class Drawn(Objective):
    """A stand-in for an objective that samples: its rollout draws one weight per example of the step from
    the step's RNG (by the example's position in the step, as a layout-free sampler would) and adds it to
    the micro-batches; the loss is the weighted sum of the model's outputs, and it logs the weights' sum."""

    name = "drawn"
    train_metric_names = ("weight",)
    rollouts: list = []  # (the step's draws, how many micro-batches it saw), one entry per call

    def rollout(self, model, group, generator):
        examples = sum(len(batch["input_ids"]) for batch in group if batch is not None)
        draws = torch.rand(examples, generator=generator)
        type(self).rollouts.append((draws, len(group)))
        out, start = [], 0
        for batch in group:
            if batch is None:
                out.append(None)
                continue
            out.append({**batch, "weight": draws[start:start + len(batch["input_ids"])]})
            start += len(batch["input_ids"])
        return out

    def item_count(self, batch):
        return torch.tensor(len(batch["input_ids"]))

    def loss(self, model, batch):
        outputs = model(batch["input_ids"].float()).sum(-1)
        weight = batch["weight"]
        return TrainLoss((weight * outputs).sum(), torch.stack([weight.sum(), torch.tensor(float(len(weight)))]))


@pytest.fixture
def drawn(monkeypatch):
    monkeypatch.setitem(objectives.REGISTRY, Drawn.name, Drawn)  # the one place an objective is registered
    monkeypatch.setattr(Drawn, "rollouts", [])
    return tasks.for_config(TrainConfig(task="causal-lm", preference=Drawn.name))


def micro_batch(seed: int) -> dict:
    ids = torch.randint(0, 5, (4, 3), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def runner(task, seed: int):
    from effitrain.runtime.distributed import make_accelerator

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return StepRunner(make_accelerator(), task, model, optimizer, scheduler, batch_size=4, seed=seed), model


def test_the_catalog_names_the_registered_objectives():
    from effitrain.catalog import objective_names

    assert tuple(objectives.REGISTRY) == tuple(objective_names.NAMES) == ("dpo", "orpo")
    assert [objectives.takes_reference(name) for name in ("dpo", "orpo", None)] == [True, False, False]


def test_the_task_holds_the_registered_objective(drawn):
    assert drawn.objective.name == "drawn" and drawn.train_metric_names() == ("weight",)


def test_the_rollout_runs_once_per_optimizer_step_and_its_output_reaches_the_loss(drawn):
    steps, model_runner = 3, runner(drawn, seed=7)
    run, model = model_runner
    for step in range(1, steps + 1):
        group = [micro_batch(10 * step + i) for i in range(3)]  # accumulation 3
        before = [p.detach().clone() for p in model.parameters()]
        result = run.run(group, step)
        draws, seen = Drawn.rollouts[-1]
        assert len(Drawn.rollouts) == step and seen == 3  # once per step, over the step's micro-batches
        # The step's loss and log sums are those of the drawn weights: the rollout's output reached the loss.
        with torch.no_grad():
            outputs = torch.cat([torch.nn.functional.linear(b["input_ids"].float(), *before).sum(-1) for b in group])
        torch.testing.assert_close(result.window[0], (draws * outputs).sum().double())
        assert result.window[1] == 12
        torch.testing.assert_close(result.window[2:], torch.stack([draws.sum(), torch.tensor(12.0)]).double())


def test_the_steps_rng_depends_on_the_seed_and_the_step_only(drawn):
    group = [micro_batch(1), micro_batch(2)]
    first, _ = runner(drawn, seed=7)
    for step in (1, 2):
        first.run(group, step)
    resumed, _ = runner(drawn, seed=7)  # a run resumed at step 2, on other batches
    resumed.run([micro_batch(3), micro_batch(4)], 2)
    other_seed, _ = runner(drawn, seed=8)
    other_seed.run(group, 2)
    (one, _), (two, _), (again, _), (seeded, _) = Drawn.rollouts
    assert torch.equal(two, again)
    assert not torch.equal(one, two) and not torch.equal(two, seeded)
    assert torch.equal(torch.rand(4, generator=step_generator(7, 2, "cpu")), two[:4])
