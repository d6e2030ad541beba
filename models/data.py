"""Data for the reference models: a byte-level tokenizer, a seeded batcher and a corpus.

* `ByteTokenizer` maps text to its UTF-8 bytes (ids 0-255) plus three special ids, BOS, EOS
  and PAD (256, 257, 258). Its `vocab_size` is 259 rounded up to a multiple of `multiple`
  (264 for the default 8), matching the ``*-tiny`` presets.
* `iterate_batches` cuts random windows out of one long token array and yields
  ``(inputs, targets)`` pairs, targets shifted by one token; the same seed gives the same
  batches.
* `load_corpus` reads a small public-domain text shipped in ``models/corpus/`` (see the README
  there); `CORPUS_NAMES` lists them.

Everything here is host-side NumPy; move batches to devices where you train.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from collections.abc import Iterator

import numpy as np

__all__ = ["CORPUS_NAMES", "ByteTokenizer", "iterate_batches", "load_corpus"]

CORPUS_NAMES = ("shakespeare_sonnets", "poe_poems")
"""Names accepted by `load_corpus`."""

_NUM_BYTES = 256


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids, plus BOS, EOS and PAD, in a vocabulary padded to `multiple`.

    Attributes:
        multiple: The vocabulary size is rounded up to a multiple of this (8 by default, so
            embedding tables tile evenly); the ids between 259 and `vocab_size` are unused.

    Example:
        >>> from models import ByteTokenizer
        >>> tok = ByteTokenizer()
        >>> tok.vocab_size, ByteTokenizer(multiple=128).vocab_size
        (264, 384)
        >>> ids = tok.encode("héllo", eos=True)
        >>> ids.tolist()
        [256, 104, 195, 169, 108, 108, 111, 257]
        >>> tok.decode(ids)
        'héllo'
    """

    multiple: int = 8

    bos_id = _NUM_BYTES
    eos_id = _NUM_BYTES + 1
    pad_id = _NUM_BYTES + 2

    def __post_init__(self):
        if not isinstance(self.multiple, int) or self.multiple < 1:
            raise ValueError(f"`multiple` must be a positive int, got {self.multiple!r}.")

    @property
    def vocab_size(self) -> int:
        """259 (bytes and specials) rounded up to a multiple of `multiple`."""
        used = self.pad_id + 1
        return -(-used // self.multiple) * self.multiple

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """Returns the int32 ids of `text`'s UTF-8 bytes, optionally framed by BOS/EOS."""
        body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        parts = [np.array([self.bos_id], np.int32)] if bos else []
        parts.append(body)
        if eos:
            parts.append(np.array([self.eos_id], np.int32))
        return np.concatenate(parts)

    def decode(self, ids) -> str:
        """Returns the text of byte ids in `ids` (any 1-D int array), dropping special ids.

        Byte sequences that are not valid UTF-8 (a model may emit them) decode to U+FFFD.

        Raises:
            ValueError: If an id is negative or not below `vocab_size`.
        """
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"`ids` must lie in [0, {self.vocab_size}), got values from {ids.min()} "
                f"to {ids.max()}."
            )
        return ids[ids < _NUM_BYTES].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def iterate_batches(
    tokens: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    num_batches: int | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields ``(inputs, targets)`` windows of `tokens`, deterministically from `seed`.

    Each batch holds `batch_size` windows of ``seq_len + 1`` consecutive tokens starting at
    uniformly random offsets; ``inputs`` are the first `seq_len` tokens of each window and
    ``targets`` the last `seq_len` (the next token at every position).

    Args:
        tokens: A 1-D integer array with at least ``seq_len + 1`` tokens.
        batch_size: Windows per batch.
        seq_len: Tokens per window.
        seed: Seed of the NumPy generator choosing the offsets.
        num_batches: Stop after this many batches; ``None`` yields forever.

    Returns:
        An iterator of int32 array pairs, each of shape ``(batch_size, seq_len)``.

    Raises:
        ValueError: For a non-1-D `tokens`, one too short for `seq_len`, or a non-positive
            `batch_size`/`seq_len` or negative `num_batches`.

    Example:
        >>> import numpy as np
        >>> from models import iterate_batches
        >>> inputs, targets = next(iterate_batches(np.arange(100), batch_size=2, seq_len=4,
        ...                                        seed=0))
        >>> inputs.shape, bool((targets[:, :-1] == inputs[:, 1:]).all())
        ((2, 4), True)
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"`tokens` must be 1-D, got shape {tokens.shape}; flatten it first.")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"`batch_size` and `seq_len` must be >= 1, got {batch_size}, {seq_len}.")
    if tokens.size < seq_len + 1:
        raise ValueError(
            f"`tokens` has {tokens.size} tokens; a window of `seq_len`={seq_len} needs at "
            f"least {seq_len + 1}. Use a shorter `seq_len` or more text."
        )
    if num_batches is not None and num_batches < 0:
        raise ValueError(f"`num_batches` must be >= 0 or None, got {num_batches}.")
    return _batches(tokens.astype(np.int32), batch_size, seq_len, seed, num_batches)


def _batches(tokens, batch_size, seq_len, seed, num_batches):
    rng = np.random.default_rng(seed)
    window = np.arange(seq_len + 1)
    count = 0
    while num_batches is None or count < num_batches:
        starts = rng.integers(0, tokens.size - seq_len, size=batch_size)
        chunk = tokens[starts[:, None] + window]
        yield chunk[:, :-1], chunk[:, 1:]
        count += 1


def load_corpus(name: str) -> str:
    """Returns the text of the shipped corpus `name` (one of `CORPUS_NAMES`).

    Args:
        name: ``"shakespeare_sonnets"`` (a selection of Shakespeare's sonnets) or
            ``"poe_poems"`` (poems by Edgar Allan Poe). Both are in the public domain.

    Returns:
        The text, as read from ``models/corpus/<name>.txt``.

    Raises:
        ValueError: If `name` is not in `CORPUS_NAMES`.

    Example:
        >>> from models import load_corpus
        >>> "Shall I compare thee" in load_corpus("shakespeare_sonnets")
        True
    """
    if name not in CORPUS_NAMES:
        raise ValueError(f"Unknown corpus `name`={name!r}. Valid names: {', '.join(CORPUS_NAMES)}.")
    path = importlib.resources.files(__package__ or "models").joinpath("corpus", f"{name}.txt")
    return path.read_text(encoding="utf-8")
