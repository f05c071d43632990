"""The run directory: checked and locked before anything heavy runs, then filled with the files other
tools rely on. effitrain only ever removes what it wrote: `--overwrite` replaces an earlier effitrain
run (recognised by its marker file, holding nothing else) and nothing else, moving it aside until the
new run has succeeded."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable

from effitrain.errors import UserError
from effitrain.outputs import files

MARKER = ".effitrain-run"  # written into every run folder: what --overwrite may replace


LOCK = ".effitrain.lock"  # held (flock) by the run writing into the folder; says its pid and host


PREVIOUS = ".effitrain-previous"  # the run being replaced, until the new one has succeeded


MOVING = PREVIOUS + ".partial"  # the earlier run while it is being moved aside


DELETING = ".tmp-previous"  # a replaced run being deleted


# What runs write. --overwrite removes these and nothing else; a folder's contents are the writer's
# (save_pretrained's, save_state's). Nested runs (bench variants) carry their own marker.
REFERENCE_LOGPS = "reference_logps.safetensors"  # --preference dpo --reference precompute: kept for a resume
TEACHER_LOGITS = "teacher_logits.safetensors"  # --distill-from: the teacher's logits on the training split
TEACHER_TOP_K = "teacher_top_k.safetensors"  # --distill-from, causal-lm: the teacher's top-k log-probs per position
RUN_FILES = {"config.yaml", "log.jsonl", "metrics.json", "bench.json", "bench.png", MARKER, LOCK,
             "report.html", "report-curves.png", "report-confusion.png",  # report/'s page and PNGs
             REFERENCE_LOGPS, REFERENCE_LOGPS + ".tmp", TEACHER_LOGITS, TEACHER_LOGITS + ".tmp",
             TEACHER_TOP_K, TEACHER_TOP_K + ".tmp"}


RUN_FOLDERS = {"model", "best", "adapter", "checkpoints", PREVIOUS, MOVING, DELETING, ".tmp-model", ".tmp-best",
               ".tmp-adapter", "tb", "trackio", "mlruns"}  # the last three: tracking.STORES


def default_dir(root: str = "runs") -> Path:
    """root/<timestamp>, never an existing folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = Path(root) / stamp, 1
    while path.exists():  # two runs started in the same second
        n += 1
        path = Path(root) / f"{stamp}-{n}"
    return path


def is_main_process() -> bool:
    """Before any process group exists: torchrun numbers the processes in RANK (a RANK without a
    WORLD_SIZE > 1 is one process, as accelerate sees it)."""
    world = os.environ.get("WORLD_SIZE", "1")
    return not world.isdigit() or int(world) <= 1 or os.environ.get("RANK", "0") == "0"


def foreign_entries(folder: Path) -> list[str]:
    """What in `folder` effitrain did not write (paths relative to it): anything but a run's own files
    and folders, nested runs holding only theirs, and a nested run's log (bench's NAME.log)."""
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.name in RUN_FILES and (entry.is_file() or entry.is_symlink()):
            continue
        if entry.name in RUN_FOLDERS and entry.is_dir() and not entry.is_symlink():
            continue
        if entry.is_dir() and not entry.is_symlink() and (entry / MARKER).is_file():
            found += [f"{entry.name}/{name}" for name in foreign_entries(entry)]
            continue
        if entry.suffix == ".log" and entry.is_file() and ((entry.with_suffix("") / MARKER).is_file()
                                                           or _variant_log(entry)):
            continue
        found.append(entry.name)
    return found


def _variant_log(entry: Path) -> bool:
    """A bench's NAME.log of a variant that left no folder (it failed at its start, and a failed start
    removes what it made): bench writes it beginning with the command it ran."""
    if files.read_json(entry.parent / MARKER).get("kind") != "bench":
        return False
    try:
        with entry.open("rb") as log:
            return log.read(12) == b"$ effitrain "
    except OSError:
        return False


def finished(folder: Path) -> bool:
    return (folder / "metrics.json").is_file() and (folder / "model").is_dir() and (folder / MARKER).is_file()


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except (ValueError, OSError):
        return False


