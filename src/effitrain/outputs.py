"""The run directory: checked and locked before anything heavy runs, then filled with the files other
tools rely on. effitrain only ever removes what it wrote: `--overwrite` replaces an earlier effitrain
run (recognised by its marker file) and nothing else, moving it aside until the new run has succeeded."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from effitrain.errors import UserError

MARKER = ".effitrain-run"  # written into every run folder: what --overwrite may replace
LOCK = ".effitrain.lock"  # pid and host of the run writing into the folder
PREVIOUS = ".effitrain-previous"  # the run being replaced, until the new one has succeeded
# What a run writes; --overwrite removes these and nothing else. Nested runs (bench variants) carry
# their own marker.
WRITTEN = {"config.yaml", "log.jsonl", "metrics.json", "model", "best", "checkpoints", "bench.json", "bench.png",
           MARKER, LOCK, PREVIOUS}


def default_dir(root: str = "runs") -> Path:
    """root/<timestamp>, never an existing folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = Path(root) / stamp, 1
    while path.exists():  # two runs started in the same second
        n += 1
        path = Path(root) / f"{stamp}-{n}"
    return path


def is_main_process() -> bool:
    """Before any process group exists: torchrun numbers the processes in RANK."""
    return os.environ.get("RANK", "0") == "0"


def written_by_effitrain(entry: Path) -> bool:
    """One of a run's own files, a temporary one, a nested run, or a nested run's log (bench's NAME.log)."""
    return (entry.name in WRITTEN or entry.name.startswith(".tmp-") or (entry / MARKER).is_file()
            or entry.suffix == ".log" and (entry.with_suffix("") / MARKER).is_file())


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except (ValueError, OSError):
        return False


