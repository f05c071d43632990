"""The saved model directory that `predict` and `evaluate` read (not a command): where it is and which
task it was made for, found before any weights or data load. Here, above tasks/ and models/, because
finding the task reads the tasks' registry (models/saved.py builds the model once it is found)."""

from __future__ import annotations

from pathlib import Path

from effitrain import tasks
from effitrain.models import loading, saved


def locate(model_dir: str, allow_pickle: bool = False, expected_task: str | None = None) -> tuple[Path, object]:
    """The directory and its task (refused when it is not `expected_task`); reads config.json only (and,
    for an adapter folder, finds its base and checks its architecture and shapes), so that bad inputs are
    refused before any weights or data load."""
    path = loading.resolve(model_dir, allow_pickle, adapter=True)  # an adapter folder is applied to its base
    task = tasks.for_model_config(loading.load_config(path), str(path), expected_task)
    saved.check_adapter_base(path)
    return path, task
