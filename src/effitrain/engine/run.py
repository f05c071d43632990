"""A training run, top to bottom: set up, loop over the steps (log, evaluate, checkpoint), test, save,
report. Each concern is a piece of its own: setup.py (the Run), step.py (one optimizer step),
state.py (the counters a checkpoint keeps), evaluator.py (validation, best, early stopping),
checkpoint.py (saving and resuming), saving.py (model/, best/), summary.py (metrics.json)."""

from __future__ import annotations

import contextlib
import math
import time

from effitrain import optimizers
from effitrain.config import TrainConfig
from effitrain.engine import checkpoint, compilation, model_card, saving, summary
from effitrain.engine import evaluator as evaluation
from effitrain.engine.callbacks import Callbacks
from effitrain.engine.checkpoint import Checkpointer
from effitrain.engine.setup import Run, setup
from effitrain.engine.state import TrainState, process_age_seconds
from effitrain.engine.step import StepRunner, window_size
from effitrain.errors import Diverged
from effitrain.optimizers import schedule
from effitrain.outputs.console import Console
from effitrain.runtime import peers
from effitrain.runtime.devices import cpu_name, peak_memory_bytes
from effitrain.speedups import process_tuning


def run(config: TrainConfig, run_dir=None, command: bool = False, callbacks=()) -> dict:
    """Train, evaluate, save. Returns the metrics written to metrics.json. `run_dir`: the output folder
    commands.train checked and locked (process 0). `command`: the process is the effitrain command, so
    its age is the start-up (the imports and checks before this call). `callbacks`: objects with hooks
    into the loop (engine/callbacks.py)."""
    wall_start = time.perf_counter()
    start_up = process_age_seconds() if command else 0.0
    with contextlib.ExitStack() as cleanup:  # closed also when a step raises
        with process_tuning.setting_up(cleanup):  # the process tuned for the run (speedups/process_tuning.py)
            job = setup(config, cleanup, run_dir)
        state = TrainState(job.accelerator.device, started=wall_start, window_size=window_size(job.task))
        checkpointer = Checkpointer(job.strategy, job.out_dir, config.save_every, config.keep_last, job.total_steps,
                                    (job.model, job.optimizer))
        if job.resume_from is not None:
            checkpointer.restore(job.resume_from, state, job.world, job.resume_state)
            if job.resume_state["world_size"] != job.world:
                schedule.continue_schedule(job.scheduler, state.step, job.world)
            job.main_print(f"resumed from {job.resume_from} at step {state.step}")
        evaluator = evaluation.Evaluator(job.accelerator, job.task, job.data.label_names, job.eval_dls["validation"],
                              steps_per_epoch=job.steps_per_epoch, total_steps=job.total_steps,
                              eval_every=config.eval_every, metric=config.metric_for_best or "loss",
                              patience=config.early_stopping_patience, threshold=config.early_stopping_threshold,
                              target=config.early_stopping_target,
                              in_pieces=job.strategy.evaluates_in_pieces, setting=eval_setting(job, "validation"))
        console = Console(job.total_steps, state.step, shown=job.accelerator.is_local_main_process)
        job.log.sinks.append(console)  # closed with the log, also when a step raises
        hooks = Callbacks([console, *callbacks])
        announce(job)
        hooks.call("on_train_begin", job)
        # Local SGD: no gradient sync inside; leaving it averages the parameters of every process.
        with peers_watched(job, state), job.local_sgd or contextlib.nullcontext():
            state.add_phase("start_up", start_up)  # added to what a restored checkpoint's invocations took
            state.add_phase("set_up", time.perf_counter() - wall_start)
            stopped_early = train(job, state, step_runner(job), evaluator, checkpointer, hooks)
        optimizers.get(job.plan.optim).use_evaluated_weights(job.optimizer)  # e.g. schedule-free's averaged ones
        console.close()  # before the test and the summary, which would print on the bar's line
        hooks.call("on_train_end", state)
        result = finish(job, state, stopped_early, hooks)
        # Every process out of every collective before any tears gloo down (accelerate's end_training destroys
        # the group at once): a 2-process fsdp run aborted at its end once ("terminate called without an
        # active exception", SIGABRT after model/ was written). Not on a failure: a peer may be gone.
        job.accelerator.wait_for_everyone()
        return result


