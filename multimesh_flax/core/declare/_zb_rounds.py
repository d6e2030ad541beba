"""The Zero Bubble paper's automatic heuristic, built round by round (Qi et al., ICLR 2024, 3.1).

One stage per row. Round 0 runs every stage's first forward, then as many extra forwards on
each row as fit (in time and memory) before that row's first ``B`` can come back, then the
first ``B`` on every row from the last to the first. Round ``i`` then runs one more forward
on each row that the options allow and ``B`` of microbatch ``i`` on every row, last row
first. A row that would wait for an input runs pending ``W`` in the gap: those that fit
whole, and one more when the gap would not leave this row more idle than the most idle row
so far (``greedy`` fills it anyway). A ``W`` also runs first when an ``F`` needs memory, and
the first row, once its forwards are done, runs its pending ``W`` before each ``B`` (nothing
waits for its ``B``). At the end every row runs its last ``W``.

Memory is counted as in the paper: an ``F`` takes one activation set, its ``B`` frees all
but ``w_share`` of it (the paper's ``M_W / M_B``, the inputs and output gradients its ``W``
still needs) and its ``W`` frees the rest; a row holds at most ``limit`` sets.

Three yes/no options, all tried (:func:`round_variants`), as in the paper's grid search:

* ``gap_before_b``: the warm-up adds a forward only if it ends before the row's first ``B``
  can start (else also one that delays it).
* ``skip_ahead``: a row two or more forwards ahead of the next skips a forward that would
  delay its next ``B``, unless that leaves it idle longer than the most idle row.
* ``greedy``: see above.
"""

from __future__ import annotations

import dataclasses
import itertools

from multimesh_flax.core.declare._costs import CostFn
from multimesh_flax.core.declare._schedule_ops import ScheduleOp, op_deps

Rows = list[list[ScheduleOp]]
_EPS = 1e-9


class NoRoom(Exception):
    """A forward needs memory that no pending ``W`` can free: the variant does not fit."""


@dataclasses.dataclass(frozen=True)
class Options:
    """The heuristic's yes/no choices (see the module docstring)."""

    gap_before_b: bool
    skip_ahead: bool
    greedy: bool


OPTIONS = tuple(Options(*flags) for flags in itertools.product((True, False), repeat=3))


@dataclasses.dataclass
class _Rows:
    """The rows built so far, with each op's end and each row's clock, memory and idle time."""

    p: int
    m: int
    cost: CostFn
    limit: float
    w_share: float

    def __post_init__(self) -> None:
        self.rows: Rows = [[] for _ in range(self.p)]
        self.end: dict[ScheduleOp, float] = {}
        self.free = [0.0] * self.p
        self.memory = [0.0] * self.p
        self.idle = [0.0] * self.p
        self.done = {(j, ph): 0 for j in range(self.p) for ph in "FBW"}

    def count(self, j: int, phase: str) -> int:
        return self.done[(j, phase)]

    def pending_w(self, j: int) -> bool:
        return self.count(j, "W") < self.count(j, "B")

    def arrival(self, op: ScheduleOp) -> float:
        """When ``op``'s inputs are on its row (all of them scheduled)."""
        return max(
            (
                self.end[d] + (self.cost(d.stage, "transfer") if d.stage != op.stage else 0.0)
                for d in op_deps(op, self.p)
            ),
            default=0.0,
        )

    def next_op(self, j: int, phase: str) -> ScheduleOp:
        return ScheduleOp(j, self.count(j, phase), phase)

    def put(self, j: int, phase: str) -> None:
        op = self.next_op(j, phase)
        start = max(self.free[j], self.arrival(op))
        if self.rows[j]:
            self.idle[j] += start - self.free[j]
        self.end[op] = self.free[j] = start + self.cost(j, phase)
        self.memory[j] += {"F": 1.0, "B": self.w_share - 1.0, "W": -self.w_share}[phase]
        self.done[(j, phase)] += 1
        self.rows[j].append(op)

    def make_room(self, j: int) -> None:
        """Runs pending ``W`` until one more forward fits in memory."""
        while self.memory[j] + 1.0 > self.limit + _EPS:
            if not self.pending_w(j):
                raise NoRoom
            self.put(j, "W")

    def fill_gap(self, j: int, arrival: float, greedy: bool) -> None:
        """Runs pending ``W`` while row ``j`` would otherwise wait until ``arrival``."""
        while self.pending_w(j) and self.free[j] + self.cost(j, "W") <= arrival + _EPS:
            self.put(j, "W")
        if self.pending_w(j) and self.free[j] < arrival - _EPS:
            hurts = arrival - self.free[j] > max(self.idle) - self.idle[j]
            if greedy or hurts:
                self.put(j, "W")


