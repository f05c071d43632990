"""Where examples come from: built-ins, the user's files and folders, or the local Hugging Face cache.

Every source ends as train/validation/test splits with canonical column names (`text`, `text_pair`,
`image`, `audio`, `label`), the label a ClassLabel whose names come from the training split."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from effitrain.data.builtins import BUILTINS
from effitrain.errors import UserError

FILE_KINDS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class Loaded:
    splits: object  # datasets.DatasetDict: train / validation / test
    base_dir: Path | None  # where relative image and audio paths start
    skipped_rows: int


def locate(source: str, flag: str = "--data") -> tuple[str, Path | None]:
    """What kind of source it is (builtin, folder, file, hub), refusing what cannot be read; no library
    is imported, so that a wrong path answers before anything heavy loads."""
    if source in BUILTINS:
        return "builtin", None
    path = Path(source).expanduser()
    if path.exists() and not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise UserError(f"{flag} {path} cannot be read (permission denied)",
                        "make it readable (chmod u+r, and u+x for a folder), or run as its owner")
    if path.is_dir():
        if flag != "--data":
            raise UserError(f"{flag} {path} is a folder", "pass one data file (.csv, .tsv, .json, .jsonl, .parquet)")
        return "folder", path
    if path.exists() and not path.is_file():  # a FIFO or a device would block or never end
        raise UserError(f"{flag} {path} is not a regular file (a pipe, socket or device)",
                        "save the data to a file and pass its path")
    if path.is_file():
        if path.suffix.lower() not in FILE_KINDS:
            raise UserError(f"{flag} {path}: unknown file type `{path.suffix}`",
                            f"use one of {', '.join(FILE_KINDS)} or a folder from save_to_disk")
        return "file", path
    if "/" in source and not source.startswith((".", "/", "~")):
        return "hub", None
    raise UserError(f"{flag} {source}: no such file, folder or built-in data set",
                    f"pass a file path or one of: {', '.join(BUILTINS)}")


def read(source: str, skip_bad_rows: bool, flag: str = "--data") -> tuple[dict, Path | None, int]:
    """{split name: Dataset} as the source holds them ("all" when it is not split yet), the folder that
    relative paths start from, and how many unreadable rows were skipped."""
    kind, path = locate(source, flag)
    if kind == "builtin":
        return BUILTINS[source](), None, 0
    if kind == "folder":
        return _read_saved(path, flag), path, 0
    if kind == "file":
        data, skipped = _read_file(path, skip_bad_rows)
        return {"all": data}, path.parent, skipped
    return _read_hub_cache(source), None, 0


def _read_file(path: Path, skip_bad_rows: bool):
    import pandas as pd
    from datasets import Dataset, load_dataset

    kind = FILE_KINDS[path.suffix.lower()]
    if path.stat().st_size == 0:
        raise UserError(f"data file {path} is empty", "pass a file with a header and rows")
    if kind == "csv":
        # pandas, not datasets' CSV builder: it names the bad line, and can count the lines it skips.
        bad_lines = []

        def on_bad_line(fields):
            bad_lines.append(fields)
            return None

        separator = "\t" if path.suffix.lower() == ".tsv" else ","
        try:
            frame = pd.read_csv(path, sep=separator, engine="python",
                                on_bad_lines=on_bad_line if skip_bad_rows else "error")
        except UnicodeDecodeError as err:  # --skip-bad-rows cannot help: the whole file has another encoding
            raise _not_utf8(path, err)
        except (pd.errors.ParserError, pd.errors.EmptyDataError) as err:
            if "unexpected end of data" in str(err):  # skipping cannot help: the rest of the file is one field
                raise UserError(f"data file {path} has a quote that is never closed (from there on the file "
                                "reads as one field)", 'close that quote; write a quote inside a field as ""')
            raise UserError(f"data file {path} cannot be read: {_first_line(err)}",
                            "fix that row (quote fields holding the separator), or pass --skip-bad-rows")
        _check_separator(path, frame, separator)
        return Dataset.from_pandas(frame, preserve_index=False), len(bad_lines)
    try:
        with _datasets_silent():
            data = load_dataset(kind, data_files=str(path), split="train")
        _check_utf8(path, data)
        return data, 0
    except UserError:
        raise
    except Exception as err:  # the builders raise many types (ArrowInvalid, DatasetGenerationError, ...)
        cause = err.__cause__ or err
        if isinstance(cause, UnicodeDecodeError):
            raise _not_utf8(path, cause)
        line = _first_bad_json_line(path) if kind == "json" else None
        if line is not None:  # pyarrow counts rows within a block it read: "row 0" of a later block
            number, problem = line
            raise UserError(f"data file {path}: line {number} {problem}",
                            "fix that line (one JSON object per line), or remove it")
        raise UserError(f"data file {path} cannot be read as {kind}: {_first_line(cause)}",
                        f"check that every line is valid {kind}")


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    """(number, what is wrong) of the first non-blank line of a JSON Lines file that is not one JSON object (a
    row); None where every line is one, or where the file is not line by line (a .json document over several
    lines whose first line does not parse alone)."""
    import json

    try:
        with open(path, encoding="utf-8") as lines:
            for number, text in enumerate(lines, 1):
                if not text.strip():
                    continue
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as err:
                    if number == 1 and path.suffix.lower() != ".jsonl":
                        return None
                    return number, f"is not valid JSON ({err.msg} at column {err.colno})"
                if not isinstance(value, dict):
                    kind = {"str": "string", "int": "number", "float": "number"}.get(type(value).__name__,
                                                                                     type(value).__name__)
                    return number, f"is a JSON {kind}, not an object (a row)"
    except (OSError, UnicodeDecodeError):
        return None
    return None


def _not_utf8(path: Path, err: UnicodeDecodeError | None) -> UserError:
    where = "" if err is None else f" (first bad byte {err.object[err.start:err.start + 1]!r})"
    return UserError(f"data file {path} is not UTF-8 text{where}",
                     "save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`)")


def _check_utf8(path: Path, data) -> None:
    """datasets' JSON reader lets bytes that are not UTF-8 into string columns (nested ones too: a
    conversation's messages), where the first string function fails on them: checked once here."""
    import pyarrow as pa

    for name in data.column_names:
        column = data.data.column(name)
        if _holds_text(column.type):
            try:
                column.validate(full=True)
            except pa.ArrowInvalid:
                raise _not_utf8(path, None) from None