class RunDir:
    """An output folder held by this run. `acquire` (the main process, before anything heavy) checks it
    and takes its lock; `start` (once the data and model have loaded) moves an earlier run aside when
    overwriting and marks the folder; `succeed` or `fail` end the hold. A failed overwrite puts the
    earlier run back; a run that failed on a user mistake before it wrote a checkpoint or a model
    leaves nothing behind, so that the corrected command is not refused."""

    def __init__(self, path: str | Path | None, overwrite: bool = False, resume: bool = False,
                 inputs: tuple[str | None, ...] = (), kind: str = "train", flag: str = "--output-dir"):
        self.path = Path(path) if path is not None else default_dir("bench" if kind == "bench" else "runs")
        self.overwrite, self.resume, self.kind, self.flag = overwrite, resume, kind, flag
        self.inputs = [Path(p) for p in inputs if p]
        self.created: Path | None = None  # the topmost folder this run created
        self.locked = False
        self.replacing = False  # an earlier run is there and --overwrite replaces it
        self.started = False  # this run has written into the folder

    # --- before anything heavy ----------------------------------------------------------------

    def acquire(self) -> RunDir:
        path = self.path
        if path.exists() and not path.is_dir():
            raise UserError(f"{self.flag} {path} is a file", f"pass a folder path to {self.flag}")
        self._make_folder()
        try:
            self._lock()
            self._check_contents()
        except BaseException:
            self.release(discard=True)
            raise
        return self

    def _make_folder(self) -> None:
        missing = [p for p in (self.path, *self.path.parents) if not p.exists()]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"{self.flag} {self.path} cannot be created ({err.strerror or err})",
                            "pass a folder path you can write") from err
        self.created = missing[-1] if missing else None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise UserError(f"{self.flag} {self.path} is not writable", "pass a folder you can write")

    def _lock(self) -> None:
        lock = self.path / LOCK
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _read_lock(lock)
                if _is_stale(owner) or not owner and _age_seconds(lock) > 10:  # unreadable: its writer died
                    lock.unlink(missing_ok=True)  # its run was killed: the folder is free again
                    continue
                where = (f"pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('started')}"
                         if owner else "a lock being written now")
                raise UserError(f"another effitrain run ({where}) is writing into {self.flag} {self.path}",
                                f"wait for it to end, or pass another {self.flag} (if that run is gone, delete "
                                f"{lock})") from None
            except OSError as err:
                raise UserError(f"{self.flag} {self.path}: the lock file cannot be written ({err.strerror or err})",
                                "pass a folder you can write") from err
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            self.locked = True
            return
        raise UserError(f"{self.flag} {self.path}: its lock keeps changing hands", f"pass another {self.flag}")

    def _check_contents(self) -> None:
        if (self.path / PREVIOUS).is_dir():
            self._put_back_previous()
            print(f"put the earlier run back into {self.path}: the run replacing it was killed before it ended")
        entries = [e for e in self.path.iterdir() if e.name != LOCK]
        if not entries or self.resume:
            return
        is_run = (self.path / MARKER).is_file()
        if not self.overwrite:
            what = "an effitrain run" if is_run else "files"
            fix = ("pass --resume auto to continue it, --overwrite to replace it, or another " + self.flag
                   if is_run and self.kind == "train" else
                   f"pass another {self.flag}" + (", or --overwrite to replace it" if is_run else ""))
            raise UserError(f"{self.flag} {self.path} already holds {what}", fix)
        if not is_run:
            raise UserError(f"{self.flag} {self.path} is not an effitrain run (no {MARKER}), so --overwrite "
                            f"will not empty it", f"pass another {self.flag}, or empty the folder yourself")
        foreign = sorted(e.name for e in entries if not written_by_effitrain(e))
        if foreign:
            raise UserError(f"{self.flag} {self.path} holds files effitrain did not write ({', '.join(foreign[:5])}), "
                            "so --overwrite will not replace it", f"move them out, or pass another {self.flag}")
        for given in self.inputs:
            if given.exists() and _inside(given, self.path):
                raise UserError(f"{self.flag} {self.path} holds this run's own input {given}, which --overwrite "
                                "would remove", f"pass another {self.flag}, or move the input out of it")
        self.replacing = True

    # --- once the run starts writing ----------------------------------------------------------

    def start(self) -> None:
        """The main process, when the run's first file is about to be written."""
        self.started = True
        if self.replacing:
            (self.path / PREVIOUS).mkdir()
            for entry in self.path.iterdir():
                if entry.name not in (LOCK, PREVIOUS):
                    entry.rename(self.path / PREVIOUS / entry.name)
        for stale in (*self.path.glob(".tmp-*"), *self.path.glob("checkpoints/.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)  # left by a run killed while saving
        write_json(self.path / MARKER, {"kind": self.kind, "created": time.strftime("%Y-%m-%d %H:%M:%S")})

    def succeed(self) -> None:
        if self.replacing:
            shutil.rmtree(self.path / PREVIOUS, ignore_errors=True)
        self.release()

    def fail(self, user_mistake: bool) -> None:
        """Put back what was there: the earlier run when overwriting; nothing when a user mistake stopped
        a fresh run before it wrote a checkpoint or a model (nothing of value, and it would block the
        corrected command). Otherwise (a crash, a signal) the run's files stay for --resume."""
        if self.replacing and (self.path / PREVIOUS).is_dir():
            self._put_back_previous()
            self.release()
            return
        worth_keeping = (self.path / "model").exists() or any(self.path.glob("checkpoints/step-*"))
        self.release(discard=user_mistake and not self.resume and not worth_keeping)

    def _put_back_previous(self) -> None:
        """The run being replaced goes back; what the replacing run wrote goes."""
        previous = self.path / PREVIOUS
        for entry in self.path.iterdir():
            if entry.name not in (LOCK, PREVIOUS) and written_by_effitrain(entry):
                _remove(entry)
        for entry in previous.iterdir():
            entry.rename(self.path / entry.name)
        previous.rmdir()

    def release(self, discard: bool = False) -> None:
        """Drop the lock; `discard`: also remove what this run wrote (all of it: the folder held none
        of the user's files, or the run was refused before writing any)."""
        if discard and self.started and not self.replacing and not self.resume:
            for entry in self.path.iterdir():
                if entry.name != LOCK and written_by_effitrain(entry):
                    _remove(entry)
        if self.locked:
            (self.path / LOCK).unlink(missing_ok=True)
            self.locked = False
        if discard and self.created is not None:
            # The folders this run made, if it left them empty.
            for folder in (self.path, *self.path.parents):
                if not _inside(folder, self.created) or any(folder.iterdir()):
                    break
                folder.rmdir()
            self.created = None


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)


def _read_lock(lock: Path) -> dict:
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return {}


def _age_seconds(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _is_stale(owner: dict) -> bool:
    """The lock's process is gone: on this host, pid no longer alive. Another host's lock is trusted."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


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


class JsonlLog:
    """log.jsonl: one JSON object per line, flushed at once so a crash keeps every line written."""

    def __init__(self, path: Path | None):
        self.file = open(path, "a", buffering=1) if path is not None else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json_text(record) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