def round_schedule(
    p: int, m: int, cost: CostFn, limit: float, w_share: float, options: Options
) -> Rows:
    """Builds the rows with ``options``; raises :class:`NoRoom` if they do not fit ``limit``."""
    state = _Rows(p, m, cost, limit, w_share)
    _warm_up(state, options)
    for i in range(1, m):
        _forwards(state, options)
        _backwards(state, i, options)
    for j in range(p):
        while state.pending_w(j):
            state.put(j, "W")
    return state.rows


def round_variants(p: int, m: int, cost: CostFn, limit: float, w_share: float) -> list[Rows]:
    """The rows of every option that fits ``limit``."""
    out = []
    for options in OPTIONS:
        try:
            out.append(round_schedule(p, m, cost, limit, w_share, options))
        except NoRoom:
            continue
    return out


def _warm_up(state: _Rows, options: Options) -> None:
    """Round 0: first forwards, the extra forwards that fit before each first ``B``, then
    every first ``B`` from the last row to the first."""
    p, cost = state.p, state.cost
    for j in range(p):
        state.put(j, "F")
    extra = [0] * p
    back = state.end[ScheduleOp(p - 1, 0, "F")] + cost(p - 1, "B")
    for j in range(p - 2, -1, -1):
        arrives = back + cost(j + 1, "transfer")
        clock, memory = state.free[j], state.memory[j]
        while state.count(j, "F") + extra[j] < state.m and memory + 1.0 <= state.limit + _EPS:
            late = clock + cost(j, "F") > arrives if options.gap_before_b else clock >= arrives
            if late:
                break
            memory += 1.0
            clock += cost(j, "F")
            extra[j] += 1
        back = max(clock, arrives) + cost(j, "B")
    for j in range(1, p):
        while 0 < extra[j] >= extra[j - 1] and state.count(j, "F") + extra[j] < state.m:
            extra[j] -= 1
    for j in range(p):
        for _ in range(extra[j]):
            state.put(j, "F")
    for j in range(p - 1, -1, -1):
        state.put(j, "B")


def _forwards(state: _Rows, options: Options) -> None:
    """One more forward on each row that has one left and that the options let run."""
    p = state.p
    want = [state.count(j, "F") < state.m and _runs_forward(state, j, options) for j in range(p)]
    for j in range(p - 2, -1, -1):
        want[j] = want[j] and want[j + 1]
    for j in range(p):
        if want[j]:
            state.make_room(j)
            if j > 0:
                state.fill_gap(j, state.arrival(state.next_op(j, "F")), options.greedy)
            state.put(j, "F")


def _runs_forward(state: _Rows, j: int, options: Options) -> bool:
    """Whether row ``j`` runs a forward this round (``skip_ahead`` may say no)."""
    p, cost = state.p, state.cost
    if not options.skip_ahead or j + 1 >= p or state.count(j, "F") < state.count(j + 1, "F") + 2:
        return True
    back = state.free[j + 1] + cost(j + 1, "F") + cost(j + 1, "B") + cost(j + 1, "transfer")
    if state.free[j] >= back:
        return False
    needed, memory, k = 0.0, state.memory[j] + 1.0, state.count(j, "W")
    while memory > state.limit + _EPS and k < state.count(j, "B"):
        needed += cost(j, "W")
        memory -= state.w_share
        k += 1
    if state.free[j] + cost(j, "F") + needed <= back:
        return True
    return back - state.free[j] > max(state.idle) - state.idle[j]


def _backwards(state: _Rows, i: int, options: Options) -> None:
    """``B`` of microbatch ``i`` on every row, last row first."""
    for j in range(state.p - 1, -1, -1):
        if j + 1 < state.p:
            state.fill_gap(j, state.arrival(ScheduleOp(j, i, "B")), options.greedy)
        if j == 0 and state.count(0, "F") == state.m:
            while state.pending_w(0):
                state.put(0, "W")
        state.put(j, "B")
