"""Split-backward schedules after Qi et al.: ZB-H1, ZB-H2, the automatic scheduler, ZB-V.

The backward of each stage is split into ``B`` (the activation gradient the previous stage
waits for) and ``W`` (the weight gradient nobody waits for), so ``W`` can fill what would be
bubbles. This module builds the orders; ``_schedules.make_schedule`` wraps them.

* :func:`zb_h1_rows`: ZB-H1 ("Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.1):
  1F1B's warm-up, then row ``r`` lets its weight gradients trail its backwards by ``r``
  microbatches, so the deferred ``W`` fill the cool-down. Every row keeps at most ``R``
  activation sets, 1F1B's peak; with ``T_W <= T_F, T_B`` and ``m >= R`` the longest row
  idles ``(R - 1)(T_F + T_B - T_W)``.
* :func:`list_schedule`: list scheduling of the paper's heuristic (section 3.1): a row
  that is free runs its next ready ``B``; else its next ready ``F`` while it holds fewer
  than ``limit`` activation sets; else a pending ``W`` to fill the gap. A :class:`Policy`
  fixes the choices the heuristic leaves open. ZB-H2 is this with unit costs and
  ``2 R - 1`` sets; on the V layout (stage ``s`` and ``2 R - 1 - s`` on row ``s``) its
  variants are ZB-V's alternatives for uneven costs.
* :func:`auto_rows`: the automatic schedule for given costs and memory limit: the paper's
  round-by-round heuristic (``_zb_rounds``, its grid of options), the list scheduler's
  policies and, where the limit allows them, ZB-H1 and ZB-H2, timed with the costs; the
  order whose longest row is shortest wins (then the shortest makespan). With the paper's
  profiled costs and memory accounting it gives its Table 5's ZB-1p and ZB-2p bubbles.
  :func:`v_rows` does the same on the V, with the paper's ZB-V (``_zb_v``) first: no
  bubble with equal costs and ``m >= 2 R``, at 1F1B's activation memory.

An activation set lives from its ``F`` to its ``W``; with ``w_share`` < 1 (the paper's
``M_W / M_B``) it counts as that share of a set from its ``B`` on. A row's *span* runs
from its first op's start to its last op's end; when steps overlap (the paper updates each stage's
weights without waiting for the others, section 4), the longest span is the step time, and
that is the bubble the paper's Table 2 gives.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from multimesh_flax.core.declare import _zb_rounds, _zb_v
from multimesh_flax.core.declare._costs import CostFn
from multimesh_flax.core.declare._schedule_ops import ScheduleOp, op_deps

Rows = list[list[ScheduleOp]]


def unit_cost(stage: int, phase: str) -> float:
    """F, B and W take 1; transfers are free."""
    return 0.0 if phase == "transfer" else 1.0


def v_layout(rows: int) -> tuple[int, ...]:
    """The row of each of ``2 rows`` stages on a V: ``s`` and ``2 rows - 1 - s`` on row ``s``."""
    return tuple(s if s < rows else 2 * rows - 1 - s for s in range(2 * rows))


# --- ZB-H1 ----------------------------------------------------------------------------------


def zb_h1_rows(rows: int, m: int) -> Rows:
    """ZB-H1: 1F1B whose ``W`` trail the ``B`` by ``r`` microbatches on row ``r``."""
    out: Rows = []
    for r in range(rows):
        warmup = min(rows - 1 - r, m)
        order = [ScheduleOp(r, i, "F") for i in range(warmup)]
        weights = 0
        for i in range(m):
            if warmup + i < m:
                order.append(ScheduleOp(r, warmup + i, "F"))
            order.append(ScheduleOp(r, i, "B"))
            if i >= r:
                order.append(ScheduleOp(r, weights, "W"))
                weights += 1
        order += [ScheduleOp(r, i, "W") for i in range(weights, m)]
        out.append(order)
    return out


# --- list scheduling ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Policy:
    """The choices the paper's heuristic leaves open.

    Attributes:
      fill_only_if_fits: An idle row runs a pending ``W`` only when it ends before the
        row's next ``F`` or ``B`` is ready (as far as is known); else whenever idle.
      forward_may_delay: A ready ``F`` starts even when a ``B`` becomes ready before the
        ``F`` would end (filling the warm-up); else the row waits for the ``B``.
      deep_first: With several stages on a row, the later stage's op goes first.
    """

    fill_only_if_fits: bool = False
    forward_may_delay: bool = True
    deep_first: bool = True


POLICIES = tuple(Policy(*flags) for flags in itertools.product((False, True), repeat=3))


@dataclasses.dataclass
class _State:
    """What the list scheduler knows so far."""

    stage_to_row: tuple[int, ...]
    m: int
    cost: CostFn
    end: dict[ScheduleOp, float] = dataclasses.field(default_factory=dict)
    done: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)

    def next_op(self, stage: int, phase: str) -> ScheduleOp | None:
        """The stage's next op of ``phase`` in microbatch order, if it may run at all."""
        k = self.done.get((stage, phase), 0)
        before = {"F": self.m, "B": self.done.get((stage, "F"), 0)}
        limit = before.get(phase, self.done.get((stage, "B"), 0))
        return ScheduleOp(stage, k, phase) if k < limit else None

    def ready_at(self, op: ScheduleOp, row: int) -> float | None:
        """When ``op``'s inputs are on ``row``; ``None`` while a dependency is unscheduled."""
        ready = 0.0
        for dep in op_deps(op, len(self.stage_to_row)):
            if dep not in self.end:
                return None
            hop = self.cost(dep.stage, "transfer") if self.stage_to_row[dep.stage] != row else 0
            ready = max(ready, self.end[dep] + hop)
        return ready