class RunDir:
    """An output folder held by this run (the main process). `acquire` (before anything heavy) locks
    it, finishes or undoes a replacement that was killed, and checks what is there; `start` (once the
    data and model have loaded) moves an earlier run aside when overwriting and marks the folder;
    `succeed` or `fail` end the hold. A failed overwrite puts the earlier run back; a run stopped by a
    user mistake before it saved anything leaves nothing behind, so that the corrected command is not
    refused; a crash, a signal or a diverged run keeps its files (log, checkpoints, best/)."""

    def __init__(self, path: str | Path | None, overwrite: bool = False, inputs: tuple[str | None, ...] = (),
                 kind: str = "train", flag: str = "--output-dir"):
        self.path = Path(path) if path is not None else default_dir("bench" if kind == "bench" else "runs")
        self.overwrite, self.kind, self.flag = overwrite, kind, flag
        self.inputs = [Path(p) for p in inputs if p]
        self.created: Path | None = None  # the topmost folder this run created
        self.fd: int | None = None  # the lock file, flock'ed while the run holds the folder
        self.resume = False  # continuing a checkpoint of this folder's own run
        self.resume_from: Path | None = None
        self.replacing = False  # an earlier run is (or will be) in PREVIOUS: deleted on success, put back on failure
        self.move_aside = False  # start() moves the earlier run into PREVIOUS
        self.started = False  # this run has written into the folder

    # --- before anything heavy ----------------------------------------------------------------

    def acquire(self, resume: str | None = None, find_checkpoint: Callable[[], Path | None] | None = None) -> RunDir:
        """`resume`: the --resume value; `find_checkpoint`: the checkpoint it names, looked up once the
        folder is locked and any killed replacement is settled (None: a fresh start)."""
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"{self.flag} {self.path} is a file", f"pass a folder path to {self.flag}")
        if self.path.is_symlink() and not self.path.exists():
            raise UserError(f"{self.flag} {self.path} is a symbolic link to {os.readlink(self.path)}, which does not "
                            "exist", f"create the folder it points to, or pass another {self.flag}")
        self._make_folder()
        try:
            self._lock()
            self._settle_killed_replacement(continuing=resume == "auto")
            self.resume_from = find_checkpoint() if find_checkpoint else None
            self.resume = self.resume_from is not None and _inside(self.resume_from, self.path)
            self._check_contents(restart=resume == "auto")
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
        """flock: the kernel releases it when the process dies, so a killed run never blocks the folder."""
        lock = self.path / LOCK
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise UserError(f"{self.flag} {self.path}: the lock file {lock} cannot be opened "
                                f"({err.strerror or err})", f"remove {lock} if no effitrain run is writing there, "
                                f"or pass another {self.flag}") from err
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = files.read_json(lock)
                os.close(fd)
                where = (f" (pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('started')})"
                         if owner else "")
                raise UserError(f"another effitrain run{where} is writing into {self.flag} {self.path}",
                                f"wait for it to end, or pass another {self.flag}") from None
            except OSError:
                pass  # a file system without locks (some network ones): the lock file still says who writes
            try:  # its last owner may have removed the file between our open and our lock
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps(mine).encode())
                self.fd = fd
                return
            os.close(fd)

    def _settle_killed_replacement(self, continuing: bool) -> None:
        """A run that replaced another and was killed left the earlier run aside: finish its work (it had
        succeeded), let it continue (--resume auto with a checkpoint of its own), or put the earlier
        run back."""
        moving, previous = self.path / MOVING, self.path / PREVIOUS
        for aside in (moving, previous):
            if aside.is_symlink() or aside.exists() and not aside.is_dir():
                raise UserError(f"{aside} is not a folder effitrain wrote", f"move it out of {self.path}")
        if moving.is_dir():  # killed while moving the earlier run aside: nothing new was written yet
            self._move_back(moving)
        if not previous.is_dir():
            return
        if finished(self.path):  # killed while deleting the replaced run
            _delete(previous, self.path / DELETING)
        elif continuing and any((self.path / "checkpoints").glob("step-*")):
            self.replacing = True  # the replacing run goes on; the earlier one stays aside until it succeeds
        else:
            self._put_back_previous()
            print(f"put the earlier run back into {self.path}: the run replacing it was stopped before it ended")

    def _check_contents(self, restart: bool) -> None:
        entries = [e for e in self.path.iterdir() if e.name != LOCK]
        if not entries or self.resume:
            return
        marker = files.read_json(self.path / MARKER) if (self.path / MARKER).is_file() else None
        what = ("files" if marker is None else "an effitrain bench" if marker.get("kind") == "bench"
                else "an effitrain run")
        # --resume auto with no checkpoint yet: a run killed before its first one starts again in its folder.
        own_restart = restart and what == "an effitrain run" and not finished(self.path)
        if not self.overwrite and not own_restart:
            fix = f"pass another {self.flag}" + (", or --overwrite to replace it" if marker else "")
            if what == "an effitrain run" and not restart:
                fix = f"pass --resume auto to continue it, --overwrite to replace it, or another {self.flag}"
            raise UserError(f"{self.flag} {self.path} already holds {what}", fix)
        if marker is None:
            raise UserError(f"{self.flag} {self.path} is not an effitrain run (no {MARKER}), so --overwrite "
                            f"will not empty it", f"pass another {self.flag}, or empty the folder yourself")
        foreign = foreign_entries(self.path)
        if foreign:
            raise UserError(f"{self.flag} {self.path} holds files effitrain did not write ({', '.join(foreign[:5])}), "
                            "so it will not replace it", f"move them out, or pass another {self.flag}")
        for given in self.inputs:
            if given.exists() and _inside(given, self.path):
                raise UserError(f"{self.flag} {self.path} holds this run's own input {given}, which replacing "
                                "the run there would remove", f"pass another {self.flag}, or move the input out of it")
        self.replacing = self.move_aside = True

    # --- once the run starts writing ----------------------------------------------------------

    def start(self) -> None:
        """The main process, when the run's first file is about to be written."""
        self.started = True
        for stale in (*self.path.glob(".tmp-*"), *self.path.glob("checkpoints/.tmp-*")):
            if stale.is_dir() and not stale.is_symlink():  # left by a run killed while saving
                shutil.rmtree(stale, ignore_errors=True)
        if self.move_aside:  # moved under another name first, so that a kill midway can be told apart
            moving = self.path / MOVING
            moving.mkdir()
            for entry in self.path.iterdir():
                if entry.name not in (LOCK, MOVING):
                    entry.rename(moving / entry.name)
            moving.rename(self.path / PREVIOUS)
        files.write_json(self.path / MARKER, {"kind": self.kind, "created": time.strftime("%Y-%m-%d %H:%M:%S")})

    def succeed(self) -> None:
        if self.replacing:
            _delete(self.path / PREVIOUS, self.path / DELETING)
        self.release()

    def fail(self, user_mistake: bool) -> None:
        """Put back what was there: the earlier run when replacing one; nothing at all when this run
        wrote nothing yet, or was stopped by a user mistake before it saved anything."""
        if not self.started:
            self.release(discard=True)
        elif self.replacing and (self.path / PREVIOUS).is_dir():
            self._put_back_previous()
            self.release()
        else:
            saved = any((self.path / name).exists() for name in ("model", "best")) or any(
                (self.path / "checkpoints").glob("step-*"))
            self.release(discard=user_mistake and not self.resume and not saved)

    def _put_back_previous(self) -> None:
        """The run being replaced goes back; what the replacing run wrote goes."""
        foreign = _foreign_names(self.path)
        for entry in self.path.iterdir():
            if entry.name not in (LOCK, PREVIOUS) and entry.name not in foreign:
                _remove(entry)
        self._move_back(self.path / PREVIOUS)

    def _move_back(self, aside: Path) -> None:
        for entry in aside.iterdir():
            if (self.path / entry.name).exists():
                raise UserError(f"cannot put {entry} back: {self.path / entry.name} is in the way",
                                f"move {self.path / entry.name} out of {self.path}, then rerun")
            entry.rename(self.path / entry.name)
        aside.rmdir()

    def release(self, discard: bool = False) -> None:
        """Drop the lock; `discard`: also remove what this run wrote, and the folders it created."""
        if discard and self.started and not self.replacing and not self.resume:
            foreign = _foreign_names(self.path)
            for entry in self.path.iterdir():
                if entry.name != LOCK and entry.name not in foreign:
                    _remove(entry)
        if self.fd is not None:
            (self.path / LOCK).unlink(missing_ok=True)  # while still locked: the next run makes a new one
            os.close(self.fd)
            self.fd = None
        if discard and self.created is not None:
            for folder in (self.path, *self.path.parents):  # the folders this run made, if it left them empty
                if not _inside(folder, self.created) or any(folder.iterdir()):
                    break
                folder.rmdir()
            self.created = None


def _foreign_names(folder: Path) -> set[str]:
    """The entries of `folder` that are, or hold, something effitrain did not write (looked for once)."""
    return {name.split("/")[0] for name in foreign_entries(folder)}


def _delete(folder: Path, via: Path) -> None:
    """Renamed first, then deleted: a kill midway leaves a temporary folder, cleared by the next run."""
    if via.is_dir() and not via.is_symlink():
        shutil.rmtree(via)
    folder.rename(via)
    shutil.rmtree(via, ignore_errors=True)


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)
