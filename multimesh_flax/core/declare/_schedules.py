"""Pipeline schedules as pure data: ops, per-submesh orders, generators and a validator.

A pipeline runs ``num_stages`` stages (tasks) ``0..S-1`` in a chain on ``num_submeshes``
submeshes, called *rows* here. Stage ``s`` lives on row ``stage_to_row[s]``: row ``s`` when
there is one stage per row, row ``s % R`` with ``interleave=v`` chunks per row (Megatron's
interleaved layout, ``S = v * R``), or on a V for ``"zero-bubble-v"`` (stages ``s`` and
``2 R - 1 - s`` on row ``s``). Each of ``m`` microbatches passes every stage forward
(phase ``"F"``) then backward (``"B"``). Split-backward schedules cut the backward in two:
``"B"`` computes the activation gradient that the previous stage waits for, ``"W"`` the
weight gradient that nobody waits for, so it can fill idle time.

* :class:`~._schedule_ops.ScheduleOp` (in ``_schedule_ops``) is one ``(stage, microbatch,
  phase)`` unit of work, written ``<phase><stage>.<microbatch>`` (``"F0.3"`` is the forward
  of stage 0 on microbatch 3); ``op_deps`` gives its dependencies ``F(s,i) <- F(s-1,i)``,
  ``B(s,i) <- F(s,i), B(s+1,i)`` and ``W(s,i) <- B(s,i)``.
* :class:`Schedule` holds one ordered tuple of ops per row; a row runs its ops in order,
  one at a time.
* :func:`make_schedule` builds GPipe, 1F1B, interleaved 1F1B, the zero-bubble schedules
  (ZB-H1, ZB-H2, the automatic one and ZB-V, built in ``_zero_bubble``) and user-given
  orders; :func:`stage_rows` gives each stage's row; :func:`validate_schedule` checks that
  an order is complete, placed on the right rows and free of deadlocks.
  ``_simulator.simulate`` predicts its timeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from multimesh_flax import errors
from multimesh_flax.core.declare import _zero_bubble
from multimesh_flax.core.declare._costs import CostFn, make_cost_fn
from multimesh_flax.core.declare._schedule_ops import _PHASES, ScheduleOp, op_deps
from multimesh_flax.core.declare._zero_bubble import unit_cost


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The order in which each row (submesh) runs its pipeline ops.

    Attributes:
      rows: One tuple of ops per row, in execution order.
      num_stages: Number of pipeline stages ``S``.
      num_microbatches: Number of microbatches ``m``.
      split_backward: Whether the backward is split into ``"B"`` and ``"W"`` ops.
      name: The generator that built the schedule (``"1f1b"``, ``"custom"``, ...).
      stage_to_row: ``stage_to_row[s]`` is the row that runs stage ``s``.

    Example:
      >>> from multimesh_flax.core import make_schedule
      >>> schedule = make_schedule("1f1b", num_stages=2, num_microbatches=3)
      >>> print(schedule)
      row 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
      row 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
      >>> schedule.num_submeshes, schedule.stage_to_row
      (2, (0, 1))
    """

    rows: tuple[tuple[ScheduleOp, ...], ...]
    num_stages: int
    num_microbatches: int
    split_backward: bool
    name: str
    stage_to_row: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(tuple(row) for row in self.rows))
        object.__setattr__(self, "stage_to_row", tuple(self.stage_to_row))

    @property
    def num_submeshes(self) -> int:
        """Number of rows (submeshes)."""
        return len(self.rows)

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases every stage runs per microbatch: ``("F", "B")`` or ``("F", "B", "W")``."""
        return _PHASES if self.split_backward else _PHASES[:2]

    def ops(self) -> Iterator[tuple[int, ScheduleOp]]:
        """Yields ``(row, op)`` for every op, row by row, in row order."""
        for row, ops in enumerate(self.rows):
            for op in ops:
                yield row, op

    def __str__(self) -> str:
        return "\n".join(
            f"row {r}: " + " ".join(str(op) for op in ops) for r, ops in enumerate(self.rows)
        )


# --- generators -----------------------------------------------------------------------------


def make_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    num_submeshes: int | None = None,
    interleave: int | None = None,
    custom: Sequence[Sequence[ScheduleOp | str | tuple[int, int, str]]] | None = None,
    costs: Mapping[str, float] | CostFn | None = None,
    max_in_flight: int | None = None,
    w_memory: float | None = None,
) -> Schedule:
    """Builds a named pipeline schedule and validates it.

    Names:

    * ``"gpipe"``: each row runs all its forwards, then all its backwards.
    * ``"1f1b"``: row ``r`` runs ``R - r - 1`` warm-up forwards, then alternates one forward
      and one backward, then drains the remaining backwards. One stage per row.
    * ``"interleaved-1f1b"``: Megatron-LM's interleaved 1F1B over ``v`` stages per row:
      row ``r`` runs ``2 (R - r - 1) + (v - 1) R`` warm-up forwards, taking ``R``
      microbatches through one stage before moving to the next. ``num_microbatches`` must
      be a multiple of ``R``. With equal costs its bubble is ``(R - 1) / (v m + R - 1)``;
      with ``v = 1`` it is ``"1f1b"``.
    * ``"zero-bubble-h1"``, ``"zero-bubble-h2"``, ``"zero-bubble-auto"``, ``"zero-bubble-v"``:
      the backward split into ``B`` (activation gradient) and ``W`` (weight gradient), after
      Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024). An activation set lives
      from a stage's ``F`` to its ``W``. With ``m >= R`` (``m >= 2 R`` for ZB-H2) and
      ``T_W <= T_F, T_B``, the longest row (``SimulationResult.steady_bubble_fraction``)
      idles the paper's Table 2 bubble:

      - ``"zero-bubble-h1"``: ZB-H1, 1F1B's memory (``R`` sets per row); row ``r``'s
        weight gradients trail its backwards by ``r`` microbatches. Bubble
        ``(R - 1)(T_F + T_B - T_W)``. One stage per row.
      - ``"zero-bubble-h2"``: ZB-H2, ``2 R - 1`` sets per row; a free row runs its next
        ready ``B``, else its next ``F`` while memory allows, else a pending ``W``.
        Bubble ``(R - 1)(T_F + T_B - 2 T_W)``, none with equal costs. One stage per row.
      - ``"zero-bubble-auto"``: the paper's automatic scheduler (its heuristic, with its
        grid of options) for ``costs`` (as ``simulate`` takes them; default unit costs)
        within ``max_in_flight`` sets per row (default ``R``, ZB-1p; ``2 R`` is ZB-2p),
        counting a set waiting for its ``W`` as ``w_memory`` of one. It also times the list
        scheduler's variants, and ZB-H1 and ZB-H2 where they fit, and keeps the order whose
        longest row is shortest. One stage per row.
      - ``"zero-bubble-v"``: ZB-V (the same paper, section 6): ``2 R`` stages on a V, stage
        ``s`` and ``2 R - 1 - s`` on row ``s``, so each microbatch turns on the last row
        and ends where it began. Each row runs ``2 R - 1`` warm-up forwards, then groups
        of ``F``, ``B``, ``W`` of one chunk, then the remaining ``B`` and ``W``. With equal
        costs and ``m >= 2 R`` no row idles, and a row holds at most ``2 R`` half-size
        sets: 1F1B's activation memory. For other ``costs`` the heuristic's variants on
        the V compete with it within ``max_in_flight`` (default ``2 R``) sets per row.
    * ``"custom"``: the order given in ``custom``, one sequence per row. An entry is a
      :class:`ScheduleOp`, a string ``"<phase><stage>.<microbatch>"`` such as ``"F0.3"``,
      or a tuple ``(stage, microbatch, phase)``. The backward counts as split when any
      entry has phase ``"W"``.

    Args:
      name: One of the names above.
      num_stages: Number of pipeline stages ``S``.
      num_microbatches: Number of microbatches ``m``.
      num_submeshes: Number of rows ``R``; defaults to ``S // interleave``.
      interleave: Stages per row ``v``; stage ``s`` runs on row ``s % R``. Defaults to
        ``S // num_submeshes``, or 1 when neither is given.
      custom: The per-row order, for ``name="custom"`` only.
      costs: Per-op durations for ``"zero-bubble-auto"`` and ``"zero-bubble-v"``, as
        ``simulate`` takes them.
      max_in_flight: Activation sets a row may hold, for ``"zero-bubble-auto"`` and
        ``"zero-bubble-v"``.
      w_memory: For ``"zero-bubble-auto"`` and ``"zero-bubble-v"``: the share of an
        activation set a stage still holds between its ``B`` and its ``W`` (the inputs and
        output gradients ``W`` needs; the paper's ``M_W / M_B``, about 0.4 for GPT-like
        layers). ``max_in_flight`` then counts a set waiting for its ``W`` as this share.
        Default 1: a set counts whole until its ``W``.

    Returns:
      A validated :class:`Schedule`.

    Raises:
      InvalidScheduleError: For an unknown name, sizes that do not fit together, or a
        ``custom`` order that :func:`validate_schedule` rejects.

    Example:
      >>> from multimesh_flax.core import make_schedule
      >>> print(make_schedule("gpipe", num_stages=2, num_microbatches=2))
      row 0: F0.0 F0.1 B0.0 B0.1
      row 1: F1.0 F1.1 B1.0 B1.1
      >>> print(make_schedule("custom", 2, 1, custom=[["F0.0", "B0.0"], [(1, 0, "F"), "B1.0"]]))
      row 0: F0.0 B0.0
      row 1: F1.0 B1.0
      >>> print(make_schedule("zero-bubble-h1", num_stages=2, num_microbatches=3))
      row 0: F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 W0.1 B0.2 W0.2
      row 1: F1.0 B1.0 F1.1 B1.1 W1.0 F1.2 B1.2 W1.1 W1.2
      >>> make_schedule("zero-bubble-v", num_stages=4, num_microbatches=2).stage_to_row
      (0, 1, 1, 0)
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise errors.InvalidScheduleError(
            f"Unknown schedule `name`={name!r}. Use one of {sorted(_BUILDERS)}."
        )
    if (custom is not None) != (name == "custom"):
        raise errors.InvalidScheduleError(
            f"`custom` goes with `name`='custom' and only with it; got `name`={name!r} and "
            f"`custom` {'given' if custom is not None else 'missing'}."
        )
    _check_positive(num_stages=num_stages, num_microbatches=num_microbatches)
    rows_count, chunks = _layout(name, num_stages, num_submeshes, interleave)
    request = _Request(
        rows_count,
        chunks,
        num_microbatches,
        custom,
        *_zb_options(name, chunks, costs, max_in_flight, w_memory),
    )
    rows, split = builder(request)
    stage_to_row = stage_rows(name, num_stages, rows_count)
    ordered = tuple(tuple(row) for row in rows)
    schedule = Schedule(ordered, num_stages, num_microbatches, split, name, stage_to_row)
    validate_schedule(schedule)
    return schedule