def _check_separator(path: Path, frame, separator: str) -> None:
    """One column whose name holds another separator: the file is not separated the way its name says."""
    if len(frame.columns) != 1:
        return
    header = str(frame.columns[0])
    other = next((sep for sep in (";", "\t", ",", "|") if sep != separator and sep in header), None)
    if other is not None:
        name = {"\t": "tabs", ";": "semicolons", ",": "commas", "|": "bars"}[other]
        wanted = "tab-separated with a .tsv name" if separator == "\t" else "comma-separated"
        raise UserError(f"data file {path} looks separated by {name} (one column named `{header[:80]}`), "
                        f"but a {path.suffix} file is read as {wanted}",
                        "save it comma-separated as .csv, or tab-separated as .tsv")


@contextlib.contextmanager
def _datasets_silent():
    """datasets' builders log an ERROR line before raising; the UserError that follows says it in one line."""
    import logging

    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _read_saved(path: Path, flag: str = "--data") -> dict:
    from datasets import Dataset, DatasetDict, load_from_disk

    if not any((path / name).is_file() for name in ("dataset_dict.json", "dataset_info.json", "state.json")):
        raise UserError(f"{flag} {path} is a folder but not one written by datasets' save_to_disk",
                        "pass a data file, or a folder from Dataset.save_to_disk / DatasetDict.save_to_disk")
    try:
        with _datasets_silent():
            data = load_from_disk(str(path))
    except (OSError, ValueError, KeyError, TypeError) as err:  # a damaged or hand-made folder
        if isinstance(err, PermissionError):
            raise
        raise UserError(f"{flag} {path} cannot be read by datasets' load_from_disk: {_first_line(err)}",
                        "save it again with save_to_disk, or pass a data file")
    if isinstance(data, Dataset):
        return {"all": data}
    return _named_splits(DatasetDict(data), str(path))


