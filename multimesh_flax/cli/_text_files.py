"""The documents of ``mmflax train --dataset PATH``: which files, and the texts in them.

`find_files` turns ``PATH`` into the sorted list of files it names: the file itself, or every
``.txt``, ``.jsonl`` and ``.parquet`` file under a folder (recursively, in path order).
`read_documents` yields the documents of one file, one string at a time, so a corpus larger
than memory is never held whole:

* ``.txt``: the whole file is one document (UTF-8).
* ``.jsonl``: one JSON object per line, the document in its ``text_field`` (blank lines are
  skipped).
* ``.parquet``: the column ``text_field``, read one row group at a time (needs ``pyarrow``).

Whatever cannot be read as text is refused with `DataFileError` naming the file (and the line
or row), what was expected, what was found and what to do: a missing path, a folder without
such files, an unreadable file, an empty one, bytes that are not UTF-8 (a binary file), a
JSONL line that is not an object with the text field, a Parquet file without the column.

Example:
  >>> import pathlib, tempfile
  >>> folder = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (folder / "a.jsonl").write_text('{"text": "one"}\\n\\n{"text": "two"}\\n')
  >>> _ = (folder / "b.txt").write_text("three")
  >>> files = find_files(folder)
  >>> [f.name for f in files]
  ['a.jsonl', 'b.txt']
  >>> [doc for f in files for doc in read_documents(f, "text")]
  ['one', 'two', 'three']
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from multimesh_flax.cli.errors import DataFileError

SUFFIXES = (".txt", ".jsonl", ".parquet")
"""The file types `find_files` and `read_documents` know."""


def find_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of ``--dataset`` ``path``: itself, or the known files under a folder.

    Raises:
        DataFileError: ``path`` does not exist, is a file of another type, or is a folder
            holding no ``.txt``, ``.jsonl`` or ``.parquet`` file.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise DataFileError(
                f"Expected `--dataset` folder '{path}' to hold .txt, .jsonl or .parquet files, "
                "found none. Point `--dataset` at a folder of such files, or at one file."
            )
        return files
    if not path.exists():
        raise DataFileError(
            f"`--dataset` '{path}' does not exist. Pass an existing .txt, .jsonl or .parquet "
            "file, or a folder of them."
        )
    if path.suffix not in SUFFIXES:
        raise DataFileError(
            f"Expected `--dataset` to be a .txt, .jsonl or .parquet file (or a folder of them), "
            f"got '{path}' ({path.suffix or 'no suffix'}). Convert it, or rename a plain text "
            "file to .txt."
        )
    return [path]


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Yields the documents of ``path`` (a file `find_files` returned), in file order.

    Raises:
        DataFileError: the file cannot be read, is empty, is not UTF-8 text, or (JSONL,
            Parquet) lacks ``text_field``.
    """
    reader = {".txt": _text, ".jsonl": _jsonl, ".parquet": _parquet}[path.suffix]
    empty = True
    for document in reader(path, text_field):
        empty = False
        yield document
    if empty:
        raise DataFileError(
            f"Expected text in '{path}', found an empty file (no document). Remove it from "
            "the `--dataset` folder, or fill it."
        )


def _unreadable(path: Path, error: OSError) -> DataFileError:
    return DataFileError(
        f"Cannot read `--dataset` file '{path}' ({error.strerror or error}). Check its "
        "permissions, or remove it from the folder."
    )


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise _unreadable(path, error) from None


def _decode(data: bytes, path: Path, where: str = "") -> str:
    """``data`` as UTF-8 text; a NUL byte or an invalid sequence means a binary file."""
    try:
        text = data.decode("utf-8")
        if "\x00" in text:  # valid UTF-8, but no text file holds it
            at = data.index(b"\x00")
            raise UnicodeDecodeError("utf-8", data, at, at + 1, "NUL byte")
        return text
    except UnicodeDecodeError as error:
        raise DataFileError(
            f"Expected UTF-8 text in '{path}'{where}, got byte 0x{data[error.start]:02x} at "
            f"offset {error.start}, so it looks binary. Convert it to UTF-8 text, or remove it "
            "from `--dataset`."
        ) from None


def _text(path: Path, _field: str) -> Iterator[str]:
    text = _decode(_read_bytes(path), path)
    if text.strip():
        yield text


def _jsonl(path: Path, field: str) -> Iterator[str]:
    try:
        handle = path.open("rb")
    except OSError as error:
        raise _unreadable(path, error) from None
    with handle:
        for number, raw in enumerate(handle, 1):
            line = _decode(raw, path, f" line {number}").strip()
            if line:
                yield _field_of(line, path, number, field)


def _field_of(line: str, path: Path, number: int, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataFileError(
            f"Expected a JSON object on line {number} of '{path}', got {line[:60]!r} "
            f"({error.msg}). Fix or delete that line."
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataFileError(
            f"Expected line {number} of '{path}' to be a JSON object with a string field "
            f"{field!r}, got {found}. Pass the field holding the text with `--text-field`, "
            "or fix that line."
        )
    return record[field]


def _parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        raise DataFileError(
            f"Cannot read '{path}' as a Parquet file ({error}). Check that it is one and "
            "complete, or remove it from `--dataset`."
        ) from None
    names = table.schema_arrow.names
    kind = table.schema_arrow.field(field).type if field in names else None
    if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataFileError(
            f"Expected a string column {field!r} in '{path}', got columns {names}. Pass the "
            "column holding the text with `--text-field`."
        )
    for group in range(table.num_row_groups):
        for text in table.read_row_group(group, columns=[field]).column(0).to_pylist():
            if text:  # a null or empty row holds no document
                yield text
