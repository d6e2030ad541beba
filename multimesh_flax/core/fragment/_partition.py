"""Fragmenting: from a placed program to per-submesh fragments in dispatch order.

Three passes, each a value in and a value out (placement, the pass before them, is
``_place``):

* :func:`cut_fragments` (*cut*) cuts the equation list into fragments, each a run of
  same-place equations that one ``jax.jit`` executes. A task equation joins the latest
  fragment of the same ``(task, phase)``, glue joins the latest fragment on its place -- in
  both cases only if every input of the equation is produced by that fragment or an earlier
  one, so every dependency points from a lower fragment index to a higher one and the
  fragments form a DAG. With microbatching (``microbatch``, see ``plan``) the keys are
  finer: a task equation joins the latest fragment of its unit ``(stage, microbatch,
  phase)``, glue of a microbatch the latest fragments of that microbatch on its place, and
  glue outside every microbatch only other such glue. Under a schedule the fragments get
  reordered later, so glue merges only where that adds no ordering constraint (see
  ``_Cutter``).
* :func:`arrange_fragments` (*arrange*, microbatched programs) puts the fragments in the
  schedule's dispatch order (``plan.dispatch_order``), folds glue into earlier glue on its
  place where that changes no order, and moves glue to the one later fragment reading it
  (``_sink``).
* :func:`fuse_fragments` (*fuse*, scheduled programs) runs a fragment and the next one on
  its place as one fragment where that changes no value or order and adds no executable
  (``_fuse``: the last stage's ``F_k`` and ``B_k``), then runs each microbatch's gradient
  accumulation at the end of the unit that produces the gradients, the running sum donated
  (``_sums``), splits glue another submesh shares (``_shared_glue``) and packs the small
  values a unit hands to another on its place into one array per dtype (``_packed_values``).

:func:`make_partition` then records where every value is produced and every program input
must arrive: the :class:`Partition` the runtime compiles.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.extend.core as jex
import numpy as np

from multimesh_flax.core.declare import Place, make_auto_mesh
from multimesh_flax.core.fragment import _fuse, _packed_values, _shared_glue, _sink, _sums
from multimesh_flax.core.fragment._place import PlacedProgram
from multimesh_flax.core.plan import PipelinePlan, Unit, dispatch_order, equation_order
from multimesh_flax.core.trace import Equation, Label, TracedProgram


@dataclasses.dataclass
class Fragment:
    """A run of equations executed by one ``jax.jit`` on one place."""

    index: int
    place: Place
    label: Label | None  # None: glue
    eqns: list[Any] = dataclasses.field(default_factory=list)
    invars: list[Any] = dataclasses.field(default_factory=list)
    outvars: list[Any] = dataclasses.field(default_factory=list)
    unit: Unit | None = None  # (region, stage, microbatch, phase) when pipelined
    microbatch: int | None = None
    parts: tuple[Fragment, ...] = ()  # the fragments fused into this one (``_fuse``), if any
    donate: tuple[Any, ...] = ()  # inputs whose buffers it may reuse (``_sums``), if any
    # (variable, value) of each constant a pass made for it (the offsets of a packed sum's
    # slices, ``_packed_sums``): inputs, placed on its place once, not literals (see there)
    consts: tuple[tuple[Any, Any], ...] = ()


@dataclasses.dataclass
class Partition:
    """The placed and fragmented program."""

    traced: TracedProgram
    fragments: list[Fragment]
    input_place: dict[Any, Place]  # program input (or const) var -> home place
    home: dict[Any, Place]  # every non-literal var -> where it is produced
    place_meshes: dict[Place, jax.sharding.Mesh]  # a mesh per place for default shardings
    default_place: Place
    plan: PipelinePlan | None = None  # microbatches, stages, schedules

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
    equation: Equation, place: Place, label: Label | None, plan: PipelinePlan | None
) -> tuple[list[_Lookup], list[_Key]]:
    """Where an equation on ``place`` with ``label`` may join (in preference order) and
    which keys it updates."""
    if plan is None:
        if label is None:
            return [_Lookup(_Key(_Group.PLACE, place), False)], [_Key(_Group.PLACE, place)]
        task = _Key(_Group.TASK, place, label)
        return [_Lookup(task, False)], [task, _Key(_Group.PLACE, place)]
    strict = plan.scheduled  # fragments get reordered: glue may only merge neutrally
    mb, unit = equation.microbatch, equation.unit
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
        label: Label | None,
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


def cut_fragments(placed: PlacedProgram) -> list[Fragment]:
    """The *cut* pass: the placed program's equations as fragments (see module doc), each
    with its inputs and outputs; every dependency points to a lower fragment index."""
    traced, plan = placed.traced, placed.plan
    cutter = _Cutter(strict=plan is not None and plan.scheduled, pool_free=plan is not None)
    equations = traced.equations
    order = range(len(equations)) if plan is None else equation_order(traced)
    keys: dict[Any, tuple[list[_Lookup], list[_Key]]] = {}  # the few distinct _keys results
    for i in order:
        equation = equations[i]
        place = cast(Place, equation.place)  # set by the place pass
        label = None if equation.mixed else equation.label  # mixing microbatches: glue
        facts = (place, label, equation.microbatch, equation.unit, equation.mixed)
        if facts not in keys:
            keys[facts] = _keys(equation, place, label, plan)
        lookups, updates = keys[facts]
        frag = cutter.add(equation.eqn, label, place, lookups, updates)
        if plan is None:
            continue
        mb, unit = equation.microbatch, equation.unit
        if frag.unit is None and unit is not None:
            frag.unit = unit
        if mb is not None and frag.microbatch is None:
            frag.microbatch = mb[1]
    _assign_boundaries(traced, cutter.fragments, cutter.made_in)
    return cutter.fragments


def _assign_boundaries(
    traced: TracedProgram, fragments: Sequence[Fragment], made_in: dict[Any, int]
) -> None:
    needed_outside: set[Any] = {v for v in traced.jaxpr.outvars if not isinstance(v, jex.Literal)}
    literal = jex.Literal
    for frag in fragments:
        seen: set[Any] = set()  # every variable read so far, made here or not
        own, invars = frag.index, frag.invars
        for eqn in frag.eqns:
            for v in eqn.invars:
                if type(v) is literal or v in seen:
                    continue
                seen.add(v)
                if made_in.get(v) != own:
                    invars.append(v)
                    needed_outside.add(v)
    for frag in fragments:
        frag.outvars = [v for eqn in frag.eqns for v in eqn.outvars if v in needed_outside]


def _merge_glue(order: Sequence[Fragment]) -> list[Fragment]:
    """Folds glue into the latest glue fragment on its place, in dispatch order (the
    fragments' boundaries are left to :func:`_rebuild_boundaries`). A fragment that absorbs
    others is a new one; ``order``'s fragments are not edited.

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
            merged[at] = _absorb(merged[at], frag)
        else:
            at = len(merged)
            merged.append(frag)
            if frag.unit is None:
                last_glue[frag.place] = at
        for v in frag.outvars:
            made_at[v] = at
    return merged


def _absorb(target: Fragment, frag: Fragment) -> Fragment:
    """``target`` followed by ``frag``'s equations, as one glue fragment."""
    mixed = target.label is None and target.microbatch != frag.microbatch
    return dataclasses.replace(
        target,
        eqns=[*target.eqns, *frag.eqns],
        # glue of several microbatches belongs to none (a task's keeps its microbatch)
        microbatch=None if mixed else target.microbatch,
    )


def arrange_fragments(placed: PlacedProgram, fragments: Sequence[Fragment]) -> list[Fragment]:
    """The *arrange* pass: the fragments of a microbatched program in dispatch order, glue
    moved to its readers (new fragments; ``fragments`` are left as they are).

    Under a schedule: ``plan.dispatch_order``, then :func:`_merge_glue`, then glue that only
    one later glue fragment reads moves there (``_sink.sink_glue``). Scheduled or not, a
    microbatch's input-only glue moves into the unit reading it (``_sink.sink_into_units``).
    Each step returns a new list, with new fragments where equations moved; boundaries are
    rebuilt once, if any did. Without microbatching the fragments stay in program order.
    """
    traced, plan = placed.traced, placed.plan
    if plan is None:
        return list(fragments)
    ordered = list(dispatch_order(fragments, plan) if plan.scheduled else fragments)
    order = ordered
    if plan.scheduled:
        order = _merge_glue(order)
        order = _sink.sink_glue(traced, order)
    order = _sink.sink_into_units(traced, order)
    if len(order) == len(ordered) and all(a is b for a, b in zip(order, ordered, strict=True)):
        return order  # nothing moved: the boundaries stand
    return _rebuild_boundaries(traced, order)


def _rebuild_boundaries(traced: TracedProgram, fragments: list[Fragment]) -> list[Fragment]:
    """New fragments for the non-empty ones, their inputs and outputs recomputed after
    equations moved."""
    fragments = [dataclasses.replace(f, invars=[], outvars=[]) for f in fragments if f.eqns]
    made_in = {v: f.index for f in fragments for e in f.eqns for v in e.outvars}
    _assign_boundaries(traced, fragments, made_in)
    return fragments


def fuse_fragments(placed: PlacedProgram, fragments: Sequence[Fragment]) -> list[Fragment]:
    """The *fuse* pass (scheduled programs): a fragment and the next one on its place run as
    one where that delays nothing and adds no executable (``_fuse.fuse_adjacent``, its
    contract there); then each running sum over microbatches runs at the end of the unit
    producing its operands, its running sum donated (``_sums``, where that adds no ordering
    constraint); then glue whose part another submesh runs as one program is split there
    (``_shared_glue``); last, the small values a unit hands to one other unit on its place
    travel as one array per dtype (``_packed_values``)."""
    if placed.plan is None or not placed.plan.scheduled:
        return list(fragments)
    traced = placed.traced
    outputs = {v for v in traced.jaxpr.outvars if not isinstance(v, jex.Literal)}
    fused = _fuse.fuse_adjacent(fragments, outputs)
    moved = _sums.sums_into_units(traced, fused)
    if moved is not None:
        order, links = moved
        fused = _sums.donate_running_sums(traced, _rebuild_boundaries(traced, order), links)
    split = _shared_glue.split_shared_glue(traced, fused, functools.partial(_place_shape, placed))
    fused = fused if split is None else split
    packed = _packed_values.pack_crossings(traced, fused)
    return fused if packed is None else _rebuild_boundaries(traced, packed)


def _place_shape(placed: PlacedProgram, place: Place) -> tuple[Any, ...]:
    """What a program on ``place`` depends on besides the devices: its mesh's axes and shape
    (the one-axis mesh ``make_partition`` gives a place without a mesh of its own)."""
    mesh = placed.meshes.get(place)
    if mesh is None:
        return ("devices",), (len(place),)
    return tuple(mesh.axis_names), mesh.devices.shape


def make_partition(placed: PlacedProgram, fragments: Sequence[Fragment]) -> Partition:
    """The placed program and its fragments as a :class:`Partition`: where every value is
    produced, where every used program input (or constant) must arrive -- the place of its
    first consumer; a fragment's own constants (``Fragment.consts``), its place -- and a mesh
    for every place."""
    traced = placed.traced
    home: dict[Any, Place] = {}
    for frag in fragments:
        for eqn in frag.eqns:
            for v in eqn.outvars:
                home[v] = frag.place
    input_place: dict[Any, Place] = {}
    users = placed.users
    for v in [*traced.jaxpr.constvars, *traced.jaxpr.invars]:
        if users.get(v):
            input_place[v] = cast(Place, traced.equations[users[v][0]].place)
            home[v] = input_place[v]
    for frag in fragments:
        for v, _ in frag.consts:
            input_place[v] = home[v] = frag.place
    meshes = dict(placed.meshes)
    by_id = {d.id: d for d in jax.devices()}
    for place in cast("set[Place]", {e.place for e in traced.equations}):
        if place not in meshes:
            grid = np.array([by_id[i] for i in place], dtype=object)
            meshes[place] = make_auto_mesh(grid, ("devices",))
    return Partition(
        traced=traced,
        fragments=list(fragments),
        input_place=input_place,
        home=home,
        place_meshes=meshes,
        default_place=placed.default_place,
        plan=placed.plan,
    )
