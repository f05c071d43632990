"""A teacher's outputs stored in the run folder (--distill-from: a classifier's logits, tasks/distillation.py; a
causal LM's top-k log-probs, tasks/lm_distillation.py): written whole by the main process with a digest of the
tensors and a fingerprint of what they were computed from (the teacher folder's files, the training rows, the
settings that shape them), read back on resume and refused when the file is gone, altered or another run's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from effitrain.errors import UserError
import effitrain.tasks.reference as reference

FINGERPRINT = "effitrain_teacher_and_data"  # the stored file's metadata key: sha256 of the teacher and the data


def teacher_source(teacher: str, allow_pickle: bool, task, wanted: str, fix: str):
    """--distill-from's folder as a model source of `task`, and its config: refused in one line when it holds no
    model, or none `task` makes (`wanted`: what it should be, in words; `fix`: the refusal's fix)."""
    from effitrain.models import loading

    where = f"--distill-from {teacher}"
    try:
        source = loading.resolve_source(str(Path(teacher).expanduser()), allow_pickle)
    except UserError as err:
        raise UserError(f"{where}: {err.problem}", err.fix) from None
    config = task.source_config(source)
    if not task.makes(config):
        kind = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise UserError(f"{where} is a {kind}, not {wanted}", fix)
    return source, config


def fingerprint(teacher: str, train, settings: str = "") -> str:
    """sha256 over the teacher folder's files (names and bytes), the training split's rows in order, and
    `settings` (what else decides the stored values: a top-k's k and temperature)."""
    import pyarrow as pa

    hashed = hashlib.sha256()
    folder = Path(teacher).expanduser()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        hashed.update(f"{path.relative_to(folder)}|{path.stat().st_size}|".encode())
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                hashed.update(chunk)
    for batch in train.with_format("arrow").iter(batch_size=4096):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_table(batch)
        hashed.update(sink.getvalue().to_pybytes())
    if settings:
        hashed.update(f"|{settings}".encode())
    return hashed.hexdigest()


def read(path: Path, fingerprint_: str, shapes_fit, what: str) -> dict[str, torch.Tensor]:
    """The tensors an earlier start of this run stored at `path` (a resume); `shapes_fit(stored)`: whether they
    fit this run's data. Refused (naming `what`) when the file is gone, altered, or made from another teacher,
    other training data or other settings."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise refused(what, path, "is missing, and the checkpoint being resumed was trained against it")
    try:
        with safe_open(str(path), framework="pt") as stored_file:
            metadata = stored_file.metadata() or {}
            stored = {name: stored_file.get_tensor(name) for name in stored_file.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise refused(what, path, f"cannot be read ({' '.join(str(err).split())[:200]})") from None
    if metadata.get(reference.DIGEST) != reference.digest(stored):
        raise refused(what, path, "is not what this run wrote (its digest differs: edited, or written by something "
                      "else)")
    if metadata.get(FINGERPRINT) != fingerprint_ or not shapes_fit(stored):
        raise refused(what, path, "was computed from another teacher folder or other training data than this run's")
    return stored


def write(out_dir: Path | None, name: str, stored: dict[str, torch.Tensor], fingerprint_: str) -> None:
    """Written whole by the main process, with its digest and fingerprint (reference.write_stored)."""
    reference.write_stored(out_dir, name, stored, {FINGERPRINT: fingerprint_})


def refused(what: str, path: Path, problem: str) -> UserError:
    return UserError(f"{what} {path} {problem}",
                     "restore the file (and the teacher folder and data it was made from), or start a new --output-dir")
