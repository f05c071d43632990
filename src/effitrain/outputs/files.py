"""Files other tools read: strict JSON (non-finite numbers written as null, and said) and YAML; writes
whose failure for a full disk is said as one."""

from __future__ import annotations

import contextlib
import errno
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


# Below this much room, a write that torch says failed ("unexpected pos", "file write failed": no errno) is
# taken for a full disk.
NEARLY_FULL = 16 * 2**20


@contextlib.contextmanager
def writing(path: Path):
    """Writes into `path` (a file or a folder) whose failure for want of space comes out as the OSError the
    CLI says in one line (ENOSPC, EDQUOT). torch.save raises a RuntimeError without an errno, safetensors its
    SafetensorError ("os error 28"): neither is an OSError. Anything else passes as it is."""
    try:
        yield
    except OSError:
        raise
    except Exception as err:
        code = _out_of_space(str(err), path)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from err


def _out_of_space(said: str, path: Path) -> int | None:
    if "os error 28" in said or "No space left on device" in said:
        return errno.ENOSPC
    if "os error 122" in said or "Disk quota exceeded" in said:
        return errno.EDQUOT
    if ("unexpected pos" in said or "file write failed" in said) and free_bytes(path) < NEARLY_FULL:
        return errno.ENOSPC
    return None


def free_bytes(path: Path) -> int:
    """Room left for this user on the file system that holds `path` (or its nearest existing folder)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return NEARLY_FULL  # unknown: not taken for full
    return stats.f_bavail * stats.f_frsize
