"""Checksums of checkpoint leaves that do not depend on the layout they are computed from.

Orbax checks the index of each zarr shard file but not the chunk bytes: changed bytes in a
checkpoint file restore without a word. ``Checkpointer`` therefore saves one checksum per
leaf (``checksums``) and compares it with the restored leaf (``verify``).

The checksum of an array is ``sum_i mix(word_i, i) mod 2**64`` over its words (its elements
viewed as 8-, 16- or 32-bit unsigned integers, ``i`` the word's index in the flattened global
array), where ``mix`` is a bijection of the word for each index. A sum over global indices
is the same whichever sharding, devices or shard order it is computed from, so a checkpoint
saved on two submeshes verifies when restored onto one device; each addressable shard of
replica 0 is hashed where it lies on the host (on CPU without a copy), and one changed word
always changes the sum.

Only single-process jobs save and verify checksums: in a ``jax.distributed`` job a process
holds only some shards, and the per-process partial sums would need a collective at every
save and restore.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_M1, _M2, _M3 = np.uint32(0x9E3779B9), np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def leaf_paths(tree: Any) -> dict[str, Any]:
    """The leaves of ``tree`` by orbax's dotted path (``params.layer_0.w``).

    Empty nodes (an optax ``EmptyState``, an empty ``model_state``) are kept while the tree
    is serialized -- orbax cannot rebuild the lists around them otherwise -- and dropped here.
    """
    flat = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(tree, keep_empty_nodes=True))
    return {
        ".".join(map(str, path)): leaf for path, leaf in flat.items() if not _is_empty_node(leaf)
    }


def _is_empty_node(leaf: Any) -> bool:
    return (
        leaf is None
        or (isinstance(leaf, (dict, list, tuple)) and not leaf)
        or (type(leaf).__name__ == "EmptyState")
    )


def checksums(tree: Any) -> dict[str, str]:
    """One hex checksum per leaf of ``tree``, by dotted path."""
    return {path: checksum(leaf) for path, leaf in leaf_paths(tree).items()}


def checksum(leaf: Any) -> str:
    """The layout-independent checksum of one leaf (an array or a Python number)."""
    if isinstance(leaf, jax.Array):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        total = 0
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                total += _sum_block(np.asarray(shard.data), shard.index, leaf.shape)
        return f"{total % 2**64:016x}"
    value = np.asarray(leaf)  # restored numbers may come back as Python or numpy scalars
    value = value.astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)
    return f"{_sum_block(value, (), value.shape) % 2**64:016x}"


def mismatches(expected: dict[str, str], restored: Any) -> list[str]:
    """Paths of ``restored`` whose checksum differs from ``expected`` (paths it lacks are
    skipped: a restore may read fewer leaves than were saved)."""
    bad = []
    for path, leaf in leaf_paths(restored).items():
        if path in expected and checksum(leaf) != expected[path]:
            bad.append(path)
    return bad


def _words(block: np.ndarray) -> tuple[np.ndarray, int]:
    """``block`` as unsigned words (last axis: the words of one element) and words per item."""
    block = np.ascontiguousarray(block)
    size = block.dtype.itemsize
    if size % 4 == 0:
        return block.view(np.uint32).reshape(*block.shape, size // 4), size // 4
    if size == 2:
        return block.view(np.uint16).reshape(*block.shape, 1), 1
    return block.view(np.uint8).reshape(*block.shape, size), size


def _sum_block(block: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    """The checksum sum of ``block``, which sits at ``index`` of a global array of ``shape``."""
    starts = [(index[a].start or 0) if a < len(index) else 0 for a in range(len(shape))]
    if block.ndim and block.size > _ROWS_AT_ONCE:  # bounded temporaries: a few rows at a time
        step = max(1, _ROWS_AT_ONCE * block.shape[0] // block.size)
        return sum(
            _sum_rows(block[r : r + step], [starts[0] + r, *starts[1:]], shape)
            for r in range(0, block.shape[0], step)
        )
    return _sum_rows(block, starts, shape)


_ROWS_AT_ONCE = 1 << 20  # elements hashed at once


def _sum_rows(block: np.ndarray, starts: list[int], shape: tuple[int, ...]) -> int:
    words, per_item = _words(block)
    flat = np.zeros((), np.uint64)
    stride = 1
    for axis in reversed(range(len(shape))):
        positions = np.arange(starts[axis], starts[axis] + block.shape[axis], dtype=np.uint64)
        view = [1] * len(shape)
        view[axis] = -1
        flat = flat + positions.reshape(view) * np.uint64(stride)
        stride *= shape[axis]
    ids = flat[..., None] * np.uint64(per_item) + np.arange(per_item, dtype=np.uint64)
    ids = ids.astype(np.uint32)  # the index mod 2**32 suffices to tell words apart
    mixed = (words.astype(np.uint32) ^ (ids * _M1)) * _M2
    mixed ^= mixed >> np.uint32(15)
    mixed *= _M3
    return int(mixed.sum(dtype=np.uint64))
