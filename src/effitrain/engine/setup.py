"""Set-up of a run: the cheap checks first, then the accelerator, the data, the plan, the model, the
output dir, the loaders, the optimizer and scheduler, all prepared; returned as a `Run`.

The config is read, never changed. What the run resolves from it (accumulation, pieces, optimizer
and checkpointing, precision) is a `RunPlan`, written beside the config in config.yaml (`plan:`), so
that rerunning config.yaml pins the same choices and reproduces the run."""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from effitrain import optimizers
from effitrain import tasks
from effitrain.config import TrainConfig
from effitrain.data import text
from effitrain.engine import (
    checkpoint,
    communication,
    compilation,
    memory_fit,
    precision,
    strategies,
)
from effitrain.errors import UserError
from effitrain.models import adapters, blocks, loading, student, transforms
from effitrain.optimizers import schedule
from effitrain.outputs import files, run_folder, sinks, tracking
from effitrain.runtime import libraries
from effitrain.runtime.distributed import make_accelerator
from effitrain.speedups import process_tuning


@dataclass
class RunPlan:
    grad_accum: int
    pieces: int = 1  # --memory-budget: each loaded micro-batch runs as this many pieces
    optim: str = "adamw"
    gradient_checkpointing: bool = False
    precision: str = "no"  # accelerate's mixed_precision: no | bf16 | fp16
    precision_reason: str = ""
    note: str | None = None  # what --memory-budget decided, in words
    # --memory-budget: the budget, the predicted peak of the setting chosen and what was in use before
    # the model (memory_fit.plan_run's numbers, for metrics.json)
    memory: dict | None = None

    def to_dict(self) -> dict:
        """What config.yaml pins (not what the planner said about it)."""
        return {key: value for key, value in asdict(self).items() if key not in ("precision_reason", "note", "memory")}


@dataclass
class Data:
    processor: Any
    loaded: Any  # sources.Loaded: splits, base dir, skipped rows
    encoded: Any  # the preprocessed splits
    label_names: list[str] | None


