"""--memory-budget: fit a run into a device's memory without changing what it computes.

The data loader keeps the user's micro-batch, so the order and grouping of examples are those of
the run without a budget; each loaded micro-batch is run as `pieces` smaller pieces whose gradients
accumulate. The loss of a step is normalised by the step's item count, so splitting changes only
the order of floating-point additions, not the step: the effective batch is the user's.

Before training, the planner picks `pieces` (and, only when even one example at a time does not fit,
checkpointing and then a lighter optimizer). During training, an out-of-memory error in a step
doubles `pieces` and runs the step again from its first micro-batch; with several processes they
agree on it first (see step.py), so no process is left waiting in a collective.
"""

from __future__ import annotations

import os

import torch

from effitrain.config import TrainConfig, parse_size
from effitrain.engine.strategies import Strategy
from effitrain.errors import UserError

# torch.OutOfMemoryError since torch 2.5; torch.cuda's before (the README promises torch >= 2.4).
OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator failing (RuntimeError: can't allocate memory)."""
    if isinstance(err, OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and ("can't allocate memory" in str(err) or "out of memory" in str(err))


def split_batch(batch: dict, parts: int) -> list[dict]:
    """A padded micro-batch as `parts` pieces along the example dimension (the last ones may be one
    example smaller, or absent when the batch has fewer examples than parts)."""
    if parts == 1:
        return [batch]
    size = len(next(iter(batch.values())))
    bounds = [size * i // parts for i in range(parts + 1)]
    return [{key: value[lo:hi] for key, value in batch.items()} for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def budget_bytes(config: TrainConfig, device: torch.device) -> int:
    from effitrain.planning import planner as plan

    if config.memory_budget != "auto":
        return parse_size(config.memory_budget)
    free = plan.available_bytes(device.type)
    # Processes of one machine share its RAM on a CPU; each GPU has its own memory.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    return int(free * 0.9 / local)  # a tenth spare for the data, the evaluation and the rest


def plan_run(config: TrainConfig, device: torch.device, world: int, accumulation: int, mixed_precision: str,
             num_labels: int, processor, fixed: tuple[str, bool] | None = None,
             encoded=None) -> tuple[int, str, bool, str, dict]:
    """Choose the pieces per micro-batch and, if needed, checkpointing and the optimizer; `fixed`:
    the (optimizer, checkpointing) a resumed run's checkpoint was trained with, kept. `mixed_precision`
    as the run chose it (accelerate's no | bf16 | fp16). Returns (pieces, optimizer, checkpointing,
    what was decided in words, the numbers: budget_bytes, predicted_peak_bytes and in_use_bytes); the
    config is left as it is."""
    # Planning draws random numbers (fake weight initialisation, the bf16 speed probe): the run's
    # initial head and dropout must not depend on whether it planned.
    with torch.random.fork_rng(devices=[]):
        return _plan_run(config, device, world, accumulation, mixed_precision, num_labels, processor, fixed,
                         encoded)


def _plan_run(config: TrainConfig, device: torch.device, world: int, accumulation: int, mixed_precision: str,
              num_labels: int, processor, fixed: tuple[str, bool] | None,
              encoded=None) -> tuple[int, str, bool, str, dict]:
    import torch.distributed as dist

    from effitrain import optimizers, tasks
    from effitrain.models import adapters
    from effitrain.planning import planner as plan

    task = tasks.get(config.task)
    vocab = len(processor) if task.is_text else None
    # Before the baseline, what the run's model, adapters and optimizer import: libraries are not training
    # memory. The model's transformers module alone brings 100-200 MiB (its losses import scipy; torchao,
    # torch.distributed.checkpoint, dynamo), which peft's import had brought to LoRA runs' baseline only.
    task.import_model_code(plan.model_config(config.model, config.task, max(num_labels, 1), vocab))
    adapters.import_libraries(config)
    optimizers.import_libraries(fixed[0] if fixed else config.optim)
    in_use = in_use_bytes(device)
    budget = budget_bytes(config, device)
    if world > 1 and dist.is_initialized():  # every process must choose the same: plan for the tightest
        smallest = torch.tensor([budget], dtype=torch.float64, device=device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        budget = int(smallest.item())
    shapes = plan.model_shapes(config.task, config.model, max(num_labels, 1), vocab, plan.Peft.of(config),
                               config.packing, config.student_layers)
    shapes = plan.for_preference(shapes, config.preference, config.reference)
    if config.rl is not None:
        planner, estimate_of = _rl_planner(config, shapes, device, world, encoded)
    else:
        if encoded is not None:  # answer-only data: the chunked head multiplies the answers' positions only
            from dataclasses import replace

            shapes = replace(shapes, loss_positions=task.loss_positions(encoded["train"]))
        planner, estimate_of = plan.Planner(shapes, task.sequence_length(config, processor), device.type, world,
                                            config.strategy, config.zero_stage), None
    if config.distill_from is not None and fixed is None:  # a resume reads the stored logits: no teacher pass
        estimate_of = _with_teacher_pass(config, planner, estimate_of, num_labels)
    precision = {"no": "fp32"}.get(mixed_precision, mixed_precision)
    optimizer, checkpointing = fixed or (config.optim, config.gradient_checkpointing)
    try:
        estimate, changes = plan.fit(planner, config.batch_size, precision, optimizer, checkpointing,
                                     budget, accumulation=accumulation, techniques_fixed=fixed is not None,
                                     estimate_of=estimate_of)
    except UserError as err:
        raise (_teacher_pass_refused(config, estimate_of, budget) or err) from None
    pieces = config.batch_size // estimate.setting.micro_batch
    said = ", ".join(changes) if changes else "no change needed"
    where = " (in the teacher's pass before training)" if estimate.peak_phase == "teacher pass" else ""
    note = (f"memory budget {budget / plan.GiB:.2f} GiB per device: predicted peak {estimate.total / plan.GiB:.2f} GiB"
            f"{where} with micro-batch {estimate.setting.micro_batch}; {said}")
    numbers = {"budget_bytes": int(budget), "predicted_peak_bytes": int(estimate.total), "in_use_bytes": in_use}
    return pieces, estimate.setting.optimizer, estimate.setting.checkpointing, note, numbers


def _with_teacher_pass(config: TrainConfig, planner, estimate_of, num_labels: int):
    """--distill-from: before the first step the teacher runs over the training split in batches of
    --eval-batch-size beside the student (tasks/distillation.py); each setting's peak is the larger of that pass
    and the step (planning/teacher_pass.py). The estimator keeps its last estimate (`last`): plan.fit's last try
    is the lightest setting, which _teacher_pass_refused names when even that does not fit."""
    from effitrain.planning import planner as plan
    from effitrain.planning import teacher_pass

    teacher = plan.model_shapes(config.task, config.distill_from, max(num_labels, 1))
    with_pass = teacher_pass.estimator(planner, teacher, config.eval_batch_size, estimate_of)

    def estimate_with_pass(setting):
        estimate_with_pass.last = with_pass(setting)
        return estimate_with_pass.last

    return estimate_with_pass


def _teacher_pass_refused(config: TrainConfig, estimate_of, budget: int) -> UserError | None:
    """The refusal when what does not fit is the teacher's pass (no micro-batch makes it smaller), else None."""
    from effitrain.planning import planner as plan
    from effitrain.planning import teacher_pass

    last = getattr(estimate_of, "last", None)
    if last is None or last.peak_phase != teacher_pass.PHASES[0]:
        return None
    return UserError(f"--distill-from {config.distill_from}: the teacher's pass before training (its weights beside "
                     f"the student's, batches of --eval-batch-size {config.eval_batch_size}) needs "
                     f"{last.total / plan.GiB:.2f} GiB, more than the memory budget of {budget / plan.GiB:.2f} GiB",
                     "lower --eval-batch-size, raise --memory-budget, or distil from a smaller teacher")


def _rl_planner(config: TrainConfig, shapes, device: torch.device, world: int, encoded):
    """--rl: the step generates --num-generations completions of each of the step's prompts at once, then
    updates on them (planning/rl_step.py); the prompts as long as the longest kept (--max-length without the
    data at hand)."""
    from effitrain.planning import planner as plan
    from effitrain.planning import rl_step

    prompt_len = config.max_length
    if encoded is not None and len(encoded["train"]):
        prompt_len = min(prompt_len, max(len(ids) for ids in encoded["train"]["input_ids"]))
    shapes = rl_step.for_rl(shapes, config.num_generations, config.max_new_tokens, config.kl_beta, config.rl,
                            config.temperature, rl_step.teacher_bytes(config.task, config.distill_from,
                                                                      config.allow_pickle))
    planner = plan.Planner(shapes, prompt_len + config.max_new_tokens, device.type, world, config.strategy,
                           config.zero_stage)
    return planner, rl_step.estimator(planner, prompt_len, config.max_new_tokens, config.top_p)


def in_use_bytes(device: torch.device) -> int:
    """What this process holds before the model is built, which the planner's peak does not count: the
    bytes allocated on a GPU; on a CPU the resident set (benchmarks/planner/memory_plan.py measures the CPU
    predictions from there), so that the run's measured peak compares with this plus the prediction."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil  # accelerate's dependency

    return int(psutil.Process().memory_info().rss)


def halve(split: int, batch_size: int, strategy: Strategy) -> int:
    """The next split after an out-of-memory error, or a one-line stop when there is none."""
    if not strategy.resplits_steps:
        raise UserError(f"out of memory under --strategy {strategy.name}: effitrain does not re-split steps of "
                        "sharded strategies during a run", "lower --batch-size, or let --memory-budget plan "
                        "it before the run (effitrain plan shows the peak)")
    if split >= batch_size:
        raise UserError("out of memory with one example per piece", "shorten --max-length, turn on "
                        "--gradient-checkpointing, use a lighter --optim, or a device with more memory")
    return min(split * 2, batch_size)


def check_rollout_fits(config: TrainConfig, device: torch.device, accumulation: int, encoded, processor) -> None:
    """--rl: a step samples all of a process's prompts x --num-generations at once. Refused before the model
    loads when even the least that takes (the KV cache of every row in fp32 and one position's logits per row;
    planning/rl_step.py) is more than the device's whole memory (on a CPU, its share of the machine's): such a
    run would be killed by the out-of-memory killer, or thrash, in its first step."""
    from effitrain.planning import planner as plan
    from effitrain.planning import rl_step
    from effitrain.runtime.devices import total_memory_bytes

    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
    else:
        total = (total_memory_bytes() or 0) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    prompts = config.batch_size * accumulation
    rows = prompts * config.num_generations
    longest = max((len(ids) for ids in encoded["train"]["input_ids"]), default=1)
    model = plan.model_config(config.model, config.task, vocab_size=len(processor),
                              student_layers=config.student_layers)
    least = (rl_step.kv_cache_bytes(model, rows, longest + config.max_new_tokens)
             + rl_step.sampled_logits_bytes(model, rows))
    if total and least > total:
        raise UserError(f"--num-generations {config.num_generations} x {prompts} prompts a step (--batch-size "
                        f"{config.batch_size} x --grad-accum {accumulation}) samples {rows:,} completions at once, "
                        f"which need at least {least / plan.GiB:,.1f} GiB (their KV cache and logits), more than "
                        f"this {device.type}'s {total / plan.GiB:,.1f} GiB",
                        "lower --num-generations or --batch-size (`effitrain plan --rl ...` shows a step's peak)")
