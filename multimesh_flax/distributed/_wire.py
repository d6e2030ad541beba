"""Moving arrays between submeshes that live in different processes.

DESIGN. On CPU, ``jax.device_put`` refuses to move an array to another process's devices
("does not support cross-host device transfers"); with socket transfers configured it took
30 s for a first transfer on the 2-core host and the processes fell out of step. What does work
on CPU (gloo) and GPU (NCCL) alike is a jitted collective over a mesh spanning both processes,
run by every process that owns one of its devices. So a cross-process transfer is a collective
program over the union of the source and destination devices, in one of two forms:

* **Layout wire** (source and destination have as many devices, disjoint): the source reshards
  the value locally to the *destination's* layout on its own devices; a (2, ...) mesh stacks the
  source devices over the destination devices, and one ``lax.ppermute`` along the stacking axis
  sends every shard straight to its destination device. The global array the collective sees
  is ``concat([value, zeros])`` along axis 0 (a scalar is reshaped to ``(1,)``), so the
  per-device buffers are the value's own shards: no copy on either side. Bytes on the wire: the
  value's size times the destination's replication.
* **One-device broadcast** (everything else: 4 devices to 2, overlapping device sets, replicated
  destinations): the source gathers the value onto its first device; a one-axis mesh over that
  device and the destination devices runs a ``lax.psum`` in which only the source contributes,
  so every destination device receives the whole value (exact: adding zeros); each destination
  process then reshards locally to the target sharding.

**One collective at a time.** A transfer returns only when its collective has finished in
this process, so at most one cross-process collective is in flight per process (fragments
are already waited for, see ``_dispatch``). With several in flight (the non-finite check
sends one flag to every stage), the resumed 2-process training run hung in 2 of 2 tries on
the busy 2-core host (jax 0.10.2, gloo), both processes inside a broadcast's ``psum``; the
likely cause is collectives of different device sets occupying the CPU client's few worker
threads while waiting for peers queued behind each other. With this wait: see the tests of
``mmflax train --processes 2``, which run with the check.

Both forms are compiled once per (mesh, layout) and reused every call. Donation and frees are
unaffected: each process only holds the buffers of its own devices, and the runtime frees its
slots as in one process.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from multimesh_flax import errors
from multimesh_flax.distributed import _exchange, _sequence, _watchdog

# The zero buffers, collectives and identity programs of the wires, per shape, mesh and
# sharding: a program uses a handful; the bound keeps a long process's set finite.
WIRE_CACHE_SIZE = 256

WIRE = "_mmflax_wire"


def owners(devices: Sequence[Any]) -> frozenset[int]:
    """The processes that own ``devices``."""
    return frozenset(d.process_index for d in devices)


def _flat(sharding: NamedSharding) -> list[Any]:
    return list(sharding.mesh.devices.flat)


@functools.lru_cache(maxsize=WIRE_CACHE_SIZE)
def _zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> jax.Array:
    return jax.device_put(np.zeros(shape, dtype), device)


@functools.lru_cache(maxsize=WIRE_CACHE_SIZE)
def _collective(mesh: Mesh, spec: PartitionSpec, kind: str) -> Any:
    if kind == "ppermute":
        body = functools.partial(lax.ppermute, axis_name=WIRE, perm=[(0, 1)])
        out = spec
    else:

        def body(x: jax.Array) -> jax.Array:
            return lax.psum(x, WIRE)[0].astype(x.dtype)  # bool sums come back as int

        out = PartitionSpec(*spec[1:])
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out))


@functools.lru_cache(maxsize=WIRE_CACHE_SIZE)
def _identity(sharding: NamedSharding) -> Any:
    return jax.jit(lambda x: x, out_shardings=sharding)


def _reshard(x: jax.Array, target: NamedSharding) -> jax.Array:
    """``x`` in ``target``, on the same processes: a local copy or a jitted identity."""
    if x.sharding == target or x.sharding.is_equivalent_to(target, x.ndim):
        return x
    if x.is_fully_addressable and len(owners(_flat(target))) == 1:
        return jax.device_put(x, target)
    return _identity(target)(x)


def _local(devices: Sequence[Any]) -> list[Any]:
    rank = jax.process_index()
    return [d for d in devices if d.process_index == rank]


def _global(
    shape: tuple[int, ...], sharding: NamedSharding, buffers: dict[Any, jax.Array], dtype: Any
) -> jax.Array:
    """The global array whose local shards are ``buffers`` (device -> buffer), zeros elsewhere."""
    local = []
    for d in _local(_flat(sharding)):
        buffer = buffers.get(d)
        if buffer is None:
            buffer = _zeros(sharding.shard_shape(shape), np.dtype(dtype), d)
        local.append(buffer)
    return jax.make_array_from_single_device_arrays(shape, sharding, local, dtype=dtype)


def assemble(aval: Any, sharding: Any, buffers: Sequence[jax.Array]) -> jax.Array:
    """The global array of ``aval`` whose local shards are ``buffers`` (none: held elsewhere).

    Keeps ``aval``'s weak type, which ``jax.make_array_from_single_device_arrays`` drops: a
    program's signature includes it, and a process whose copy of an output lost it would build
    a different program for the next step than the process that computed it.
    """
    shape, dtype = tuple(aval.shape), aval.dtype
    if not getattr(aval, "weak_type", False) or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return jax.make_array_from_single_device_arrays(shape, sharding, list(buffers), dtype=dtype)
    from jax._src import array, core  # weak-typed global arrays have no public constructor

    weak = core.update_aval_with_sharding(core.ShapedArray(shape, dtype, weak_type=True), sharding)
    return array.ArrayImpl(weak, sharding, list(buffers), committed=True)


def _shards(x: jax.Array | None, devices: set[Any]) -> dict[Any, jax.Array]:
    if x is None:
        return {}
    return {s.device: s.data for s in x.addressable_shards if s.device in devices}


# --- the two wires --------------------------------------------------------------------------


def uses_layout_wire(source: NamedSharding, target: NamedSharding) -> bool:
    """Whether ``source -> target`` takes the layout wire (else the one-device broadcast)."""
    src, dst = _flat(source), _flat(target)
    replicated = all(e is None for e in target.spec) and len(dst) > 1
    return len(src) == len(dst) and not set(src) & set(dst) and not replicated


def _layout_wire(
    x: jax.Array | None, source: NamedSharding, target: NamedSharding, aval: Any
) -> jax.Array | None:
    src_mesh = Mesh(
        np.array(_flat(source), dtype=object).reshape(target.mesh.devices.shape),
        target.mesh.axis_names,
        axis_types=target.mesh.axis_types,
    )
    wire_source = NamedSharding(src_mesh, target.spec)
    stacked = Mesh(
        np.stack([src_mesh.devices, target.mesh.devices]),
        (WIRE, *target.mesh.axis_names),
        axis_types=(AxisType.Auto, *target.mesh.axis_types),
    )
    scalar = aval.ndim == 0
    shape = (1,) if scalar else tuple(aval.shape)
    spec = list(target.spec) + [None] * (len(shape) - len(target.spec))
    first = spec[0] if isinstance(spec[0], tuple) else (() if spec[0] is None else (spec[0],))
    wire_spec = PartitionSpec((WIRE, *first), *spec[1:])
    wire_shape = (2 * shape[0], *shape[1:])
    buffers = {}
    if x is not None and _local(_flat(source)):
        sent = _reshard(x, wire_source)
        buffers = _shards(sent, set(src_mesh.devices.flat))
        if scalar:
            buffers = {d: b.reshape(1) for d, b in buffers.items()}
    wire_sharding = NamedSharding(stacked, wire_spec)
    out = _collective(stacked, wire_spec, "ppermute")(
        _global(wire_shape, wire_sharding, buffers, aval.dtype)
    )
    jax.block_until_ready(out)  # see "one collective at a time" in the module docstring
    received = _shards(out, set(target.mesh.devices.flat))
    if not _local(_flat(target)):
        return None
    if scalar:
        received = {d: b.reshape(()) for d, b in received.items()}
    return assemble(aval, target, [received[d] for d in _local(_flat(target))])


def _broadcast_wire(
    x: jax.Array | None, source: NamedSharding, target: NamedSharding, aval: Any
) -> jax.Array | None:
    s0 = _flat(source)[0]
    members = [s0] + [d for d in _flat(target) if d != s0]
    mesh = Mesh(np.array(members, dtype=object), (WIRE,), axis_types=(AxisType.Auto,))
    buffers = {}
    if x is not None and _local(_flat(source)):
        whole = _reshard(x, NamedSharding(source.mesh, PartitionSpec()))
        buffers = {d: b[None] for d, b in _shards(whole, {s0}).items()}
    shape = (len(members), *aval.shape)
    spec = PartitionSpec(WIRE)
    out = None
    if _local(members):
        out = _collective(mesh, spec, "psum")(
            _global(shape, NamedSharding(mesh, spec), buffers, aval.dtype)
        )
        jax.block_until_ready(out)  # see "one collective at a time" in the module docstring
    if not _local(_flat(target)):
        return None
    received = _shards(out, set(_flat(target)))
    replicated = NamedSharding(target.mesh, PartitionSpec())
    whole = assemble(aval, replicated, [received[d] for d in _local(_flat(target))])
    return jax.block_until_ready(_reshard(whole, target))  # a collective if target spans processes


def transfer(
    x: jax.Array | None, source: NamedSharding, target: NamedSharding, aval: Any
) -> jax.Array | None:
    """Moves ``x`` (``source``-sharded) to ``target`` across processes.

    Every process owning a device of ``source`` or ``target`` calls it (``x`` is ``None`` in
    a process that holds none of the source). Returns the moved array in processes owning a
    target device, else ``None``.
    """
    if uses_layout_wire(source, target):
        return _layout_wire(x, source, target, aval)
    return _broadcast_wire(x, source, target, aval)


def wire_bytes(source: NamedSharding, target: NamedSharding, aval: Any) -> int:
    """Bytes that cross devices for one transfer (the analytic count B8 compares with)."""
    size = int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    if uses_layout_wire(source, target):
        shard = int(np.prod(target.shard_shape(tuple(aval.shape)), dtype=np.int64))
        return shard * np.dtype(aval.dtype).itemsize * len(_flat(target))
    return size * len([d for d in _flat(target) if d != _flat(source)[0]])


# --- host values ----------------------------------------------------------------------------


def _first_device_per_process() -> list[Any]:
    first: dict[int, Any] = {}
    for d in jax.devices():
        if d.process_index not in first or d.id < first[d.process_index].id:
            first[d.process_index] = d
    return [first[p] for p in sorted(first)]


def _local_read(x: Any) -> bool:
    """Whether every process can read ``x`` from its own devices (no broadcast needed)."""
    if not isinstance(x, jax.Array):
        return True
    everyone = frozenset(range(jax.process_count()))
    return owners(list(x.sharding.device_set)) == everyone and x.is_fully_replicated


_HOST_VALUE_CALLS = itertools.count()  # host_values calls that broadcast, the same everywhere


def _check_same_arrays(tree: Any) -> None:
    """Raises ``HostValuesError`` unless every process passed the same arrays to broadcast.

    A leaf to broadcast names its devices; for one array of the job they are the same in
    every process, for arrays each process made alone they differ, and the broadcast would
    wait for a partner that never comes (a gloo timeout minutes later). Each process
    publishes its leaves' devices once per such call and compares them with the others';
    the store keeps each process's entry of the latest call only.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    mine = [
        [jax.tree_util.keystr(path), sorted(d.id for d in x.sharding.device_set)]
        for path, x in leaves
        if not _local_read(x)
    ]
    if not mine:  # decided alike everywhere: an array's device set is the same in every process
        return
    call, me = next(_HOST_VALUE_CALLS), jax.process_index()
    _exchange.publish(f"mmflax/host_values/{call}/{me}", json.dumps(mine))
    for other in range(jax.process_count()):
        if other == me:
            continue
        what = f"process {other}'s arrays for host_values call {call}"
        theirs = json.loads(_exchange.fetch(f"mmflax/host_values/{call}/{other}", what))
        for (path, here), (_, there) in zip(mine, theirs, strict=False):
            if here != there:
                raise errors.HostValuesError(
                    f"Expected the same arrays in every process, got leaf {path or '(root)'} "
                    f"on devices {here} in process {me} and {there} in process {other}: "
                    "each process made its own array. Pass the outputs of the program "
                    "(the same array in every process), or read a value each process "
                    "computed alone with `np.asarray`."
                )
        if len(theirs) != len(mine):
            raise errors.HostValuesError(
                f"Expected the same tree in every process, got {len(mine)} leaves to "
                f"broadcast in process {me} and {len(theirs)} in process {other}. Call "
                "host_values with the same tree everywhere."
            )
    if call:  # everyone published this call, so has read the last one: drop our entry
        _exchange.forget(f"mmflax/host_values/{call - 1}/{me}")


