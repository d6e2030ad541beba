"""A simulator that predicts a pipeline schedule's timeline, bubble and activation memory.

:func:`simulate` replays a :class:`~multimesh_flax.core.declare._schedules.Schedule` with per-op
costs: each row (submesh) runs its ops in order, one at a time, and an op starts as soon as
its row is free and the ops it depends on have finished (plus a transfer cost when they ran
on another row). The result, a :class:`SimulationResult`, holds the makespan, the bubble
(idle fraction), per-row busy time, every op's start and end, and the peak number of
activation sets each row keeps alive.

Costs are per phase. A split backward runs ``B`` (activation gradient) and ``W`` (weight
gradient) as separate ops; an unsplit ``B`` op is the whole backward and costs
``B + W``, so split and unsplit schedules of the same model compare on equal terms.

With ``fused=True`` the simulator prices what the runtime does with an ``F`` followed on its
row by the same microbatch's ``B`` (the last stage's, in 1F1B and zero-bubble schedules): it
runs the two as one program, which keeps the residuals inside and pays one launch, so the
pair costs ``cost(stage, "F+B")``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    CostFn,
    Schedule,
    ScheduleOp,
    make_cost_fn,
    op_deps,
    validated_order,
)


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """The predicted timeline of a schedule.

    Attributes:
      makespan: Time from the first op's start to the last op's end.
      bubble_fraction: Idle time over total row time, ``1 - sum(busy_time) / (rows *
        makespan)``; 0 when the makespan is 0.
      busy_time: Per row, the summed duration of its ops.
      timeline: Every op as ``(row, op, start, end)``, sorted by start time, then row.
      peak_in_flight: Per row, the largest number of ``(stage, microbatch)`` activation
        sets alive at once: counted from the start of ``F`` to the end of the last backward
        op of that stage and microbatch (``W`` when the backward is split, else ``B``).
        With one stage per row this is the number of microbatches in flight.
      row_spans: Per row, from its first op's start to its last op's end (0 for an empty
        row).
      steady_bubble_fraction: The idle fraction when consecutive steps overlap, so that a
        row starts its next step as soon as it ends this one: ``1 - sum(busy_time) / (rows
        * max(row_spans))``. This is how the Zero Bubble paper (Qi et al., 2024) measures
        a schedule's bubble (its "largest execution time of all stages"); with the
        optimizer step synchronised it is the lower bound of ``bubble_fraction``. Equal
        to ``bubble_fraction`` when the first row runs from the start to the end (GPipe,
        1F1B).
      peak_bytes: Per row, the largest activation bytes alive at once, when ``simulate``
        is given ``activation_bytes``; else ``None``. A split backward's set counts
        ``w_memory`` of its bytes from its ``B`` to its ``W``.

    Example:
      >>> from multimesh_flax.core import make_schedule, simulate
      >>> result = simulate(make_schedule("1f1b", num_stages=2, num_microbatches=2))
      >>> result.makespan, result.busy_time, result.peak_in_flight
      (9.0, (6.0, 6.0), (2, 1))
      >>> result.timeline[:2]
      ((0, ScheduleOp(stage=0, microbatch=0, phase='F'), 0.0, 1.0),
       (0, ScheduleOp(stage=0, microbatch=1, phase='F'), 1.0, 2.0))
    """

    makespan: float
    bubble_fraction: float
    busy_time: tuple[float, ...]
    timeline: tuple[tuple[int, ScheduleOp, float, float], ...]
    peak_in_flight: tuple[int, ...]
    row_spans: tuple[float, ...] = ()
    steady_bubble_fraction: float = 0.0
    peak_bytes: tuple[float, ...] | None = None


def simulate(
    schedule: Schedule,
    *,
    costs: Mapping[str, float] | CostFn | None = None,
    activation_bytes: float | Sequence[float] | None = None,
    w_memory: float = 1.0,
    fused: bool = False,
) -> SimulationResult:
    """Predicts when every op of ``schedule`` runs, given per-op costs.

    Args:
      schedule: A schedule; it is validated first.
      costs: Durations. Either a mapping with any of the keys ``"F"``, ``"B"``, ``"W"``
        and ``"transfer"`` (defaults 1, 1, 1 and 0), or a callable ``(stage, phase) ->
        float`` that is asked for phases ``"F"``, ``"B"``, ``"W"`` and ``"transfer"``
        (the time to send stage ``stage``'s output, activation or gradient, to another
        row). ``transfer`` is added to every dependency between ops on different rows.
        When the backward is not split, a ``B`` op costs ``B + W``.
      activation_bytes: The bytes one activation set holds: one number for every stage,
        or one per stage. Gives ``peak_bytes``.
      w_memory: The share of a set's bytes still held between its ``B`` and its ``W``
        when the backward is split (the Zero Bubble paper's ``M_W / M_B``); default 1.
      fused: Price an ``F`` and the next op on its row, when that is the ``B`` of the same
        stage and microbatch, as one program: the pair costs ``cost(stage, "F+B")`` (``F``
        and the whole backward when it is not split, ``F`` and ``B`` when it is), the
        ``F`` its own cost and the ``B`` the rest (never below 0). A callable ``costs`` is
        then also asked for phase ``"F+B"``; a mapping may give it (default: the sum).

    Returns:
      A :class:`SimulationResult`.

    Raises:
      InvalidScheduleError: If the schedule is invalid (see ``validate_schedule``), or a
        cost is negative, not finite, or keyed by an unknown phase, or
        ``activation_bytes`` is not one non-negative number or one per stage, or
        ``w_memory`` is not in [0, 1].

    Example:
      >>> from multimesh_flax.core import make_schedule, simulate
      >>> gpipe = make_schedule("gpipe", num_stages=4, num_microbatches=8)
      >>> result = simulate(gpipe)
      >>> result.makespan, round(result.bubble_fraction, 4)  # (p - 1) / (m + p - 1) = 3/11
      (33.0, 0.2727)
      >>> simulate(gpipe, costs={"transfer": 0.5}).makespan
      36.0
      >>> def cost(stage, phase):  # the last stage is twice as slow; transfers are free
      ...     return 0.0 if phase == "transfer" else (2.0 if stage == 3 else 1.0)
      >>> simulate(gpipe, costs=cost).makespan
      57.0

      ZB-H2 with equal costs: the rows' spans are equal, so overlapped steps have no
      bubble; each row holds up to ``2 p - 1`` activation sets (here 1 MiB each):

      >>> zb = simulate(make_schedule("zero-bubble-h2", 4, 8), activation_bytes=2**20)
      >>> zb.steady_bubble_fraction, zb.peak_in_flight, zb.peak_bytes[0] / 2**20
      (0.0, (7, 7, 7, 7), 7.0)

      1F1B's last stage runs each microbatch's F and B back to back; fused, a pair costing
      1.5 instead of 2 shortens the step:

      >>> one_f_one_b = make_schedule("1f1b", num_stages=2, num_microbatches=4)
      >>> apart = {"F": 1.0, "B": 1.0, "W": 0.0}
      >>> simulate(one_f_one_b, costs=apart).makespan
      10.0
      >>> simulate(one_f_one_b, costs=apart | {"F+B": 1.5}, fused=True).makespan
      9.0
    """
    order = validated_order(schedule)
    cost = make_cost_fn(costs)
    sizes = _activation_bytes(activation_bytes, schedule.num_stages)
    if (
        isinstance(w_memory, bool)
        or not isinstance(w_memory, (int, float))
        or not (0.0 <= w_memory <= 1.0)
    ):
        raise errors.InvalidScheduleError(
            f"Expected `w_memory` to be a number in [0, 1] (the share of an activation set "
            f"kept from B to W), got {w_memory!r}."
        )
    priced = costs is not None and (not isinstance(costs, Mapping) or "F+B" in costs)
    pairs = fused_backwards(schedule) if fused and priced else frozenset()
    return _simulate(schedule, order, cost, sizes, float(w_memory), pairs)


def _activation_bytes(value: object, num_stages: int) -> tuple[float, ...] | None:
    """One byte count per stage, checked; ``None`` when not given."""
    if value is None:
        return None
    many = isinstance(value, Sequence) and not isinstance(value, str)
    sizes = tuple(value) if many else (value,) * num_stages  # type: ignore[arg-type]
    good = len(sizes) == num_stages and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and b >= 0
        for b in sizes
    )
    if not good:
        raise errors.InvalidScheduleError(
            f"Expected `activation_bytes` to be one non-negative number, or one per stage "
            f"({num_stages}), got {value!r}."
        )
    return tuple(float(b) for b in sizes)


def _simulate(
    schedule: Schedule,
    order: list[tuple[int, ScheduleOp]],
    cost: CostFn,
    sizes: tuple[float, ...] | None,
    w_share: float = 1.0,
    fused: frozenset[ScheduleOp] = frozenset(),
) -> SimulationResult:
    """Times ``order`` (a dependency-respecting order of all ops) as early as possible;
    a ``B`` in ``fused`` runs as one program with the ``F`` before it."""
    rows = schedule.num_submeshes
    free = [0.0] * rows
    first = [math.inf] * rows
    busy = [0.0] * rows
    end: dict[ScheduleOp, float] = {}
    timeline = []
    for row, op in order:
        start = free[row]
        for dep in op_deps(op, schedule.num_stages):
            crossing = schedule.stage_to_row[dep.stage] != row
            start = max(start, end[dep] + (cost(dep.stage, "transfer") if crossing else 0.0))
        duration = _duration(schedule, op, cost)
        if op in fused:
            duration = max(cost(op.stage, "F+B") - cost(op.stage, "F"), 0.0)
        end[op] = free[row] = start + duration
        busy[row] += duration
        first[row] = min(first[row], start)
        timeline.append((row, op, start, end[op]))
    timeline.sort(key=lambda item: (item[2], item[0]))
    makespan = max(end.values(), default=0.0)
    spans = tuple(f - s if s < math.inf else 0.0 for f, s in zip(free, first, strict=True))
    return SimulationResult(
        makespan=makespan,
        bubble_fraction=_idle_fraction(busy, makespan),
        busy_time=tuple(busy),
        timeline=tuple(timeline),
        peak_in_flight=tuple(_peak_live(schedule, ops, None) for ops in schedule.rows),
        row_spans=spans,
        steady_bubble_fraction=_idle_fraction(busy, max(spans, default=0.0)),
        peak_bytes=None
        if sizes is None
        else tuple(float(_peak_live(schedule, ops, sizes, w_share)) for ops in schedule.rows),
    )


def _idle_fraction(busy: Sequence[float], span: float) -> float:
    """``1 - sum(busy) / (rows * span)``; 0 when ``span`` is 0."""
    return 1.0 - sum(busy) / (len(busy) * span) if span > 0 else 0.0


def _duration(schedule: Schedule, op: ScheduleOp, cost: CostFn) -> float:
    if op.phase == "B" and not schedule.split_backward:
        return cost(op.stage, "B") + cost(op.stage, "W")
    return cost(op.stage, op.phase)


def fused_backwards(schedule: Schedule) -> frozenset[ScheduleOp]:
    """The ``B`` ops that directly follow, on their row, the ``F`` of the same stage and
    microbatch (the pairs the runtime fuses into one program).

    Example:
      >>> from multimesh_flax.core import make_schedule
      >>> from multimesh_flax.core.plan import fused_backwards
      >>> sorted(op.microbatch for op in fused_backwards(make_schedule("1f1b", 2, 3)))
      [0, 1, 2]
      >>> fused_backwards(make_schedule("gpipe", 2, 3))  # every F before the first B
      frozenset()
    """
    return frozenset(
        b
        for ops in schedule.rows
        for f, b in itertools.pairwise(ops)
        if f.phase == "F" and b.phase == "B" and (f.stage, f.microbatch) == (b.stage, b.microbatch)
    )


def _peak_live(
    schedule: Schedule,
    ops: tuple[ScheduleOp, ...],
    sizes: tuple[float, ...] | None,
    w_share: float = 1.0,
) -> float:
    """The most activation sets (``sizes=None``) or bytes alive along one row at once; its
    ops run one after another, a set alive from its ``F`` to its last backward op (with
    bytes, only ``w_share`` of it from a split ``B`` to its ``W``)."""
    last = schedule.phases[-1]
    live = peak = 0
    for op in ops:
        size = 1 if sizes is None else sizes[op.stage]
        kept = w_share if sizes is not None and schedule.split_backward else 1
        if op.phase == "F":
            live += size
            peak = max(peak, live)
        elif op.phase == last:
            live -= size * kept
        elif op.phase == "B":
            live -= size * (1 - kept)
    return peak