def stage_rows(name: str, num_stages: int, num_submeshes: int) -> tuple[int, ...]:
    """The row of each stage: on a V for ``"zero-bubble-v"``, else ``s % num_submeshes``.

    Example:
      >>> from multimesh_flax.core.declare import stage_rows
      >>> stage_rows("zero-bubble-v", 6, 3), stage_rows("interleaved-1f1b", 6, 3)
      ((0, 1, 2, 2, 1, 0), (0, 1, 2, 0, 1, 2))
    """
    if name in _V_SHAPED:
        return _zero_bubble.v_layout(num_submeshes)
    return tuple(s % num_submeshes for s in range(num_stages))


def _zb_options(
    name: str, chunks: int, costs: object, max_in_flight: int | None, w_memory: object
) -> tuple[CostFn, int | None, float]:
    """Checks ``costs``, ``max_in_flight`` and ``w_memory`` against ``name``; returns them for
    a builder."""
    if costs is not None and name not in ("zero-bubble-auto", *_V_SHAPED):
        raise errors.InvalidScheduleError(
            f"`costs` shapes only 'zero-bubble-auto' and 'zero-bubble-v' (the others are "
            f"fixed orders; pass costs to `simulate`), got `name`={name!r}."
        )
    if max_in_flight is not None:
        if name not in ("zero-bubble-auto", *_V_SHAPED):
            raise errors.InvalidScheduleError(
                f"`max_in_flight` applies to 'zero-bubble-auto' and 'zero-bubble-v', got "
                f"`name`={name!r}. Drop it, or use one of those schedules."
            )
        _check_positive(max_in_flight=max_in_flight)
        if max_in_flight < chunks:
            raise errors.InvalidScheduleError(
                f"Expected `max_in_flight` >= {chunks} (the stages per submesh: a microbatch "
                f"holds one activation set on each), got {max_in_flight}."
            )
    return make_cost_fn(costs), max_in_flight, _w_share(name, w_memory)


