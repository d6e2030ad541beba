"""The tokens of a ``--dataset``, written once to a memory-mapped file and reused.

`load_tokens` tokenizes every document of the files (`_text_files.read_documents`), one at a
time, with an end-of-text id after each, and appends them to ``tokens.bin`` in a folder of
``cache_root`` named by a key: a hash of the files' absolute paths, sizes and modification
times, the tokenizer's identity (`tokenizer_identity`) and the text field. A later run (or
``--resume``) with the same key maps that file instead of tokenizing again; a changed, added
or removed file, or another tokenizer, gives another key, so the tokens are rebuilt (and
the stale folders of ``cache_root`` removed). The corpus is never held in memory: documents
stream in, tokens stream out in chunks, and training reads the file through ``np.memmap``.

A cache folder is built under a temporary name and renamed when complete, so a run killed
while tokenizing leaves no half-written cache that a later run would trust, and processes of
one job that tokenize at once keep whichever finished first. If reading fails (a bad file,
see `DataFileError`) or ``check`` refuses the token count, everything this call created is
removed again.

Example:
  >>> import pathlib, tempfile
  >>> from models import ByteTokenizer
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (root / "a.txt").write_text("hi")
  >>> tokens = load_tokens([root / "a.txt"], ByteTokenizer(), "text", root / "cache")
  >>> tokens.ids.tolist(), tokens.documents, tokens.rebuilt
  ([104, 105, 257], 1, True)
  >>> load_tokens([root / "a.txt"], ByteTokenizer(), "text", root / "cache").rebuilt
  False
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from multimesh_flax.cli._text_files import read_documents
from multimesh_flax.cli.errors import RunOptionError

TOKENS = "tokens.bin"
INFO = "info.json"
_VERSION = 1  # of the cache's layout; part of the key
_CHUNK = 1 << 20  # tokens buffered before a write


@dataclasses.dataclass(frozen=True)
class Tokens:
    """A dataset's token ids, memory-mapped, and where they came from.

    Attributes:
        ids: every document's ids followed by the end-of-text id, in file order (read-only).
        documents: how many documents there are.
        key: the cache key (see the module docstring).
        folder: the cache folder holding ``tokens.bin``.
        rebuilt: whether this call tokenized (``False``: the cache was reused).
    """

    ids: np.ndarray
    documents: int
    key: str
    folder: Path
    rebuilt: bool


def tokenizer_identity(tokenizer: Any) -> str:
    """What distinguishes ``tokenizer``'s ids: its class and settings, or its file's hash."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        return repr(tokenizer)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return f"{type(tokenizer).__name__}:{digest}:eos={tokenizer.eos_id}"


def cache_key(files: Sequence[Path], tokenizer: Any, text_field: str) -> str:
    """The key of ``files`` tokenized by ``tokenizer``: changes when any of them changes."""
    stats = [(str(f.absolute()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    text = json.dumps([_VERSION, stats, tokenizer_identity(tokenizer), text_field])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def load_tokens(
    files: Sequence[Path],
    tokenizer: Any,
    text_field: str,
    cache_root: Path,
    check: Callable[[int], None] = lambda count: None,
) -> Tokens:
    """The tokens of ``files``, from ``cache_root`` if cached under their key, else built.

    Args:
        files: the dataset's files (`_text_files.find_files`).
        tokenizer: ``encode(text, bos=, eos=)`` and ``eos_id``, ``vocab_size``.
        text_field: the JSONL field or Parquet column holding the text.
        cache_root: the folder of cache folders (created when needed).
        check: called with the token count before anything is kept; raises to refuse it.

    Raises:
        DataFileError: a file cannot be read as documents (nothing is left behind).
        RunOptionError: the tokenizer has no end-of-text id to separate documents.
    """
    if getattr(tokenizer, "eos_id", None) is None:
        raise RunOptionError(
            "The run's tokenizer has no end-of-text id (`eos_token_id`) to separate "
            "`--dataset` documents. Add `eos_token_id` to the `--init-from` folder's "
            "config.json."
        )
    key = cache_key(files, tokenizer, text_field)
    folder = cache_root / key
    if (folder / INFO).is_file():
        tokens = _open(folder, key, rebuilt=False)
        check(tokens.ids.size)
        return tokens
    return _build(files, tokenizer, text_field, cache_root, key, check)


def _open(folder: Path, key: str, *, rebuilt: bool) -> Tokens:
    info = json.loads((folder / INFO).read_text())
    ids = np.memmap(folder / TOKENS, dtype=info["dtype"], mode="r", shape=(info["count"],))
    return Tokens(ids, info["documents"], key, folder, rebuilt)


def _build(
    files: Sequence[Path],
    tokenizer: Any,
    text_field: str,
    cache_root: Path,
    key: str,
    check: Callable[[int], None],
) -> Tokens:
    created = _missing_dirs(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_root))
    scratch.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as the run
    try:
        info = _write(files, tokenizer, text_field, scratch / TOKENS)
        check(info["count"])
        (scratch / INFO).write_text(json.dumps({**info, "key": key}))
        _commit(scratch, cache_root / key)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty: another process may be building
        raise
    _prune(cache_root, keep=key)
    return _open(cache_root / key, key, rebuilt=True)


def _write(files: Sequence[Path], tokenizer: Any, field: str, path: Path) -> dict[str, Any]:
    """Streams every document's ids (end-of-text after each) into ``path``."""
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32)
    count = documents = 0
    buffer: list[np.ndarray] = []
    buffered = 0
    with path.open("wb") as out:
        for file in files:
            for text in read_documents(file, field):
                ids = tokenizer.encode(text, bos=False, eos=True)
                buffer.append(ids.astype(dtype))
                buffered += ids.size
                documents += 1
                if buffered >= _CHUNK:
                    count += _flush(buffer, out)
                    buffered = 0
        count += _flush(buffer, out)
    return {"count": count, "documents": documents, "dtype": dtype.name}


def _flush(buffer: list[np.ndarray], out: Any) -> int:
    if not buffer:
        return 0
    chunk = np.concatenate(buffer)
    chunk.tofile(out)
    buffer.clear()
    return chunk.size


def _commit(scratch: Path, folder: Path) -> None:
    """Renames the finished ``scratch`` to ``folder``; keeps a ``folder`` another process made."""
    try:
        os.rename(scratch, folder)
    except OSError:
        if not (folder / INFO).is_file():
            raise
        shutil.rmtree(scratch, ignore_errors=True)


def _prune(cache_root: Path, keep: str) -> None:
    """Removes the cache folders of other keys (stale: their files changed)."""
    for folder in cache_root.iterdir():
        if folder.name != keep and not folder.name.startswith(".building-"):
            shutil.rmtree(folder, ignore_errors=True)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, outermost first."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    return missing[::-1]