@dataclass
class Run:
    config: TrainConfig
    task: Any
    accelerator: Any
    plan: RunPlan
    data: Data
    model: Any
    optimizer: Any
    scheduler: Any
    train_dl: Any
    eval_dls: dict
    stand_in: dict  # a one-example micro-batch for processes that lack one at the end of an epoch
    sizes: list[int]  # micro-batches per process in each step of an epoch
    out_dir: Path
    log: sinks.RunLog  # log.jsonl, and the trackers of --report-to
    strategy: strategies.Strategy
    resume_from: Path | None = None
    resume_state: dict | None = None
    wire: communication.Counter = field(default_factory=communication.Counter)
    local_sgd: Any = None
    compiled: compilation.Watch | None = None  # --compile: the graphs and seconds compiling cost
    transforms: list[str] = field(default_factory=list)  # the model transforms applied, in order
    student: dict | None = None  # --student-layers: models/student.summary (N layers of L, which ones)

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def steps_per_epoch(self) -> int:
        return len(self.sizes)

    @property
    def total_steps(self) -> int:
        return self.config.max_steps or self.config.epochs * self.steps_per_epoch

    @property
    def keeps_best(self) -> bool:
        """The best evaluation's weights are saved to best/ only when the user asked for them."""
        config = self.config
        return bool(config.metric_for_best or config.early_stopping_patience or config.keep == "best")

    @property
    def form(self) -> adapters.PlainModel | adapters.AdaptedModel:
        """The model's form (models/adapters/model_form.py): how it is saved, restored and described; with
        --peft's adapters, model/ is merged and adapter/ and best/ hold the adapter."""
        return adapters.form_of(self.config)

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over processes (a collective; the tensor itself on one process)."""
        return self.accelerator.reduce(tensor, "sum") if self.world > 1 else tensor

    def main_print(self, message: str) -> None:
        self.accelerator.print(message)


def setup(config: TrainConfig, cleanup: contextlib.ExitStack, run_dir: run_folder.RunDir | None) -> Run:
    """Everything a run needs; `cleanup` gets what must be closed even if the run raises. `run_dir`: the
    output folder process 0 holds (checked and locked by commands/train.train; None on the other processes)."""
    from accelerate.utils import set_seed

    libraries.quiet_libraries(config.debug)
    task = tasks.for_config(config)
    # Fail on the cheap checks before loading anything heavy.
    source = loading.resolve_source(config.model, config.allow_pickle, tokenizer=config.tokenizer)
    source.allow_partial = config.allow_partial_load
    made_student = student.check_source(source, config.student_layers, task.build_on_meta)
    tracking.check_installed(config)
    mixed_precision, reason = precision.choose(config.precision)
    accelerator = make_accelerator(config.ddp_timeout, strategies.accelerator_plugins(config), mixed_precision,
                                   broadcast_buffers=config.memory_budget is None, log_with=trackers(config, run_dir))
    cleanup.callback(accelerator.end_training)  # also finishes the trackers
    process_tuning.keep_freed_memory(accelerator.device, cleanup)  # each step reuses the last one's pages
    strategy = strategies.for_config(config, accelerator)
    strategy.setup_environment(cleanup)
    accelerator.wait_for_everyone()  # process 0 has locked the output folder and settled what was in it
    resume_from = checkpoint.find(Path(config.output_dir), config.resume) if config.resume else None
    resume_state = checkpoint.check(resume_from, config.to_dict(), accelerator.num_processes,
                                    accumulation(config, accelerator.num_processes)) if resume_from else None
    set_seed(config.seed)
    data = load_data(task, config, source, accelerator)
    check_metric(task, config, data.label_names)
    plan = resolve_plan(config, accelerator, mixed_precision, reason, data, resume_state)
    if config.rl is not None:
        memory_fit.check_rollout_fits(config, accelerator.device, plan.grad_accum, data.encoded, data.processor)
    sizes = step_sizes(math.ceil(len(data.encoded["train"]) / config.batch_size), accelerator.num_processes,
                       plan.grad_accum)
    check_schedule(config, sizes)
    model, applied = build_model(task, source, data, plan, config, accelerator.device)
    strategy.check_module(model)
    compiled = compilation.watch(model, applied, cleanup)
    # Only now, with data and model loaded: a mistake in either leaves no half-made output dir behind.
    out_dir = claim_output_dir(accelerator, config, plan, run_dir)
    log = sinks.RunLog(sinks.JsonlLog(out_dir / "log.jsonl" if accelerator.is_main_process else None),
                         tracking.start(accelerator, config, out_dir, plan.to_dict()))
    cleanup.callback(log.close)
    run = prepare(config, task, strategy, plan, data, model, sizes, out_dir, log, resuming=resume_from is not None)
    run.resume_from, run.resume_state, run.compiled, run.transforms = resume_from, resume_state, compiled, applied
    run.student = made_student
    return run


def trackers(config: TrainConfig, run_dir: run_folder.RunDir | None) -> list:
    """--report-to's trackers, on the main process only (the others log nothing); they start once the
    output folder is claimed. Resuming, they continue from the checkpoint's step."""
    if run_dir is None or config.report_to == "none":
        return []
    resumed_step = checkpoint.trainer_state(run_dir.resume_from)["step"] if run_dir.resume_from else None
    return tracking.trackers(config, run_dir.path, resumed_step)


def accumulation(config: TrainConfig, world: int) -> int:
    """--grad-accum, or what --effective-batch-size asks for given the micro-batch and the processes."""
    if config.effective_batch_size is None:
        return config.grad_accum
    per_pass = config.batch_size * world
    if config.effective_batch_size % per_pass:
        raise UserError(f"--effective-batch-size {config.effective_batch_size} is not a multiple of --batch-size "
                        f"{config.batch_size} x {world} process(es)",
                        f"pass a multiple of {per_pass}, or change --batch-size")
    return config.effective_batch_size // per_pass


def load_data(task, config: TrainConfig, source, accelerator) -> Data:
    processor = task.load_processor(source)
    loaded = task.load_data(config)
    train = loaded.splits["train"]
    label_names = train.features["label"].names if "label" in train.column_names else None
    with accelerator.main_process_first():  # the main process fills the preprocessing cache, the others reuse it
        encoded = task.preprocess(loaded.splits, processor, config, loaded.base_dir)
    encoded, dropped = task.drop_untrainable(encoded, config)
    loaded.skipped_rows += dropped
    return Data(processor, loaded, encoded, label_names)


def check_metric(task, config: TrainConfig, label_names) -> None:
    known = task.metric_names(label_names)
    if config.metric_for_best is not None and config.metric_for_best not in known:
        raise UserError(f"--metric-for-best `{config.metric_for_best}` is not a metric of {task.name}",
                        f"pass one of {', '.join(known)}")


