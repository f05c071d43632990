"""The engine's pieces alone, on tiny nn.Modules: the step runner (with an injected out-of-memory
error), the strategies, the train state's checkpoint form, the evaluator's decisions, and the clean-up
of a run whose step raises. The shape of the code is tests/architecture/test_layers.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from effitrain.engine import memory_fit
from effitrain.engine.evaluator import Evaluator
from effitrain.engine.state import TrainState
from effitrain.engine.step import StepRunner
from effitrain.tasks.base import TrainLoss


class Linear(torch.nn.Module):
    """A task-shaped model: model(**inputs).logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 3)

    def forward(self, x):
        return type("Out", (), {"logits": self.layer(x)})


class TinyTask:
    """What the step runner needs of a task; `fits`: the most examples a forward takes before an
    out-of-memory error (None: any number)."""

    def __init__(self, fits: int | None = None):
        self.fits, self.forwards = fits, []

    def train_metric_names(self):
        return ()  # nothing beside the loss on the step's log line

    def rollout(self, model, group, generator):
        return group

    def train_loss(self, model, batch):
        return TrainLoss(self.loss_sum(model, batch))

    def loss_sum(self, model, batch):
        self.forwards.append(len(batch["labels"]))
        if self.fits is not None and len(batch["labels"]) > self.fits:
            raise memory_fit.OutOfMemoryError("injected: does not fit")
        return F.cross_entropy(model(x=batch["x"]).logits, batch["labels"], reduction="sum")

    def item_count(self, batch):
        return torch.tensor(len(batch["labels"]))

    example_count = item_count

    def token_count(self, batch):
        return None


def one_step(task, budgeted: bool, batches):
    from effitrain.runtime.distributed import make_accelerator

    accelerator = make_accelerator()
    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    retries = []
    runner = StepRunner(accelerator, task, model, optimizer, scheduler, batch_size=8, max_grad_norm=1.0,
                        budgeted=budgeted, on_retry=lambda step, pieces: retries.append(pieces))
    result = runner.run(batches, step=1)
    return model, result, runner, retries


def batch(seed: int, size: int = 8) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(size, 4, generator=generator), "labels": torch.randint(0, 3, (size,), generator=generator)}


def test_an_out_of_memory_error_retries_the_step_in_smaller_pieces_with_the_same_result():
    plain_model, plain, _, _ = one_step(TinyTask(), budgeted=False, batches=[batch(1), batch(2)])
    task = TinyTask(fits=2)
    model, result, runner, retries = one_step(task, budgeted=True, batches=[batch(1), batch(2)])
    assert retries == [2, 4] and runner.pieces == 4  # 8 -> 4 -> 2 examples per piece
    assert task.forwards[0] == 8 and task.forwards[-4:] == [2, 2, 2, 2]
    assert result.finite and plain.finite
    torch.testing.assert_close(result.window, plain.window)  # loss sum and items of the step
    for a, b in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b)


def test_without_a_budget_an_out_of_memory_error_is_raised():
    with pytest.raises(memory_fit.OutOfMemoryError):
        one_step(TinyTask(fits=2), budgeted=False, batches=[batch(1)])


def test_a_non_finite_loss_skips_the_step_and_leaves_the_weights():
    class NaNTask(TinyTask):
        def loss_sum(self, model, batch):
            return super().loss_sum(model, batch) * float("nan")

    model, result, _, _ = one_step(NaNTask(), budgeted=False, batches=[batch(1)])
    assert not result.finite
    for a, b in zip(model.parameters(), Linear().parameters()):
        assert torch.equal(a, b)