def _read_hub_cache(name: str) -> dict:
    """A data set repo already in the local hub cache: its snapshot folder, loaded by datasets (which
    infers the builder from the files). datasets cannot resolve a repo id offline by itself."""
    from datasets import load_dataset
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(name, repo_type="dataset", local_files_only=True)
        with _datasets_silent():
            return _named_splits(load_dataset(folder), name)
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"--data {name} is not a local file nor a data set in the Hugging Face cache "
                        f"({_first_line(err)})", "pass a file path, or download the data set where there is internet")


def _named_splits(data, where: str) -> dict:
    renames = {"train": "all", "valid": "validation", "dev": "validation", "eval": "validation"}
    splits = {renames.get(name, name): split for name, split in data.items()}
    if "all" not in splits:
        raise UserError(f"{where} has no `train` split (it has {', '.join(data)})", "save a train split with it")
    return splits


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def column_flag(canonical: str) -> str | None:
    """The flag that names the data's column for `canonical` (--text-column, ...); None for the columns read
    by their own name (messages, prompt, completion, chosen, rejected)."""
    from effitrain import config

    name = f"{canonical}_column"
    return config.flag(name) if name in {field.name for field in config.fields()} else None


def select_columns(data, columns: dict[str, str], where: str):
    for canonical, user in columns.items():
        other = next((c for c, u in columns.items() if u == user and c != canonical), None)
        if other is not None:  # e.g. --label-column text: one column cannot be both the input and the label
            first, second = (flag.replace("_", "-") for flag in (canonical, other))
            flags = [flag for flag in (column_flag(other), column_flag(canonical)) if flag]
            raise UserError(f"{where}: column `{user}` is both the {first} column and the {second} column",
                            f"pass {' or '.join(flags)} naming another column")
    missing = [user for user in columns.values() if user not in data.column_names]
    if missing:
        canonical = next(c for c, user in columns.items() if user == missing[0])
        flag = column_flag(canonical)
        raise UserError(f"{where} has no column `{missing[0]}` (columns: {', '.join(data.column_names)})",
                        f"pass {flag} with one of them" if flag else
                        f"give it a `{canonical}` column, as the training data has")
    data = data.select_columns(list(columns.values()))
    return data.rename_columns({user: canonical for canonical, user in columns.items() if user != canonical})


def drop_bad_rows(data, where: str, skip: bool):
    """Rows with a missing or blank value are an error naming the row, or skipped and counted.
    Checked on the Arrow columns, so images are not decoded for it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    bad = None
    for name in data.column_names:
        column = data.data.column(name)
        missing = column.is_null()
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            missing = pc.or_(missing, pc.equal(pc.utf8_trim_whitespace(column), ""))
        missing = missing.fill_null(True)
        first = pc.index(missing, True).as_py()
        if first >= 0 and not skip:
            count = pc.sum(missing).as_py()
            raise UserError(f"{where}: row {first + 1} has no value in column `{name}` ({count} such rows)",
                            "fill those rows, or pass --skip-bad-rows to leave them out")
        bad = missing if bad is None else pc.or_(bad, missing)
    count = pc.sum(bad).as_py() or 0
    if count:
        import numpy as np

        data = data.select(np.flatnonzero(~bad.to_numpy(zero_copy_only=False)))
    return data, count


# The Arrow types each canonical column may hold (the label column is checked by labels_as_classes).
def _is_text(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _holds_text(t) -> bool:
    """A string type, or a list or struct with one somewhere inside."""
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _holds_text(t.value_type)
    if pa.types.is_struct(t):
        return any(_holds_text(field.type) for field in t)
    return _is_text(t)


def _is_image(t) -> bool:
    import pyarrow as pa

    return _is_text(t) or (pa.types.is_struct(t) and {"bytes", "path"} & {f.name for f in t})


_EXPECTED = {"text": (_is_text, "text"), "text_pair": (_is_text, "text"), "audio": (_is_text, "file paths"),
             "image": (_is_image, "images or file paths")}


def _kind(t) -> str:
    """An Arrow type in the user's words."""
    import pyarrow as pa

    for test, words in ((pa.types.is_boolean, "true/false values"), (pa.types.is_integer, "integers"),
                        (pa.types.is_floating, "decimal numbers"), (pa.types.is_struct, "objects (dicts)"),
                        (pa.types.is_list, "lists"), (pa.types.is_large_list, "lists"), (pa.types.is_map, "maps"),
                        (pa.types.is_binary, "raw bytes"), (pa.types.is_temporal, "dates or times"),
                        (_is_text, "text")):
        if test(t):
            return words
    return f"values of type {t}"