def _host_value(x: Any) -> np.ndarray:
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if _local_read(x):
        return np.asarray(x.addressable_shards[0].data)
    source = x.sharding
    if not isinstance(source, NamedSharding):
        source = NamedSharding(Mesh(np.array(list(source.device_set)), ("_one",)), PartitionSpec())
    target = NamedSharding(
        Mesh(
            np.array(_first_device_per_process(), dtype=object),
            (WIRE,),
            axis_types=(AxisType.Auto,),
        ),
        PartitionSpec(),
    )
    held = x if x.is_fully_addressable or _local(_flat(source)) else None
    out = _broadcast_wire(held, source, target, x.aval)
    return np.asarray(out.addressable_shards[0].data)


def host_values(tree: Any) -> Any:
    """Every array leaf of ``tree`` as a numpy array, in every process of the job.

    A collective: every process calls it with the same tree (the same leaves, as the program
    returned them). Leaves held by other processes (a loss computed by the last pipeline stage)
    are broadcast from their holder; replicated leaves are read locally. In a single process it
    is ``jax.device_get``. Before broadcasting, the processes compare the devices of the leaves
    to broadcast through the coordinator's key-value store.

    Raises:
        HostValuesError: a leaf is an array each process made on its own devices (or the
            trees differ), instead of one array of the job.

    Example:
        >>> import jax.numpy as jnp
        >>> from multimesh_flax.distributed import host_values
        >>> host_values({"loss": jnp.float32(0.5)})
        {'loss': array(0.5, dtype=float32)}
    """
    if jax.process_count() == 1:
        return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))
    _sequence.enter("host_values", publish=True)
    _check_same_arrays(tree)
    try:
        return jax.tree_util.tree_map(_host_value, tree)
    except jax.errors.JaxRuntimeError:
        _watchdog.await_loss()  # a lost peer: the watchdog names it and ends the process
        raise
