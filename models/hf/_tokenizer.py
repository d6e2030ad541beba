"""`HFTokenizer`: a ``tokenizer.json`` behind the interface of `models.ByteTokenizer`.

Real GPT-2 and Llama checkpoints come with BPE vocabularies saved by the `tokenizers`
package as ``tokenizer.json``. `HFTokenizer` loads one and offers what the training and
sampling code uses from `models.ByteTokenizer`: ``vocab_size``, ``bos_id``/``eos_id``/
``pad_id``, ``encode(text, bos=..., eos=...)`` returning int32 NumPy ids, and
``decode(ids)``. The special ids come from the folder's ``config.json``
(``bos_token_id``, ``eos_token_id``, ``pad_token_id``) when present, else from the
tokenizer's own special tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from multimesh_flax import errors

from ._config import read_json

FILE = "tokenizer.json"


def _special(config: dict[str, Any], name: str, fallback: int | None) -> int | None:
    value = config.get(name)
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else fallback


class HFTokenizer:
    """A `tokenizers` tokenizer with the interface of `models.ByteTokenizer`.

    Attributes:
        path: The ``tokenizer.json`` it was read from.
        bos_id: Id prepended by ``encode(bos=True)``.
        eos_id: Id appended by ``encode(eos=True)``.
        pad_id: Padding id (the EOS id when the checkpoint names none).

    Example:
        >>> from models.hf import HFTokenizer
        >>> tok = HFTokenizer.from_folder("tests/fixtures/hf/gpt2")
        >>> tok.vocab_size, tok.bos_id
        (320, 0)
        >>> ids = tok.encode("Shall I compare thee")
        >>> len(ids) < len("Shall I compare thee"), tok.decode(ids)
        (True, 'Shall I compare thee')
    """

    def __init__(self, path: str | os.PathLike, config: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise errors.PretrainedConfigError(
                f"Expected a {FILE} at {str(self.path)!r}, found none. Pass the file the "
                "`tokenizers` package saved (or a model folder holding it)."
            )
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as error:  # tokenizers raises a bare Exception
            raise errors.PretrainedConfigError(
                f"Cannot read {str(self.path)!r} as a tokenizer ({error}). Re-save it with "
                "`tokenizers`."
            ) from None
        config = config or {}
        first = self._first_special()
        self.bos_id = _special(config, "bos_token_id", first)
        self.eos_id = _special(config, "eos_token_id", first)
        self.pad_id = _special(config, "pad_token_id", self.eos_id)
        self._vocab_size = int(config.get("vocab_size") or self._tokenizer.get_vocab_size())

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> HFTokenizer:
        """The tokenizer of a model folder: its ``tokenizer.json`` and ``config.json`` ids."""
        folder = Path(folder)
        config_path = folder / "config.json"
        config = read_json(config_path) if config_path.is_file() else {}
        return cls(folder / FILE, config)

    def _first_special(self) -> int | None:
        added = self._tokenizer.get_added_tokens_decoder()
        specials = sorted(i for i, token in added.items() if token.special)
        return specials[0] if specials else None

    @property
    def vocab_size(self) -> int:
        """Rows of the model's token table (``config.json``), else the tokenizer's size."""
        return self._vocab_size

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """Returns the int32 ids of `text`, optionally framed by BOS/EOS."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        framed = ([self.bos_id] if bos and self.bos_id is not None else []) + ids
        if eos and self.eos_id is not None:
            framed.append(self.eos_id)
        return np.asarray(framed, dtype=np.int32)

    def decode(self, ids: Any) -> str:
        """Returns the text of `ids` (any 1-D int array), dropping special and padding ids.

        Raises:
            ValueError: If an id is negative or not below `vocab_size`.
        """
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"`ids` must lie in [0, {self.vocab_size}), got values from {ids.min()} "
                f"to {ids.max()}."
            )
        known = ids[ids < self._tokenizer.get_vocab_size()]
        return self._tokenizer.decode(known.tolist(), skip_special_tokens=True)