def _w_share(name: str, w_memory: object) -> float:
    """``w_memory`` checked: a number in [0, 1] for the cost-driven schedules; default 1."""
    if w_memory is None:
        return 1.0
    if name not in ("zero-bubble-auto", *_V_SHAPED):
        raise errors.InvalidScheduleError(
            f"`w_memory` applies to 'zero-bubble-auto' and 'zero-bubble-v', got `name`="
            f"{name!r}. Drop it, or use one of those schedules."
        )
    number = isinstance(w_memory, (int, float)) and not isinstance(w_memory, bool)
    if not number or not 0.0 <= w_memory <= 1.0:
        raise errors.InvalidScheduleError(
            f"Expected `w_memory` to be a number in [0, 1] (the share of an activation set "
            f"kept from B to W), got {w_memory!r}."
        )
    return float(w_memory)


def _check_positive(**values: object) -> None:
    for arg, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise errors.InvalidScheduleError(
                f"Expected a positive integer `{arg}`, got {value!r}."
            )


def _layout(
    name: str, num_stages: int, num_submeshes: int | None, interleave: int | None
) -> tuple[int, int]:
    """Returns ``(rows, stages per row)``, checking that they fit ``num_stages``."""
    if name in _V_SHAPED and num_submeshes is None and interleave is None:
        interleave = 2
    if name == "interleaved-1f1b" and num_submeshes is None and interleave is None:
        raise errors.InvalidScheduleError(
            "`name`='interleaved-1f1b' needs `interleave` (stages per submesh) or "
            "`num_submeshes`; pass one of them."
        )
    if interleave is not None:
        _check_positive(interleave=interleave)
        if num_stages % interleave or (
            num_submeshes is not None and num_submeshes * interleave != num_stages
        ):
            raise errors.InvalidScheduleError(
                f"Expected `num_stages` = `interleave` * `num_submeshes`, got `num_stages`="
                f"{num_stages}, `interleave`={interleave}, `num_submeshes`={num_submeshes}."
            )
        rows = num_stages // interleave
    else:
        rows = num_stages if num_submeshes is None else num_submeshes
        _check_positive(num_submeshes=rows)
        if num_stages % rows:
            raise errors.InvalidScheduleError(
                f"Expected `num_stages` to be a multiple of `num_submeshes`, got "
                f"`num_stages`={num_stages} and `num_submeshes`={rows}."
            )
    chunks = num_stages // rows
    if chunks > 1 and name in _ONE_STAGE_PER_ROW:
        raise errors.InvalidScheduleError(
            f"`name`={name!r} runs one stage per submesh, got {chunks} stages per submesh "
            f"(`num_stages`={num_stages} on {rows} submeshes). Use 'interleaved-1f1b', "
            "'zero-bubble-v' or 'gpipe', or as many submeshes as stages."
        )
    if chunks != 2 and name in _V_SHAPED:
        raise errors.InvalidScheduleError(
            f"`name`={name!r} runs two stages per submesh (stage s and 2R-1-s on submesh "
            f"s), got {num_stages} stages on {rows} submeshes. Use `num_stages` = "
            f"{2 * rows}, or `num_submeshes` = {num_stages // 2}."
        )
    return rows, chunks


