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
input of the equation is produced by that fragment or an earlier one, so every dependency
points from a lower fragment index to a higher one and the fragments form a DAG.

With microbatching (``microbatch``, see ``_pipeline``) the keys are finer: a task equation
joins the latest fragment of its unit ``(stage, microbatch, phase)``, glue of a microbatch
the latest fragments of that microbatch on its place, and glue outside every microbatch only
other such glue. Under a schedule, sums over microbatches are first re-associated into the
schedule's order (``_accumulate``), and ``_pipeline.dispatch_order`` finally reorders the
fragments, so glue merges only where that adds no ordering constraint (see ``_Cutter``).
Last, ``_fuse`` runs a fragment and the next one on its place as one fragment where that
changes no value or order and adds no executable (the last stage's ``F_k`` and ``B_k``).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import numpy as np

from multimesh_flax.core.declare import _devices
from multimesh_flax.core.declare._devices import Place, place_of
from multimesh_flax.core.fragment import _fuse, _sink
from multimesh_flax.core.plan import _accumulate, _pipeline
from multimesh_flax.core.trace import _session, _trace


def aval_nbytes(aval: Any) -> int:
    """The bytes of a value of type ``aval`` (Python integers: no overflow, no NumPy call)."""
    return math.prod(aval.shape) * aval.dtype.itemsize


def nbytes(var: Any) -> int:
    """The bytes of a variable's value."""
    return aval_nbytes(var.aval)


@dataclasses.dataclass
class Fragment:
    """A run of equations executed by one ``jax.jit`` on one place."""

    index: int
    place: Place
    label: _session.Label | None  # None: glue
    eqns: list[Any] = dataclasses.field(default_factory=list)
    invars: list[Any] = dataclasses.field(default_factory=list)
    outvars: list[Any] = dataclasses.field(default_factory=list)
    unit: _pipeline.Unit | None = None  # (region, stage, microbatch, phase) when pipelined
    microbatch: int | None = None
    parts: tuple[Fragment, ...] = ()  # the fragments fused into this one (``_fuse``), if any


@dataclasses.dataclass
class Partition:
    """The placed and fragmented program."""

    traced: _trace.TracedProgram
    fragments: list[Fragment]
    input_place: dict[Any, Place]  # program input (or const) var -> home place
    home: dict[Any, Place]  # every non-literal var -> where it is produced
    place_meshes: dict[Place, jax.sharding.Mesh]  # a mesh per place for default shardings
    default_place: Place
    plan: _pipeline.PipelinePlan | None = None  # microbatches, stages, schedules

    @functools.cached_property
    def _first_readers(self) -> dict[tuple[Any, Place], Fragment]:
        first: dict[tuple[Any, Place], Fragment] = {}
        for frag in self.fragments:
            for v in frag.invars:
                first.setdefault((v, frag.place), frag)
        return first

    def first_reader(self, var: Any, place: Place) -> Fragment:
        """The first fragment on ``place`` that takes ``var`` as an input (index built once)."""
        return self._first_readers[(var, place)]


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
    with _devices.use_device_list(devices):
        pool = np.array(_devices.get_device_list(), dtype=object)
    everything = _devices.make_auto_mesh(pool, ("devices",))
    first = next(
        (traced.tasks[label.task].mesh for label in traced.labels if label is not None), None
    )
    if traced.default_task is not None:  # a task registered as "default" says where
        first = traced.default_task.mesh
    default_mesh = first if first is not None else everything
    meshes.setdefault(place_of(default_mesh), default_mesh)
    return meshes, place_of(default_mesh)


def _pinned_place(eqn: Any, task_places: set[Place]) -> Place | None:
    """The place a glue sharding constraint names, if it is a task's submesh.

    ``with_sharding_constraint(x, NamedSharding(stage_mesh, spec))`` outside every task (e.g.
    a training step keeping its new state where the old one was) runs on that submesh, so
    the value ends up there; placed by its producer instead, the constraint would only fix
    the layout and the value would stay on the producer's devices.
    """
    sharding = _trace.concrete_constraint(eqn)
    if sharding is None:
        return None
    place = place_of(sharding.mesh)
    return place if place in task_places else None


def _place_equations(
    traced: _trace.TracedProgram, default: Place, users: dict[Any, list[int]]
) -> list[Place]:
    eqns = traced.jaxpr.eqns
    of_task = {uid: place_of(resolved.mesh) for uid, resolved in traced.tasks.items()}
    places: list[Place | None] = [
        None if label is None else of_task[label.task] for label in traced.labels
    ]
    producer = traced.producer
    task_places = set(of_task.values())
    for i, eqn in enumerate(eqns):  # glue: where most produced input bytes live
        if places[i] is not None:
            continue
        places[i] = _pinned_place(eqn, task_places)
        if places[i] is not None:
            continue
        weight: dict[Place, int] = {}
        for v in eqn.invars:
            src = None if isinstance(v, jex.Literal) else producer.get(v)
            if src is not None and places[src] is not None:
                weight[places[src]] = weight.get(places[src], 0) + nbytes(v) + 1
        if weight:
            places[i] = max(weight, key=weight.__getitem__)
    for i in reversed(range(len(eqns))):  # remaining glue: at its first consumer
        if places[i] is None:
            after = sorted(u for v in eqns[i].outvars for u in users.get(v, ()))
            placed = [places[u] for u in after if places[u] is not None]
            places[i] = placed[0] if placed else default
    return places  # type: ignore[return-value]


class _Group(enum.Enum):
    """What the fragments under a join key have in common (besides their place)."""

    PLACE = "any equation on the place (no microbatching)"
    TASK = "one task label (and microbatch)"
    UNIT = "one pipeline unit"
    MICROBATCH = "one microbatch"
    OUTSIDE = "glue outside every microbatch"
    FREE = "free glue (depends only on other free glue)"

    def __repr__(self) -> str:
        return f"_Group.{self.name}"


class _Key(NamedTuple):
    """A group of fragments an equation may join: ``(group, place, what identifies it)``."""

    group: _Group
    place: Place
    of: Any = None  # the label, unit, microbatch or (label, microbatch)


class _Lookup(NamedTuple):
    key: _Key
    neutral: bool  # join only if that adds no ordering constraint


def _keys(
    i: int, place: Place, label: _session.Label | None, plan: _pipeline.PipelinePlan | None
) -> tuple[list[_Lookup], list[_Key]]:
    """Where equation ``i`` may join (in preference order) and which keys it updates."""
    if plan is None:
        if label is None:
            return [_Lookup(_Key(_Group.PLACE, place), False)], [_Key(_Group.PLACE, place)]
        task = _Key(_Group.TASK, place, label)
        return [_Lookup(task, False)], [task, _Key(_Group.PLACE, place)]
    strict = plan.scheduled  # fragments get reordered: glue may only merge neutrally
    mb, unit, _ = plan.equations[i]
    microbatch = _Key(_Group.MICROBATCH, place, mb)
    if unit is not None:
        return [_Lookup(_Key(_Group.UNIT, place, unit), False)], [
            _Key(_Group.UNIT, place, unit),
            microbatch,
        ]
    if label is not None:
        task = _Key(_Group.TASK, place, (label, mb))
        return [_Lookup(task, False)], [task, microbatch]
    if mb is None:
        return [_Lookup(_Key(_Group.OUTSIDE, place), strict)], [_Key(_Group.OUTSIDE, place)]
    return [_Lookup(microbatch, strict)], [microbatch]


class _Cutter:
    """Cuts equations into fragments; every dependency points to a lower fragment index.

    An equation joins a candidate fragment only if the candidate's index is at least that of
    every fragment producing its inputs. A *neutral* join (``strict``: when a schedule will
    reorder the fragments) also needs the equation's ancestors -- the fragments it depends
    on, transitively -- to be the candidate's ancestors, plus possibly the candidate: then
    merging adds no ordering constraint. *Free* fragments (glue depending only on free
    fragments, such as batch slicing) do not count: they are dispatched first anyway, and
    glue that only needs free fragments joins the latest free fragment on its place.
    """

    def __init__(self, strict: bool, pool_free: bool) -> None:
        self.strict = strict
        self.pool_free = pool_free  # join glue that only needs free fragments to them
        self.fragments: list[Fragment] = []
        self.made_in: dict[Any, int] = {}  # var -> index of the fragment producing it
        self.ancestors: list[int] = []  # per fragment, a bit set of fragment indices
        self.free = 0  # bit set of free fragments
        self.latest: dict[_Key, list[int]] = {}  # key -> fragments under it, ascending

    def _inputs(self, eqn: Any) -> tuple[int, int]:
        """``(highest producing fragment index, ancestor bit set)`` of an equation."""
        earliest, bits = -1, 0
        for v in eqn.invars:
            f = None if isinstance(v, jex.Literal) else self.made_in.get(v)
            if f is not None:
                earliest, bits = max(earliest, f), bits | self.ancestors[f] | (1 << f)
        return earliest, bits

    def _fits(self, f: int, earliest: int, bits: int, neutral: bool) -> bool:
        if f < earliest:
            return False
        own, bits = self.ancestors[f] & ~self.free, bits & ~self.free
        return not neutral or (own & ~bits == 0 and bits & ~(own | (1 << f)) == 0)

    def _find(self, lookups: list[_Lookup], earliest: int, bits: int) -> int | None:
        for key, neutral in lookups:
            candidates = self.latest.get(key, [])
            for f in reversed(candidates[-8:] if neutral else candidates[-1:]):
                if self._fits(f, earliest, bits, neutral):
                    return f
        return None

    def add(
        self,
        eqn: Any,
        label: _session.Label | None,
        place: Place,
        lookups: list[_Lookup],
        updates: list[_Key],
    ) -> Fragment:
        earliest, bits = self._inputs(eqn)
        only_free = self.pool_free and label is None and bits & ~self.free == 0
        if only_free:
            lookups = [_Lookup(_Key(_Group.FREE, place), self.strict), *lookups]
        f = self._find(lookups, earliest, bits)
        if f is None:
            f = len(self.fragments)
            self.fragments.append(Fragment(index=f, place=place, label=label))
            self.ancestors.append(0)
            self.free |= (1 << f) if only_free else 0
        self.ancestors[f] |= bits & ~(1 << f)
        if self.free >> f & 1:
            updates = [*updates, _Key(_Group.FREE, place)]
        for key in updates:
            under = self.latest.get(key)
            if under is None:
                self.latest[key] = [f]
            elif under[-1] < f:  # the common case: the newest fragment under the key
                under.append(f)
            elif under[-1] != f:
                at = bisect.bisect_left(under, f)
                if under[at] != f:
                    under.insert(at, f)
        frag = self.fragments[f]
        frag.eqns.append(eqn)
        for v in eqn.outvars:
            self.made_in[v] = f
        return frag


def _fragment(
    traced: _trace.TracedProgram, places: list[Place], plan: _pipeline.PipelinePlan | None
) -> list[Fragment]:
    cutter = _Cutter(strict=plan is not None and plan.scheduled, pool_free=plan is not None)
    eqns = traced.jaxpr.eqns
    order = range(len(eqns)) if plan is None else _pipeline.equation_order(traced, plan)
    keys: dict[Any, tuple[list[_Lookup], list[_Key]]] = {}  # the few distinct _keys results
    for i in order:
        eqn, label, place = eqns[i], traced.labels[i], places[i]
        if plan is not None and plan.equations[i].mixed:
            label = None  # mixes microbatches: glue
        facts = (place, label, None if plan is None else plan.equations[i])
        if facts not in keys:
            keys[facts] = _keys(i, place, label, plan)
        lookups, updates = keys[facts]
        frag = cutter.add(eqn, label, place, lookups, updates)
        if plan is None:
            continue
        mb, unit, _ = plan.equations[i]
        if frag.unit is None and unit is not None:
            frag.unit = unit
        if mb is not None and frag.microbatch is None:
            frag.microbatch = mb[1]
    _assign_boundaries(traced, cutter.fragments, cutter.made_in)
    return cutter.fragments


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


def _merge_glue(order: Sequence[Fragment]) -> list[Fragment]:
    """Folds glue into the latest glue fragment on its place, in dispatch order (the
    fragments' boundaries are left to :func:`_rebuild_boundaries`).

    Under a schedule the cutter keeps glue apart unless merging is order-neutral, which
    leaves the optimizer update and the state constraints as dozens of tiny fragments (one
    per dependency pattern), each a ``jax.jit`` to compile and dispatch. Once the dispatch
    order is fixed, a glue fragment whose inputs all exist by the time the previous glue
    fragment on its place is dispatched can run as part of it: the order of everything else
    is unchanged. Pipeline units are never merged, so the schedule is untouched.
    """
    made_at: dict[Any, int] = {}  # var -> position (in the merged list) of its fragment
    merged: list[Fragment] = []
    last_glue: dict[Place, int] = {}
    for frag in order:
        at = last_glue.get(frag.place) if frag.unit is None else None
        if at is not None and all(made_at.get(v, -1) <= at for v in frag.invars):
            target = merged[at]
            target.eqns.extend(frag.eqns)
            if target.label is None and target.microbatch != frag.microbatch:
                target.microbatch = None  # glue of several microbatches (a task's keeps its)
        else:
            at = len(merged)
            merged.append(frag)
            if frag.unit is None:
                last_glue[frag.place] = at
        for v in frag.outvars:
            made_at[v] = at
    return merged


def _arrange(
    traced: _trace.TracedProgram, plan: _pipeline.PipelinePlan, fragments: list[Fragment]
) -> list[Fragment]:
    """The fragments of a microbatched program in dispatch order, glue moved to its readers.

    Under a schedule: ``_pipeline.dispatch_order``, then :func:`_merge_glue`, then glue
    that only one later glue fragment reads moves there (``_sink.sink_glue``). Scheduled or
    not, a microbatch's input-only glue moves into the unit reading it
    (``_sink.sink_into_units``). Boundaries are rebuilt once, if anything changed.
    """
    changed = False
    if plan.scheduled:
        order = _pipeline.dispatch_order(fragments, plan)
        fragments = _merge_glue(order)
        changed = len(fragments) != len(order)
        changed = _sink.sink_glue(traced, fragments) or changed
    changed = _sink.sink_into_units(traced, plan, fragments) or changed
    return _rebuild_boundaries(traced, fragments) if changed else fragments


def _rebuild_boundaries(traced: _trace.TracedProgram, fragments: list[Fragment]) -> list[Fragment]:
    """The non-empty fragments, their inputs and outputs recomputed after equations moved."""
    fragments = [f for f in fragments if f.eqns]
    made_in = {v: f.index for f in fragments for e in f.eqns for v in e.outvars}
    for frag in fragments:
        frag.invars, frag.outvars = [], []
    _assign_boundaries(traced, fragments, made_in)
    return fragments


def partition(traced: _trace.TracedProgram, devices: Any = None) -> Partition:
    """Places and fragments a traced program: a straight list of passes, each linear in the
    number of equations.

    1. ``_pipeline.analyze``: every equation's microbatch and pipeline unit, each region's
       schedule (simulated once, on first use).
    2. ``_accumulate.reassociate_sums`` (scheduled only): sums over microbatches become
       chains in predicted-ready order, summed per submesh first.
       ``_accumulate.bundle_sums`` (microbatched): each microbatch's additions of one
       block's gradients become one equation.
    3. ``_place_meshes`` / ``_place_equations``: one place per equation (module doc).
    4. ``_fragment``: same-place runs cut into fragments whose dependencies point backwards.
    5. ``_arrange`` (microbatched): under a schedule, the schedule's order
       (``_pipeline.dispatch_order``) with glue folded into earlier glue on its place where
       that changes no order (``_merge_glue``) and glue only a later glue fragment reads
       moved there (``_sink.sink_glue``); in every case, a microbatch's input-only glue
       moved into the unit reading it (``_sink.sink_into_units``).
    6. ``_fuse.fuse_adjacent`` (scheduled only): a fragment and the next one on its place
       run as one where that delays nothing and adds no executable (its contract there).
    7. ``_homes``: where every value is produced and every program input must arrive.
    """
    plan = _pipeline.analyze(traced)
    if plan is not None and plan.scheduled:
        traced, plan = _accumulate.reassociate_sums(traced, plan)
    if plan is not None:
        traced, plan = _accumulate.bundle_sums(traced, plan)
    meshes, default = _place_meshes(traced, devices)
    users = _consumers(traced.jaxpr)  # the one consumer index of this program
    places = _place_equations(traced, default, users)
    fragments = _fragment(traced, places, plan)
    if plan is not None:
        fragments = _arrange(traced, plan, fragments)
    if plan is not None and plan.scheduled:
        outputs = {v for v in traced.jaxpr.outvars if not isinstance(v, jex.Literal)}
        fragments = _fuse.fuse_adjacent(fragments, outputs)
    home, input_place = _homes(traced, fragments, places, users)
    by_id = {d.id: d for d in jax.devices()}
    for place in set(places):
        if place not in meshes:
            grid = np.array([by_id[i] for i in place], dtype=object)
            meshes[place] = _devices.make_auto_mesh(grid, ("devices",))
    return Partition(
        traced=traced,
        fragments=fragments,
        input_place=input_place,
        home=home,
        place_meshes=meshes,
        default_place=default,
        plan=plan,
    )


def _homes(
    traced: _trace.TracedProgram,
    fragments: Sequence[Fragment],
    places: list[Place],
    users: dict[Any, list[int]],
) -> tuple[dict[Any, Place], dict[Any, Place]]:
    """``(home, input_place)``: the place producing each value, and for each used program
    input (or constant) the place of its first consumer, where it must arrive."""
    home: dict[Any, Place] = {}
    for frag in fragments:
        for eqn in frag.eqns:
            for v in eqn.outvars:
                home[v] = frag.place
    input_place: dict[Any, Place] = {}
    for v in [*traced.jaxpr.constvars, *traced.jaxpr.invars]:
        if users.get(v):
            input_place[v] = places[users[v][0]]
            home[v] = input_place[v]
    return home, input_place
