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


def test_sms_spam_preference_pairs_the_right_answer_with_the_wrong_one_and_holds_out_sms_spam_chat_rows():
    """Each pair is sms-spam-chat's conversation: its user turn the prompt, its answer chosen, the other
    label rejected; the seeded split holds out the same messages, so SFT on sms-spam-chat then preference
    tuning on this set never trains on a held-out row."""
    from effitrain.data import builtins

    chat = sources.load(TrainConfig(task="causal-lm", data="sms-spam-chat"), {"messages": "messages"}).splits
    columns = {name: name for name in ("prompt", "chosen", "rejected")}
    pairs = sources.load(TrainConfig(task="causal-lm", data="sms-spam-preference"), columns).splits
    assert sum(len(s) for s in pairs.values()) == 4862
    wrong = {"spam": "ham", "ham": "spam"}
    for name in ("train", "validation", "test"):  # row for row: the same messages in the same splits
        conversations = chat[name]["messages"]
        assert pairs[name]["prompt"] == [[user] for user, _ in conversations]
        assert pairs[name]["chosen"] == [[answer] for _, answer in conversations]
        assert pairs[name]["rejected"] == [[{"role": "assistant", "content": wrong[answer["content"]]}]
                                           for _, answer in conversations]
    assert pairs["train"][0]["prompt"][0]["content"].endswith(builtins.SPAM_QUESTION)


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


def test_bad_json_line_names_the_file_and_the_line(tmp_path):
    """pyarrow counts rows within the block it read ("row 0" of a later block): the file's own line is named."""
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": "x"}\n{not json\n')
    check("d.jsonl: line 2 is not valid JSON", tmp_path / "d.jsonl")
    rows = [f'{{"text": "message {n}", "label": "{["ham", "spam"][n % 2]}"}}\n' for n in range(5000)]
    rows[4100] = '{"text": "broken, "label": "ham"}\n'
    (tmp_path / "long.jsonl").write_text("".join(rows))
    check("long.jsonl: line 4101 is not valid JSON (Expecting ',' delimiter at column 20)", tmp_path / "long.jsonl")
    rows[4100] = "[1, 2]\n"  # valid JSON, and no row
    (tmp_path / "list.jsonl").write_text("".join(rows))
    check("list.jsonl: line 4101 is a JSON list, not an object (a row)", tmp_path / "list.jsonl")


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


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


@pytest.mark.parametrize("value, words", [(7, "integers"), (["a", "b"], "lists"), ({"a": 1}, "objects")])
def test_text_column_of_another_type_is_refused(tmp_path, value, words):
    # A list of words would reach the tokenizer as pre-split text and train on it, silently.
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": value, "label": l} for _, l in ROWS])
    with pytest.raises(UserError, match=f"column `text` \\(text\\) holds {words}"):
        load(path)


def test_text_pair_column_of_another_type_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t, "q": 1.5, "label": l} for t, l in ROWS])
    with pytest.raises(UserError, match="column `q` \\(text pair\\) holds decimal numbers"):
        load(path, text_pair_column="q")


@pytest.mark.parametrize("value, words", [([1], "lists"), ({"x": 1}, "objects")])
def test_label_column_of_lists_or_dicts_is_refused(tmp_path, value, words):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t, "label": value} for t, _ in ROWS])
    with pytest.raises(UserError, match=f"label column `label` holds {words}"):
        load(path)


def test_fractional_labels_are_a_regression_target(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t, "label": i * 0.25} for i, (t, _) in enumerate(ROWS)])
    with pytest.raises(UserError, match="holds numbers like 0.25: a regression target"):
        load(path)


def test_whole_float_and_boolean_labels_are_classes(tmp_path):
    floats = write_jsonl(tmp_path / "f.jsonl", [{"text": t, "label": float(l == "spam")} for t, l in ROWS])
    bools = write_jsonl(tmp_path / "b.jsonl", [{"text": t, "label": l == "spam"} for t, l in ROWS])
    for path, names in ((floats, ["0", "1"]), (bools, ["false", "true"])):
        splits = load(path).splits
        assert splits["train"].features["label"].names == names
        total = sum(sum(s["label"]) for s in splits.values())  # label 1 is spam in both
        assert total == sum(l == "spam" for _, l in ROWS)


def test_float_labels_with_a_skipped_empty_row(tmp_path):
    # Rows dropped by --skip-bad-rows are selected away, not gone from the Arrow table: not a NaN label.
    path = tmp_path / "d.csv"
    path.write_text("text,label\n" + "\n".join(f"row {i},{i % 2}.0" for i in range(18)) + "\nno label,\n")
    loaded = load(path, skip_bad_rows=True)
    assert loaded.skipped_rows == 1 and loaded.splits["train"].features["label"].names == ["0", "1"]


def test_one_class_training_data_is_refused_naming_the_class(tmp_path):
    # Loading is fine (evaluate scores a one-class file); building a classifier head for it is not.
    path = write_csv(tmp_path / "d.csv", [(t, "ham") for t, _ in ROWS])
    names = load(path).splits["train"].features["label"].names
    assert names == ["ham"]
    with pytest.raises(UserError, match="every training label is `ham` \\(one class\\)"):
        tasks.get("sequence-classification").build_model(None, names, None)


def test_one_column_for_two_roles_is_refused(tmp_path):
    with pytest.raises(UserError, match="column `text` is both the text column and the label column"):
        load(write_csv(tmp_path / "d.csv"), label_column="text")