_ONE_STAGE_PER_ROW = ("1f1b", "zero-bubble-h1", "zero-bubble-h2", "zero-bubble-auto")
_V_SHAPED = ("zero-bubble-v",)


_Rows = list[list[ScheduleOp]]


class _Request(NamedTuple):
    """What a builder gets: the layout, the microbatches and the options for its name."""

    rows: int
    chunks: int
    m: int
    custom: Any = None
    cost: CostFn = unit_cost
    limit: int | None = None
    w_share: float = 1.0


def _gpipe_rows(req: _Request) -> tuple[_Rows, bool]:
    """All forwards by (microbatch, stage), then all backwards by (microbatch, -stage)."""
    rows, chunks, m = req.rows, req.chunks, req.m
    out: _Rows = []
    for r in range(rows):
        stages = [c * rows + r for c in range(chunks)]
        fwd = [ScheduleOp(s, i, "F") for i in range(m) for s in stages]
        bwd = [ScheduleOp(s, i, "B") for i in range(m) for s in reversed(stages)]
        out.append(fwd + bwd)
    return out, False


def _one_f_one_b_rows(req: _Request) -> tuple[_Rows, bool]:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    rows, m = req.rows, req.m
    out: _Rows = []
    for r in range(rows):
        warmup = min(rows - r - 1, m)
        order = [ScheduleOp(r, i, "F") for i in range(warmup)]
        for i in range(m - warmup):
            order += [ScheduleOp(r, warmup + i, "F"), ScheduleOp(r, i, "B")]
        order += [ScheduleOp(r, i, "B") for i in range(m - warmup, m)]
        out.append(order)
    return out, False


