"""Placement and fragmenting: from a labelled jaxpr to per-submesh fragments.

Placement gives every equation and program input exactly one *place* (the set of device ids
of a submesh):

* task equations go to their task's submesh;
* glue equations (loss, gradient sums, optimizer updates) go where most of their input bytes
  were produced; glue with no produced inputs (constants, input preprocessing) goes to its
  first consumer; glue with neither goes to the first task's submesh;
* program inputs go to their first consumer (a parameter lives where its task uses it).

Fragmenting then cuts the equation list into fragments, each a run of same-place equations
that one ``jax.jit`` executes. A task equation joins the latest fragment of the same
``(task, phase)``, glue joins the latest fragment on its place -- in both cases only if every
input of the equation is produced by that fragment or an earlier one, which keeps the
fragment order a valid execution order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from multimesh_flax.core import _mesh, _trace

Place = tuple[int, ...]


def place_of(mesh: jax.sharding.Mesh) -> Place:
    """The place (sorted device ids) of a mesh."""
    return tuple(sorted(int(i) for i in mesh.device_ids.reshape(-1)))


def nbytes(var: Any) -> int:
    aval = var.aval
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


@dataclasses.dataclass
class Fragment:
    """A run of equations executed by one ``jax.jit`` on one place."""

    index: int
    place: Place
    label: _trace.Label
    eqns: list[Any] = dataclasses.field(default_factory=list)
    invars: list[Any] = dataclasses.field(default_factory=list)
    outvars: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Partition:
    """The placed and fragmented program."""

    traced: _trace.TracedProgram
    fragments: list[Fragment]
    input_place: dict[Any, Place]  # program input (or const) var -> home place
    home: dict[Any, Place]  # every non-literal var -> where it is produced
    place_meshes: dict[Place, jax.sharding.Mesh]  # a mesh per place for default shardings
    default_place: Place


def _consumers(jaxpr: jex.Jaxpr) -> dict[Any, list[int]]:
    users: dict[Any, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex.Literal):
                users.setdefault(v, []).append(i)
    return users


def _place_meshes(traced: _trace.TracedProgram, devices: Any) -> tuple[dict[Place, Any], Place]:
    meshes: dict[Place, Any] = {}
    for resolved in traced.tasks.values():
        meshes.setdefault(place_of(resolved.mesh), resolved.mesh)
    with _mesh.use_device_list(devices):
        pool = np.array(_mesh.get_device_list(), dtype=object)
    everything = _mesh.make_auto_mesh(pool, ("devices",))
    first = next(
        (traced.tasks[label[0]].mesh for label in traced.labels if label is not None), None
    )
    default_mesh = first if first is not None else everything
    meshes.setdefault(place_of(default_mesh), default_mesh)
    return meshes, place_of(default_mesh)


def _place_equations(traced: _trace.TracedProgram, default: Place) -> list[Place]:
    eqns = traced.jaxpr.eqns
    places: list[Place | None] = [
        None if label is None else place_of(traced.tasks[label[0]].mesh) for label in traced.labels
    ]
    producer: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            producer[v] = i
    for i, eqn in enumerate(eqns):  # glue: where most produced input bytes live
        if places[i] is not None:
            continue
        weight: dict[Place, int] = {}
        for v in eqn.invars:
            src = None if isinstance(v, jex.Literal) else producer.get(v)
            if src is not None and places[src] is not None:
                weight[places[src]] = weight.get(places[src], 0) + nbytes(v) + 1
        if weight:
            places[i] = max(weight, key=weight.__getitem__)
    users = _consumers(traced.jaxpr)
    for i in reversed(range(len(eqns))):  # remaining glue: at its first consumer
        if places[i] is None:
            after = sorted(u for v in eqns[i].outvars for u in users.get(v, ()))
            placed = [places[u] for u in after if places[u] is not None]
            places[i] = placed[0] if placed else default
    return places  # type: ignore[return-value]


def _fragment(traced: _trace.TracedProgram, places: list[Place]) -> list[Fragment]:
    fragments: list[Fragment] = []
    made_in: dict[Any, int] = {}  # var -> fragment index producing it
    latest: dict[Any, int] = {}  # (place, label) or place -> latest fragment index
    for eqn, label, place in zip(traced.jaxpr.eqns, traced.labels, places, strict=True):
        deps = [made_in[v] for v in eqn.invars if not isinstance(v, jex.Literal) and v in made_in]
        earliest = max(deps, default=-1)
        key = (place, label) if label is not None else place
        candidate = latest.get(key)
        if candidate is None or candidate < earliest:
            candidate = len(fragments)
            fragments.append(Fragment(index=candidate, place=place, label=label))
            latest[(place, label)] = candidate
        latest[place] = max(latest.get(place, -1), candidate)
        fragments[candidate].eqns.append(eqn)
        for v in eqn.outvars:
            made_in[v] = candidate
    _assign_boundaries(traced, fragments, made_in)
    return fragments


def _assign_boundaries(
    traced: _trace.TracedProgram, fragments: Sequence[Fragment], made_in: dict[Any, int]
) -> None:
    needed_outside: set[Any] = {v for v in traced.jaxpr.outvars if not isinstance(v, jex.Literal)}
    for frag in fragments:
        seen: set[Any] = set()
        for eqn in frag.eqns:
            for v in eqn.invars:
                if isinstance(v, jex.Literal) or v in seen:
                    continue
                if made_in.get(v) != frag.index:
                    frag.invars.append(v)
                    seen.add(v)
                    needed_outside.add(v)
    for frag in fragments:
        frag.outvars = [v for eqn in frag.eqns for v in eqn.outvars if v in needed_outside]


def partition(traced: _trace.TracedProgram, devices: Any = None) -> Partition:
    """Places and fragments a traced program."""
    meshes, default = _place_meshes(traced, devices)
    places = _place_equations(traced, default)
    fragments = _fragment(traced, places)
    home: dict[Any, Place] = {}
    for frag in fragments:
        for eqn in frag.eqns:
            for v in eqn.outvars:
                home[v] = frag.place
    users = _consumers(traced.jaxpr)
    input_place: dict[Any, Place] = {}
    for v in [*traced.jaxpr.constvars, *traced.jaxpr.invars]:
        if users.get(v):
            input_place[v] = places[users[v][0]]
            home[v] = input_place[v]
    by_id = {d.id: d for d in jax.devices()}
    for place in set(places):
        if place not in meshes:
            grid = np.array([by_id[i] for i in place], dtype=object)
            meshes[place] = _mesh.make_auto_mesh(grid, ("devices",))
    return Partition(
        traced=traced,
        fragments=fragments,
        input_place=input_place,
        home=home,
        place_meshes=meshes,
        default_place=default,
    )
