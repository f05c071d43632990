"""Files other tools read: strict JSON (non-finite numbers written as null, and said) and YAML."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable


def read_json(path: Path, notes: list[str] | None = None) -> dict:
    """A JSON object file, or {} (missing, unreadable, not an object); `notes` gets why one could not be read."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        value = None
        if notes is not None:
            notes.append(f"{path.name} cannot be read ({str(err).splitlines()[0]})")
    return value if isinstance(value, dict) else {}


def finite(data: Any) -> tuple[Any, list[str]]:
    """`data` with every NaN or infinite float replaced by None, and the places replaced ("test.loss"):
    strict JSON has no NaN or Infinity, and a reader must not take a missing value for a number."""
    replaced: list[str] = []

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            replaced.append(f"{where} ({value})")
            return None
        if isinstance(value, dict):
            return {key: walk(item, f"{where}.{key}" if where else str(key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return value

    return walk(data, ""), replaced


def json_text(data: Any, indent: int | None = None, ensure_ascii: bool = True) -> str:
    """Strict JSON: non-finite numbers become null, listed under `non_finite` (objects only)."""
    clean, replaced = finite(data)
    if replaced and isinstance(clean, dict):
        clean["non_finite"] = replaced
    return json.dumps(clean, indent=indent, allow_nan=False, ensure_ascii=ensure_ascii)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json_text(data, indent=2) + "\n")


def write_yaml(path: Path, data: dict) -> None:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))


def place(path: Path, write: Callable[[Path], object], replace: bool = False) -> None:
    """Writes a file through `write(temporary path)` beside `path`, then gives it its name: by a hard
    link, which fails if the name exists (FileExistsError), so that a file that appeared after the
    caller's checks is never replaced; `replace`: the caller checked that `path` is its own earlier
    output, which is replaced whole (os.replace). A reader never sees half a file either way."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        if replace:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
