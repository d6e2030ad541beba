"""Fragment compilation: one cached program per distinct fragment, compiled once.

Fragments are compiled through a process-wide cache keyed by (structural key of the fragment
jaxpr, donation, output shardings), with sharding constraints rewritten onto abstract meshes,
so identical fragments -- the same stage for every microbatch, identical blocks on different
submeshes, or the same step traced twice -- share one ``FragmentProgram``: traced and lowered
once, and compiled once per input signature up to the devices. For a second device set
with the same shapes, specs and mesh shapes, the executable is relocated
(``_relocate``), not compiled again.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax.core.fragment import (
    Fragment,
    canonical_spec,
    constraints_making,
    fragment_jaxpr,
)
from multimesh_flax.core.run import _relocate
from multimesh_flax.core.run._explicit import explicit_fun, has_explicit_axes, untyped
from multimesh_flax.core.trace import (
    BoundedCache,
    structural_key,
)

# Compiled fragments by (structural key, donation, output shardings): shared by every
# program of the process. Bounded: a program keeps the fragments it uses.
_FRAGMENT_CACHE = BoundedCache(capacity=2048)


def _as_tuple_fun(jaxpr: jex.Jaxpr) -> Any:
    if has_explicit_axes(jaxpr):  # a task with Explicit axes: typed as traced (_explicit)
        return explicit_fun(jaxpr)
    run = jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, []))

    def fragment(*args: Any) -> tuple[Any, ...]:
        return tuple(run(*[untyped(x) for x in args]))

    return fragment


class FragmentProgram:
    """A fragment's ``jax.jit`` and the executables it has, per input signature.

    ``executable(args)`` returns the executable for arguments like ``args``: one already made
    for the same shardings; else one compiled here for the same shapes and specs on another,
    equally shaped device set, relocated (``relocations`` counts them); else a new compile
    (or a load from the persistent compilation cache).
    """

    def __init__(self, jitted: Any) -> None:
        self.jit = jitted
        # (avals and shardings up to the devices) -> executables made for them
        self._executables: dict[Any, list[_Made]] = {}
        self.relocations = 0
        # held while making an executable: a first call and a walk compiling ahead of it
        # (``_ahead``) make each executable once
        self._lock = threading.Lock()

    def executable_count(self) -> int:
        # list(): one step under the interpreter lock, while a walk (``_ahead``) may add keys
        return sum(len(made) for made in list(self._executables.values()))

    def executable(self, args: Any) -> Any:
        """The executable for arguments like ``args`` (arrays, or ``jax.ShapeDtypeStruct``\\ s
        with their shardings)."""
        with self._lock:
            return self._executable(args)

    def _executable(self, args: Any) -> Any:
        key, devices = _signature(args)
        made = self._executables.setdefault(key, [])
        for entry in made:
            if entry.devices == devices:
                return entry.compiled
        compiled = self._relocated(made, devices) if devices is not None else None
        compiled_here = False
        if compiled is None:
            compiled, compiled_here = _relocate.compile(self.jit.lower(*args))
        else:
            self.relocations += 1
        made.append(_Made(devices, compiled, compiled_here))
        return compiled

    def _relocated(self, made: list[_Made], devices: tuple[Any, ...]) -> Any:
        if jax.process_count() > 1:  # another process may run the other device set
            return None
        for entry in made:
            mapping = _device_mapping(entry.devices, devices) if entry.compiled_here else None
            if mapping is not None:
                return _relocate.relocate(entry.compiled, mapping)
        return None


class _Made(NamedTuple):
    devices: tuple[Any, ...] | None  # each argument's mesh devices (``_signature``)
    compiled: Any  # the ``jax.stages.Compiled``
    compiled_here: bool  # by the backend in this process: a source for relocation


def _signature(args: Any) -> tuple[Any, Any]:
    """``(key, devices)``: the arguments' avals and shardings up to their devices, and per
    argument its mesh's devices in mesh order (``None``: not all on named meshes, so the key
    holds the shardings themselves)."""
    key, devices = [], []
    for x in args:
        sharding = x.sharding
        if not isinstance(sharding, NamedSharding):
            return tuple((_aval_key(a), a.sharding) for a in args), None
        mesh = sharding.mesh
        spec = canonical_spec(sharding.spec)  # P("x", None) lays out as P("x")
        where = (mesh.axis_names, mesh.axis_types, mesh.devices.shape, spec, sharding.memory_kind)
        key.append((_aval_key(x), *where))
        devices.append(mesh.devices.flat)
    return tuple(key), tuple(tuple(devs) for devs in devices)


def _aval_key(x: Any) -> tuple[Any, ...]:
    """What of ``x``'s type a fragment's executable depends on besides its sharding: shape,
    dtype, weak type and the manual axes it varies over. (Newer JAX's avals also carry a
    layout object that compares unequal between two arrays of one default layout, so the
    aval itself is not the key.)"""
    aval = jax.typeof(x)
    return aval.shape, aval.dtype, aval.weak_type, getattr(aval, "vma", None)


def _device_mapping(old: Any, new: Any) -> dict[int, Any] | None:
    """``{old device id: new device}``, position by position over every argument's mesh, if
    that is one consistent one-to-one mapping (``None``: it is not, or nothing moves)."""
    mapping: dict[int, Any] = {}
    for before, after in zip(old, new, strict=True):
        for d, e in zip(before, after, strict=True):
            if mapping.setdefault(d.id, e).id != e.id:  # devices compare by id: two meshes
                return None  # may hold different objects for one device
    targets = {e.id for e in mapping.values()}
    if len(targets) != len(mapping) or all(k == e.id for k, e in mapping.items()):
        return None
    return mapping


def compile_fragment(
    frag: Fragment,
    mesh: jax.sharding.Mesh,
    donate: tuple[int, ...],
    memo: dict[int, Any] | None = None,
) -> Any:
    """Returns the (cached) ``FragmentProgram`` of a fragment (``memo``: see
    ``structural_key``)."""
    jaxpr = fragment_jaxpr(frag)
    out_shardings = None
    if not frag.invars:  # nothing to infer devices from: pin outputs to the place
        made_by = constraints_making(frag.eqns)  # an output a constraint makes keeps its spec
        specs = {v: e.params["sharding"].spec for v, e in made_by.items()}
        out_shardings = tuple(
            NamedSharding(mesh, specs.get(v, PartitionSpec())) for v in frag.outvars
        )
    key = (structural_key(jaxpr, memo), donate, out_shardings)
    return _FRAGMENT_CACHE.get_or_make(
        key,
        lambda _: FragmentProgram(
            jax.jit(_as_tuple_fun(jaxpr), donate_argnums=donate, out_shardings=out_shardings)
        ),
    )