@contextlib.contextmanager
def peers_watched(job: Run, state: TrainState):
    """A collective that failed because another process of the job ended becomes one PeerLost naming the
    step and the checkpoint to resume from: the process that ended says why (or its launcher does), this
    one only what it knows, without gloo's or NCCL's traceback."""
    try:
        yield
    except Exception as err:
        if job.world < 2 or not peers.lost_peer(err):
            raise
        saved = checkpoint.complete(job.out_dir)
        raise peers.PeerLost(state.step + 1, str(saved[-1]) if saved else None) from err


def eval_setting(job: Run, split: str):
    """The task's evaluation setting for a split (causal-lm on answers: how answers are generated)."""
    return job.task.eval_setting(job.data.processor, job.config, job.data.encoded[split])


def finish(job: Run, state: TrainState, stopped_early: bool, hooks: Callbacks) -> dict:
    """After the loop: the weights to keep, checked; the test split; model/ (and adapter/), metrics.json
    and the model card. Never reports success for a model that cannot predict."""
    config = job.config
    if config.keep == "best" and state.best_step is not None:
        with state.timed("saving"):
            saving.load_weights(job, job.out_dir / "best")
    check_trained(job, state)
    with state.timed("evaluation"):
        gathered = evaluation.gather_outputs(job.accelerator, job.task, job.model, job.eval_dls["test"],
                                             job.strategy.evaluates_in_pieces, eval_setting(job, "test"))
    test = job.task.metrics(gathered, job.data.label_names)
    log_record(job, state, split="test", **test)
    if not math.isfinite(test["loss"]):  # finite weights can still overflow: a model that cannot predict
        raise Diverged(f"the trained model's test loss is {test['loss']}, so no model was saved", non_finite_fix(job))
    result = summary.metrics(job, state, test, stopped_early,
                             confusion=job.task.confusion_matrix(gathered, job.data.label_names))
    with state.timed("saving"):
        saving.save_model(job, job.out_dir / "model")
        hooks.call("on_save", state, job.out_dir / "model")
        for name in job.form.folders_beside_model:  # adapters: adapter/, the adapter alone
            saving.save_trained(job, job.out_dir / name)
            hooks.call("on_save", state, job.out_dir / name)
    result["wall_seconds"] = state.wall_seconds()
    result["wall_seconds_by_phase"] = state.seconds_by_phase(result["compile"]["seconds"] if job.compiled else 0.0)
    summary.write(job, result)
    if job.accelerator.is_main_process:
        # The folder chosen (a launched run without --output-dir names it on process 0 only).
        model_card.write(job.out_dir / "model", {**config.to_dict(), "output_dir": str(job.out_dir)}, result,
                         card_facts(job))
    return result


def card_facts(job: Run) -> dict:
    """What model/README.md says that metrics.json does not."""
    import torch

    device = job.accelerator.device
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"pipeline_tag": job.task.pipeline_tag, "is_text": job.task.is_text, "hardware": hardware,
            "sharding": job.strategy.technique()}


def train(job: Run, state: TrainState, runner: StepRunner, evaluator: evaluation.Evaluator,
          checkpointer: Checkpointer, hooks: Callbacks) -> bool:
    """The steps from state.step on; True if early stopping ended them."""
    groups = batches(job, state.step)
    while state.step < job.total_steps:
        tick, compiling = time.perf_counter(), compile_seconds(job)
        group = next(groups)
        if job.config.debug:
            log_examples(job, state.step + 1, group)
        hooks.call("on_step_begin", state, group)
        result = runner.run(group, state.step + 1)
        after_step(job, state, result)
        if job.local_sgd is not None:
            job.local_sgd.step()
        state.step += 1
        compiled = compile_seconds(job) - compiling
        state.train_seconds += time.perf_counter() - tick - compiled  # not training time: compiling, evaluation, saving
        if compiled:
            said_compiled(job, state, compiled)
        if state.step % job.config.log_every == 0 or state.step == job.total_steps:
            log_window(job, state, result)
        hooks.call("on_step_end", state, result)
        if evaluator.due(state.step) and validate(job, state, evaluator, hooks):
            return True
        if checkpointer.due(state.step):
            with state.timed("saving"):
                path = checkpointer.save(state.step, {"config": job.config.to_dict(), "plan": job.plan.to_dict(),
                                                      "world_size": job.world, **state.state_dict(job.reduce)})
            hooks.call("on_save", state, path)
    return False


def compile_seconds(job: Run) -> float:
    """Seconds spent compiling in this process so far (--compile; 0 without)."""
    return compilation.totals()[1] if job.compiled else 0.0


