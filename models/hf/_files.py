"""Safetensors files of a Hugging Face model folder: lazy reading and sharded writing.

`TensorFiles` indexes a folder's weights -- ``model.safetensors``, or the shards that
``model.safetensors.index.json`` lists -- by reading only the files' headers, and reads one
tensor at a time on request (safetensors memory-maps the file, so a checkpoint larger than
the host's memory still loads tensor by tensor). Every failure names the file and the key.

`plan_shards` groups tensors into files of at most ``max_shard_size`` bytes, and
`write_folder` writes a complete folder into a fresh temporary directory next to the
target and renames it into place, so a failed save leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from multimesh_flax import errors

from ._config import read_json

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
FLOATING = frozenset(_DTYPES.values())
"""The dtype names a model weight may have; anything else (``I32``, ``U8``, ...) is refused."""


def _open(path: Path) -> Any:
    try:
        return safetensors.safe_open(str(path), framework="np")
    except (safetensors.SafetensorError, OSError) as error:
        raise errors.PretrainedTensorError(
            f"Cannot read {str(path)!r} as a safetensors file ({error}); it is truncated or "
            "corrupt. Re-download or re-save the checkpoint."
        ) from None


def _check_finite(key: str, path: Path, array: np.ndarray) -> None:
    """Raises unless every value of the floating-point tensor `array` is finite."""
    if array.dtype.name not in FLOATING:  # integers are refused from the header earlier
        return
    finite = np.isfinite(array)
    if finite.all():
        return
    bad = array.size - int(np.count_nonzero(finite))
    raise errors.PretrainedTensorError(
        f"Tensor {key!r} in {str(path)!r} holds {bad} non-finite value(s) (NaN or inf) of "
        f"{array.size}; a model loaded from it trains to NaN. Re-download or re-save the "
        "checkpoint from a run whose weights are finite."
    )


class TensorFiles(contextlib.AbstractContextManager):
    """The tensors of a folder's safetensors files, by key; use as a context manager.

    Attributes:
        folder: The model folder.
        files: ``{key: file path}`` for every tensor.
        shapes: ``{key: shape}`` from the file headers.
        dtypes: ``{key: dtype name}`` (``"float32"``, ``"bfloat16"``, ...).
    """

    def __init__(self, folder: Path, canonical: Callable[[str], str]) -> None:
        self.folder = folder
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._raw: dict[str, str] = {}
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}
        try:
            for path in self._weight_files():
                self._index(path, canonical)
        except BaseException:
            self._stack.close()
            raise

    def _weight_files(self) -> list[Path]:
        if (self.folder / INDEX).is_file():
            weight_map = read_json(self.folder / INDEX).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise errors.PretrainedConfigError(
                    f"{str(self.folder / INDEX)!r} has no `weight_map`. Re-save the checkpoint."
                )
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.folder / n).is_file()]
            if missing:
                raise errors.PretrainedTensorError(
                    f"{INDEX} in {str(self.folder)!r} lists {missing[0]!r}, which is not in "
                    "the folder. Copy every shard of the checkpoint into it."
                )
            return [self.folder / n for n in names]
        if (self.folder / SINGLE).is_file():
            return [self.folder / SINGLE]
        raise errors.PretrainedConfigError(
            f"Expected {SINGLE} or {INDEX} in {str(self.folder)!r}, found neither. Save the "
            "model with `save_pretrained(..., safe_serialization=True)` (PyTorch .bin weights "
            "are not read)."
        )

    def _index(self, path: Path, canonical: Callable[[str], str]) -> None:
        handle = self._stack.enter_context(_open(path))
        self._handles[path] = handle
        for raw in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
            view = handle.get_slice(raw)
            key = canonical(raw)
            self.files[key], self._raw[key] = path, raw
            self.shapes[key] = tuple(view.get_shape())
            dtype = str(view.get_dtype())
            self.dtypes[key] = _DTYPES.get(dtype, dtype)

    def read(self, key: str, dtype: Any = None) -> np.ndarray:
        """The tensor `key` as a NumPy array, cast to `dtype` if given."""
        path = self.files[key]
        try:
            array = self._handles[path].get_tensor(self._raw[key])
        except (safetensors.SafetensorError, OSError) as error:
            raise errors.PretrainedTensorError(
                f"Cannot read tensor {key!r} from {str(path)!r} ({error}). Re-download or "
                "re-save the checkpoint."
            ) from None
        _check_finite(key, path, array)
        return array if dtype is None else array.astype(dtype)

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Keys grouped, in order, into files of at most `max_shard_size` bytes each.

    A tensor larger than `max_shard_size` gets a file of its own.

    Example:
        >>> plan_shards([("a", 40), ("b", 40), ("c", 40)], 100)
        [['a', 'b'], ['c']]
    """
    shards: list[list[str]] = [[]]
    used = 0
    for key, size in sizes:
        if shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def shard_names(count: int) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` for several files."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_shards(
    folder: Path,
    shards: list[list[str]],
    tensors: Callable[[list[str]], dict[str, np.ndarray]],
) -> None:
    """Writes each shard (``tensors(keys)`` makes its arrays) and, if several, the index."""
    names = shard_names(len(shards))
    weight_map, total = {}, 0
    for name, keys in zip(names, shards, strict=True):
        arrays = tensors(keys)
        safetensors.numpy.save_file(arrays, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
        total += sum(a.nbytes for a in arrays.values())
        log.info("wrote %s (%d tensors)", name, len(keys))
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def fresh_folder(target: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary folder next to `target`, renamed to `target` when the block succeeds.

    Raises:
        PretrainedConfigError: `target` exists (and is not an empty folder) without
            `overwrite`, or is a file.
    """
    if target.exists() and (target.is_file() or (any(target.iterdir()) and not overwrite)):
        raise errors.PretrainedConfigError(
            f"Expected a new folder to save into, but {str(target)!r} already exists. Pick "
            "another path, or pass `overwrite=True` to replace it."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _usual_permissions(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _usual_permissions(folder: Path) -> None:
    """The modes a plain ``mkdir``/``open`` would give (``mkdtemp`` makes them private)."""
    umask = _umask()
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (threads stay safe)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("Umask:")[1].split()[0], 8)
    except (OSError, IndexError, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask
