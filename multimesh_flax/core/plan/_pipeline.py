"""Pipelining: microbatches, stages and phases of a traced program, and its dispatch order.

A program traced through ``microbatch`` holds the equations of chunk ``k`` under the scope
``mmmb<uid>_<k>`` (one *region* per ``uid``). :func:`analyze` gives every equation's record
(``trace.Equation``):

* its microbatch ``(uid, k)`` -- read from the innermost such scope; an equation that mixes
  values of different microbatches (gradient accumulation, which a backward taken outside
  ``microbatch`` puts into a chunk's scope) belongs to none and is glue;
* its *unit* ``(uid, stage, k, phase)`` when it belongs to a task: the stages of a region are
  its tasks in order of first forward use within each microbatch, consecutive tasks on one
  submesh forming one stage (tasks with a
  ``loop_dependent_mesh_slice`` move between submeshes and are not stages); the phase is
  ``"F"`` or ``"B"``, and under a split-backward schedule a backward is cut into ``"B"``
  (the equations that the cotangent sent to another task needs) and ``"W"`` (the rest,
  chiefly weight gradients).

For a region with a ``schedule`` it builds the :class:`~._schedules.Schedule` from the stages
found (stage ``s`` must share its submesh with stage ``s % num_submeshes``, or under a V
schedule with stage ``2 R - 1 - s``). The partitioner
then cuts one fragment per unit (visiting equations in :func:`equation_order`, which moves
each unit's ``W`` equations after its ``B`` ones), and :func:`dispatch_order` sorts the
fragments: a topological order of their data dependencies that takes units by their start
time in the schedule's simulation and everything else as soon as its inputs exist. Each
submesh runs its queue in dispatch order, so this realises every submesh's row of the
schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax.extend.core as jex

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    Phase,
    Place,
    Schedule,
    Sentinel,
    make_schedule,
    place_of,
    stage_rows,
)
from multimesh_flax.core.plan import _simulator
from multimesh_flax.core.trace import (
    MICROBATCH_RE,
    Equation,
    MicrobatchCall,
    TracedProgram,
    each_distinct,
    reaches_other_owner,
    with_producers,
)

Microbatch = tuple[int, int]  # (region uid, k)


class Unit(NamedTuple):
    """One unit of pipeline work: a phase of one stage on one microbatch of one region."""

    region: int  # the uid of the ``microbatch`` call
    stage: int
    microbatch: int  # k
    phase: Phase

    @property
    def work(self) -> tuple[int, int, int]:
        """``(region, stage, microbatch)``: the unit without its phase."""
        return self.region, self.stage, self.microbatch


SPLIT_NAMES = ("bwd_act", "bwd_weight")


@dataclasses.dataclass
class Region:
    """One traced ``microbatch`` call: its options, stages and schedule."""

    uid: int
    call: MicrobatchCall
    stage_tasks: list[list[Any]]  # the ResolvedTasks of each stage (microbatch 0's)
    stage_places: list[Place]
    schedule: Schedule | None = None

    @functools.cached_property
    def simulated(self) -> list[tuple[Any, Any, float, float]]:
        """The schedule's simulated timeline (simulated once per region, on first use)."""
        return [] if self.schedule is None else _simulator.simulate(self.schedule).timeline


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The regions and their schedules, and the planned program's equations.

    ``equations`` is the planned program's own table (``TracedProgram.equations``, the same
    tuple): each record's ``microbatch``, ``unit`` and ``mixed`` are what the plan says of it.
    """

    equations: tuple[Equation, ...]
    regions: dict[int, Region]

    @functools.cached_property
    def scheduled(self) -> bool:
        """Whether some region has a schedule (so fragments are cut per unit and reordered)."""
        return any(r.schedule is not None for r in self.regions.values())

    @property
    def schedule(self) -> Schedule | None:
        """The schedule of the first scheduled region."""
        return next((r.schedule for r in self.regions.values() if r.schedule), None)


# --- analysis -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8192)
def _microbatch_scopes(stack: str) -> tuple[Microbatch, ...]:
    """The ``(uid, k)`` of every microbatch scope in a name stack, innermost first.

    Memoised: a program's equations share a few thousand distinct name stacks.
    """
    found = [(int(m.group(1)), int(m.group(2))) for m in MICROBATCH_RE.finditer(stack)]
    return tuple(reversed(found))


def microbatch_of(stack: str, calls: Mapping[int, Any]) -> Microbatch | None:
    """The ``(uid, k)`` of the innermost microbatch scope in a name stack whose call was
    traced in this program (``calls``: ``TracedProgram.microbatch_calls``)."""
    return next((found for found in _microbatch_scopes(stack) if found[0] in calls), None)


# The "microbatch" of a value computed from several microbatches.
_MIXED = Sentinel("several microbatches")


def _with_microbatches(
    equations: Sequence[Equation], mbs: Sequence[Microbatch | None]
) -> list[Equation]:
    """The records with their microbatch (``mbs``: read from each name stack), cleared where
    an equation reads values of other microbatches.

    Such values -- gradient sums, and whatever is computed from them -- are *mixed*; an
    equation of microbatch ``k`` that reads one is mixed too, and becomes glue.
    """
    of_var: dict[Any, Microbatch | None] = {}
    out = []
    for equation, mb in zip(equations, mbs, strict=True):
        eqn = equation.eqn
        ins = {of_var.get(v) for v in eqn.invars if not isinstance(v, jex.Literal)}
        ins.discard(None)
        made, mixed = mb, False
        if mb is not None and ins - {mb}:
            mb, made, mixed = None, _MIXED, True
        elif mb is None and (len(ins) > 1 or _MIXED in ins):
            made = _MIXED
        for v in eqn.outvars:
            of_var[v] = made
        label, unit, place = equation.label, equation.unit, equation.place
        out.append(Equation(eqn, equation.stack, label, mb, unit, mixed, place))
    return out


def _stage_ranks(
    traced: TracedProgram, equations: Sequence[Equation]
) -> dict[tuple[int, int], list[int]]:
    """Per microbatch ``(uid, k)``: its stage tasks (uids) in order of first forward use."""
    order: dict[tuple[int, int], list[int]] = {}
    seen_specs: dict[tuple[int, int], list[Any]] = {}
    for equation in equations:
        label, mb = equation.label, equation.microbatch
        if label is None or label.phase is not Phase.F or mb is None or equation.mixed:
            continue
        resolved = traced.tasks[label.task]
        if resolved.task.loop_dependent_mesh_slice is not None:
            continue
        uids, specs = order.setdefault(mb, []), seen_specs.setdefault(mb, [])
        if label.task in uids:
            continue
        if any(spec is resolved.task for spec in specs):  # a task called twice: one stage
            continue
        uids.append(label.task)
        specs.append(resolved.task)
    return order


def _group_stages(
    traced: TracedProgram, order: dict[tuple[int, int], list[int]]
) -> dict[tuple[int, int], list[list[int]]]:
    """Consecutive tasks on the same submesh form one stage (e.g. a stem and two blocks);
    under a V schedule the run at the turn forms two (see :func:`_split_turn`)."""
    grouped: dict[tuple[int, int], list[list[int]]] = {}
    for mb, uids in order.items():
        groups: list[list[int]] = []
        for uid in uids:
            place = place_of(traced.tasks[uid].mesh)
            if groups and place_of(traced.tasks[groups[-1][0]].mesh) == place:
                groups[-1].append(uid)
            else:
                groups.append([uid])
        call = traced.microbatch_calls.get(mb[0])
        if call is not None and call.options.schedule in V_SCHEDULES:
            groups = _split_turn(traced, groups)
        grouped[mb] = groups
    return grouped


V_SCHEDULES = ("zero-bubble-v",)


def _split_turn(traced: TracedProgram, groups: list[list[int]]) -> list[list[int]]:
    """A V pipeline visits its last submesh twice in a row (stages ``R - 1`` and ``R``), so
    the run of tasks there, the middle one of ``2 R - 1`` runs, is two stages: its first
    half (rounded up) and the rest. Any other grouping is left for the layout check."""
    places = {place_of(traced.tasks[g[0]].mesh) for g in groups}
    turn = len(places) - 1
    if len(groups) != 2 * len(places) - 1 or len(groups[turn]) < 2:
        return groups
    run = groups[turn]
    half = (len(run) + 1) // 2
    return [*groups[:turn], run[:half], run[half:], *groups[turn + 1 :]]


def stage_name(tasks: Sequence[Any]) -> str:
    """A stage's display name: its tasks' names joined by ``+``."""
    return "+".join(t.name for t in tasks)


def _regions(
    traced: TracedProgram,
    order: dict[tuple[int, int], list[list[int]]],
    places_of: dict[int, Place],
) -> dict[int, Region]:
    regions: dict[int, Region] = {}
    for (uid, k), groups in sorted(order.items()):
        call = traced.microbatch_calls.get(uid)
        assert call is not None
        tasks = [[traced.tasks[t] for t in group] for group in groups]
        places = [places_of[group[0]] for group in groups]
        if uid not in regions:
            regions[uid] = Region(uid, call, tasks, places)
        elif call.options.schedule is not None:
            _check_same_stages(regions[uid], k, tasks, places)
    return regions


def _check_same_stages(region: Region, k: int, tasks: list[Any], places: list[Place]) -> None:
    first = [
        (stage_name(t), p) for t, p in zip(region.stage_tasks, region.stage_places, strict=True)
    ]
    this = [(stage_name(t), p) for t, p in zip(tasks, places, strict=True)]
    if first != this:
        raise errors.InvalidScheduleError(
            f"A pipeline schedule needs every microbatch to run the same stages on the same "
            f"submeshes; microbatch 0 runs (task, devices) {first}, microbatch {k} runs "
            f"{this}. Give the tasks fixed meshes, or use `schedule`=None."
        )


def _with_units(
    traced: TracedProgram,
    equations: Sequence[Equation],
    order: dict[tuple[int, int], list[list[int]]],
) -> list[Equation]:
    """The records with their pipeline unit (task equations of a microbatch's stages)."""
    stage_of = {
        (mb, t): s for mb, groups in order.items() for s, group in enumerate(groups) for t in group
    }
    spec_stage = {(mb, id(traced.tasks[t].task)): s for (mb, t), s in stage_of.items()}
    out = []
    for equation in equations:
        label, mb = equation.label, equation.microbatch
        if label is None or mb is None:
            out.append(equation)
            continue
        stage = stage_of.get((mb, label.task))
        if stage is None:
            stage = spec_stage.get((mb, id(traced.tasks[label.task].task)))
        unit = None if stage is None else Unit(mb[0], stage, mb[1], label.phase)
        out.append(equation._replace(unit=unit))
    return out


def analyze(traced: TracedProgram) -> tuple[TracedProgram, PipelinePlan] | None:
    """The program with every equation's microbatch and unit, and its plan (``None``
    without microbatching).

    Raises:
        InvalidScheduleError: a region's schedule does not fit its stages.
    """
    mbs = each_distinct(lambda s: microbatch_of(s, traced.microbatch_calls), traced.stacks)
    if not any(mbs):
        return None
    equations = _with_microbatches(traced.equations, mbs)
    order = _group_stages(traced, _stage_ranks(traced, equations))
    places_of = {uid: place_of(resolved.mesh) for uid, resolved in traced.tasks.items()}
    regions = {
        uid: region
        if region.call.options.schedule is None
        else dataclasses.replace(region, schedule=_region_schedule(region))
        for uid, region in _regions(traced, order, places_of).items()
    }
    equations = _with_units(traced, equations, order)
    split = {uid for uid, r in regions.items() if r.schedule and r.schedule.split_backward}
    if split:
        equations = _split_backward(traced, equations, split)
    planned = dataclasses.replace(traced, equations=tuple(equations))
    return planned, PipelinePlan(equations=planned.equations, regions=regions)


# --- schedules for regions ------------------------------------------------------------------


def _region_schedule(region: Region) -> Schedule:
    options = region.call.options
    names = [stage_name(t) for t in region.stage_tasks]
    count = len(names)
    if options.num_stages is not None and options.num_stages != count:
        raise errors.InvalidScheduleError(
            f"`num_stages`={options.num_stages}, but `fun` runs {count} task(s) per "
            f"microbatch: {names}. Pass `num_stages`={count}, or change the tasks."
        )
    rows = list(dict.fromkeys(region.stage_places))
    _check_layout(options.schedule or "gpipe", names, region.stage_places, len(rows))
    if options.interleave is not None and options.interleave * len(rows) != count:
        raise errors.InvalidScheduleError(
            f"`interleave`={options.interleave}, but the {count} stages run on {len(rows)} "
            f"submeshes ({count // len(rows)} per submesh). Pass `interleave`="
            f"{count // len(rows)}."
        )
    custom = None
    if options.schedule == "custom":
        custom = _custom_ops(options.custom_schedule or (), names)
    return make_schedule(
        options.schedule or "gpipe",
        count,
        region.call.num_microbatches,
        num_submeshes=len(rows),
        custom=custom,
        costs=options.costs,
        max_in_flight=options.max_in_flight,
        w_memory=options.w_memory,
    )


def _check_layout(name: str, names: list[str], places: list[Place], num_rows: int) -> None:
    """Stage ``s`` must run on the submesh the schedule gives it: that of stage
    ``s % num_rows``, or on a V that of stage ``min(s, 2 R - 1 - s)``."""
    if name in V_SCHEDULES and len(names) != 2 * num_rows:
        raise errors.InvalidScheduleError(
            f"`schedule`={name!r} runs 2 stages per submesh on a V, got {len(names)} "
            f"stage(s) on {num_rows} submesh(es): {names}. Place stage s and stage 2R-1-s "
            f"on submesh s, for R submeshes and 2R tasks."
        )
    expected = stage_rows(name, len(names), num_rows)
    rule = "min(s, 2R-1-s)" if name in V_SCHEDULES else f"s % {num_rows}"
    for s, place in enumerate(places):
        home = expected[s]
        if place != places[home]:
            raise errors.InvalidScheduleError(
                f"Schedule {name!r} puts stage s on the submesh of stage {rule} (with "
                f"{num_rows} distinct submeshes); stage {s} ({names[s]!r}) runs on devices "
                f"{list(place)}, stage {home} on devices {list(places[home])}. Place stage "
                f"s on submesh {rule}."
            )


def _custom_ops(rows: Sequence[Sequence[Any]], names: list[str]) -> list[list[Any]]:
    """Replaces task names in ``(task, microbatch, phase)`` entries by stage indices."""
    out = []
    for row in rows:
        resolved_row = []
        for entry in row:
            if isinstance(entry, tuple) and isinstance(entry[0], str):
                entry = (_stage_index(entry[0], names), int(entry[1]), entry[2])
            elif isinstance(entry, tuple):
                entry = (int(entry[0]), int(entry[1]), entry[2])
            resolved_row.append(entry)
        out.append(resolved_row)
    return out


def _stage_index(name: str, names: list[str]) -> int:
    matches = [s for s, n in enumerate(names) if name == n or name in n.split("+")]
    if len(matches) != 1:
        problem = "names no stage" if not matches else f"names stages {matches}"
        raise errors.InvalidScheduleError(
            f"Task name {name!r} in `custom_schedule` {problem}; the stages are {names} "
            "(in order). Use one of these names, or stage indices."
        )
    return matches[0]


# --- split backward -------------------------------------------------------------------------


def _backward_owner(equation: Equation) -> Any:
    """A backward task equation's owner: its task call ``(task, microbatch)``."""
    label = equation.label
    is_bwd = label is not None and label.phase is Phase.B and not equation.mixed
    return (label.task, equation.microbatch) if is_bwd else None  # type: ignore[union-attr]


def _split_backward(
    traced: TracedProgram, equations: list[Equation], regions: set[int]
) -> list[Equation]:
    """The records with the weight-gradient part of every backward unit in ``regions``
    relabelled as ``"W"``."""

    def splits(equation: Equation) -> bool:
        unit = equation.unit
        return unit is not None and unit.phase is Phase.B and unit.region in regions

    # Per equation: does an output feed (transitively) the backward of another task call?
    critical = reaches_other_owner(equations, _backward_owner)
    seeds = [i for i, e in enumerate(equations) if splits(e) and critical[i]]
    needed = with_producers(equations, traced.producer, seeds, lambda e: e.unit)
    return [
        e._replace(unit=e.unit._replace(phase=Phase.W)) if splits(e) and i not in needed else e
        for i, e in enumerate(equations)
    ]


def equation_order(traced: TracedProgram) -> list[int]:
    """A valid equation order that puts each unit's ``W`` equations after its ``B`` ones.

    A backward interleaves activation- and weight-gradient equations. Each ``W`` equation
    (and glue that reads it, such as a gradient sum) is deferred past the following ``B``
    equations of its unit -- which never read it -- so each half becomes one fragment.
    """
    order: list[int] = []
    deferred: list[int] = []
    produced: set[Any] = set()
    current: tuple[int, int, int] | None = None
    for i, equation in enumerate(traced.equations):
        eqn, unit = equation.eqn, equation.unit
        reads = any(not isinstance(v, jex.Literal) and v in produced for v in eqn.invars)
        if unit is not None and unit.phase is Phase.W and current in (None, unit.work):
            current = unit.work
        elif reads and unit is None:
            pass  # glue reading a deferred W: deferred with it
        elif unit is not None and unit.phase is Phase.B and unit.work == current and not reads:
            order.append(i)
            continue
        else:
            order.extend(deferred)
            deferred, produced, current = [], set(), None
            if unit is not None and unit.phase is Phase.W:
                current = unit.work
            else:
                order.append(i)
                continue
        deferred.append(i)
        produced.update(eqn.outvars)
    return order + deferred


# --- dispatch order -------------------------------------------------------------------------


def unit_times(plan: PipelinePlan) -> dict[Unit, tuple[int, float, float]]:
    """``(region rank, start, end)`` of every scheduled unit in its schedule's simulation."""
    times: dict[Unit, tuple[int, float, float]] = {}
    for rank, region in enumerate(plan.regions.values()):
        if region.schedule is None:
            continue
        for _, op, start, end in region.simulated:
            times[(region.uid, op.stage, op.microbatch, op.phase)] = (rank, start, end)
    return times


def dispatch_order(fragments: Sequence[Any], plan: PipelinePlan) -> list[Any]:
    """Sorts fragments for dispatch: schedule order for units, glue as soon as possible.

    A topological order of the fragments' data dependencies (list scheduling): among the
    fragments whose inputs are all produced, it takes the one whose unit starts first in
    the simulated schedule, or any glue fragment before that.
    """
    keys = {unit: (rank, start) for unit, (rank, start, _) in unit_times(plan).items()}
    producer = {v: f.index for f in fragments for v in f.outvars}
    by_index = {f.index: f for f in fragments}
    waiting: dict[int, int] = {}
    users: dict[int, list[int]] = {}
    for f in fragments:
        deps = {producer[v] for v in f.invars if v in producer}
        waiting[f.index] = len(deps)
        for d in deps:
            users.setdefault(d, []).append(f.index)

    def key(index: int) -> tuple[tuple[float, ...], int]:
        unit = by_index[index].unit
        return keys.get(unit, (-math.inf,)) if unit is not None else (-math.inf,), index

    ready = [key(i) for i, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, index = heapq.heappop(ready)
        order.append(by_index[index])
        for user in users.get(index, ()):
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, key(user))
    assert len(order) == len(fragments), "fragment dependencies are acyclic by construction"
    return order
