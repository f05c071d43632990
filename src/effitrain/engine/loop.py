"""The training loop on accelerate's Accelerator.

One optimizer step = `grad_accum` micro-batches on each of W processes. The loss of a step is the
sum of per-item losses over all of them divided by the number of items in all of them, so the step
is the same whatever W, the micro-batch and the accumulation are (a mean of per-micro-batch means
is not, when micro-batches hold different numbers of items).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from effitrain import models, outputs, tasks
from effitrain.config import TrainConfig
from effitrain.data import text
from effitrain.devices import make_accelerator, peak_memory_bytes
from effitrain.engine import checkpoint, communication, memory_fit, optim, precision
from effitrain.engine.evaluate import evaluate
from effitrain.errors import UserError


def step_sizes(num_batches: int, world: int, accum: int) -> list[int]:
    """Micro-batches per process in each optimizer step of an epoch of `num_batches` global micro-batches.

    Process p holds micro-batches p, p + W, p + 2W, ... so step s covers global micro-batches
    [s*k*W, (s+1)*k*W): the same examples as one process with a batch W*k times larger. In the last
    step a process whose shard ended one micro-batch early runs an empty one (see `step_groups`)."""
    per_process = math.ceil(num_batches / world)
    steps = math.ceil(per_process / accum)
    return [accum] * (steps - 1) + [per_process - (steps - 1) * accum]


def step_groups(dataloader, sizes: list[int]):
    """One list per optimizer step; None stands for a micro-batch this process does not have."""
    batches = iter(dataloader)
    for size in sizes:
        yield [next(batches, None) for _ in range(size)]


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


def _claim_output_dir(accelerator, config: TrainConfig, clear: bool) -> Path:
    from accelerate.utils import broadcast_object_list

    # Every process must write to the same directory: the main process picks the default name.
    chosen = [str(config.output_dir or outputs.default_dir())]
    broadcast_object_list(chosen, from_process=0)
    out_dir = Path(chosen[0])
    config.output_dir = str(out_dir)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        outputs.prepare(out_dir, config.overwrite and clear)
        outputs.write_yaml(out_dir / "config.yaml", config.to_dict())
    accelerator.wait_for_everyone()
    return out_dir


def run(config: TrainConfig) -> dict:
    """Train, evaluate, save. Returns the metrics written to metrics.json."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    wall_start = time.perf_counter()
    task = tasks.get(config.task)
    models.quiet_libraries(config.debug)
    # Fail on the cheap checks before loading anything heavy.
    source = models.resolve_source(config.model, config.allow_pickle)
    resume_from = checkpoint.find(Path(config.output_dir), config.resume) if config.resume else None
    if config.output_dir is not None and resume_from is None:
        outputs.check_free(Path(config.output_dir), config.overwrite)
    mixed_precision, precision_reason = precision.choose(config.precision)
    accelerator = make_accelerator(config.ddp_timeout, config.strategy, config.zero_stage, config.max_grad_norm,
                                   mixed_precision, broadcast_buffers=config.memory_budget is None)
    grad_accum = accumulation(config, accelerator.num_processes)
    if resume_from is not None:
        if config.memory_budget:
            memory_fit.adopt_planned(config, checkpoint.trainer_state(resume_from)["config"])
        resume_state = checkpoint.check(resume_from, config.to_dict(), accelerator.num_processes)

    set_seed(config.seed)
    processor = task.load_processor(source)
    loaded = task.load_data(config)
    splits = loaded.splits
    label_names = splits["train"].features["label"].names if "label" in splits["train"].column_names else None
    with accelerator.main_process_first():  # the main process fills the preprocessing cache, the others reuse it
        encoded = task.preprocess(splits, processor, config, loaded.base_dir)
    split, fit_note = 1, None  # pieces each loaded micro-batch runs as (--memory-budget)
    if config.memory_budget:
        split, fit_note = memory_fit.plan_run(config, accelerator.device, accelerator.num_processes, grad_accum,
                                              mixed_precision, len(label_names or []), processor,
                                              resuming=resume_from is not None)
    model = task.build_model(source, label_names, processor)
    if config.gradient_checkpointing:
        models.enable_gradient_checkpointing(model)
    model.train()
    # Only now, with data and model loaded: a mistake in either leaves no half-made output dir behind.
    out_dir = _claim_output_dir(accelerator, config, clear=resume_from is None)
    log = outputs.JsonlLog(out_dir / "log.jsonl" if accelerator.is_main_process else None)
    if fit_note:
        accelerator.print(fit_note)
        log.write({"step": 0, "memory_plan": fit_note, "pieces": split})

    world = accelerator.num_processes
    train_collate, eval_collate = task.collators(processor, config)
    sampler = text.train_sampler(encoded["train"], config.batch_size * world * grad_accum,
                                 config.group_by_length, config.seed)
    # Its own generator: the loader's base seed must not draw from the global RNG (dropout's), or a
    # resumed run would draw differently from the uninterrupted one.
    train_dl = DataLoader(encoded["train"], batch_size=config.batch_size, sampler=sampler, collate_fn=train_collate,
                          generator=torch.Generator().manual_seed(config.seed))
    eval_dls = {split: DataLoader(encoded[split], batch_size=config.eval_batch_size, collate_fn=eval_collate)
                for split in ("validation", "test")}
    # A zero-weight stand-in for micro-batches a process lacks at the end of an epoch: every process
    # must run the same forward/backward passes for DDP's collectives to match.
    stand_in = train_collate([encoded["train"][0]])

    sizes = step_sizes(len(train_dl), world, grad_accum)
    steps_per_epoch = len(sizes)
    total_steps = config.max_steps or config.epochs * steps_per_epoch
    optimizer = optim.build(config.optim, model, config.lr, config.weight_decay, (config.beta1, config.beta2))
    scheduler = optim.linear_schedule(optimizer, total_steps, optim.warmup_steps(total_steps, config.warmup_ratio),
                                      world)
    # Training shards must not recycle examples to even out the processes (accelerate's default):
    # that would train on duplicates that one process with a big batch never sees.
    accelerator.even_batches = False
    train_dl = accelerator.prepare(train_dl)
    accelerator.even_batches = True  # evaluation: gather_for_metrics drops the padded-in duplicates
    model, optimizer, eval_dls["validation"], eval_dls["test"], scheduler = accelerator.prepare(
        model, optimizer, eval_dls["validation"], eval_dls["test"], scheduler)
    stand_in = {key: value.to(accelerator.device) for key, value in stand_in.items()}
    # What crosses the wire: DDP's gradient buckets, or local SGD's parameter averaging.
    wire = communication.Counter()
    local_sgd = None
    if world > 1 and config.local_sgd_steps:
        local_sgd = communication.AveragingLocalSGD(accelerator, model, config.local_sgd_steps, wire)
        local_sgd.__enter__()  # no gradient sync until __exit__ after the loop (a final average)
    elif world > 1 and config.strategy == "ddp":
        communication.count_gradient_allreduces(model, wire)

    skipped = f", {loaded.skipped_rows} bad rows skipped" if loaded.skipped_rows else ""
    accelerator.print(f"training {config.model} ({task.name}) on {config.data}: {len(encoded['train'])} train / "
                      f"{len(encoded['validation'])} validation / {len(encoded['test'])} test examples{skipped}"
                      + (f", labels {label_names}" if label_names else "")
                      + f", {total_steps} steps of {config.batch_size} x {grad_accum} x {world} process(es) "
                        f"on {accelerator.device}; {precision_reason}; optimizer {config.optim}"
                      + (", gradient checkpointing" if config.gradient_checkpointing else ""))
    # disable=None: no bar when stderr is not a terminal (CI logs), and none on other processes.
    bar = tqdm(total=total_steps, desc="train", unit="step", mininterval=1.0,
               disable=None if accelerator.is_local_main_process else True)
    step, train_seconds, last_loss = 0, 0.0, None
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # items, tokens (this process)
    window = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # loss sum, items since last log
    step_window = torch.zeros_like(window)  # this step's, added to window only if the step was good
    skipped_steps, bad_in_a_row = 0, 0
    history: dict[str, dict] = {}
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        state = resume_state
        step, train_seconds, last_loss = state["step"], state["train_seconds"], state["last_loss"]
        skipped_steps, bad_in_a_row = state["skipped_steps"], state["bad_in_a_row"]
        window += torch.tensor(state["window"], dtype=window.dtype, device=window.device) / world
        totals += torch.tensor(state["totals"], dtype=totals.dtype, device=totals.device) / world
        if accelerator.is_main_process:
            checkpoint.trim_log(out_dir / "log.jsonl", step)
        bar.update(step)
        accelerator.print(f"resumed from {resume_from} at step {step}")
    while step < total_steps:
        tick = time.perf_counter()
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        train_dl.set_epoch(epoch)  # the epoch's order is a function of (seed, epoch)
        groups = step_groups(train_dl, sizes)
        for _ in range(done_in_epoch):  # resumed mid-epoch: pass over the batches already trained on
            next(groups)
        for group in groups:
            items = sum((task.item_count(batch) for batch in group if batch is not None),
                        torch.zeros((), dtype=torch.long, device=accelerator.device))
            # Local SGD: each process minimises its own loss; otherwise one loss over all processes.
            synced = world > 1 and local_sgd is None
            step_items = accelerator.reduce(items, "sum") if synced else items
            # DDP with a budget: no piece syncs, the processes first agree that none ran out of memory.
            agree = synced and config.memory_budget is not None and config.strategy == "ddp"
            # An out-of-memory error can be retried where no collective is left waiting for this process.
            retry = config.memory_budget is not None and (agree or not synced)
            while True:  # once, or again with smaller pieces after an out-of-memory error
                step_totals = torch.zeros_like(totals)
                out_of_memory = _forward_backward(accelerator, task, model, group, split, stand_in, step_items,
                                                  world if synced else 1, step_window, step_totals, agree, retry)
                if agree:
                    # Every process learns whether one ran out, before any gradient crosses the wire.
                    flag = torch.tensor([float(out_of_memory)], device=accelerator.device)
                    out_of_memory = bool(accelerator.reduce(flag, "sum") > 0)
                    if not out_of_memory:
                        communication.allreduce_gradients(model, world, wire)
                if not out_of_memory:
                    break
                optimizer.zero_grad(set_to_none=True)
                step_window.zero_()
                memory_fit.release_cached(accelerator.device)
                split = memory_fit.halve(split, config.batch_size, config.strategy)
                said = f"out of memory at step {step + 1}: retrying it in pieces of {config.batch_size // split}"
                log.write({"step": step + 1, "out_of_memory": said, "pieces": split})
                accelerator.print(said)
            totals += step_totals
            # The norm is needed even without clipping (max_norm inf): it is how a non-finite loss or
            # gradient is seen, the same on every process since gradients are already all-reduced.
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf"))
            finite = grad_norm is None or bool(torch.isfinite(grad_norm))
            if finite or accelerator.scaler is not None:  # an fp16 scaler skips the step and backs off itself
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if finite:
                window += step_window
                bad_in_a_row = 0
            else:
                skipped_steps, bad_in_a_row = skipped_steps + 1, bad_in_a_row + 1
                log.write({"step": step + 1, "skipped": "non-finite loss or gradient", "grad_norm": None})
                if accelerator.is_local_main_process:
                    bar.write(f"step {step + 1}: non-finite loss or gradient, step skipped ({skipped_steps} so far)")
                if bad_in_a_row >= config.max_bad_steps:
                    _save(accelerator, model, processor, config, out_dir)  # the weights of the last good step
                    raise UserError(f"{bad_in_a_row} steps in a row had a non-finite loss or gradient (up to step "
                                    f"{step + 1}); the last good weights are in {out_dir / 'model'}",
                                    "lower --lr, use --precision fp32, or check the data for extreme values")
            step_window.zero_()
            if local_sgd is not None:
                local_sgd.step()
            step += 1
            bar.update(1)
            if step % config.log_every == 0 or step == total_steps:
                loss_total, item_total = (accelerator.reduce(window, "sum") if world > 1 else window).tolist()
                window.zero_()
                record = {"step": step, "epoch": round(step / steps_per_epoch, 4),
                          "loss": loss_total / max(item_total, 1), "lr": scheduler.get_last_lr()[0],
                          "grad_norm": None if grad_norm is None or not finite else float(grad_norm),
                          "elapsed_seconds": round(train_seconds + time.perf_counter() - tick, 3)}
                log.write(record)
                last_loss = record["loss"]
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                if accelerator.is_local_main_process:
                    bar.write(f"step {step}/{total_steps} epoch {record['epoch']:.2f} loss {record['loss']:.4f} "
                              f"lr {record['lr']:.2e} grad_norm {record['grad_norm'] or 0:.3f}")
            if config.save_every and step % config.save_every == 0 and step < total_steps:
                saving = time.perf_counter()
                checkpoint.save(accelerator, out_dir, step, {
                    # Summed over processes here; on resume each process takes 1/W, so that the sums
                    # over processes come out the same.
                    "config": config.to_dict(), "world_size": world,
                    "window": (accelerator.reduce(window.clone(), "sum") if world > 1 else window).tolist(),
                    "totals": (accelerator.reduce(totals.clone(), "sum") if world > 1 else totals).tolist(),
                    "train_seconds": train_seconds + saving - tick, "last_loss": last_loss,
                    "skipped_steps": skipped_steps, "bad_in_a_row": bad_in_a_row}, config.keep_last)
                tick += time.perf_counter() - saving  # saving is not training time
            if step >= total_steps:
                break
        train_seconds += time.perf_counter() - tick
        epoch = math.ceil(step / steps_per_epoch)
        history["validation"] = evaluate(accelerator, task, model, eval_dls["validation"], label_names)
        log.write({"step": step, "epoch": round(step / steps_per_epoch, 4), "split": "validation",
                   **history["validation"]})
        if accelerator.is_local_main_process:
            bar.write(f"epoch {epoch} validation: " + _short(history["validation"]))
    bar.close()
    if local_sgd is not None:
        local_sgd.__exit__(None, None, None)  # leaves every process with the averaged parameters
    test = evaluate(accelerator, task, model, eval_dls["test"], label_names)
    log.write({"step": step, "epoch": round(step / steps_per_epoch, 4), "split": "test", **test})

    samples, tokens = (accelerator.reduce(totals, "sum") if world > 1 else totals).tolist()
    # Measured from the optimizer's own state tensors (this process's shard under FSDP/ZeRO).
    state_size = optim.state_bytes(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer)
    trainable = max(1, sum(p.numel() for p in accelerator.unwrap_model(model).parameters() if p.requires_grad))
    peak = torch.tensor([peak_memory_bytes(accelerator.device)], device=accelerator.device)
    metrics = {
        "task": task.name,
        "validation": history["validation"],
        "test": test,
        "train_samples_per_second": samples / train_seconds,
        "train_tokens_per_second": tokens / train_seconds if task.is_text else None,
        "peak_memory_bytes": int(accelerator.gather(peak).max()),
        "train_seconds": train_seconds,
        "steps": step,
        "epochs": round(step / steps_per_epoch, 4),
        "world_size": world,
        "device": accelerator.device.type,
        "labels": label_names,
        "skipped_rows": loaded.skipped_rows,
        "train_loss": last_loss,  # mean over the last logged window
        "skipped_steps": skipped_steps,  # non-finite loss or gradient
        "precision": {"no": "fp32"}.get(mixed_precision, mixed_precision),
        "optimizer": config.optim,
        "optimizer_state_bytes": state_size,
        "optimizer_state_bytes_per_param": state_size / trainable,
        "gradient_checkpointing": config.gradient_checkpointing,
        "grad_accum": grad_accum,
        # --memory-budget: each loaded micro-batch ran as this many pieces (1: as loaded).
        "pieces_per_micro_batch": split,
        # Gradient all-reduces (DDP buckets) or parameter averagings (local SGD) of process 0.
        "sync_allreduce_calls": wire.calls,
        "sync_allreduce_bytes": wire.bytes,
    }
    _save(accelerator, model, processor, config, out_dir)
    metrics["wall_seconds"] = time.perf_counter() - wall_start
    if accelerator.is_main_process:
        outputs.write_json(out_dir / "metrics.json", metrics)
        tokens_per_s = (f"{metrics['train_tokens_per_second']:.0f} tokens/s, "
                        if metrics["train_tokens_per_second"] is not None else "")
        accelerator.print(f"test: {_short(test)}\n"
                          f"{metrics['train_samples_per_second']:.1f} samples/s, {tokens_per_s}"
                          f"peak memory {metrics['peak_memory_bytes'] / 2**20:.0f} MiB, "
                          f"{metrics['wall_seconds']:.1f} s in all\nsaved to {out_dir}")
    log.close()
    accelerator.end_training()
    return metrics