def _interleaved_rows(req: _Request) -> tuple[_Rows, bool]:
    """Megatron-LM's interleaved 1F1B: 1F1B over ``m * chunks`` (chunk, microbatch) units."""
    rows, chunks, m = req.rows, req.chunks, req.m
    if chunks == 1:
        return _one_f_one_b_rows(req)
    if m % rows:
        raise errors.InvalidScheduleError(
            f"'interleaved-1f1b' needs `num_microbatches` to be a multiple of the number of "
            f"submeshes, got {m} microbatches on {rows} submeshes. Use "
            f"{(m // rows + 1) * rows} microbatches, or another schedule."
        )
    total = m * chunks
    out: _Rows = []
    for r in range(rows):
        unit = _interleaved_unit(r, rows, chunks)
        warmup = min(2 * (rows - r - 1) + (chunks - 1) * rows, total)
        order = [unit(k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit(warmup + k, "F"), unit(k, "B")]
        order += [unit(k, "B") for k in range(total - warmup, total)]
        out.append(order)
    return out, False


def _interleaved_unit(r: int, rows: int, chunks: int) -> Callable[[int, str], ScheduleOp]:
    """Maps a row's k-th forward or backward to its op: ``rows`` microbatches per chunk turn."""

    def unit(k: int, phase: str) -> ScheduleOp:
        chunk = (k % (rows * chunks)) // rows
        if phase == "B":
            chunk = chunks - 1 - chunk
        microbatch = (k // (rows * chunks)) * rows + k % rows
        return ScheduleOp(chunk * rows + r, microbatch, phase)

    return unit


def _zb_h1_rows(req: _Request) -> tuple[_Rows, bool]:
    return _zero_bubble.zb_h1_rows(req.rows, req.m), True


def _zb_h2_rows(req: _Request) -> tuple[_Rows, bool]:
    """List scheduling with unit costs and ``2 rows - 1`` activation sets per row."""
    layout = tuple(range(req.rows))
    policy = _zero_bubble.Policy()
    return _zero_bubble.list_schedule(layout, req.m, unit_cost, 2 * req.rows - 1, policy), True


def _zb_auto_rows(req: _Request) -> tuple[_Rows, bool]:
    limit = req.rows if req.limit is None else req.limit
    return _zero_bubble.auto_rows(req.rows, req.m, req.cost, limit, req.w_share), True


def _zb_v_rows(req: _Request) -> tuple[_Rows, bool]:
    limit = 2 * req.rows if req.limit is None else req.limit
    return _zero_bubble.v_rows(req.rows, req.m, req.cost, limit, req.w_share), True


def _custom_rows(req: _Request) -> tuple[_Rows, bool]:
    """Reads the user's per-row order; the backward is split when any op is a ``W``."""
    rows, custom = req.rows, req.custom
    if isinstance(custom, (str, bytes)) or len(custom) != rows:
        got = len(custom) if not isinstance(custom, (str, bytes)) else repr(custom)
        raise errors.InvalidScheduleError(
            f"Expected `custom` to hold one sequence of ops per submesh ({rows}), got {got}."
        )
    out = [[_to_op(entry) for entry in row] for row in custom]
    return out, any(op.phase == "W" for row in out for op in row)


def _to_op(entry: object) -> ScheduleOp:
    if isinstance(entry, ScheduleOp):
        return entry
    if isinstance(entry, str):
        return ScheduleOp.parse(entry)
    if isinstance(entry, (tuple, list)) and len(entry) == 3:
        stage, microbatch, phase = entry
        if isinstance(stage, int) and isinstance(microbatch, int) and phase in _PHASES:
            return ScheduleOp(stage, microbatch, phase)
    raise errors.InvalidScheduleError(
        f"Expected each `custom` entry to be a ScheduleOp, a string like 'F0.3' or a tuple "
        f"(stage, microbatch, phase) with phase in {_PHASES}, got {entry!r}."
    )


_BUILDERS: dict[str, Callable[[_Request], tuple[_Rows, bool]]] = {
    "gpipe": _gpipe_rows,
    "1f1b": _one_f_one_b_rows,
    "interleaved-1f1b": _interleaved_rows,
    "zero-bubble-h1": _zb_h1_rows,
    "zero-bubble-h2": _zb_h2_rows,
    "zero-bubble-auto": _zb_auto_rows,
    "zero-bubble-v": _zb_v_rows,
    "custom": _custom_rows,
}

# Every name ``make_schedule`` builds, in the order the docs list them ("custom" last).
SCHEDULE_NAMES = tuple(_BUILDERS)


# --- validation -----------------------------------------------------------------------------


def validate_schedule(schedule: Schedule) -> None:
    """Checks that a schedule can run: complete, on the right rows, and free of deadlocks.

    Args:
      schedule: The schedule to check.

    Raises:
      InvalidScheduleError: If the layout is inconsistent, an op has an unknown phase,
        stage or microbatch, appears twice, is missing, sits on a row its stage does not
        belong to, or if the per-row orders deadlock. The message names the op.

    Example:
      >>> from multimesh_flax.core import Schedule, ScheduleOp, validate_schedule
      >>> ops = lambda *names: tuple(ScheduleOp.parse(n) for n in names)
      >>> stuck = Schedule(
      ...     rows=(ops("F0.0", "B0.0"), ops("B1.0", "F1.0")),
      ...     num_stages=2, num_microbatches=1, split_backward=False, name="custom",
      ...     stage_to_row=(0, 1))
      >>> validate_schedule(stuck)
      Traceback (most recent call last):
      ...
      multimesh_flax.errors.InvalidScheduleError: The schedule deadlocks: ...
    """
    validated_order(schedule)


def validated_order(schedule: Schedule) -> list[tuple[int, ScheduleOp]]:
    """Validates ``schedule`` and returns its ops as ``(row, op)`` in a runnable order."""
    _check_layout(schedule)
    positions = _check_ops(schedule)
    _check_complete(schedule, positions)
    return _execution_order(schedule, positions)


def _check_layout(schedule: Schedule) -> None:
    if not isinstance(schedule, Schedule):
        raise errors.InvalidScheduleError(
            f"Expected a Schedule, got {type(schedule).__name__}: {schedule!r}. Build one with "
            "`make_schedule(name, num_stages, num_microbatches)`, or "
            "`make_schedule('custom', ..., custom=rows)` for your own order."
        )
    _check_positive(num_stages=schedule.num_stages, num_microbatches=schedule.num_microbatches)
    rows = schedule.num_submeshes
    if len(schedule.stage_to_row) != schedule.num_stages or any(
        not isinstance(r, int) or not 0 <= r < rows for r in schedule.stage_to_row
    ):
        raise errors.InvalidScheduleError(
            f"Expected `stage_to_row` to give a row in [0, {rows}) for each of the "
            f"{schedule.num_stages} stages, got {schedule.stage_to_row}."
        )


def _check_ops(schedule: Schedule) -> dict[ScheduleOp, tuple[int, int]]:
    """Checks each op on its own and against duplicates; returns op -> (row, position)."""
    positions: dict[ScheduleOp, tuple[int, int]] = {}
    for r, row in enumerate(schedule.rows):
        for k, op in enumerate(row):
            _check_op(schedule, r, k, op)
            if op in positions:
                r0, k0 = positions[op]
                raise errors.InvalidScheduleError(
                    f"Op {op} appears twice: row {r0} position {k0} and row {r} position {k}. "
                    "Each (stage, microbatch, phase) runs exactly once; remove one of them."
                )
            positions[op] = (r, k)
    return positions


def _check_op(schedule: Schedule, r: int, k: int, op: object) -> None:
    where = f"row {r} position {k}"
    if not isinstance(op, ScheduleOp):
        raise errors.InvalidScheduleError(f"Expected a ScheduleOp at {where}, got {op!r}.")
    if op.phase not in schedule.phases:
        hint = " Set `split_backward=True` to use W ops." if op.phase == "W" else ""
        raise errors.InvalidScheduleError(
            f"Op {op} at {where} has phase {op.phase!r}; expected one of {schedule.phases}.{hint}"
        )
    if not (0 <= op.stage < schedule.num_stages and 0 <= op.microbatch < schedule.num_microbatches):
        raise errors.InvalidScheduleError(
            f"Op {op} at {where} names stage {op.stage} and microbatch {op.microbatch}; "
            f"expected a stage in [0, {schedule.num_stages}) and a microbatch in "
            f"[0, {schedule.num_microbatches})."
        )
    home = schedule.stage_to_row[op.stage]
    if home != r:
        raise errors.InvalidScheduleError(
            f"Op {op} sits on row {r}, but stage {op.stage} belongs to row {home} "
            f"(`stage_to_row[{op.stage}]` = {home}). Move it to row {home}."
        )


def _check_complete(schedule: Schedule, positions: dict[ScheduleOp, tuple[int, int]]) -> None:
    missing = [
        ScheduleOp(s, i, phase)
        for s in range(schedule.num_stages)
        for i in range(schedule.num_microbatches)
        for phase in schedule.phases
        if ScheduleOp(s, i, phase) not in positions
    ]
    if missing:
        shown = ", ".join(f"{op} (row {schedule.stage_to_row[op.stage]})" for op in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise errors.InvalidScheduleError(
            f"The schedule lacks {len(missing)} op(s): {shown}{more}. Every stage runs "
            f"{'/'.join(schedule.phases)} once per microbatch "
            f"({schedule.num_microbatches} microbatches); add the missing ops to their rows."
        )


def _execution_order(
    schedule: Schedule, positions: dict[ScheduleOp, tuple[int, int]]
) -> list[tuple[int, ScheduleOp]]:
    """Runs every row as far as its dependencies allow; raises if the rows get stuck."""
    heads = [0] * schedule.num_submeshes
    done: set[ScheduleOp] = set()
    order: list[tuple[int, ScheduleOp]] = []
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(schedule.rows):
            while heads[r] < len(row) and done.issuperset(
                op_deps(row[heads[r]], schedule.num_stages)
            ):
                done.add(row[heads[r]])
                order.append((r, row[heads[r]]))
                heads[r] += 1
                progress = True
    if len(order) < len(positions):
        raise _deadlock_error(schedule, heads, done, positions)
    return order


def _deadlock_error(
    schedule: Schedule,
    heads: list[int],
    done: set[ScheduleOp],
    positions: dict[ScheduleOp, tuple[int, int]],
) -> errors.InvalidScheduleError:
    waits = []
    for r, row in enumerate(schedule.rows):
        if heads[r] < len(row):
            op = row[heads[r]]
            dep = next(d for d in op_deps(op, schedule.num_stages) if d not in done)
            dr, dk = positions[dep]
            waits.append(
                f"row {r} waits at {op} (position {heads[r]}) for {dep} (row {dr} position {dk})"
            )
    return errors.InvalidScheduleError(
        f"The schedule deadlocks: {'; '.join(waits)}. Reorder the rows so every op comes "
        "after the ops it needs: F(s,i) after F(s-1,i), B(s,i) after F(s,i) and B(s+1,i), "
        "W(s,i) after B(s,i)."
    )
