"""ZB-V as the Zero Bubble paper describes it (Qi et al., ICLR 2024, section 6).

``2 R`` stages on ``R`` rows in a V: row ``r`` runs stage ``r`` (its first chunk) and stage
``2 R - 1 - r`` (its second), so a microbatch goes down the rows and back up, and its
backward starts and ends on row 0. Each row runs three phases:

1. warm-up: ``2 R - 1 - r`` forwards of its first chunk and ``r`` of its second, each one
   as soon as its input is there (the second chunk's first on a tie);
2. steady: groups of ``F``, ``B``, ``W`` of one chunk: ``R - 1 - r`` groups of the second
   chunk, then one of the second and one of the first in turn, until every forward ran;
3. cool-down: the remaining ``B``, each as soon as it is ready, and pending ``W`` (oldest
   first) whenever no ``B`` is.

With equal costs and no transfer time every row is busy from its first op to its last, and
it holds at most ``2 R`` sets of a half-size stage, which is 1F1B's peak activation memory.
The timing is the same list scheduling as elsewhere: each step commits, over all rows, the
op that starts earliest (ties: the lower row); only the rows of the committed op's stage
and its neighbours choose again.
"""

from __future__ import annotations

import math

from multimesh_flax.core.declare._costs import CostFn
from multimesh_flax.core.declare._schedule_ops import ScheduleOp, op_deps

Rows = list[list[ScheduleOp]]


class _Row:
    """One row's plan and progress."""

    def __init__(self, r: int, rows: int, m: int) -> None:
        self.first, self.second = r, 2 * rows - 1 - r
        self.warm = {self.first: min(2 * rows - 1 - r, m), self.second: min(r, m)}
        self.lead = rows - 1 - r  # steady groups of the second chunk before alternating
        self.group: list[tuple[int, str]] = []
        self.groups_done = 0
        self.free = 0.0


class _VState:
    """The ops committed so far and when each ends."""

    def __init__(self, rows: int, m: int, cost: CostFn) -> None:
        self.rows, self.m, self.cost = rows, m, cost
        self.stages = 2 * rows
        self.end: dict[ScheduleOp, float] = {}
        self.done = {(s, ph): 0 for s in range(self.stages) for ph in "FBW"}
        self.home = [s if s < rows else self.stages - 1 - s for s in range(self.stages)]

    def next_op(self, stage: int, phase: str) -> ScheduleOp | None:
        k = self.done[(stage, phase)]
        bound = {"F": self.m, "B": self.done[(stage, "F")], "W": self.done[(stage, "B")]}
        return ScheduleOp(stage, k, phase) if k < bound[phase] else None

    def ready(self, op: ScheduleOp) -> float | None:
        """When ``op``'s inputs are on its row; ``None`` while one is not scheduled."""
        t = 0.0
        for dep in op_deps(op, self.stages):
            if dep not in self.end:
                return None
            hop = self.home[dep.stage] != self.home[op.stage]
            t = max(t, self.end[dep] + (self.cost(dep.stage, "transfer") if hop else 0.0))
        return t

    def commit(self, op: ScheduleOp, start: float) -> float:
        self.end[op] = start + self.cost(op.stage, op.phase)
        self.done[(op.stage, op.phase)] += 1
        return self.end[op]


def zb_v_rows(rows: int, m: int, cost: CostFn) -> Rows | None:
    """The rows of ZB-V for ``cost`` (see the module docstring); ``None`` if the plan gets
    stuck (a row's group waits for an op that only a later group of its own would run)."""
    state = _VState(rows, m, cost)
    plans = [_Row(r, rows, m) for r in range(rows)]
    out: Rows = [[] for _ in range(rows)]
    picks: list[tuple[float, ScheduleOp] | None] = [None] * rows
    stale = set(range(rows))
    for _ in range(3 * state.stages * m):
        for i in stale:
            picks[i] = _pick(state, plans[i])
        waiting = [i for i, pick in enumerate(picks) if pick is not None]
        if not waiting:
            return None  # the plan deadlocks for these costs
        r = min(waiting, key=lambda i: picks[i][0])  # type: ignore[index]
        start, op = picks[r]  # type: ignore[misc]
        plans[r].free = state.commit(op, start)
        if plans[r].group and plans[r].group[0] == (op.stage, op.phase):
            plans[r].group.pop(0)
        out[r].append(op)
        near = (t for t in (op.stage - 1, op.stage + 1) if 0 <= t < state.stages)
        stale = {r, *(state.home[t] for t in near)}
    return out


def _pick(state: _VState, row: _Row) -> tuple[float, ScheduleOp] | None:
    """The op ``row`` runs next and its start, or ``None`` while it waits on other rows."""
    warm = [s for s in (row.second, row.first) if state.done[(s, "F")] < row.warm[s]]
    if warm:
        ops = [state.next_op(s, "F") for s in warm]
        timed = [_at(row, (t, op)) for op in ops if (t := _ready(state, op)) is not None]
        # The earliest start; on a tie the second chunk (listed first).
        return min(timed, key=lambda x: x[0]) if timed else None
    head = _group_head(state, row)
    if head is None:
        return _cool_down(state, row)
    t = state.ready(head)
    if t is not None and t <= row.free:
        return row.free, head
    other = _cool_down(state, row)  # the group waits: a ready B or a pending W meanwhile
    if t is None or (other is not None and other[0] < max(t, row.free)):
        return other
    return _at(row, (t, head))


def _group_head(state: _VState, row: _Row) -> ScheduleOp | None:
    """The next op of the current steady group, starting a new group when one is done;
    ``None`` once every forward of the row ran and its last group is done."""
    while True:
        while row.group:
            chunk, phase = row.group[0]
            op = state.next_op(chunk, phase)
            if op is not None:
                return op
            row.group.pop(0)
        if not _forwards_left(state, row):
            return None
        _start_group(state, row)


def _ready(state: _VState, op: ScheduleOp | None) -> float | None:
    return None if op is None else state.ready(op)


def _at(row: _Row, timed: tuple[float, ScheduleOp]) -> tuple[float, ScheduleOp]:
    return max(row.free, timed[0]), timed[1]


def _forwards_left(state: _VState, row: _Row) -> bool:
    return any(state.done[(s, "F")] < state.m for s in (row.first, row.second))


def _start_group(state: _VState, row: _Row) -> None:
    """``F``, ``B``, ``W`` of the chunk whose turn it is (the other if it has no ``F`` left)."""
    k = row.groups_done
    chunk = row.second if k < row.lead or (k - row.lead) % 2 == 0 else row.first
    row.groups_done += 1
    row.group = [(chunk, "F"), (chunk, "B"), (chunk, "W")]


def _cool_down(state: _VState, row: _Row) -> tuple[float, ScheduleOp] | None:
    """The earliest ready ``B`` if it can start now, else the oldest pending ``W``, else the
    ``B`` that comes first."""
    timed = [
        (t, op)
        for s in (row.first, row.second)
        if (op := state.next_op(s, "B")) is not None and (t := state.ready(op)) is not None
    ]
    first_b = min(timed, key=lambda x: x[0], default=(math.inf, None))
    if first_b[0] <= row.free:
        return row.free, first_b[1]  # type: ignore[return-value]
    weights = [op for s in (row.second, row.first) if (op := state.next_op(s, "W"))]
    if weights:
        oldest = min(weights, key=lambda op: state.end[ScheduleOp(op.stage, op.microbatch, "B")])
        return row.free, oldest
    return None if first_b[1] is None else _at(row, first_b)  # type: ignore[arg-type]