def _forward_backward(accelerator, task, model, group, split, stand_in, step_items, scale, step_window, step_totals,
                      agree: bool, retry: bool) -> bool:
    """Forward and backward of every micro-batch of a step, each run as `split` pieces. Gradients
    are all-reduced by DDP on the last piece, unless `agree`: then no piece syncs and the caller
    all-reduces the gradients once the processes agree. With `retry`, an out-of-memory error is
    returned (True) instead of raised, for the caller to run the step again in smaller pieces."""
    pieces = [piece for batch in group for piece in ([None] if batch is None else memory_fit.split_batch(batch, split))]
    try:
        for i, piece in enumerate(pieces):
            # Gradients are all-reduced only on the last piece of the step.
            last = i == len(pieces) - 1 and not agree
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                if piece is None:  # this process has no micro-batch here: a zero-weight stand-in
                    accelerator.backward(task.loss_sum(model, stand_in) * 0.0)
                    continue
                memory_fit.check_test_hook(piece, accelerator.process_index)
                loss = task.loss_sum(model, piece)
                # DDP averages gradients over W processes, hence the factor W.
                accelerator.backward(loss * scale / step_items)
            count = task.item_count(piece).double()
            tokens = task.token_count(piece)
            step_window += torch.stack([loss.detach().double(), count])
            step_totals += torch.stack([task.example_count(piece).double(),
                                        count.new_tensor(0.0) if tokens is None else tokens.double()])
    except Exception as err:
        if retry and memory_fit.is_out_of_memory(err):
            return True
        raise
    return False


def _short(metrics: dict) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k not in ("samples", "tokens"))


def _save(accelerator, model, processor, config: TrainConfig, out_dir: Path) -> None:
    """model/ as save_pretrained writes it (safetensors, config with id2label, the processor), loadable
    by plain transformers."""
    accelerator.wait_for_everyone()
    model_dir = out_dir / "model"
    accelerator.unwrap_model(model).save_pretrained(
        model_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model), safe_serialization=True)
    if accelerator.is_main_process:
        if tasks.get(config.task).is_text:
            processor.model_max_length = config.max_length  # predictions truncate where training did
        processor.save_pretrained(model_dir)
    accelerator.wait_for_everyone()