def check_types(data, columns: dict[str, str], where: str) -> None:
    """Each input column holds what its task reads: text as strings, images as images or paths, audio as
    paths. A number or a list where text belongs would reach the tokenizer (a traceback) or, worse, be
    taken as pre-split words."""
    for canonical, (accepts, wanted) in _EXPECTED.items():
        if canonical not in data.column_names:
            continue
        t = data.data.column(canonical).type
        if not accepts(t):
            raise UserError(f"{where}: column `{columns[canonical]}` ({canonical.replace('_', ' ')}) holds {_kind(t)}, "
                            f"not {wanted}", f"pass {column_flag(canonical)} naming a column of {wanted}, or convert "
                            "that column")


def labels_as_classes(data, user_column: str, where: str):
    """The label column as class labels: strings, integers and ClassLabels as they are; true/false as
    the strings "false"/"true"; decimal numbers only when all are whole (1.0 -> 1). Anything else
    (fractions: a regression target; lists, dicts) is refused with what it is."""
    import numpy as np
    import pyarrow as pa
    from datasets import ClassLabel, Value

    if isinstance(data.features["label"], ClassLabel):
        return data
    t = data.data.column("label").type
    if _is_text(t) or pa.types.is_integer(t):
        return data
    if pa.types.is_boolean(t):
        return data.cast_column("label", Value("string"))
    if pa.types.is_floating(t):
        values = np.asarray(data["label"], dtype=np.float64)  # not data.data: rows may be selected
        fraction = values[~np.isfinite(values) | (values != np.round(values))]
        if len(fraction) == 0:
            return data.cast_column("label", Value("int64"))
        raise UserError(f"{where}: label column `{user_column}` holds numbers like {fraction[0]:g}: a regression "
                        "target, and effitrain trains classifiers only", "give each row a class (a name or a whole "
                        "number), e.g. bin the values into ranges, or pass --label-column naming a class column")
    raise UserError(f"{where}: label column `{user_column}` holds {_kind(t)}, not class labels",
                    "give each row one label, a name or a whole number (multi-label data is not supported)")


def label_names(data) -> list[str]:
    """A ClassLabel's own names (built-ins keep their order), else the sorted distinct values."""
    from datasets import ClassLabel

    feature = data.features["label"]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = set(data.unique("label"))
    return [str(v) for v in sorted(values)]  # ints sort as numbers, before becoming names


def encode_labels(data, names: list[str], where: str):
    """The label as a ClassLabel with `names`; a label outside them is an error: the model could never
    predict it."""
    from datasets import ClassLabel, Value

    feature = data.features["label"]
    if isinstance(feature, ClassLabel):
        if list(feature.names) == names:
            return data
        old = feature.names
        data = data.map(lambda batch: {"label": [old[i] for i in batch["label"]]},
                        batched=True).cast_column("label", Value("string"))
    data = data.cast_column("label", Value("string"))
    unknown = sorted(set(data.unique("label")) - set(names))
    if unknown:
        raise UserError(f"{where}: label `{unknown[0]}` is not in the training data "
                        f"(training labels: {', '.join(names[:20])})",
                        "add examples of it to the training data, or drop those rows")
    return data.cast_column("label", ClassLabel(names=names))