def test_a_missing_micro_batch_runs_a_zero_weight_stand_in():
    task = TinyTask()
    from effitrain.runtime.distributed import make_accelerator

    accelerator, model = make_accelerator(), Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    runner = StepRunner(accelerator, task, model, optimizer, scheduler, batch_size=8, stand_in=batch(9, 1))
    result = runner.run([batch(1), None], step=1)
    reference, alone, _, _ = one_step(TinyTask(), budgeted=False, batches=[batch(1)])
    assert task.forwards == [8, 1] and result.window[1] == 8
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("max_norm", [1e-3, 1e3, float("inf")])
def test_cpu_clipping_gives_accelerates_norm_and_gradients_bit_for_bit(max_norm):
    """clip_on_cpu skips the multiplication by 1.0 when the norm is within max_norm; clipped or not,
    the norm and every gradient are accelerate's own, bit for bit."""
    from effitrain.engine.strategies.ddp import clip_on_cpu, clips_on_cpu
    from effitrain.runtime.distributed import make_accelerator

    accelerator = make_accelerator()
    assert clips_on_cpu(accelerator)
    results = []
    for clip in (accelerator.clip_grad_norm_, lambda params, norm: clip_on_cpu(accelerator, params, norm)):
        model = Linear()
        loss = F.cross_entropy(model(x=batch(1)["x"]).logits, batch(1)["labels"], reduction="sum")
        loss.backward()
        results.append((clip(model.parameters(), max_norm), [p.grad.clone() for p in model.parameters()]))
    (theirs, their_grads), (ours, our_grads) = results
    assert torch.equal(ours, theirs) and all(torch.equal(a, b) for a, b in zip(our_grads, their_grads))
    clipped = max_norm < theirs
    assert clipped == (max_norm == 1e-3)  # both cases are exercised
    unclipped = Linear()
    F.cross_entropy(unclipped(x=batch(1)["x"]).logits, batch(1)["labels"], reduction="sum").backward()
    assert all(torch.equal(a, b.grad) for a, b in zip(our_grads, unclipped.parameters())) != clipped


# -- the strategies, alone on tiny models ------------------------------------------------------------

def backward(model, scale: float = 1.0) -> None:
    loss = F.cross_entropy(model(x=batch(1)["x"]).logits, batch(1)["labels"], reduction="sum")
    (loss * scale).backward()


def test_the_config_and_the_processes_choose_the_strategy_and_deepspeed_is_refused_on_a_cpu():
    from effitrain.config import TrainConfig
    from effitrain.engine import strategies
    from effitrain.errors import UserError
    from effitrain.runtime.distributed import make_accelerator

    accelerator = make_accelerator()
    chosen = {name: strategies.for_config(TrainConfig(strategy=name), accelerator)
              for name in ("ddp", "fsdp", "deepspeed")}
    assert [type(s) for s in chosen.values()] == [strategies.Single, strategies.Fsdp, strategies.DeepSpeed]
    assert not strategies.for_config(TrainConfig(strategy="fsdp", fsdp_reshard_after_forward=False),
                                     accelerator).reshard_after_forward
    two = type("TwoProcesses", (), {"num_processes": 2})()
    assert type(strategies.for_config(TrainConfig(), two)) is strategies.Ddp
    assert strategies.accelerator_plugins(TrainConfig()) == strategies.accelerator_plugins(
        TrainConfig(strategy="fsdp")) == {}
    with pytest.raises(UserError, match="--strategy deepspeed needs GPUs"):
        strategies.accelerator_plugins(TrainConfig(strategy="deepspeed"))
    assert [s.technique() for s in chosen.values()] == [None, None, None]  # one process shards nothing
    assert memory_fit.halve(2, 8, chosen["ddp"]) == 4
    with pytest.raises(UserError, match="out of memory under --strategy fsdp"):
        memory_fit.halve(2, 8, chosen["fsdp"])


def test_one_process_clips_as_torch_flags_a_non_finite_norm_and_syncs_nothing():
    from effitrain.engine import communication
    from effitrain.engine.strategies import Single
    from effitrain.runtime.distributed import make_accelerator

    strategy = Single(make_accelerator())
    assert strategy.replicates and strategy.evaluates_in_pieces and strategy.resplits_steps
    model, reference = Linear(), Linear()
    with strategy.no_sync(model):  # one process: a plain context, gradients as without it
        backward(model)
    backward(reference)
    finite, norm = strategy.clip_gradients(model.parameters(), 1e-3)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    assert finite and torch.equal(norm, expected)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)
    backward(model, scale=float("nan"))
    finite, norm = strategy.clip_gradients(model.parameters(), 1.0)
    assert not finite and norm.isnan()
    wire = communication.Counter()
    strategy.count_traffic(model, wire)  # no DDP wrapper to hook: nothing counted
    assert strategy.summary(wire) == {"sync_allreduce_calls": 0, "sync_allreduce_bytes": 0}
    assert strategy.optimizer_state_bytes(100, reduce=None) == 100


