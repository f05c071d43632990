"""Evaluation: gathered metrics over a whole split, and (during training) when to evaluate, which
evaluation was best, and when to stop early."""

from __future__ import annotations

import torch


def evaluate(accelerator, task, model, dataloader, label_names) -> dict[str, float]:
    """The task's metrics over the whole split; gather_for_metrics drops the samples padded in to even
    out shards, so every process gets the same metrics whatever their number."""
    was_training = model.training
    model.eval()
    gathered = []
    with torch.inference_mode():
        for batch in dataloader:
            outputs = accelerator.gather_for_metrics(task.eval_outputs(model, batch))
            gathered.append([t.cpu() for t in outputs])
    model.train(was_training)
    return task.metrics(tuple(torch.cat(column) for column in zip(*gathered)), label_names)
