"""The run directory: claimed without clobbering, then filled with the files other tools rely on."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from effitrain.errors import UserError


def default_dir(root: str = "runs") -> Path:
    """root/<timestamp>, never an existing folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = Path(root) / stamp, 1
    while path.exists():  # two runs started in the same second
        n += 1
        path = Path(root) / f"{stamp}-{n}"
    return path


def check_free(path: Path, overwrite: bool) -> None:
    """Refuse a non-empty directory unless --overwrite: a finished run is never lost by accident."""
    if path.exists() and not path.is_dir():
        raise UserError(f"--output-dir {path} is a file", "pass a directory path to --output-dir")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(f"--output-dir {path} already holds files from another run",
                        "pass another --output-dir, or --overwrite to replace them")


def prepare(path: Path, overwrite: bool) -> None:
    """Called on the main process only, after every process has run check_free."""
    if path.is_dir() and overwrite:
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_yaml(path: Path, data: dict) -> None:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))


class JsonlLog:
    """log.jsonl: one JSON object per line, flushed at once so a crash keeps every line written."""

    def __init__(self, path: Path | None):
        self.file = open(path, "a", buffering=1) if path is not None else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