def resolve_plan(config: TrainConfig, accelerator, mixed_precision: str, reason: str, data: Data,
                 resume_state: dict | None) -> RunPlan:
    """Accumulation from the config; pieces, optimizer and checkpointing pinned by config.plan, or kept
    from the checkpoint being resumed, or chosen by the memory planner (--memory-budget)."""
    world = accelerator.num_processes
    plan = RunPlan(accumulation(config, world), 1, config.optim, config.gradient_checkpointing, mixed_precision,
                   reason)
    if config.plan:
        check_pinned(config, plan)
        plan.pieces = config.plan.get("pieces", 1)
        plan.optim = config.plan.get("optim", plan.optim)
        plan.gradient_checkpointing = config.plan.get("gradient_checkpointing", plan.gradient_checkpointing)
        return plan
    if not config.memory_budget:
        return plan
    # Resuming: the optimizer and checkpointing the checkpoint's states belong to, whatever a new plan
    # would choose with the memory free now; only the pieces are planned again.
    earlier = (resume_state or {}).get("plan")
    fixed = (earlier["optim"], earlier["gradient_checkpointing"]) if earlier else None
    plan.pieces, plan.optim, plan.gradient_checkpointing, plan.note, plan.memory = memory_fit.plan_run(
        config, accelerator.device, world, plan.grad_accum, mixed_precision, len(data.label_names or []),
        data.processor, fixed=fixed, encoded=data.encoded)
    return plan


def check_pinned(config: TrainConfig, plan: RunPlan) -> None:
    """A plan written by a run with these settings: what they resolve to here must be what it says,
    and what it chose must be a choice the memory planner could make from them (a flag changed since
    the plan was written, or a hand-edited plan, is refused rather than half applied)."""
    pinned, budget = config.plan, config.memory_budget is not None
    possible = {
        "grad_accum": pinned.get("grad_accum", plan.grad_accum) == plan.grad_accum,
        "precision": pinned.get("precision", plan.precision) == plan.precision,
        "pieces": pinned.get("pieces", 1) == 1 or budget,
        "optim": pinned.get("optim", plan.optim) in [plan.optim,
                                                     *(optimizers.get(plan.optim).lighter if budget else ())],
        "gradient_checkpointing": pinned.get("gradient_checkpointing", plan.gradient_checkpointing) in
        ({plan.gradient_checkpointing, True} if budget else {plan.gradient_checkpointing}),
    }
    for key, ok in possible.items():
        if not ok:
            raise UserError(f"config: the plan's `{key}: {pinned[key]!r}` is not what this run's settings give "
                            f"(the plan was written for other settings, or edited)",
                            "drop the plan block to plan again, or rerun with the settings it was written with")


def build_model(task, source, data: Data, plan: RunPlan, config: TrainConfig, device) -> tuple[Any, list[str]]:
    """The task's model through the transform pipeline (models/transforms.py: its order and conditions;
    QLoRA's base loaded in 4 bits first), and the names of the transforms applied (metrics.json)."""
    options = adapters.load_options(task, source, config, plan.precision, device)
    model = task.build_model(source, data.label_names, data.processor, options)
    adapters.keep_4bit_layout(model)  # before the first forward: the checks below and transforms' run the model
    loading.check_finite(model, f"model {source.path}" if source.path else "the model built from its config")
    task.check_built_model(model, data.encoded, data.processor, config)
    settings = transforms.of_run(config, plan, device, task)
    model, applied = transforms.apply_all(model, settings)
    model.train()
    return model, applied


def claim_output_dir(accelerator, config: TrainConfig, plan: RunPlan, run_dir: run_folder.RunDir | None) -> Path:
    from accelerate.utils import broadcast_object_list

    # Every process must write to the same directory: the one the main process holds.
    chosen = [str(run_dir.path) if accelerator.is_main_process else ""]
    broadcast_object_list(chosen, from_process=0)
    out_dir = Path(chosen[0])
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        run_dir.start()  # an overwritten run is moved aside now, not before the data and model loaded
        # What reproduces the run; not how this command treated the folder (a rerun of this file with
        # another --output-dir must not replace or resume what is there).
        written = {**config.to_dict(), "output_dir": str(out_dir), "overwrite": False, "resume": None,
                   "plan": plan.to_dict()}
        files.write_yaml(out_dir / "config.yaml", written)
    accelerator.wait_for_everyone()
    return out_dir


