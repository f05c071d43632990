"""Where `datasets.map` keeps preprocessed splits, so that a rerun with nothing changed loads them."""

from __future__ import annotations

import os
from pathlib import Path


def files(splits, key: list) -> dict[str, str]:
    """One Arrow file per split, named by the split's content fingerprint and the preprocessing settings
    in `key` (datasets fingerprints in-memory data by content, so CSV and built-in data qualify too)."""
    from datasets import config as datasets_config
    from datasets.fingerprint import Hasher

    folder = Path(datasets_config.HF_DATASETS_CACHE) / "effitrain"
    folder.mkdir(parents=True, exist_ok=True)
    return {name: str(folder / f"{Hasher.hash([split._fingerprint, key])}.arrow") for name, split in splits.items()}


def map_splits(splits, function, key: list, per_split: bool = False, **options):
    """`splits.map(function, **options)`, each split into its file of `files`, with that file's hash as its
    new fingerprint: otherwise datasets fingerprints the result by hashing `function` with dill, the
    tokenizer or processor it closes over included (~0.1 s a split, a quarter of the default job's
    tokenization). The file name already holds all the result depends on: the data and `key`.
    `per_split`: `function` also takes the split it maps, last (to name a row by where it came from)."""
    import functools

    from datasets import DatasetDict

    names = files(splits, key)
    return DatasetDict({name: split.map(functools.partial(_with_split, function, split) if per_split else function,
                                        cache_file_name=names[name], new_fingerprint=Path(names[name]).stem, **options)
                        for name, split in splits.items()})


def _with_split(function, split, *args):
    return function(*args, split)


def file_signature(splits, column: str, base_dir) -> list:
    """(path, size, mtime) of the files a column points to: the fingerprint sees paths, not the files
    behind them, and a file replaced under the same name must not reuse a stale cache."""
    signature = []
    for split in splits.values():
        for value in split.data.column(column).to_pylist():
            path = value.get("path") if isinstance(value, dict) and not value.get("bytes") else value
            if isinstance(path, str):
                full = Path(path) if base_dir is None or os.path.isabs(path) else Path(base_dir) / path
                stat = full.stat() if full.exists() else None
                signature.append((path, stat and stat.st_size, stat and stat.st_mtime_ns))
    return [str(base_dir), signature]
