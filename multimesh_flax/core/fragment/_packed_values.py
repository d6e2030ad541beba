"""Small values one unit hands to another on the same place travel as one array per dtype.

A forward unit hands its backward the residuals of autodiff: a gpt-tiny block's forward
returns 33 arrays besides its activation, most of them a few kilobytes per device (layer-norm
statistics, softmax maxima, a head-split query). Each array costs the host on both sides:
JAX's call of a compiled program grows by about 6 us per output on this CPU host and 2-4 us
on an H200's (``benchmarks/_breakdown.jax_call_costs``), the backward's call by about 1 us
per input, and each array is freed on its own. (B7's S=4 m=16 1F1B point: the stage-1
forward ran 218-325 us a call faster without its 25 outputs of at most 16 KiB a device;
packed, the step's calling thread spends 10-28% less CPU time; ``docs/design-notes.md``.)

:func:`pack_crossings` gives each such handover one array per dtype: the producing fragment
ends by concatenating the values, raveled, behind an optimization barrier, and the one
fragment reading them starts by slicing them back out, behind another. Nothing is computed
differently: the barriers keep XLA from compiling the code around them otherwise, so the
values are the same bit for bit. Copying them costs memory bandwidth, so only values of at
most :data:`SMALL_BYTES` per device are packed, and only in groups of two or more.

On a place of several devices a value's layout is the compiler's choice, and a concatenation
of differently sharded values would make it gather them. Values are packed there only on a
data-parallel place whose microbatch rows are sharded over all its devices (read from its
sharding constraints, :func:`_stacked_sums.batch_axes`), and only values whose leading
dimension is the microbatch's: each is reshaped to ``(devices, -1)`` and the rows
concatenated, so each device packs and unpacks its own rows and nothing is communicated.
(A value XLA keeps replicated, a mask say, is then handed over as each device's rows: its
reader gets it sharded, which only a reader needing all of it would pay for with a gather.)

What qualifies: an output of one pipeline unit that exactly one other unit on the same place
reads (a forward's residuals, read by its backward), that the program does not return and
that the reader does not donate. Units run once per microbatch, so that is where the arrays
add up; glue, which runs once a step, is left as it is (its programs are shared between
places by structure, ``_shared_glue``, which packing would only perturb).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.extend.core import primitives
from jax.sharding import AxisType

from multimesh_flax.core.fragment._stacked_sums import Batch, batch_axes
from multimesh_flax.core.trace import TracedProgram, reading_renamed

ENABLED = True  # internal switch: False hands every value over as an array of its own
SMALL_BYTES = 16 * 1024  # the most bytes per device of a value that is packed

_OUTPUT = "output"  # a reader that is not a fragment: the program returns the value
_APART = object()  # a value that is not packed (``_layout``)


def pack_crossings(traced: TracedProgram, fragments: Sequence[Any]) -> list[Any] | None:
    """``fragments`` (in dispatch order, boundaries set) with the small values each unit
    hands to one other unit on its place packed (module doc): the maker's last equation packs
    them, the reader's first unpacks them into new variables its equations read instead.
    Their boundaries are left to rebuild; ``None`` if nothing is packed. ``fragments`` are
    not edited."""
    if not ENABLED:
        return None
    groups = _groups(traced, fragments)
    if not groups:
        return None
    order = list(fragments)
    for (maker, reader, _, batch), values in groups.items():
        pack, unpack = _pair(tuple(v.aval for v in values), batch)
        flat = jex.Var(pack["call_jaxpr"].out_avals[0])
        made = order[maker]
        eqn = jex.new_jaxpr_eqn(values, [flat], primitives.closed_call_p, pack, frozenset())
        order[maker] = dataclasses.replace(made, eqns=[*made.eqns, eqn])
        renamed = {v: jex.Var(v.aval) for v in values}
        eqn = jex.new_jaxpr_eqn(
            [flat], list(renamed.values()), primitives.closed_call_p, unpack, frozenset()
        )
        order[reader] = _reading(order[reader], eqn, renamed)
    return order


def _groups(
    traced: TracedProgram, fragments: Sequence[Any]
) -> dict[tuple[int, int, Any, Batch | None], list[Any]]:
    """The values to pack, by ``(maker's position, reader's position, dtype, batch)``:
    groups of two or more."""
    readers = _readers(traced, fragments)
    batches = functools.cache(lambda place: _batches(fragments, place))
    groups: dict[tuple[int, int, Any, Batch | None], list[Any]] = {}
    for pos, frag in enumerate(fragments):
        if frag.unit is None:
            continue
        for v in frag.outvars:
            found = readers.get(v, ())
            if len(found) != 1 or found[0] == _OUTPUT:
                continue
            (reader,) = found
            into = fragments[reader]
            if into.unit is None or into.place != frag.place or v in into.donate:
                continue
            batch = _layout(v.aval, len(frag.place), batches(frag.place))
            if batch is not _APART:
                groups.setdefault((pos, reader, v.aval.dtype, batch), []).append(v)
    return {key: values for key, values in groups.items() if len(values) >= 2}


def _readers(traced: TracedProgram, fragments: Sequence[Any]) -> dict[Any, list[Any]]:
    """Per variable, the positions of the fragments taking it as an input, each once, and
    ``_OUTPUT`` if the program returns it."""
    readers: dict[Any, list[Any]] = {}
    for pos, frag in enumerate(fragments):
        for v in frag.invars:
            readers.setdefault(v, []).append(pos)
    for v in traced.jaxpr.outvars:
        if not isinstance(v, jex.Literal):
            readers.setdefault(v, []).append(_OUTPUT)
    return readers


def _batches(fragments: Sequence[Any], place: Any) -> dict[int, Batch]:
    """The place's batches by leading size, where they shard over all its devices."""
    found = batch_axes([e for frag in fragments if frag.place == place for e in frag.eqns])
    return {size: b for size, b in found.items() if b.size == len(place)}