def loaders(task, config: TrainConfig, data: Data, world: int, grad_accum: int):
    """(training loader, {validation, test} loaders, a one-example stand-in batch)."""
    train_collate, eval_collate = task.collators(data.processor, config)
    encoded = data.encoded
    sampler = text.train_sampler(encoded["train"], config.batch_size * world * grad_accum,
                                 config.group_by_length, config.seed)
    # Its own generator: the loader's base seed must not draw from the global RNG (dropout's), or a
    # resumed run would draw differently from the uninterrupted one.
    train_dl = DataLoader(encoded["train"], batch_size=config.batch_size, sampler=sampler, collate_fn=train_collate,
                          generator=torch.Generator().manual_seed(config.seed))
    eval_dls = {split: DataLoader(encoded[split], batch_size=config.eval_batch_size, collate_fn=eval_collate,
                                  sampler=text.eval_order(encoded[split])) for split in ("validation", "test")}
    return train_dl, eval_dls, train_collate([encoded["train"][0]])


def prepare(config: TrainConfig, task, strategy: strategies.Strategy, plan: RunPlan, data: Data, model,
            sizes: list[int], out_dir: Path, log, resuming: bool = False) -> Run:
    accelerator, world = strategy.accelerator, strategy.accelerator.num_processes
    # The starting model, before any wrapping: what the task makes of it (a preference reference, a teacher's
    # logits); `resuming`: a checkpoint is resumed, so what an earlier start stored must be there.
    data.encoded = task.before_training(model, data.encoded, data.processor, config, out_dir, accelerator.autocast,
                                        resuming=resuming)
    train_dl, eval_dls, stand_in = loaders(task, config, data, world, plan.grad_accum)
    assert len(train_dl) == math.ceil(len(data.encoded["train"]) / config.batch_size)
    total_steps = config.max_steps or config.epochs * len(sizes)
    model = strategy.setup_module(model)  # before the optimizer, which must hold what it made (FSDP's shards)
    optimizer = optimizers.build(plan.optim, model, config.lr, config.weight_decay, (config.beta1, config.beta2),
                                 blocks=blocks.blocks(model))
    warmup = schedule.warmup_steps(total_steps, config.warmup_ratio)
    scheduler = schedule.linear_schedule(optimizer, total_steps, warmup, world, decay=optimizers.get(plan.optim).decays,
                                         shape=config.lr_schedule)
    # Training shards must not recycle examples to even out the processes (accelerate's default):
    # that would train on duplicates that one process with a big batch never sees.
    accelerator.even_batches = False
    train_dl = accelerator.prepare(train_dl)
    accelerator.even_batches = True  # evaluation: gather_for_metrics drops the padded-in duplicates
    model, optimizer, eval_dls["validation"], eval_dls["test"], scheduler = strategy.prepare(
        model, optimizer, eval_dls["validation"], eval_dls["test"], scheduler)
    stand_in = {key: value.to(accelerator.device) for key, value in stand_in.items()}
    run = Run(config, task, accelerator, plan, data, model, optimizer, scheduler, train_dl, eval_dls, stand_in,
              sizes, out_dir, log, strategy)
    # What crosses the wire: local SGD's parameter averaging, or the strategy's gradient sync.
    if world > 1 and config.local_sgd_steps:
        run.local_sgd = communication.AveragingLocalSGD(accelerator, model, config.local_sgd_steps, run.wire)
    else:
        strategy.count_traffic(model, run.wire)
    return run


def step_sizes(num_batches: int, world: int, accum: int) -> list[int]:
    """Micro-batches per process in each optimizer step of an epoch of `num_batches` global micro-batches.

    Process p holds micro-batches p, p + W, p + 2W, ... so step s covers global micro-batches
    [s*k*W, (s+1)*k*W): the same examples as one process with a batch W*k times larger. In the last
    step a process whose shard ended one micro-batch early runs an empty one (see `step_groups`)."""
    per_process = math.ceil(num_batches / world)
    steps = math.ceil(per_process / accum)
    return [accum] * (steps - 1) + [per_process - (steps - 1) * accum]


def check_schedule(config: TrainConfig, sizes: list[int]) -> None:
    """Early stopping needs evaluations to compare: at least patience + 1 of them."""
    patience, every = config.early_stopping_patience, config.eval_every or len(sizes)
    if patience is None:
        return
    total = config.max_steps or config.epochs * len(sizes)
    evaluations = total // every + (total % every != 0)
    if evaluations <= patience:
        raise UserError(f"--early-stopping-patience {patience} needs at least {patience + 1} evaluations; this "
                        f"run has {evaluations} ({total} steps, evaluated every {every})",
                        "pass a smaller --eval-every, or more --epochs/--max-steps")