def said_compiled(job: Run, state: TrainState, seconds: float) -> None:
    """A step that compiled new graphs (the first, and each new kind of input): logged and shown, since
    it pauses the run; a bounded number of times (see engine/compilation.py)."""
    graphs, total = job.compiled.since_start()
    job.log.write({"step": state.step, "compile_seconds": round(seconds, 3), "compile_graphs_so_far": graphs})
    job.log.say(f"step {state.step}: compiled for {seconds:.1f} s (not counted as training time; {graphs} "
                    f"graph(s), {total:.1f} s so far)")


def batches(job: Run, start_step: int):
    """This process's micro-batches of each step from `start_step` on (None where it has none); the
    order of an epoch is a function of (seed, epoch), so a resumed run sees what the uninterrupted
    one saw."""
    step = start_step
    while True:
        epoch, done_in_epoch = divmod(step, job.steps_per_epoch)
        job.train_dl.set_epoch(epoch)
        loaded = iter(job.train_dl)
        for index, size in enumerate(job.sizes):
            group = [next(loaded, None) for _ in range(size)]
            if index >= done_in_epoch:  # resumed mid-epoch: pass over the batches already trained on
                yield group
                step += 1


def log_examples(job: Run, step: int, group: list) -> None:
    """--debug: which examples the step trains on, over all processes, as one number (the sum of their
    hashes), to show that runs with other processes, micro-batches or a resume see the same ones."""
    import torch

    digests = [d for batch in group if batch is not None for d in job.task.example_digests(batch)]
    total = job.reduce(torch.tensor([sum(digests), len(digests)], dtype=torch.int64, device=job.accelerator.device))
    job.log.write({"step": step, "examples": int(total[1]), "examples_digest": f"{int(total[0]) % 2**56:014x}"})


def step_runner(job: Run) -> StepRunner:
    synced = job.world > 1 and job.local_sgd is None  # local SGD: each process minimises its own loss

    def said_retry(step: int, pieces: int) -> None:
        message = f"out of memory at step {step}: retrying it in pieces of {job.config.batch_size // pieces}"
        job.log.write({"step": step, "out_of_memory": message, "pieces": pieces})
        job.main_print(message)
        job.plan.pieces = pieces

    return StepRunner(job.accelerator, job.task, job.model, job.optimizer, job.scheduler, pieces=job.plan.pieces,
                      batch_size=job.config.batch_size, max_grad_norm=job.config.max_grad_norm, synced=synced,
                      budgeted=job.config.memory_budget is not None, strategy=job.strategy,
                      stand_in=job.stand_in, wire=job.wire, on_retry=said_retry, seed=job.config.seed)


def after_step(job: Run, state: TrainState, result) -> None:
    """Counters of a finished step; a skipped (non-finite) one is logged, and too many in a row stop
    the run with the last good weights saved."""
    state.totals += result.totals
    if result.finite:
        state.window += result.window
        state.bad_in_a_row = 0
        return
    state.skipped_steps, state.bad_in_a_row = state.skipped_steps + 1, state.bad_in_a_row + 1
    step = state.step + 1
    job.log.write({"step": step, "skipped": "non-finite loss or gradient", "grad_norm": None})
    job.log.say(f"step {step}: non-finite loss or gradient, step skipped ({state.skipped_steps} so far)")
    if state.bad_in_a_row >= job.config.max_bad_steps:
        # The weights now are those the last good step made, and they gave these non-finite losses:
        # not a model to hand out. Checkpoints and best/ (if any) stay, with the log.
        raise Diverged(f"{state.bad_in_a_row} steps in a row had a non-finite loss or gradient (up to step {step}), "
                       "so the run stopped; no model was saved", non_finite_fix(job))


def non_finite_fix(job: Run) -> str:
    """What to change when training stopped being finite, as the model's form says it (with adapters, their
    settings first). The model's own weights were finite at the start (setup.check_finite_weights)."""
    config = job.config
    beta = ""
    if config.preference:
        beta = f" or --beta ({config.beta:g} now: it scales every {config.preference} loss term)"
    return job.form.non_finite_fix(config, beta)


def check_trained(job: Run, state: TrainState) -> None:
    """Never report success for a broken model: a run whose every step was skipped, or whose weights
    are not finite, ends here as a user error, and model/ is not written."""
    import torch

    if state.step and state.skipped_steps >= state.step:
        raise Diverged(f"all {state.step} steps had a non-finite loss or gradient and were skipped, so the model "
                        "did not train; no model was saved", non_finite_fix(job))
    model = job.accelerator.unwrap_model(job.model)
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())  # FSDP: this process's shard
    bad = sum(int(not torch.isfinite(p).all()) for p in local)
    if job.reduce(torch.tensor([bad], device=job.accelerator.device)).item():
        raise Diverged("the trained weights are not finite (NaN or infinity), so no model was saved",
                        non_finite_fix(job))