def load(config, columns, undecodable=None, bad_rows=None) -> Loaded:
    """Read, pick and rename the task's `columns` (canonical name -> the user's column; or a function of
    the data's column names and where they come from, giving them), check rows, encode labels, split, and
    cap sizes. `undecodable(data, base_dir)`: with --skip-bad-rows, the indices of rows whose image or
    audio file does not decode (left out and counted, before splitting). `bad_rows(data, where, skip)`:
    the task's own check of rows (canonical columns): it refuses the first bad row, or with skip returns
    the indices of all of them, left out and counted."""
    from datasets import DatasetDict

    raw, base_dir, skipped = read(config.data, config.skip_bad_rows)
    where = {name: f"--data {config.data}" + ("" if name == "all" else f" ({name} split)") for name in raw}
    if callable(columns):
        columns = columns(raw["all"].column_names, where["all"])
    for flag, split, path in (("--validation-file", "validation", config.validation_file),
                              ("--test-file", "test", config.test_file)):
        if path:
            data, _, extra = read(path, config.skip_bad_rows, flag)
            raw[split], where[split] = data["all"], f"{flag} {path}"
            skipped += extra
    prepared = {}
    for name, data in raw.items():
        if len(data) == 0:
            raise UserError(f"{where[name]} has no rows", "pass data with at least one example per split")
        data = select_columns(data, columns, where[name])
        data, dropped = drop_bad_rows(data, where[name], config.skip_bad_rows)
        if config.skip_bad_rows and undecodable is not None:
            bad = set(undecodable(data, base_dir))
            if bad:
                data, dropped = data.select([i for i in range(len(data)) if i not in bad]), dropped + len(bad)
        if bad_rows is not None:
            bad = set(bad_rows(data, where[name], config.skip_bad_rows))
            if bad:
                data, dropped = data.select([i for i in range(len(data)) if i not in bad]), dropped + len(bad)
        if len(data) == 0:
            raise UserError(f"{where[name]} has no usable rows", "pass data with at least one complete row")
        check_types(data, columns, where[name])
        if "label" in columns:
            data = labels_as_classes(data, columns["label"], where[name])
        prepared[name], skipped = data, skipped + dropped
    if "label" in columns:
        names = label_names(prepared["all"])
        prepared = {name: encode_labels(data, names, where[name]) for name, data in prepared.items()}
    splits = _split(prepared, config)
    return Loaded(limit(DatasetDict(splits), config.max_train_samples, config.max_eval_samples), base_dir, skipped)


def _split(prepared: dict, config) -> dict:
    """Hold out test and validation from `all` where the source did not bring them: stratified by
    label when every class has at least two examples, by seed."""
    rest, splits, held_out = prepared["all"], {}, 0.0
    for name, share in (("test", config.test_split), ("validation", config.validation_split)):
        if name in prepared:
            splits[name] = prepared[name]
            continue
        if len(rest) < 3:
            raise UserError(f"--data {config.data} has {len(prepared['all'])} rows, too few to split",
                            "pass more data, or --validation-file and --test-file")
        size = share / (1 - held_out)
        try:
            if "label" not in rest.column_names:
                raise ValueError("nothing to stratify by")
            held, rest = stratified_split(rest, size, config.seed)
        except ValueError:  # a class with a single example, or fewer held-out rows than classes
            parts = rest.train_test_split(test_size=size, seed=config.seed)
            held, rest = parts["test"], parts["train"]
        splits[name], held_out = held, held_out + share
    return {"train": rest, "validation": splits["validation"], "test": splits["test"]}


def stratified_split(data, test_size: float, seed: int):
    """(held out, rest): the rows of datasets' `train_test_split(test_size=test_size, stratify_by_column=
    "label", seed=seed)`, by its own index generator with its sizes and seeding, and the labels read as one
    column (datasets reads them a row at a time: 0.2-0.3 s a split for SMS spam, run after run). Raises
    ValueError where datasets' stratification would."""
    import math

    import numpy as np
    from datasets.utils.stratify import stratified_shuffle_split_generate_indices

    rows = len(data)
    held = math.ceil(test_size * rows)
    labels = np.asarray(data.select_columns(["label"]).with_format("numpy")[:]["label"])
    kept, held_out = next(stratified_shuffle_split_generate_indices(labels, rows - held, held,
                                                                    rng=np.random.default_rng(seed)))
    return data.select(held_out), data.select(kept)


def limit(splits, max_train: int | None, max_eval: int | None):
    """Keep the first N of each split (splits are already shuffled by the seeded split)."""
    from datasets import DatasetDict

    def head(ds, n):
        return ds if n is None or n >= len(ds) else ds.select(range(n))

    return DatasetDict(train=head(splits["train"], max_train), validation=head(splits["validation"], max_eval),
                       test=head(splits["test"], max_eval))