def list_schedule(
    stage_to_row: Sequence[int],
    m: int,
    cost: CostFn,
    limit: float,
    policy: Policy,
    w_share: float = 1.0,
) -> Rows:
    """Builds every row's order by simulating the heuristic with ``cost``.

    Each step commits, over all rows, the op that starts earliest (ties: lower row). A row
    holds at most ``limit`` activation sets (``F`` started, ``W`` not run). A row's choice
    changes only when it or a neighbouring stage's row commits an op, so only those rows
    choose again.
    """
    state = _State(tuple(stage_to_row), m, cost)
    num_rows = max(stage_to_row) + 1
    stages = [[s for s, r in enumerate(stage_to_row) if r == row] for row in range(num_rows)]
    free, live = [0.0] * num_rows, [0.0] * num_rows
    change = {"F": 1.0, "B": w_share - 1.0, "W": -w_share}
    out: Rows = [[] for _ in range(num_rows)]
    picks: list[tuple[float, ScheduleOp] | None] = [None] * num_rows
    stale = set(range(num_rows))
    for _ in range(3 * len(stage_to_row) * m):
        for r in stale:
            picks[r] = _pick(state, r, stages[r], free[r], limit - live[r], policy)
        row = min((r for r, p in enumerate(picks) if p is not None), key=lambda r: picks[r][0])
        start, op = picks[row]  # type: ignore[misc]
        state.end[op] = free[row] = start + cost(op.stage, op.phase)
        state.done[(op.stage, op.phase)] = op.microbatch + 1
        live[row] += change[op.phase]
        out[row].append(op)
        near = (s for s in (op.stage - 1, op.stage + 1) if 0 <= s < len(stage_to_row))
        stale = {row, *(stage_to_row[s] for s in near)}
    return out


def _pick(
    state: _State, row: int, stages: list[int], free: float, room: float, policy: Policy
) -> tuple[float, ScheduleOp] | None:
    """The op ``row`` runs next and its start, or ``None`` if it must wait for others.

    ``room`` is the number of activation sets the row may still take. A forward of stage
    ``s`` needs room for the sets its microbatch will take on this row from ``s`` on, so
    a microbatch that entered the row can always come back through it (no deadlock).
    """
    order = sorted(stages, reverse=policy.deep_first)
    timed: dict[str, list[tuple[float, ScheduleOp]]] = {"B": [], "F": []}
    for phase in ("B", "F"):
        for s in order:
            if phase == "F" and sum(t >= s for t in stages) > room + 1e-9:
                continue
            op = state.next_op(s, phase)
            ready = None if op is None else state.ready_at(op, row)
            if ready is not None:
                timed[phase].append((max(free, ready), op))
    weight = next((op for s in order if (op := state.next_op(s, "W"))), None)
    first_b = min(timed["B"], default=(math.inf, None), key=lambda t: t[0])
    first_f = min(timed["F"], default=(math.inf, None), key=lambda t: t[0])
    if first_b[0] <= free:
        return first_b
    if first_f[0] <= free:
        delays = first_b[0] < free + state.cost(first_f[1].stage, "F")
        if policy.forward_may_delay or not delays:
            return first_f
    upcoming = min(first_b, first_f, key=lambda t: t[0]) if first_f[0] > free else first_b
    if weight is not None:
        fits = free + state.cost(weight.stage, "W") <= upcoming[0]
        if fits or not policy.fill_only_if_fits:
            return free, weight
    return None if upcoming[1] is None else upcoming