def test_not_utf8_and_semicolons_are_not_sent_to_skip_bad_rows(tmp_path):
    latin = tmp_path / "latin.csv"
    latin.write_bytes("text,label\ncaf\xe9,ham\nok,spam\n".encode("latin-1"))
    latin_jsonl = tmp_path / "latin.jsonl"  # datasets reads it; the bytes would fail at the first string function
    latin_jsonl.write_bytes('{"text": "caf\xe9", "label": "ham"}\n{"text": "ok", "label": "spam"}\n'.encode("latin-1"))
    semi = write_csv(tmp_path / "semi.csv", sep=";")
    for path, needle in ((latin, "is not UTF-8 text"), (latin_jsonl, "is not UTF-8 text"),
                         (semi, "looks separated by semicolons")):
        for skip in (False, True):
            with pytest.raises(UserError, match=needle) as err:
                load(path, skip_bad_rows=skip)
            assert "--skip-bad-rows" not in str(err.value)


def test_pipes_devices_and_folders_where_a_file_belongs(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.csv")
    with pytest.raises(UserError, match="is not a regular file"):  # would block forever if opened
        load(tmp_path / "pipe.csv")
    with pytest.raises(UserError, match="is not a regular file"):
        load("/dev/zero")
    (tmp_path / "folder").mkdir()
    with pytest.raises(UserError, match="--validation-file .*folder is a folder"):
        load(write_csv(tmp_path / "d.csv"), validation_file=str(tmp_path / "folder"))


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root reads files whatever their mode")
def test_unreadable_data_file_is_named(tmp_path):
    path = write_csv(tmp_path / "d.csv")
    path.chmod(0)
    with pytest.raises(UserError, match="cannot be read \\(permission denied\\)"):
        load(path)


def test_datasets_error_log_is_silenced(tmp_path, capsys):
    import logging

    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a", "label": "x"}\n{"text": oops\n')
    handler = logging.StreamHandler()  # what a user's terminal would get from datasets' logger
    logging.getLogger("datasets").addHandler(handler)
    try:
        with pytest.raises(UserError, match="line 2 is not valid JSON"):
            load(path)
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    assert "Failed to load JSON" not in capsys.readouterr().err


def test_skip_bad_rows_skips_undecodable_images_and_counts_them(tmp_path):
    import numpy as np
    from PIL import Image

    rows = ["image,label"]
    for i in range(10):
        Image.fromarray(np.full((8, 8, 3), i * 20, dtype=np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,{'ab'[i % 2]}")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG garbage")
    (tmp_path / "data.csv").write_text("\n".join(rows + ["broken.png,a", "missing.png,b"]) + "\n")
    config = TrainConfig(task="image-classification", data=str(tmp_path / "data.csv"), skip_bad_rows=True,
                         model="vit:image_size=8,patch_size=4,hidden_size=16,num_hidden_layers=1,"
                               "num_attention_heads=2,intermediate_size=16")
    loaded = tasks.get(config.task).load_data(config)
    assert loaded.skipped_rows == 2
    kept = [p for split in loaded.splits.values() for p in split["image"]]
    assert sorted(kept) == sorted(f"{i}.png" for i in range(10))
    # Without the flag nothing is decoded here: preprocessing names the first bad file (test_image.py).
    unskipped = tasks.get(config.task).load_data(TrainConfig(**{**config.to_dict(), "skip_bad_rows": False}))
    assert unskipped.skipped_rows == 0 and sum(len(s) for s in unskipped.splits.values()) == 12


def test_an_unclosed_quote_is_named_not_sent_to_skip_bad_rows(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('text,label\nok,ham\n"never closed,spam\nmore,ham\n')
    with pytest.raises(UserError, match="has a quote that is never closed") as err:
        load(path)
    assert "--skip-bad-rows" not in str(err.value)


@pytest.mark.parametrize("seed", [0, 42])
def test_the_stratified_split_holds_out_the_rows_datasets_would(seed):
    """sources.stratified_split reads the labels at once; its parts are datasets' own train_test_split's,
    row for row, on a whole dataset and on one already selected from (the second split), and it refuses
    what datasets refuses (a class of one example), which _split answers with an unstratified split."""
    import random

    from datasets import ClassLabel, Dataset

    rng = random.Random(seed)
    rows = 301
    data = Dataset.from_dict({"text": [f"row {i}" for i in range(rows)],
                              "label": [rng.choice([0] * 8 + [1] * 3 + [2]) for _ in range(rows)]})
    data = data.cast_column("label", ClassLabel(names=["a", "b", "c"]))
    for dataset in (data, data.select(range(0, rows, 2))):
        for size in (0.1, 0.1 / 0.9, 0.25):
            expected = dataset.train_test_split(test_size=size, stratify_by_column="label", seed=seed)
            held, rest = sources.stratified_split(dataset, size, seed)
            assert list(held["text"]) == list(expected["test"]["text"])
            assert list(rest["text"]) == list(expected["train"]["text"])
    single = Dataset.from_dict({"text": ["x"] * 10, "label": [0] * 9 + [1]})
    single = single.cast_column("label", ClassLabel(names=["a", "b"]))
    with pytest.raises(ValueError):
        single.train_test_split(test_size=0.2, stratify_by_column="label", seed=seed)
    with pytest.raises(ValueError):
        sources.stratified_split(single, 0.2, seed)


def test_train_help_names_every_built_in_data_set():
    """config.py names the built-ins without importing data/ (its help answers without heavy libraries)."""
    from effitrain import config
    from effitrain.data import builtins

    assert config.BUILTIN_DATA == tuple(builtins.BUILTINS)
    data_help = next(f for f in config.fields() if f.name == "data").metadata["help"]
    assert all(name in data_help for name in builtins.BUILTINS)