def _layout(aval: Any, devices: int, batches: dict[int, Batch]) -> Batch | None | object:
    """How a value of ``aval`` on a place of ``devices`` is packed: raveled (``None``, one
    device), as rows over its batch (several, ``batches`` by leading size), or ``_APART``
    (not packed: too large, no batch, or typed on Explicit axes or manual ones).

    >>> small = jax.core.ShapedArray((4, 6), jnp.float32)
    >>> _layout(small, 1, {}) is None, _layout(small, 2, {}) is _APART
    (True, True)
    """
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is not None and AxisType.Explicit in getattr(mesh, "axis_types", ()):
        return _APART
    if getattr(aval, "vma", None) or not hasattr(aval, "dtype"):
        return _APART
    if devices == 1:
        return None if aval.size * aval.dtype.itemsize <= SMALL_BYTES else _APART
    batch = batches.get(aval.shape[0]) if aval.ndim else None
    if batch is None or aval.size * aval.dtype.itemsize > SMALL_BYTES * batch.size:
        return _APART
    return batch


def _reading(frag: Any, unpack: Any, renamed: dict[Any, Any]) -> Any:
    """``frag`` starting with ``unpack``, its equations reading the renamed values."""
    eqns = [unpack, *(reading_renamed(e, renamed) for e in frag.eqns)]
    return dataclasses.replace(frag, eqns=eqns)


@functools.lru_cache(maxsize=256)
def _pair(avals: tuple[Any, ...], batch: Batch | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The bodies packing values of ``avals`` into one array and slicing them back out, as
    call parameters (one pair per signature: every microbatch's units share programs)."""
    rows = 1 if batch is None else batch.size
    sizes = [a.size // rows for a in avals]
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]

    def pack(*values: Any) -> Any:
        values = jax.lax.optimization_barrier(values)
        if batch is None:
            return jnp.concatenate([v.ravel() for v in values])
        flat = jnp.concatenate([v.reshape(rows, -1) for v in values], axis=1)
        return jax.lax.with_sharding_constraint(flat, batch.sharding())

    def unpack(flat: Any) -> tuple[Any, ...]:
        parts, at = [], 0
        for size, a in zip(sizes, avals, strict=True):
            if batch is None:
                part = flat[at : at + size].reshape(a.shape)
            else:
                part = flat[:, at : at + size].reshape(a.shape)
                part = jax.lax.with_sharding_constraint(part, batch.sharding())
            parts.append(part)
            at += size
        return jax.lax.optimization_barrier(tuple(parts))

    packed = jax.make_jaxpr(pack)(*shapes)
    return {"call_jaxpr": packed}, {"call_jaxpr": jax.make_jaxpr(unpack)(packed.out_avals[0])}
