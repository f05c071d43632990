"""Every source and the bad-data errors, through sources.load (what `train` calls)."""

import json

import pytest

from effitrain import tasks
from effitrain.config import TrainConfig
from effitrain.data import sources
from effitrain.errors import UserError

ROWS = [("free cash prize now", "spam"), ("see you at lunch", "ham"), ("win a car text WIN", "spam"),
        ("ok thanks", "ham"), ("call me later", "ham"), ("claim your reward", "spam")] * 3


def write_csv(path, rows=ROWS, header=("text", "label"), sep=","):
    lines = [sep.join(header)] + [sep.join(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def load(data, **overrides):
    config = TrainConfig(data=str(data), **overrides)
    return sources.load(config, tasks.get(config.task).columns(config))


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".json", ".jsonl", ".parquet"])
def test_file_formats(tmp_path, suffix):
    path = tmp_path / f"d{suffix}"
    records = [{"text": t, "label": label} for t, label in ROWS]
    if suffix in (".csv", ".tsv"):
        write_csv(path, sep="\t" if suffix == ".tsv" else ",")
    elif suffix == ".json":
        path.write_text(json.dumps(records))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in records))
    else:
        import pandas as pd

        pd.DataFrame(records).to_parquet(path)
    loaded = load(path)
    splits = loaded.splits
    assert sum(len(s) for s in splits.values()) == len(ROWS)
    assert splits["train"].features["label"].names == ["ham", "spam"]
    assert set(splits["train"].column_names) == {"text", "label"}
    assert loaded.base_dir == tmp_path


def test_save_to_disk_folder_with_its_own_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_dict({"sentence": [t for t, _ in ROWS], "y": [int(l == "spam") for _, l in ROWS]})
    DatasetDict(train=ds, validation=ds.select(range(4)), test=ds.select(range(6))).save_to_disk(tmp_path / "saved")
    splits = load(tmp_path / "saved", text_column="sentence", label_column="y").splits
    assert (len(splits["train"]), len(splits["validation"]), len(splits["test"])) == (18, 4, 6)
    assert splits["train"].features["label"].names == ["0", "1"]  # integer labels become names


def test_integer_labels_sort_as_numbers(tmp_path):
    rows = [(f"text {i}", str(label)) for i, label in enumerate([2, 10, 1] * 6)]
    assert load(write_csv(tmp_path / "d.csv", rows)).splits["train"].features["label"].names == ["1", "2", "10"]


def test_sentence_pairs_and_separate_validation_and_test_files(tmp_path):
    rows = [("He said hi.", "He greeted.", "equivalent"), ("It rains.", "The sun shines.", "not_equivalent")] * 5
    header = ("sentence1", "sentence2", "quality")
    train = write_csv(tmp_path / "train.csv", rows, header)
    dev = write_csv(tmp_path / "dev.csv", rows[:2], header)
    test = write_csv(tmp_path / "test.csv", rows[:4], header)
    splits = load(train, validation_file=str(dev), test_file=str(test), text_column="sentence1",
                  text_pair_column="sentence2", label_column="quality").splits
    assert (len(splits["train"]), len(splits["validation"]), len(splits["test"])) == (10, 2, 4)
    assert set(splits["train"].column_names) == {"text", "text_pair", "label"}


def test_stratified_split_keeps_the_class_mix():
    splits = load("sms-spam").splits
    for split in splits.values():
        share = sum(split["label"]) / len(split)
        assert share == pytest.approx(642 / 4862, abs=0.01)


@pytest.mark.parametrize("name, size, labels", [("bbc-news", 2225, 5), ("digits", 1797, 10)])
def test_builtins(name, size, labels):
    task = "image-classification" if name == "digits" else "sequence-classification"
    splits = load(name, task=task).splits
    assert sum(len(s) for s in splits.values()) == size
    assert len(splits["train"].features["label"].names) == labels


def test_fashion_mnist_keeps_its_official_test_set():
    splits = load("fashion-mnist", task="image-classification").splits
    assert len(splits["test"]) == 10000 and len(splits["train"]) + len(splits["validation"]) == 60000
    assert splits["train"].features["label"].names[0] == "t-shirt/top"


def check(match, data, **overrides):
    with pytest.raises(UserError) as err:
        load(data, **overrides)
    assert match in str(err.value) and "\n" not in str(err.value)
    return str(err.value)


def test_missing_column_names_the_columns_and_the_flag(tmp_path):
    message = check("has no column `body`", write_csv(tmp_path / "d.csv"), text_column="body")
    assert "columns: text, label" in message and "--text-column" in message


def test_empty_file_and_empty_split(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    check("is empty", tmp_path / "empty.csv")
    (tmp_path / "header.csv").write_text("text,label\n")
    check("has no rows", tmp_path / "header.csv")
    check("no such file, folder or built-in", tmp_path / "missing.csv")


def test_label_absent_from_training(tmp_path):
    train = write_csv(tmp_path / "train.csv")
    dev = write_csv(tmp_path / "dev.csv", [("hello", "ham"), ("buy now", "promo")])
    check("label `promo` is not in the training data", train, validation_file=str(dev))


def test_unreadable_row_is_named_or_skipped_and_counted(tmp_path):
    path = tmp_path / "d.csv"
    write_csv(path)
    path.write_text(path.read_text() + "too,many,fields\n")
    check("line 20", path)
    loaded = load(path, skip_bad_rows=True)
    assert loaded.skipped_rows == 1 and sum(len(s) for s in loaded.splits.values()) == len(ROWS)


def test_missing_value_is_named_or_skipped_and_counted(tmp_path):
    path = write_csv(tmp_path / "d.csv", ROWS + [("", "spam"), ("no label here", "")])
    check("row 19 has no value in column `text` (1 such rows)", path)
    loaded = load(path, skip_bad_rows=True)
    assert loaded.skipped_rows == 2 and sum(len(s) for s in loaded.splits.values()) == len(ROWS)


def test_bad_json_line_names_the_file(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": "x"}\n{not json\n')
    check("cannot be read as json", tmp_path / "d.jsonl")


def test_data_set_from_the_local_hub_cache_offline(tmp_path):
    """The layout huggingface_hub writes for a data set repo: datasets--ORG--NAME/refs/main -> snapshots/<commit>/."""
    import os
    import subprocess
    import sys

    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "datasets--someorg--tiny-spam" / "snapshots" / commit / "data"
    snapshot.mkdir(parents=True)
    write_csv(snapshot / "train.csv")
    (tmp_path / "hub" / "datasets--someorg--tiny-spam" / "refs").mkdir()
    (tmp_path / "hub" / "datasets--someorg--tiny-spam" / "refs" / "main").write_text(commit)
    code = ("from effitrain.config import TrainConfig; from effitrain.data import sources; "
            "from effitrain import tasks; c = TrainConfig(data='someorg/tiny-spam'); print(sum(len(s) for s in tasks.get(c.task).load_data(c).splits.values()))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(len(ROWS))