# --- timing and the automatic schedule ------------------------------------------------------


def row_spans(rows: Rows, stage_to_row: Sequence[int], cost: CostFn) -> tuple[list[float], float]:
    """Each row's span and the makespan of ``rows`` run as early as possible with ``cost``.

    The rows must be a valid (deadlock-free) order.
    """
    end: dict[ScheduleOp, float] = {}
    first = [math.inf] * len(rows)
    free = [0.0] * len(rows)
    heads = [0] * len(rows)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while heads[r] < len(row):
                op = row[heads[r]]
                deps = op_deps(op, len(stage_to_row))
                if any(d not in end for d in deps):
                    break
                start = max(
                    [free[r]]
                    + [
                        end[d] + (cost(d.stage, "transfer") if stage_to_row[d.stage] != r else 0)
                        for d in deps
                    ]
                )
                end[op] = free[r] = start + cost(op.stage, op.phase)
                first[r] = min(first[r], start)
                heads[r] += 1
                progress = True
    spans = [f - s if row else 0.0 for f, s, row in zip(free, first, rows, strict=True)]
    return spans, max(free, default=0.0)


def auto_rows(rows: int, m: int, cost: CostFn, limit: int, w_share: float = 1.0) -> Rows:
    """The best order for ``cost`` within ``limit`` activation sets per row (one stage each):
    the paper's round-by-round heuristic (``_zb_rounds``), the list scheduler's policies, and
    ZB-H1 and ZB-H2 where they fit, each timed with ``cost``."""
    layout = tuple(range(rows))
    candidates = _zb_rounds.round_variants(rows, m, cost, limit, w_share)
    ideal = next((c for c in candidates if no_idle(c, layout, cost)), None)
    if ideal is not None:
        return ideal
    one_stage = [pol for pol in POLICIES if pol.deep_first]  # the same orders either way
    candidates += [list_schedule(layout, m, cost, limit, pol, w_share) for pol in one_stage]
    if limit >= rows:
        candidates.append(zb_h1_rows(rows, m))
    if limit >= 2 * rows - 1:
        candidates.append(list_schedule(layout, m, unit_cost, 2 * rows - 1, Policy()))
    return best_of(candidates, layout, cost)


def v_rows(rows: int, m: int, cost: CostFn, limit: int, w_share: float = 1.0) -> Rows:
    """The best V order for ``cost`` within ``limit`` half-size sets per row: the paper's
    ZB-V (``_zb_v``) where it fits, and the list scheduler's policies."""
    layout = v_layout(rows)
    paper = _zb_v.zb_v_rows(rows, m, cost)
    fits = paper is not None and max(peak_sets(r, w_share) for r in paper) <= limit + 1e-9
    if fits and no_idle(paper, layout, cost):  # type: ignore[arg-type]
        return paper  # type: ignore[return-value]
    candidates = [list_schedule(layout, m, cost, limit, pol, w_share) for pol in POLICIES]
    return best_of([paper, *candidates] if fits else candidates, layout, cost)  # type: ignore[list-item]


def no_idle(rows: Rows, layout: Sequence[int], cost: CostFn) -> bool:
    """Whether every row of ``rows`` is busy from its first op to its last (no order can
    have a shorter longest row)."""
    spans, _ = row_spans(rows, layout, cost)
    busy = [sum(cost(op.stage, op.phase) for op in row) for row in rows]
    return all(span <= b * (1 + 1e-12) + 1e-12 for span, b in zip(spans, busy, strict=True))


def peak_sets(row: Sequence[ScheduleOp], w_share: float = 1.0) -> float:
    """The most activation sets ``row`` holds at once: an ``F`` takes one, its ``B`` frees
    all but ``w_share`` of it and its ``W`` the rest."""
    change = {"F": 1.0, "B": w_share - 1.0, "W": -w_share}
    live = peak = 0.0
    for op in row:
        live += change[op.phase]
        peak = max(peak, live)
    return peak


def best_of(candidates: list[Rows], layout: Sequence[int], cost: CostFn) -> Rows:
    """The candidate whose longest row is shortest with ``cost``, then the shortest makespan
    (the first such)."""

    def key(candidate: Rows) -> tuple[float, float]:
        spans, makespan = row_spans(candidate, layout, cost)
        return max(spans), makespan

    return min(candidates, key=key)
