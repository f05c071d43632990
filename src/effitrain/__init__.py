"""effitrain: fine-tune pretrained transformers efficiently with PyTorch and accelerate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from effitrain.config import TrainConfig
from effitrain.errors import UserError

__version__ = "0.1.0"
__all__ = ["TrainConfig", "UserError", "train"]


def train(config: TrainConfig | dict[str, Any] | str | Path | None = None, callbacks=()) -> dict:
    """Run one training job, as `effitrain train` does; returns the metrics written to metrics.json.

    `config` is a TrainConfig, a dict of its keys, or the path of a YAML file. Bad input raises UserError.
    `callbacks`: objects with any of the hooks on_train_begin, on_step_begin, on_step_end, on_evaluate,
    on_save, on_train_end (effitrain/engine/callbacks.py), to watch a run without patching it.
    """
    from effitrain.commands import train as train_command
    from effitrain.config import from_any

    return train_command.train(from_any(config), config if isinstance(config, (str, Path)) else None, callbacks=callbacks)
