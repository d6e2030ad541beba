"""Batches of ``mmflax train --dataset``: packed windows, a held-out split, a grain stream.

`prepare_dataset` reads the files (`_text_files`), maps their cached tokens
(`_token_cache`) and cuts them into a `TextData`:

* **Packing.** The documents, each followed by the end-of-text id, form one token stream,
  cut into consecutive windows of ``seq_len + 1`` tokens (inputs are a window's first
  ``seq_len`` tokens, targets its last ``seq_len``), so a window may span the end of one
  document and the start of the next. The last ``tail_tokens`` (< ``seq_len + 1``) tokens
  fill no window and are not trained on; `TextData.describe` reports them.
* **Held out.** With ``eval_fraction`` F, the last ``round(F * BLOCK)`` windows of every
  block of `BLOCK` consecutive windows (the whole corpus, for fewer windows) are held out
  for evaluation: spread over the corpus, the same in every run and every process, and
  found by arithmetic (no table of window ids, however large the corpus).
* **Training stream** (`TextData.train_stream`): a grain ``MapDataset`` of the training
  windows, shuffled with the run's seed, repeated with a new order each epoch, and batched
  by ``batch_size``: windows left over at an epoch's end start the next epoch's first batch,
  so none is dropped. Batch ``i`` depends only on the seed and ``i``; the iterator's state
  (`BatchStream.get_state`) is saved with every checkpoint and restored by ``--resume``, which
  therefore continues with the batch an uninterrupted run would have drawn.
* **Evaluation** (`TextData.eval_batches`): the held-out windows in order, in batches of
  ``batch_size`` (at most `EVAL_MAX_BATCHES`); the last batch is padded by repeating windows,
  and its ``valid`` count says how many rows count.

**Processes.** Every process of a ``--processes N`` job builds the same stream (the same
seed, the same index order: no shard of grain's own, which would give processes different
batches), and reads from it only the rows of each batch that its own devices hold
(`rows_of_process`, from the train step's input shardings); the batch then becomes one array
of the job (`place_batch`). What a process's share is depends on the layout: ``mmflax
train``'s step replicates the batch on the submesh that uses it (the first stage reads the
inputs, the last stage the targets; microbatches are split inside the step), so a process
holding the first or last stage reads every row, and a process holding only middle stages
(``--stages 4 --processes 4``: processes 1 and 2) reads nothing. A step whose batch is split
over the data axis across processes would give each process its rows of that split.

Example:
  >>> import numpy as np
  >>> data = TextData(np.arange(23, dtype=np.uint16), seq_len=4, eval_fraction=0.25)
  >>> data.windows.shape, data.train_count, data.held_out_count, data.tail_tokens
  ((4, 5), 3, 1, 3)
  >>> stream = data.train_stream(batch_size=2, seed=0)
  >>> first = next(stream)
  >>> first["inputs"].shape, bool((first["targets"][:, :-1] == first["inputs"][:, 1:]).all())
  ((2, 4), True)
  >>> state = stream.get_state()
  >>> second = next(stream)
  >>> again = data.train_stream(batch_size=2, seed=0)
  >>> again.set_state(state)
  >>> bool((next(again)["inputs"] == second["inputs"]).all())
  True
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import einops
import grain
import jax
import numpy as np

from multimesh_flax.cli import _text_files, _token_cache
from multimesh_flax.cli.errors import DataSizeError, RunOptionError

BLOCK = 1000
"""Windows per block of the held-out split (see the module docstring)."""
EVAL_MAX_BATCHES = 64
"""Evaluation reads at most this many batches of held-out windows."""
CACHE_DIR = "data_cache"
"""The folder of the token cache inside the run folder."""

Batch = dict[str, np.ndarray]


class TextData:
    """A token stream cut into ``seq_len + 1`` windows, split into training and held out.

    Args:
        tokens: 1-D token ids (a ``np.memmap`` is read lazily, never copied whole).
        seq_len: tokens per input sequence.
        eval_fraction: the share of windows held out (``None``: none).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, eval_fraction: float | None = None):
        width = seq_len + 1
        count = tokens.size // width
        self.tokens = tokens
        self.windows = einops.rearrange(tokens[: count * width], "(n w) -> n w", w=width)
        self.tail_tokens = tokens.size - count * width
        self.block = max(1, min(BLOCK, count))
        held = round((eval_fraction or 0.0) * self.block)
        self.block_train = self.block - held
        whole, rest = divmod(count, self.block)
        self.train_count = whole * self.block_train + min(rest, self.block_train)
        self.held_out_count = count - self.train_count

    def train_window(self, i: np.ndarray) -> np.ndarray:
        """The window ids of training windows ``i`` (``0 <= i < train_count``)."""
        return (i // self.block_train) * self.block + i % self.block_train

    def held_out_window(self, j: np.ndarray) -> np.ndarray:
        """The window ids of held-out windows ``j`` (``0 <= j < held_out_count``)."""
        held = self.block - self.block_train
        return (j // held) * self.block + self.block_train + j % held

    def train_stream(
        self, batch_size: int, seed: int, rows: np.ndarray | None = None
    ) -> BatchStream:
        """Batches of training windows, shuffled per epoch (see the module docstring).

        ``rows``: the rows of each batch to read (`rows_of_process`); the others are zeros.
        """
        order = grain.MapDataset.range(self.train_count).shuffle(seed=seed).repeat(None)
        gather = functools.partial(_gather, self, rows)
        return BatchStream(order.batch(batch_size).map(gather))

    def eval_batches(self, batch_size: int) -> list[tuple[Batch, int]]:
        """``(batch, valid)`` pairs covering the held-out windows (see the module docstring)."""
        count = min(self.held_out_count, batch_size * EVAL_MAX_BATCHES)
        out = []
        for begin in range(0, count, batch_size):
            j = np.arange(begin, begin + batch_size) % count  # the last batch wraps around
            rows = np.asarray(self.windows[self.held_out_window(j)], dtype=np.int32)
            out.append((_pair(rows), min(batch_size, count - begin)))
        return out

    def head_text(self, tokenizer: Any, count: int = 100_000) -> str:
        """The text of the first ``count`` tokens (what samples are compared with)."""
        return tokenizer.decode(np.asarray(self.tokens[:count], dtype=np.int32))

    def describe(self) -> dict[str, int]:
        """The counts ``metrics.json`` records."""
        return {
            "windows": int(self.windows.shape[0]),
            "train_windows": self.train_count,
            "held_out_windows": self.held_out_count,
            "tail_tokens_unused": int(self.tail_tokens),
        }


def _pair(windows: np.ndarray) -> Batch:
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def _gather(data: TextData, rows: np.ndarray | None, indices: np.ndarray) -> Batch:
    """The batch of training windows ``indices``; only ``rows`` of it read, if given."""
    ids = data.train_window(indices)
    if rows is None:
        return _pair(np.asarray(data.windows[ids], dtype=np.int32))
    windows = np.zeros((ids.size, data.windows.shape[1]), np.int32)
    windows[rows] = data.windows[ids[rows]]
    return _pair(windows)


class BatchStream:
    """An iterator of training batches whose position can be saved and restored.

    ``get_state`` returns grain's iterator state (JSON-able), ``set_state`` moves a fresh
    stream to it: the next batch is then the one that followed when the state was taken.
    """

    def __init__(self, dataset: grain.MapDataset) -> None:
        read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # no threads left over
        self._iterator = iter(dataset.to_iter_dataset(read_options=read))

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        return self._iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._iterator.set_state(state)


def check_sizes(tokens: int, seq_len: int, batch_size: int, eval_fraction: float | None) -> None:
    """Raises `DataSizeError` unless ``tokens`` make a batch and, if asked, a held-out window."""
    data = TextData(np.empty(tokens, np.uint8), seq_len, eval_fraction)
    held = f", after holding out {data.held_out_count} for evaluation" if eval_fraction else ""
    if data.train_count < batch_size:
        raise DataSizeError(
            f"Expected `--dataset` to fill at least one batch of `--batch-size` {batch_size} "
            f"windows of `--seq-len` + 1 = {seq_len + 1} tokens, got {tokens} tokens: "
            f"{data.train_count} training windows{held}. Add text, or lower `--batch-size` "
            "or `--seq-len`."
        )
    if eval_fraction is not None and data.held_out_count == 0:
        raise DataSizeError(
            f"`--eval-fraction` {eval_fraction} of the {data.windows.shape[0]} windows of "
            f"`--dataset` holds out no window (it holds out round({eval_fraction} x "
            f"{data.block}) of every {data.block}). Raise `--eval-fraction`, or add text."
        )


def check_eval_fraction(fraction: float | None) -> None:
    """Raises `RunOptionError` unless ``fraction`` is ``None`` or inside (0, 1)."""
    if fraction is not None and not 0.0 < fraction < 1.0:
        raise RunOptionError(
            f"Expected `--eval-fraction` strictly between 0 and 1 (the share of windows held "
            f"out), got {fraction!r}. Use e.g. `--eval-fraction 0.05`."
        )


def prepare_dataset(
    path: str,
    tokenizer: Any,
    *,
    text_field: str,
    seq_len: int,
    batch_size: int,
    eval_fraction: float | None,
    run_dir: Path,
) -> tuple[TextData, _token_cache.Tokens]:
    """The `TextData` of ``--dataset`` ``path``, its tokens cached in ``run_dir``.

    Raises:
        DataFileError: a file cannot be read as documents (`_text_files`).
        DataSizeError: too few tokens for a batch, or no held-out window (`check_sizes`).
    """
    files = _text_files.find_files(path)
    check = functools.partial(
        check_sizes, seq_len=seq_len, batch_size=batch_size, eval_fraction=eval_fraction
    )
    tokens = _token_cache.load_tokens(files, tokenizer, text_field, run_dir / CACHE_DIR, check)
    return TextData(tokens.ids, seq_len, eval_fraction), tokens


def rows_of_process(
    shardings: Sequence[jax.sharding.Sharding],
    shape: tuple[int, ...],
    process: int,
    process_of: Any = lambda device: device.process_index,
) -> np.ndarray:
    """The batch rows that ``process``'s devices hold under any of ``shardings``.

    Example:
      >>> import jax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
      ...                      devices=jax.devices()[:4])
      >>> split = NamedSharding(mesh, P("data"))
      >>> rows_of_process([split], (8, 3), 1, process_of=lambda d: d.id // 2).tolist()
      [4, 5, 6, 7]
    """
    rows = np.zeros(shape[0], bool)
    for sharding in shardings:
        for device, index in sharding.devices_indices_map(shape).items():
            if process_of(device) == process:
                rows[index[0]] = True
    return np.flatnonzero(rows)


def place_batch(batch: Batch, shardings: dict[str, jax.sharding.Sharding]) -> dict[str, Any]:
    """``batch`` as arrays of the job, each device's shard taken from this process's rows."""
    return {
        key: jax.make_array_from_callback(
            value.shape, shardings[key], value.__getitem__, dtype=value.dtype
        )
        for key, value in batch.items()
    }
