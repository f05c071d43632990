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


def tokenizer_key(tokenizer) -> str:
    """What a tokenizer does, hashed: a fast tokenizer's whole definition (vocabulary, normaliser, pre-tokenizer,
    post-processor) and its special tokens, not its folder's name and size: a tokenizer saved again in the same
    folder with other tokens, or two in-memory tokenizers without a path (--tokenizer characters), must not
    share preprocessed splits."""
    import hashlib
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Less the truncation and padding a call leaves set on it (transformers sets them per call).
        definition = json.loads(backend.to_str())
        definition = json.dumps({k: v for k, v in definition.items() if k not in ("truncation", "padding")})
    else:
        definition = repr(sorted(tokenizer.get_vocab().items()))
    specials = repr(sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items()))
    return hashlib.sha256(f"{definition}\n{specials}\n{len(tokenizer)}".encode()).hexdigest()


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