class Blocks(torch.nn.Module):
    """Two repeated layers (the blocks FSDP shards one by one) and a head on the root."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return type("Out", (), {"logits": self.head(x)})


@pytest.fixture
def process_group_of_one():
    """What `--strategy fsdp` on one process joins (sharding.join_alone), in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_on_one_process_accumulates_clips_saves_and_loads_as_the_plain_model(tmp_path, process_group_of_one):
    import types

    from effitrain.engine.strategies import Fsdp

    accelerator = types.SimpleNamespace(device=torch.device("cpu"), num_processes=1, mixed_precision="no",
                                        is_main_process=True, save_state=lambda folder: None,
                                        load_state=lambda folder: None, prepare=lambda *objects: objects)
    strategy = Fsdp(accelerator)
    assert not strategy.replicates and not strategy.evaluates_in_pieces and not strategy.resplits_steps
    plain, model = Blocks(), strategy.setup_module(Blocks())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert strategy.prepare(model, optimizer, "loader", "schedule") == (model, optimizer, "loader", "schedule")
    with strategy.no_sync(model):  # the first micro-batch's gradients kept whole, reduced with the second's
        backward(model)
    backward(model)
    backward(plain), backward(plain)
    finite, norm = strategy.clip_gradients(model.parameters(), 0.5)
    assert finite and torch.allclose(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5))
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad.full_tensor(), theirs.grad, msg=name)
    whole = {name: value.clone() for name, value in strategy.module_state_dict(model).items()}  # one process: views
    assert all(torch.equal(whole[name], value) for name, value in plain.state_dict().items())
    strategy.save_checkpoint(tmp_path / "checkpoint", model, optimizer)
    optimizer.step()
    assert not torch.equal(strategy.module_state_dict(model)["head.weight"], whole["head.weight"])
    strategy.load_checkpoint(tmp_path / "checkpoint", model, optimizer)  # the step undone
    assert all(torch.equal(strategy.module_state_dict(model)[name], value) for name, value in whole.items())
    assert strategy.load_full_state_dict(model, {name: value + 1 for name, value in whole.items()}) == []
    assert all(torch.equal(strategy.module_state_dict(model)[name], value + 1) for name, value in whole.items())
    assert strategy.summary(None) == {"sync_allreduce_calls": None, "sync_allreduce_bytes": None}