def log_window(job: Run, state: TrainState, result) -> None:
    reduce = job.reduce if job.world > 1 else None
    loss_total, item_total, *sums = state.take_window(reduce)
    examples, tokens, seconds = state.take_throughput(reduce)
    grad_norm = None if result.grad_norm is None or not result.finite else float(result.grad_norm)
    loss = loss_total / item_total if item_total else None  # None: every step of the window was skipped
    per_second = examples / seconds if seconds > 0 else None
    memory = peak_memory_bytes(job.accelerator.device)  # process 0's peak so far
    # The task's own (preference: rewards, accuracy), means over the window's items as the loss is.
    own = {name: total / sums[-1] if sums[-1] else None for name, total in zip(job.task.train_metric_names(), sums)}
    log_record(job, state, loss=loss, **own, lr=job.scheduler.get_last_lr()[0],
               grad_norm=grad_norm, elapsed_seconds=round(state.train_seconds, 3),
               samples_per_second=per_second,
               tokens_per_second=tokens / seconds if job.task.is_text and seconds > 0 else None,
               peak_memory_bytes=memory)  # the console shows it as the step's line
    state.last_loss, state.last_task_metrics = loss, own


def validate(job: Run, state: TrainState, evaluator: evaluation.Evaluator, hooks: Callbacks) -> bool:
    """Evaluate on the validation split; keep the best weights in best/ when asked; True to stop early."""
    with optimizers.get(job.plan.optim).evaluated_weights(job.optimizer):  # e.g. schedule-free's averaged ones
        with state.timed("evaluation"):
            improved = evaluator.validate(job.model, state)
        log_record(job, state, split="validation", **state.validation)  # the console shows it as a line
        hooks.call("on_evaluate", state)
        if improved and job.keeps_best:
            with state.timed("saving"):
                saving.save_trained(job, job.out_dir / "best")  # adapters: the adapter alone
            hooks.call("on_save", state, job.out_dir / "best")
    stop = evaluator.should_stop(state)
    if stop and evaluator.reached_target(state):
        job.log.say(f"early stopping at step {state.step}: validation {evaluator.metric} "
                    f"{state.validation[evaluator.metric]:.4f} reached --early-stopping-target {evaluator.target:g}")
    elif stop:
        job.log.say(f"early stopping at step {state.step}: no improvement of validation {evaluator.metric} in "
                    f"{state.evals_without_improvement} evaluations (best {state.best_value:.4f} at step "
                    f"{state.best_step})")
    return stop


def log_record(job: Run, state: TrainState, **values) -> dict:
    record = {"step": state.step, "epoch": round(state.step / job.steps_per_epoch, 4), **values}
    job.log.write(record)
    return record


def announce(job: Run) -> None:
    config, data, plan = job.config, job.data, job.plan
    encoded, skipped = data.encoded, data.loaded.skipped_rows
    if plan.note:
        job.main_print(plan.note)
        job.log.write({"step": 0, "memory_plan": plan.note, "pieces": plan.pieces, **(plan.memory or {})})
    described = job.task.data_description(data.loaded.splits, config)
    student = f", a student of {config.student_layers} layers" if config.student_layers else ""
    distillation = getattr(job.task, "distillation", None)  # offline; --rl distill's objective names its teacher
    if distillation is not None:  # the teacher named as the student is: its folder and the loss's weights
        student += f", distilled from {distillation.describe()}"
    job.main_print(f"training {config.model} ({job.task.name}{student}) on {config.data}"
                   + (f" ({described})" if described else "") + f": {len(encoded['train'])} train / "
                   f"{len(encoded['validation'])} validation / {len(encoded['test'])} test examples"
                   + (f", {skipped} bad rows skipped" if skipped else "")
                   + (f", labels {data.label_names}" if data.label_names else "")
                   + f", {job.total_steps} steps of {config.batch_size} x {plan.grad_accum} x {job.world} "
                     f"process(es) on {job.accelerator.device}; {plan.precision_reason}; optimizer {plan.optim}"
                   + (", gradient checkpointing" if plan.gradient_checkpointing else ""))
