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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from multimesh_flax import errors
from multimesh_flax.core.declare import Schedule, ScheduleOp, op_deps, validated_order

_DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0, "transfer": 0.0}

CostFn = Callable[[int, str], float]


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


def simulate(
    schedule: Schedule, *, costs: Mapping[str, float] | CostFn | None = None
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

    Returns:
      A :class:`SimulationResult`.

    Raises:
      InvalidScheduleError: If the schedule is invalid (see ``validate_schedule``), or a
        cost is negative, not finite, or keyed by an unknown phase.

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
    """
    order = validated_order(schedule)
    cost = _cost_fn(costs)
    return _simulate(schedule, order, cost)


def _cost_fn(costs: Mapping[str, float] | CostFn | None) -> CostFn:
    """Turns ``costs`` into a checked ``(stage, phase) -> float``."""
    if costs is None or isinstance(costs, Mapping):
        unknown = set(costs or {}) - set(_DEFAULT_COSTS)
        if unknown:
            raise errors.InvalidScheduleError(
                f"Unknown keys {sorted(unknown)} in `costs`; use {sorted(_DEFAULT_COSTS)}."
            )
        table = {**_DEFAULT_COSTS, **(costs or {})}
        return lambda stage, phase: _checked(table[phase], stage, phase)
    if callable(costs):
        return lambda stage, phase: _checked(costs(stage, phase), stage, phase)
    raise errors.InvalidScheduleError(
        f"Expected `costs` to be a mapping of phase to duration or a callable "
        f"(stage, phase) -> duration, got {type(costs).__name__}."
    )


def _checked(value: object, stage: int, phase: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise errors.InvalidScheduleError(
            f"Expected a finite, non-negative cost for phase {phase!r} of stage {stage}, "
            f"got {value!r}. Give every duration as a number >= 0."
        )
    return float(value)


def _simulate(
    schedule: Schedule, order: list[tuple[int, ScheduleOp]], cost: CostFn
) -> SimulationResult:
    """Times ``order`` (a dependency-respecting order of all ops) as early as possible."""
    rows = schedule.num_submeshes
    free = [0.0] * rows
    busy = [0.0] * rows
    end: dict[ScheduleOp, float] = {}
    timeline = []
    for row, op in order:
        start = free[row]
        for dep in op_deps(op, schedule.num_stages):
            crossing = schedule.stage_to_row[dep.stage] != row
            start = max(start, end[dep] + (cost(dep.stage, "transfer") if crossing else 0.0))
        duration = _duration(schedule, op, cost)
        end[op] = free[row] = start + duration
        busy[row] += duration
        timeline.append((row, op, start, end[op]))
    timeline.sort(key=lambda item: (item[2], item[0]))
    makespan = max(end.values(), default=0.0)
    idle = rows * makespan - sum(busy)
    return SimulationResult(
        makespan=makespan,
        bubble_fraction=idle / (rows * makespan) if makespan > 0 else 0.0,
        busy_time=tuple(busy),
        timeline=tuple(timeline),
        peak_in_flight=tuple(_peak_in_flight(schedule, ops) for ops in schedule.rows),
    )


def _duration(schedule: Schedule, op: ScheduleOp, cost: CostFn) -> float:
    if op.phase == "B" and not schedule.split_backward:
        return cost(op.stage, "B") + cost(op.stage, "W")
    return cost(op.stage, op.phase)


def _peak_in_flight(schedule: Schedule, ops: tuple[ScheduleOp, ...]) -> int:
    """Counts live activation sets along one row; its ops run one after another."""
    last = schedule.phases[-1]
    live = peak = 0
    for op in ops:
        if op.phase == "F":
            live += 1
            peak = max(peak, live)
        elif op.phase == last:
            live -= 1
    return peak
