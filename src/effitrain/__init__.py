"""effitrain: fine-tune pretrained transformers efficiently with PyTorch and accelerate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from effitrain.config import TrainConfig
from effitrain.errors import UserError

__version__ = "0.1.0"
__all__ = ["TrainConfig", "UserError", "train"]


def train(config: TrainConfig | dict[str, Any] | str | Path | None = None) -> dict:
    """Run one training job, as `effitrain train` does; returns the metrics written to metrics.json.

    `config` is a TrainConfig, a dict of its keys, or the path of a YAML file. Bad input raises UserError.
    """
    from effitrain.commands import train as runs
    from effitrain.config import from_any

    return runs.train(from_any(config), config if isinstance(config, (str, Path)) else None)
