"""What `effitrain predict --input` reads: a JSONL/JSON/CSV/TSV table of inputs, one media file, or a
folder of media files. Standard library only: prediction inputs are small, and errors name the row."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from effitrain.errors import UserError

TABLES = (".jsonl", ".json", ".csv", ".tsv")
IMAGES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
AUDIO = (".wav", ".flac", ".ogg", ".mp3")


def existing(path: str, fix: str) -> Path:
    """The --input path, refused when missing or empty."""
    found = Path(path).expanduser()
    if not found.exists():
        raise UserError(f"--input {path} does not exist", fix)
    if found.is_file() and found.stat().st_size == 0:
        raise UserError(f"--input {path} is empty", fix)
    return found


def read_table(path: Path, fix: str) -> list[dict]:
    """The rows of a JSONL, JSON (an array of objects, or JSON lines), CSV or TSV file, as dicts."""
    suffix = path.suffix.lower()
    if path.is_dir():
        raise UserError(f"--input {path} is a folder", fix)
    if suffix not in TABLES:
        raise UserError(f"--input {path}: unknown file type `{path.suffix}`", fix)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"--input {path} is not UTF-8 text", fix) from None
    if suffix in (".csv", ".tsv"):
        rows = list(csv.DictReader(text.splitlines(), delimiter="\t" if suffix == ".tsv" else ","))
    else:
        rows = _json_rows(path, text, fix)
    if not rows:
        raise UserError(f"--input {path} has no rows", fix)
    return rows


def _json_rows(path: Path, text: str, fix: str) -> list[dict]:
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"--input {path} is not valid JSON ({err.msg} at line {err.lineno})", fix) from None
        numbered = list(enumerate(rows, 1))
    else:
        numbered = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((number, json.loads(line)))
            except json.JSONDecodeError:
                raise UserError(f"--input {path} line {number} is not JSON", fix) from None
    for number, row in numbered:
        if not isinstance(row, dict):
            raise UserError(f"--input {path} line {number} is not a JSON object", fix)
    return [row for _, row in numbered]


def string_field(path: Path, rows: list[dict], names: tuple[str, ...], fix: str, required: bool = True) -> list:
    """Each row's value of the first of `names` that the rows have (e.g. `path`, else `image`); None
    where a row lacks an optional field."""
    name = next((n for n in names if any(n in row for row in rows)), None)
    if name is None:
        if not required:
            return [None] * len(rows)
        wanted = " or ".join(f"`{n}`" for n in names)
        raise UserError(f"--input {path} has no {wanted} field (it has: {', '.join(rows[0]) or 'nothing'})", fix)
    values = []
    for number, row in enumerate(rows, 1):
        value = row.get(name)
        if not isinstance(value, str) or (required and not value.strip()):
            if not required and value in (None, ""):
                values.append(None)
                continue
            raise UserError(f"--input {path} row {number} has no text in `{name}`", fix)
        values.append(value)
    return values


def media_files(given: str, extensions: tuple[str, ...], columns: tuple[str, ...], kind: str) -> list[str]:
    """The files an --input names: itself (a media file), the media files of a folder (sorted by name),
    or the `columns` of a table, relative paths resolved against the table's folder."""
    fix = (f"pass a{'n' if kind[0] in 'aeiou' else ''} {kind} file ({', '.join(extensions)}), a folder of them, or a "
           f"JSONL/CSV file with a {' or '.join(f'`{c}`' for c in columns)} column of file paths")
    path = existing(given, fix)
    if path.is_dir():
        files = sorted(str(p) for p in path.iterdir() if p.is_file() and p.suffix.lower() in extensions)
        if not files:
            raise UserError(f"--input {given} is a folder without {kind} files ({', '.join(extensions)})", fix)
        return files
    if path.suffix.lower() in extensions:
        return [str(path)]
    if path.suffix.lower() not in TABLES:
        raise UserError(f"--input {given}: unknown file type `{path.suffix}` for {kind}", fix)
    rows = read_table(path, fix)
    return [value if Path(value).is_absolute() else str(path.parent / value)
            for value in string_field(path, rows, columns, fix)]
