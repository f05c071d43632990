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
import torch.nn.functional as F
from torch.utils.data import DataLoader

from effitrain import models, outputs
from effitrain.config import TrainConfig
from effitrain.data import sources, text
from effitrain.devices import make_accelerator, peak_memory_bytes
from effitrain.engine import optim
from effitrain.engine.metrics import classification_metrics


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


def item_count(batch) -> torch.Tensor:
    """The items the loss averages over: here sequences with a label."""
    return (batch["labels"] != -100).sum()


def loss_sum(model, batch) -> torch.Tensor:
    """Sum (not mean) of the per-item losses of a micro-batch; labels are kept out of the model so
    that no model-side reduction decides the normalisation."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum", ignore_index=-100)


def evaluate(accelerator, model, dataloader, label_names: list[str]) -> dict[str, float]:
    """Metrics over the whole split; gather_for_metrics drops the samples padded in to even out shards."""
    model.eval()
    predictions, references, losses = [], [], []
    with torch.inference_mode():
        for batch in dataloader:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            logits = model(**inputs).logits.float()
            per_item = F.cross_entropy(logits, batch["labels"], reduction="none")
            pred, ref, loss = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"], per_item))
            predictions.append(pred.cpu())
            references.append(ref.cpu())
            losses.append(loss.cpu())
    model.train()
    predictions, references = torch.cat(predictions).numpy(), torch.cat(references).numpy()
    metrics = classification_metrics(predictions, references, label_names)
    metrics["loss"] = float(torch.cat(losses).mean())
    metrics["samples"] = int(len(references))
    return metrics


def run(config: TrainConfig) -> dict:
    """Train, evaluate, save. Returns the metrics written to metrics.json."""
    from accelerate.utils import broadcast_object_list, set_seed
    from tqdm.auto import tqdm

    wall_start = time.perf_counter()
    models.quiet_transformers(config.debug)
    # Fail on the cheap checks before loading anything heavy.
    model_path = models.resolve(config.model)
    if config.output_dir is not None:
        outputs.check_free(Path(config.output_dir), config.overwrite)

    accelerator = make_accelerator()
    # Every process must write to the same directory: the main process picks the default name.
    chosen = [str(config.output_dir or outputs.default_dir())]
    broadcast_object_list(chosen, from_process=0)
    out_dir = Path(chosen[0])
    config.output_dir = str(out_dir)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        outputs.prepare(out_dir, config.overwrite)
        outputs.write_yaml(out_dir / "config.yaml", config.to_dict())
    accelerator.wait_for_everyone()
    log = outputs.JsonlLog(out_dir / "log.jsonl" if accelerator.is_main_process else None)

    set_seed(config.seed)
    tokenizer = models.load_tokenizer(model_path)
    splits = sources.limit(sources.load_splits(config.data, config.validation_split, config.test_split, config.seed),
                           config.max_train_samples, config.max_eval_samples)
    label_names = splits["train"].features["label"].names
    with accelerator.main_process_first():
        encoded = text.tokenize(splits, tokenizer, config.max_length)
    model = models.load_classifier(model_path, label_names)
    model.train()

    world = accelerator.num_processes
    collate = text.collator(tokenizer)
    sampler = text.train_sampler(encoded["train"], config.batch_size * world * config.grad_accum,
                                 config.group_by_length, config.seed)
    train_dl = DataLoader(encoded["train"], batch_size=config.batch_size, sampler=sampler, collate_fn=collate)
    eval_dls = {split: DataLoader(encoded[split], batch_size=config.eval_batch_size, collate_fn=collate)
                for split in ("validation", "test")}
    # A zero-weight stand-in for micro-batches a process lacks at the end of an epoch: every process
    # must run the same forward/backward passes for DDP's collectives to match.
    stand_in = collate([encoded["train"][0]])

    sizes = step_sizes(len(train_dl), world, config.grad_accum)
    steps_per_epoch = len(sizes)
    total_steps = config.max_steps or config.epochs * steps_per_epoch
    optimizer = optim.adamw(model, config.lr, config.weight_decay)
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

    accelerator.print(f"training {config.model} on {config.data}: {len(encoded['train'])} train / "
                      f"{len(encoded['validation'])} validation / {len(encoded['test'])} test examples, "
                      f"labels {label_names}, {total_steps} steps of {config.batch_size} x {config.grad_accum} "
                      f"x {world} process(es) on {accelerator.device}")
    # disable=None: no bar when stderr is not a terminal (CI logs), and none on other processes.
    bar = tqdm(total=total_steps, desc="train", unit="step", mininterval=1.0,
               disable=None if accelerator.is_local_main_process else True)
    step, epoch, train_seconds = 0, 0, 0.0
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # items, tokens (this process)
    window = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # loss sum, items since last log
    history: dict[str, dict] = {}
    while step < total_steps:
        tick = time.perf_counter()
        for group in step_groups(train_dl, sizes):
            items = sum((item_count(batch) for batch in group if batch is not None),
                        torch.zeros((), dtype=torch.long, device=accelerator.device))
            step_items = accelerator.reduce(items, "sum") if world > 1 else items
            for i, batch in enumerate(group):
                # Gradients are all-reduced only on the last micro-batch of the step.
                sync = contextlib.nullcontext() if i == len(group) - 1 else accelerator.no_sync(model)
                with sync:
                    if batch is None:
                        accelerator.backward(loss_sum(model, stand_in) * 0.0)
                        continue
                    loss = loss_sum(model, batch)
                    # DDP averages gradients over W processes, hence the factor W.
                    accelerator.backward(loss * world / step_items)
                window += torch.stack([loss.detach().double(), item_count(batch).double()])
                totals += torch.stack([item_count(batch).double(), batch["attention_mask"].sum().double()])
            grad_norm = (accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                         if config.max_grad_norm > 0 else None)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            if step % config.log_every == 0 or step == total_steps:
                loss_total, item_total = (accelerator.reduce(window, "sum") if world > 1 else window).tolist()
                window.zero_()
                record = {"step": step, "epoch": round(step / steps_per_epoch, 4),
                          "loss": loss_total / max(item_total, 1), "lr": scheduler.get_last_lr()[0],
                          "grad_norm": None if grad_norm is None else float(grad_norm),
                          "elapsed_seconds": round(train_seconds + time.perf_counter() - tick, 3)}
                log.write(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                if accelerator.is_local_main_process:
                    bar.write(f"step {step}/{total_steps} epoch {record['epoch']:.2f} loss {record['loss']:.4f} "
                              f"lr {record['lr']:.2e} grad_norm {record['grad_norm'] or 0:.3f}")
            if step >= total_steps:
                break
        train_seconds += time.perf_counter() - tick
        epoch += 1
        history["validation"] = evaluate(accelerator, model, eval_dls["validation"], label_names)
        log.write({"step": step, "epoch": round(step / steps_per_epoch, 4), "split": "validation",
                   **history["validation"]})
        if accelerator.is_local_main_process:
            bar.write(f"epoch {epoch} validation: " + _short(history["validation"]))
    bar.close()
    test = evaluate(accelerator, model, eval_dls["test"], label_names)
    log.write({"step": step, "epoch": round(step / steps_per_epoch, 4), "split": "test", **test})

    items, tokens = (accelerator.reduce(totals, "sum") if world > 1 else totals).tolist()
    peak = torch.tensor([peak_memory_bytes(accelerator.device)], device=accelerator.device)
    metrics = {
        "validation": history["validation"],
        "test": test,
        "train_samples_per_second": items / train_seconds,
        "train_tokens_per_second": tokens / train_seconds,
        "peak_memory_bytes": int(accelerator.gather(peak).max()),
        "train_seconds": train_seconds,
        "steps": step,
        "epochs": round(step / steps_per_epoch, 4),
        "world_size": world,
        "device": accelerator.device.type,
        "labels": label_names,
    }
    _save(accelerator, model, tokenizer, config, out_dir)
    metrics["wall_seconds"] = time.perf_counter() - wall_start
    if accelerator.is_main_process:
        outputs.write_json(out_dir / "metrics.json", metrics)
        accelerator.print(f"test: {_short(test)}\n"
                          f"{metrics['train_samples_per_second']:.1f} samples/s, "
                          f"{metrics['train_tokens_per_second']:.0f} tokens/s, "
                          f"peak memory {metrics['peak_memory_bytes'] / 2**20:.0f} MiB, "
                          f"{metrics['wall_seconds']:.1f} s in all\nsaved to {out_dir}")
    log.close()
    accelerator.end_training()
    return metrics


def _short(metrics: dict) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "samples")


def _save(accelerator, model, tokenizer, config: TrainConfig, out_dir: Path) -> None:
    """model/ as save_pretrained writes it (safetensors, config with id2label), loadable by plain transformers."""
    accelerator.wait_for_everyone()
    model_dir = out_dir / "model"
    accelerator.unwrap_model(model).save_pretrained(
        model_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model), safe_serialization=True)
    if accelerator.is_main_process:
        # Predictions truncate where training did.
        tokenizer.model_max_length = config.max_length
        tokenizer.save_pretrained(model_dir)
    accelerator.wait_for_everyone()
