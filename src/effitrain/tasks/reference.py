"""DPO's reference log-probs (the starting model's, summed over each answer), from one of three places
that give the same numbers: `precompute` (one pass over every split before training, stored as a column
of the data and in the run folder, so that a resumed run reads them back), `copy` (a frozen copy of the
starting model, run beside the policy), `adapters` (with --peft: the policy itself with its adapters
switched off, which is the starting model; no second copy). The reference always runs in evaluation mode
(no dropout) and without gradients, as TRL's does, and under the run's autocast (bf16 on most CPUs here):
the policy's precision, so that the three agree and the first step's policy equals its reference."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from effitrain.outputs import files
from effitrain.outputs.run_folder import REFERENCE_LOGPS as FILE  # in the run folder: {split: [pairs, 2] float64}
COLUMN = "reference_logps"


@contextlib.contextmanager
def evaluating(model):
    """No dropout and no gradients inside; the model's mode restored after."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(training)


class Reference:
    """Where the reference log-probs come from. `answer_logps(model, batch)` is the task's: each pair's
    answers' summed log-probs, [pairs, 2]."""

    autocast = contextlib.nullcontext  # the run's (accelerator.autocast), set by prepare

    def prepare(self, model, encoded, collate, batch_size: int, out_dir: Path | None, answer_logps):
        """Before training, with the starting model: the splits (with their column, for precompute)."""
        return encoded

    def logps(self, model, batch, answer_logps) -> torch.Tensor:
        raise NotImplementedError


class Precomputed(Reference):
    def prepare(self, model, encoded, collate, batch_size, out_dir, answer_logps):
        from datasets import DatasetDict

        stored = _read(out_dir, {name: len(split) for name, split in encoded.items()})
        if stored is None:
            with self.autocast():
                stored = {name: compute_shared(model, split, collate, batch_size, answer_logps)
                          for name, split in encoded.items()}
            _write(out_dir, stored)
        return DatasetDict({name: split.remove_columns([c for c in (COLUMN,) if c in split.column_names])
                            .add_column(COLUMN, stored[name].tolist()) for name, split in encoded.items()})

    def logps(self, model, batch, answer_logps):
        return batch[COLUMN].float()


class FrozenCopy(Reference):
    model = None

    def prepare(self, model, encoded, collate, batch_size, out_dir, answer_logps):
        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)
        return encoded

    def logps(self, model, batch, answer_logps):
        with evaluating(self.model), self.autocast():
            return answer_logps(self.model, batch)


class AdaptersOff(Reference):
    def logps(self, model, batch, answer_logps):
        from effitrain.models import adapters

        with evaluating(model), adapters.switched_off(model), self.autocast():
            return answer_logps(model, batch)


class Absent(Reference):
    """`effitrain evaluate` without --reference-model: no reference (log-probs 0), so the rewards are beta x
    the policy's own log-probs and preference accuracy the share of pairs whose chosen answer it finds likelier."""

    def logps(self, model, batch, answer_logps):
        return torch.zeros(batch["input_ids"].shape[:2], device=batch["input_ids"].device)


MODES = {"precompute": Precomputed, "copy": FrozenCopy, "adapters": AdaptersOff, "none": Absent}


def compute(model, split, collate, batch_size: int, answer_logps, width: int = 2) -> torch.Tensor:
    """The starting model's [pairs, 2] log-probs over a split, in its order, in evaluation mode (adapters, if
    any, switched off: they start as zero updates, and so every mode computes the same model); `answer_logps`
    may give any [rows, width] values (a teacher's logits: tasks/distillation.py)."""
    from effitrain.models import adapters

    device = next(model.parameters()).device
    out = []
    with evaluating(model), adapters.as_its_base(model):
        for start in range(0, len(split), batch_size):
            batch = collate([split[i] for i in range(start, min(start + batch_size, len(split)))])
            batch = {key: value.to(device) for key, value in batch.items()}
            out.append(answer_logps(model, batch).double().cpu())
    return torch.cat(out) if out else torch.zeros(0, width, dtype=torch.float64)


def compute_shared(model, split, collate, batch_size: int, answer_logps, width: int = 2) -> torch.Tensor:
    """`compute` over a split with the work shared by the processes: each takes every W-th pair (rank,
    rank + W, ...), and all of them end with every pair's log-probs, in the split's order."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return compute(model, split, collate, batch_size, answer_logps, width)
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = compute(model, split.select(range(rank, len(split), world)), collate, batch_size, answer_logps, width)
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)  # small: 2 float64 a pair
    whole = torch.zeros(len(split), width, dtype=torch.float64)
    for r, part in enumerate(parts):
        whole[r::world] = part
    return whole


def _read(out_dir: Path | None, sizes: dict[str, int]) -> dict | None:
    """The log-probs an earlier start of this run stored, when they fit the splits (a resume); refused when
    the file is not what was written (its digest, kept in its metadata, differs: edited, cut, or not ours)."""
    if out_dir is None or not (Path(out_dir) / FILE).is_file():
        return None
    from safetensors import SafetensorError, safe_open

    path = Path(out_dir) / FILE
    try:
        with safe_open(str(path), framework="pt") as stored_file:
            recorded = (stored_file.metadata() or {}).get(DIGEST)
            stored = {name: stored_file.get_tensor(name) for name in stored_file.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise _changed(path, f"cannot be read ({' '.join(str(err).split())[:200]})") from None
    if recorded is None or recorded != digest(stored):
        raise _changed(path, "is not what this run wrote (its digest differs: edited, or written by something else)")
    if {name: len(values) for name, values in stored.items()} != sizes:
        return None
    return stored


DIGEST = "effitrain_sha256"  # the metadata key of the stored log-probs' digest


def digest(stored: dict) -> str:
    """sha256 over each split's name, shape, dtype and bytes, in name order."""
    import hashlib

    hashed = hashlib.sha256()
    for name in sorted(stored):
        values = stored[name].contiguous()
        hashed.update(f"{name}|{tuple(values.shape)}|{values.dtype}|".encode())
        hashed.update(values.view(torch.uint8).numpy().tobytes() if values.numel() else b"")
    return hashed.hexdigest()


def _changed(path: Path, problem: str):
    from effitrain.errors import UserError

    return UserError(f"DPO's precomputed reference {path} {problem}", "delete it (a resumed run computes it again "
                     "from the starting model), or start a new --output-dir")


def _write(out_dir: Path | None, stored: dict) -> None:
    write_stored(out_dir, FILE, stored)


def write_stored(out_dir: Path | None, name: str, stored: dict, metadata: dict[str, str] | None = None) -> None:
    """`stored` as OUT_DIR/NAME (safetensors, with its digest and `metadata`), written whole (a temporary file
    renamed) by the main process; every process holds the same. Also the teachers' stored outputs' writer."""
    import os

    from accelerate import PartialState
    from safetensors.torch import save_file

    if out_dir is None or not PartialState().is_main_process:
        return
    path = Path(out_dir) / name
    partial = path.with_name(name + ".tmp")
    stored = {key: values.contiguous() for key, values in stored.items()}
    try:
        with files.writing(partial):
            save_file(stored, str(partial), metadata={DIGEST: digest(stored), **(metadata or {})})
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
