"""Orbax saves and restores in which each process writes and reads only its own shards.

DESIGN. In a job of several processes every process holds the whole training state as a tree
of global ``jax.Array``: a leaf on this process's devices has all its shards here (it is
*fully addressable*); a leaf of another process's stage has the same shape and sharding but
no local shard (``_wire.assemble(aval, sharding, [])``, as multi-controller ``jax.jit``
returns it); a leaf on a submesh spanning processes has some local shards. Orbax 0.12.8
assumes SPMD arrays, every process holding some shard of every array:

* ``ArrayHandler.serialize`` (``orbax/checkpoint/_src/serialization/jax_array_handlers.py``,
  line 1462) refuses a fully addressable array when ``jax.process_count() > 1`` ("Cannot
  serialize host local jax.Array"): it guards against pmap-era arrays whose values differ
  per process, which ours are not (each leaf lives in exactly one place);
* ``replica_slices.get_replica_slices`` (line 266) reads ``arr.addressable_shards[0]``, so
  an array with no local shard fails (``IndexError``), although the primary process (0)
  must still create its tensorstore metadata;
* ``serialization._read_and_create_array`` (line 387) calls
  ``jax.make_array_from_single_device_arrays`` without ``dtype``, which jax 0.10 requires
  when a process reads no shard of the target sharding.

So saving goes through ``ShardsArrayHandler``, an ``ArrayHandler`` registered (in a registry
of our own, not orbax's global one) for this save only. It hands orbax's own serialization a
view of each leaf: a fully addressable leaf as an array that is not host-local (the same
buffers, sharding and replica ids; only ``is_fully_addressable`` says ``False``), and a leaf
without local shards as one whose single stand-in shard has the shard shape (orbax sizes the
chunk grid from it) and no replica to write. Orbax then does what it does for any global
array: every process writes the replica-0 shards of its own devices into its own OCDBT
database (``ocdbt.process_<i>``), process 0 writes the metadata and the sharding file, and
orbax merges the databases at commit. Restoring passes orbax's ``PLACEHOLDER`` for every leaf
whose target sharding has no device here (orbax skips it) and fills it afterwards with an
empty global array of the target's shape and sharding; every other leaf is read by orbax
shard by shard for this process's devices only.

The files are those orbax's standard handler writes in one process (same OCDBT keys,
``_METADATA`` and ``_sharding``), with one difference that readers do not see: on CPU that
handler splits the writing of a replicated array among its replicas (one chunk per replica),
while this one writes it from replica 0 as one chunk per shard. Replica-parallel writing is
off here because every process must size an array's chunks alike, including the primary
process when it holds no shard of the array.

Checked with 2 processes x 4 CPU devices (the two-submesh MLP, ``tests/distributed``):
process 1's OCDBT database holds exactly the chunks of the stage on its devices, process 0's
those of its own stage plus the metadata of both, and a stage on devices of both processes is
written half by each; on restore each process reads only the chunks its own devices overlap
(tensorstore's chunk-read counter: 6 and 2 for a checkpoint whose 8 chunks every process
would read whole under the earlier host-copy scheme); 2-process checkpoints restore in one
process, and the reverse, bit for bit. Not supported: PRNG key leaves held by one process
(orbax converts keys with ``jax.random.key_data`` on the view); ``save`` refuses them with a
typed error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

from multimesh_flax import errors
from multimesh_flax.distributed import _wire


class _Global:
    """A fully addressable array shown to orbax as one shard set of a global array."""

    is_fully_addressable = False

    def __init__(self, array: jax.Array) -> None:
        self._array = array

    def __getattr__(self, name: str) -> Any:
        return getattr(self._array, name)


class _StandIn:
    """The one shard orbax reads of an array this process holds none of: its index and shard
    shape (orbax sizes the chunk grid from it), and a replica id that nobody writes."""

    replica_id = -1
    device = None

    def __init__(self, array: jax.Array) -> None:
        self.index = next(iter(array.sharding.devices_indices_map(array.shape).values()))
        self.data = jax.ShapeDtypeStruct(array.sharding.shard_shape(array.shape), array.dtype)


class _Absent(_Global):
    """An array with no shard in this process, as orbax's multi-host path expects one."""

    def __init__(self, array: jax.Array) -> None:
        super().__init__(array)
        self.addressable_shards = [_StandIn(array)]


def _view(array: jax.Array) -> Any:
    if not array.addressable_shards:
        return _Absent(array)
    if array.is_fully_addressable:
        return _Global(array)
    return array


class ShardsArrayHandler(ocp.type_handlers.ArrayHandler):
    """``ArrayHandler`` that saves each process's own shards in a ``jax.distributed`` job.

    Replica-parallel writing is off: every process then sizes an array's chunks by its shard
    shape, as the stand-in of ``_Absent`` does.
    """

    def __init__(self) -> None:
        default = ocp.type_handlers.get_type_handler(jax.Array)
        super().__init__(
            use_replica_parallel=False,
            array_metadata_store=getattr(default, "_array_metadata_store", None),
        )

    async def serialize(
        self,
        values: Sequence[jax.Array],
        infos: Sequence[Any],
        args: Sequence[Any] | None = None,
    ) -> Any:
        return await super().serialize([_view(v) for v in values], infos, args)


def state_handler() -> ocp.PyTreeCheckpointHandler:
    """The checkpoint handler of a multi-process job's state (see the module docstring)."""
    handlers = [
        (ty, ocp.type_handlers.get_type_handler(ty))
        for ty in ocp.type_handlers.supported_types()
        if ty is not jax.Array
    ]
    registry = ocp.type_handlers.create_type_handler_registry(
        *handlers, (jax.Array, ShardsArrayHandler())
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def check_savable(state: Any) -> None:
    """Refuses PRNG key leaves held by one process (orbax cannot save them from a view)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if (
            isinstance(leaf, jax.Array)
            and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
            and (leaf.is_fully_addressable or not leaf.addressable_shards)
        ):
            raise errors.CheckpointArgumentError(
                f"Cannot save leaf {jax.tree_util.keystr(path)} of `state` in this "
                f"{jax.process_count()}-process job: a PRNG key array held by one process "
                "(orbax converts keys before it writes them). Save "
                "`jax.random.key_data(key)` instead and wrap it again after restoring."
            )


def _here(leaf: Any) -> bool:
    """Whether ``leaf`` (a target) is placed on at least one device of this process."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(leaf, jax.ShapeDtypeStruct) or sharding is None:
        return True
    return jax.process_index() in _wire.owners(list(sharding.device_set))


def restore_args(target: Any) -> ocp.args.PyTreeRestore:
    """Orbax's arguments to read ``target``'s leaves placed on this process's devices only."""
    read = jax.tree.map(lambda x: x if _here(x) else ocp.PLACEHOLDER, target)
    return ocp.args.PyTreeRestore(
        item=read, restore_args=ocp.checkpoint_utils.construct_restore_args(read)
    )


def fill_absent(restored: Any, target: Any) -> Any:
    """``restored`` with every leaf placed elsewhere as an empty global array of ``target``."""
    return jax.tree.map(
        lambda r, x: r if _here(x) else _wire.assemble(x, x.sharding, []),
        restored,
        target,
    )
