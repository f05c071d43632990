"""The base model an adapter folder belongs to: recorded beside peft's files when the adapter is saved
(where the base is, its architecture, its tensors' shapes and a digest of its weight files), found
and checked when the adapter is loaded, so that an adapter is only ever applied to its own base.

peft records the base only as the path the model was loaded from (`base_model_name_or_path`), often
relative to the folder training ran in; a moved run, another working folder or a base saved again over
the same path would load something else without a word. The record is effitrain's own file (peft's
LoraConfig would warn about keys it does not know in adapter_config.json)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from effitrain.errors import UserError

RECORD = "effitrain_base.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")  # what from_pretrained may read, safetensors first


# -- what is recorded ----------------------------------------------------------------------------------
def weight_files(base: Path) -> list[Path]:
    """The files holding the base's weights: its safetensors, or its pickles where it has none."""
    for pattern in WEIGHT_PATTERNS[:1], WEIGHT_PATTERNS[1:]:
        found = sorted(path for glob in pattern for path in base.glob(glob) if path.is_file())
        if found:
            return found
    return []


_digests: dict[tuple, dict[str, str]] = {}  # a run saves best/ many times over one base: hashed once


def digests(base: Path, cached: bool = False) -> dict[str, str]:
    """sha256 of each weight file's bytes, streamed (its cost: docs/adapters.md). The files' bytes, not
    the tensors' values: a base saved again with the same values in another layout counts as other
    weights, which is the safe side. `cached`: for the saves of one run only (a file's times are too
    coarse to tell a base replaced within milliseconds)."""
    files = weight_files(base)
    key = tuple((str(path.resolve()), path.stat().st_ino, path.stat().st_size, path.stat().st_mtime_ns)
                for path in files)
    if key not in _digests or not cached:
        found = {}
        for path in files:
            with path.open("rb") as handle:
                found[path.name] = hashlib.file_digest(handle, "sha256").hexdigest()
        _digests[key] = found
    return _digests[key]


def shapes(base: Path) -> dict[str, str]:
    """Each tensor's shape as `rows x columns`, from the safetensors headers (no weights read); {} for
    pickle weights."""
    from safetensors import safe_open

    found = {}
    for path in weight_files(base):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as weights:
                found.update({name: "x".join(map(str, weights.get_slice(name).get_shape())) for name in weights.keys()})
    return found


def model_type(base: Path) -> str | None:
    try:
        return json.loads((base / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def record(folder: Path, base: str | None) -> None:
    """Write the record of `base` (the path the adapted model was loaded from, relative to the working
    folder) into the adapter `folder`, a folder of the run: the base's absolute path and its path from
    the run folder, its model_type, shapes and weight digests. Nothing for a model built from a config."""
    if not base or not (Path(base) / "config.json").is_file():
        return
    absolute = Path(base).resolve()
    run = Path(folder).resolve().parent  # adapter/ and best/ sit in the run folder
    content = {"path": str(absolute), "path_from_run": os.path.relpath(absolute, run),
               "model_type": model_type(absolute), "sha256": digests(absolute, cached=True),
               "shapes": shapes(absolute)}
    (Path(folder) / RECORD).write_text(json.dumps(content, indent=1) + "\n", encoding="utf-8")


# -- finding and checking the base ---------------------------------------------------------------------
def read(adapter: Path) -> dict | None:
    """The record of an adapter folder; None for folders saved before effitrain wrote one."""
    path = Path(adapter) / RECORD
    if not path.is_file():
        return None
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
        if not (isinstance(content, dict) and isinstance(content["path"], str) and isinstance(content["sha256"], dict)
                and isinstance(content.get("shapes", {}), dict)):
            raise ValueError("not the fields effitrain writes")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} (which base the adapter belongs to) cannot be read: {err}",
                        f"use the merged model {merged_model(adapter)}, or train the adapter again")
    return content


def merged_model(adapter: Path) -> Path:
    """What to use instead of an adapter folder: the run's model/, the adapter merged into its base."""
    return Path(adapter).parent / "model"


def candidates(adapter: Path, content: dict) -> list[Path]:
    """Where the base may be, in this order: the absolute path it was trained from (what a run moved
    on its own or read from another folder needs), then its path from the run folder (a run and its
    base moved together). Both are checked against the digests: order only decides which is named."""
    found = [Path(content["path"])]
    if isinstance(content.get("path_from_run"), str):
        found.append(Path(adapter).resolve().parent / content["path_from_run"])
    unique = []
    for path in found:
        if all(os.path.normpath(path) != os.path.normpath(seen) for seen in unique):
            unique.append(path)
    return unique


def find(adapter: Path, content: dict, weights: bool = True) -> Path:
    """The base the record names, with its own weights; refused when it is missing, of another
    architecture, of other shapes or (`weights`: its files hashed) holds other weights."""
    places = candidates(adapter, content)
    present = [path for path in places if (path / "config.json").is_file()]
    fix = (f"put the base it was trained on back at {places[0]}, or use the merged model {merged_model(adapter)}, "
           "which needs no base")
    if not present:
        raise UserError(f"the base model of the adapter in {adapter} is missing: nothing at "
                        f"{' nor at '.join(map(str, places))}", fix)
    problems = [mismatch(path, content, weights) for path in present]
    for path, problem in zip(present, problems):
        if problem is None:
            return path
    raise UserError(f"the base model of the adapter in {adapter}: {problems[0]}", fix)


def mismatch(base: Path, content: dict, weights: bool = True) -> str | None:
    """What differs between `base` and the base the adapter was trained on (None: nothing), the cheap
    differences first, so that the message names the deepest one: architecture, shapes, then values."""
    found, wanted = model_type(base), content.get("model_type")
    if wanted and found != wanted:
        return f"{base} is a {found} model, and the adapter was trained on a {wanted} model"
    recorded = content.get("shapes") or {}
    if recorded:
        now = shapes(base)
        for name in sorted(set(recorded) | set(now)):
            if now.get(name) != recorded.get(name):
                return (f"{base} has other shapes than the base the adapter was trained on ({name}: "
                        f"{now.get(name, 'absent')} there, {recorded.get(name, 'absent')} in the base it was "
                        "trained on)")
    now = digests(base) if weights else content["sha256"]
    if now != content["sha256"]:
        return (f"{base} holds other weights than the base the adapter was trained on (sha256 of "
                f"{', '.join(sorted(set(now) | set(content['sha256'])))} differs)")
    return None