def test_train_state_round_trips_and_scales_the_sums_per_process():
    state = TrainState(step=7, best_value=0.5, best_step=4, evals_without_improvement=1, last_loss=0.3,
                       last_task_metrics={"reward": 0.25, "completion_length": 3.5})
    state.window += torch.tensor([6.0, 3.0])
    state.totals += torch.tensor([10.0, 100.0])
    saved = state.state_dict(reduce=lambda t: t * 2)  # as if two processes held the same sums
    assert saved["window"] == [12.0, 6.0] and saved["totals"] == [20.0, 200.0]
    restored = TrainState()
    restored.load_state_dict(saved, world=2)
    assert (restored.step, restored.best_value, restored.best_step, restored.evals_without_improvement) == (7, 0.5, 4, 1)
    assert restored.last_task_metrics == {"reward": 0.25, "completion_length": 3.5}  # metrics.json's train_metrics
    assert restored.window.tolist() == [6.0, 3.0] and restored.totals.tolist() == [10.0, 100.0]
    assert restored.take_window() == [6.0, 3.0] and restored.window.tolist() == [0.0, 0.0]
    # A task that logs sums of its own (preference: 4 sums and their count) resumed from a checkpoint
    # written before it did: the loss window is taken back, the task's sums start at 0.
    longer = TrainState(window_size=7)
    longer.load_state_dict(saved, world=2)
    assert longer.window.tolist() == [6.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    longer.window += torch.arange(7.0)
    assert TrainState(window_size=7).state_dict()["window"] == [0.0] * 7
    again = TrainState(window_size=7)
    again.load_state_dict(longer.state_dict(), world=1)
    assert again.take_window() == longer.window.tolist()


class FakeTask:
    def __init__(self, values):
        self.values = iter(values)

    def is_higher_better(self, metric):
        return metric == "accuracy"


def evaluations(monkeypatch, metric: str, values: list[float], **stopping) -> tuple[Evaluator, TrainState, int | None]:
    """An evaluator fed `values` as its validation `metric` every 2 steps: (it, the state after them, the
    evaluation (1-based) at which it first said stop, or None)."""
    from effitrain.engine import evaluator as evaluation

    task = FakeTask(values)
    monkeypatch.setattr(evaluation, "evaluate", lambda *a: {metric: next(task.values)})
    evaluator = Evaluator(None, task, None, None, steps_per_epoch=100, total_steps=100, eval_every=2, metric=metric,
                          **stopping)
    state, stopped = TrainState(), None
    for number in range(1, len(values) + 1):
        state.step = 2 * number
        evaluator.validate(None, state)
        if stopped is None and evaluator.should_stop(state):
            stopped = number
    return evaluator, state, stopped


@pytest.mark.parametrize("metric, values, threshold, best_step, stop_after", [
    ("loss", [1.0, 0.8, 0.9, 0.85, 0.7], 0.0, 10, 4),  # 0.9 and 0.85 do not beat 0.8: patience 2 runs out
    ("loss", [1.0, 0.97, 0.96], 0.05, 6, 3),  # improvements below the threshold: best, but patience runs
    ("accuracy", [0.5, 0.7, 0.6, 0.8], 0.0, 8, None),  # higher is better
])
def test_evaluator_best_and_patience(monkeypatch, metric, values, threshold, best_step, stop_after):
    evaluator, state, stopped = evaluations(monkeypatch, metric, values, patience=2, threshold=threshold)
    assert state.best_step == best_step and stopped == stop_after
    assert evaluator.due(2) and not evaluator.due(3) and evaluator.due(100)
    state.step = 100  # the last step: the run ends there anyway, that is no early stop
    assert not evaluator.should_stop(state)


@pytest.mark.parametrize("metric, values, target, stop_after", [
    ("loss", [1.0, 0.8, 0.5, 0.4], 0.5, 3),  # loss: at most the target (0.5 itself reaches it)
    ("accuracy", [0.1, 0.25, 0.19, 0.3], 0.2, 2),  # higher is better: at least the target
    ("accuracy", [0.1, 0.15], 0.2, None),  # never reached
])
def test_evaluator_stops_once_the_target_is_reached(monkeypatch, metric, values, target, stop_after):
    """--early-stopping-target (Lightning's stopping_threshold), without patience."""
    assert evaluations(monkeypatch, metric, values, target=target)[2] == stop_after


def test_a_step_that_raises_still_closes_the_log_the_bar_and_the_accelerator(tiny_model_dir, tmp_path, monkeypatch):
    import effitrain
    from effitrain import tasks
    from effitrain.outputs import sinks

    task = tasks.get("sequence-classification")
    real, calls, closed = task.loss_sum, [], []

    def failing(model, batch):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("boom")
        return real(model, batch)

    monkeypatch.setattr(task, "loss_sum", failing)
    from effitrain.outputs.console import Console

    real_close, real_bar_close = sinks.JsonlLog.close, Console.close
    monkeypatch.setattr(sinks.JsonlLog, "close", lambda self: (closed.append("log"), real_close(self)))
    monkeypatch.setattr(Console, "close", lambda self: (closed.append("bar"), real_bar_close(self)))
    from accelerate import Accelerator

    real_end = Accelerator.end_training
    monkeypatch.setattr(Accelerator, "end_training", lambda self: (closed.append("accelerator"), real_end(self)))
    with pytest.raises(ValueError, match="boom"):
        effitrain.train({"model": str(tiny_model_dir), "max_train_samples": 32, "max_eval_samples": 8,
                         "batch_size": 4, "log_every": 1, "output_dir": str(tmp_path / "o")})
    assert closed == ["log", "bar", "accelerator"]  # the console is a sink of the log
    assert [r["step"] for r in __import__("conftest").read_jsonl(tmp_path / "o" / "log.jsonl")] == [1, 2]


def test_a_lora_checkpoint_resumed_without_peft_names_peft_not_the_lr_it_implies(tmp_path):
    """Without --lr, --peft lora resolves lr to 1e-3 and --peft none to 1e-4: the cause is peft."""
    import json

    from effitrain import config as cfg
    from effitrain.engine import checkpoint
    from effitrain.errors import UserError

    lora = cfg.build(None, {"peft": "lora"}).to_dict()
    state = {"config": lora, "world_size": 1, "plan": {"grad_accum": 1}}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    plain = cfg.build(None, {}).to_dict()
    assert (lora["lr"], plain["lr"]) == (1e-3, 1e-4)
    with pytest.raises(UserError, match=r"made with peft='lora', this run has 'none'.*fix: resume with --peft lora"):
        checkpoint.check(tmp_path, plain, 1, 1)
    assert checkpoint.check(tmp_path, lora, 1, 1)["world_size"] == 1


@pytest.mark.parametrize("changed", [{"loss_on": "all"}, {"chat_template": "chatml"}, {"skip_bad_rows": True},
                                     {"max_grad_norm": 0.5}], ids=lambda c: next(iter(c)))
def test_a_checkpoint_resumed_with_another_loss_mask_template_data_filter_or_clipping_is_refused(tmp_path, changed):
    """Each changes what a step trains on or how far it moves: a resume with another would not continue the run."""
    import json

    from effitrain import config as cfg
    from effitrain.engine import checkpoint
    from effitrain.errors import UserError

    made = cfg.build(None, {"task": "causal-lm"}).to_dict()
    state = {"world_size": 1, "plan": {"grad_accum": 1}}
    (tmp_path / "trainer_state.json").write_text(json.dumps({"config": made, **state}))
    now = cfg.build(None, {"task": "causal-lm", **changed}).to_dict()
    key = next(iter(changed))
    with pytest.raises(UserError, match=f"made with {key}="):
        checkpoint.check(tmp_path, now, 1, 1)
    older = {k: v for k, v in made.items() if k != key}  # a checkpoint from before the setting: its default
    (tmp_path / "trainer_state.json").write_text(json.dumps({"config": older, **state}))
    assert checkpoint.check(tmp_path, made, 1, 1)["world_size"] == 1


def test_a_diverged_preference_run_names_beta_beside_the_lr():
    """--beta 1e30 makes DPO's loss terms overflow: the fix names it, not only --lr."""
    import types

    from effitrain.config import TrainConfig
    from effitrain.engine.run import non_finite_fix
    from effitrain.models.adapters import PlainModel

    dpo = types.SimpleNamespace(config=TrainConfig(task="causal-lm", preference="dpo", beta=1e30, lr=1e-4),
                                form=PlainModel())
    assert non_finite_fix(dpo).startswith("lower --lr or --beta (1e+30 now: it scales every dpo loss term)")
    plain = types.SimpleNamespace(config=TrainConfig(), form=PlainModel())
    assert "--beta" not in non_finite_fix(plain)


def test_the_warm_up_leaves_the_last_step_to_train_at_its_peak():
    """A warm-up starts at lr 0: one that took the only step of a 1-step run (transformers' ceil(1 x 0.1) = 1)
    would report a run that changed nothing. Short of every step, it is transformers' count otherwise."""
    from effitrain.optimizers import schedule

    assert schedule.warmup_steps(1, 0.1) == 0 and schedule.warmup_steps(243, 0.1) == 25
    assert schedule.warmup_steps(6, 1.0) == 5 and schedule.warmup_steps(6, 0.0) == 0
    assert schedule.warmup_steps(0, 0.1) == 0
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = schedule.linear_schedule(optimizer, 1, schedule.warmup_steps(1, 0.1), num_processes=1)
    assert scheduler.get_last_lr() == [1.0]  # the one step trains at the peak
