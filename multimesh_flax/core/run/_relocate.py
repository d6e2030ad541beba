"""Relocating a compiled executable to another device set, instead of compiling it again.

An SPMD executable addresses its partitions by number; its device assignment says which
device runs each. An executable compiled for submesh A therefore runs on an equally shaped
submesh B once loaded with B's devices in the positions of A's, which takes milliseconds
where compiling takes seconds. Pipeline stages with identical bodies (every middle stage of
a transformer) then compile once, not once per submesh.

JAX has no public call for this: :func:`relocate` serializes the executable with
``jax.experimental.serialize_executable.serialize`` and loads it back with every device
replaced through ``mapping``. Whatever fails there returns ``None`` (the caller compiles
instead), so a change in JAX's serialized form costs time, never a wrong result.

Only an executable the backend compiled in this process serializes whole: one loaded from
the persistent compilation cache serializes without its kernels, so its relocated copy fails
when run ("Function ... not found"), and a relocated one does not serialize at all.
:func:`compile` says which kind it made; relocate only the first (the other device sets'
programs then usually come from the cache too). ``xla_client`` is JAX's private module for
the PJRT client types (``CompileOptions``, ``DeviceAssignment``, ``DeviceList``).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax._src.lib import xla_client as xc
from jax.experimental import serialize_executable

from multimesh_flax import _compilation_cache


def compile(lowered: Any) -> tuple[Any, bool]:  # noqa: A001 -- the stage it performs
    """``(lowered.compile(), whether the backend compiled it here)``: only then is it a
    source :func:`relocate` can use (else it came from the persistent compilation cache).
    Hits are counted in the calling thread: another thread compiling meanwhile (``_ahead``)
    does not count."""
    read = _compilation_cache.compilation_counter(this_thread=True)
    compiled = lowered.compile()
    return compiled, read()["cache_hits"] == 0


class _Relocating(pickle.Unpickler):
    """Loads ``serialize``'s payload with each device ``d`` replaced by ``mapping[d.id]``."""

    def __init__(self, payload: bytes, mapping: Mapping[int, Any], assignment: list[Any]):
        super().__init__(io.BytesIO(payload))
        self.mapping = mapping
        self.devices = xc.DeviceList(tuple(assignment))
        self.client = assignment[0].client
        options = xc.CompileOptions()
        options.num_replicas = 1
        options.num_partitions = len(assignment)
        options.device_assignment = xc.DeviceAssignment.create(
            np.array([[d.id for d in assignment]])
        )
        self.options = options

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "exec":
            return self.client.deserialize_executable(pid[1], self.devices, self.options)
        if kind == "device":
            return self.mapping[pid[1]]
        if kind == "client":
            return self.client
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


def relocate(compiled: Any, mapping: Mapping[int, Any]) -> Any:
    """``compiled`` (a ``jax.stages.Compiled`` the backend compiled in this process, see
    :func:`compile`) loaded to run on ``mapping[d.id]`` wherever it ran on ``d``; ``None`` if
    that cannot be done.

    Example:
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> a, b = (jax.make_mesh((4,), ("x",), devices=jax.devices()[i : i + 4],
        ...         axis_types=(jax.sharding.AxisType.Auto,)) for i in (0, 4))
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(a, P("x")))
        >>> on_a = jax.jit(lambda v: v * 2 + 1).lower(x).compile()
        >>> on_b = relocate(on_a, {d.id: e for d, e in zip(a.devices.flat, b.devices.flat)})
        >>> y = on_b(jax.device_put(x, NamedSharding(b, P("x"))))
        >>> sorted(d.id for d in y.devices()), float(y.sum())
        ([4, 5, 6, 7], 64.0)
    """
    try:
        assignment = [mapping[d.id] for d in compiled.runtime_executable().local_devices()]
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        unloaded, args_info, no_kwargs = _Relocating(payload, mapping, assignment).load()
        return jax.stages.Compiled(
            unloaded.load(), [], in_tree.unflatten(args_info), out_tree, no_kwargs=no_kwargs
        )
    except Exception:  # noqa: BLE001 -- any failure: the caller compiles instead
        return None
