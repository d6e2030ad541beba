"""Pipeline schedules as pure data: ops, per-submesh orders, generators and a validator.

A pipeline runs ``num_stages`` stages (tasks) ``0..S-1`` in a chain on ``num_submeshes``
submeshes, called *rows* here. Stage ``s`` lives on row ``stage_to_row[s]``: row ``s`` when
there is one stage per row, row ``s % R`` with ``interleave=v`` chunks per row (Megatron's
interleaved layout, ``S = v * R``). Each of ``m`` microbatches passes every stage forward
(phase ``"F"``) then backward (``"B"``). Split-backward schedules cut the backward in two:
``"B"`` computes the activation gradient that the previous stage waits for, ``"W"`` the
weight gradient that nobody waits for, so it can fill idle time.

* :class:`ScheduleOp` is one ``(stage, microbatch, phase)`` unit of work, written
  ``<phase><stage>.<microbatch>`` (``"F0.3"`` is the forward of stage 0 on microbatch 3).
* :class:`Schedule` holds one ordered tuple of ops per row; a row runs its ops in order,
  one at a time. The dependencies are ``F(s,i) <- F(s-1,i)``, ``B(s,i) <- F(s,i), B(s+1,i)``
  and ``W(s,i) <- B(s,i)``.
* :func:`make_schedule` builds GPipe, 1F1B, interleaved 1F1B, zero-bubble (ZB-H2) and
  user-given orders; :func:`validate_schedule` checks that an order is complete, placed on
  the right rows and free of deadlocks. ``_simulator.simulate`` predicts its timeline.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Iterator, Sequence

from multimesh_flax import errors


class Phase(str, enum.Enum):
    """A pipeline phase: ``F`` forward; ``B`` backward, or its activation-gradient half when
    the backward is split; ``W`` the weight-gradient half. Equal to its letter as a string."""

    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


_PHASES = tuple(p.value for p in Phase)
_OP_PATTERN = re.compile(r"^\s*([FBW])(\d+)\.(\d+)\s*$")


@dataclasses.dataclass(frozen=True, order=True)
class ScheduleOp:
    """One unit of pipeline work: a phase of one stage on one microbatch.

    Attributes:
      stage: The pipeline stage (task) index, ``0 <= stage < num_stages``.
      microbatch: The microbatch index, ``0 <= microbatch < num_microbatches``.
      phase: ``"F"`` (forward), ``"B"`` (backward, or its activation-gradient half when the
        backward is split) or ``"W"`` (weight-gradient half of a split backward).

    Example:
      >>> from multimesh_flax.core import ScheduleOp
      >>> op = ScheduleOp.parse("B1.3")
      >>> op
      ScheduleOp(stage=1, microbatch=3, phase='B')
      >>> str(op)
      'B1.3'
    """

    stage: int
    microbatch: int
    phase: str

    def __str__(self) -> str:
        return f"{self.phase}{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> ScheduleOp:
        """Reads an op written ``<phase><stage>.<microbatch>``, such as ``"F0.3"``.

        Raises:
          InvalidScheduleError: If ``text`` does not have that form.
        """
        match = _OP_PATTERN.match(text)
        if match is None:
            raise errors.InvalidScheduleError(
                f"Expected an op written `<phase><stage>.<microbatch>` with phase F, B or W "
                f"(for example 'F0.3'), got {text!r}."
            )
        phase, stage, microbatch = match.groups()
        return cls(int(stage), int(microbatch), phase)


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
    * ``"zero-bubble-h2"``: backward split into ``B`` and ``W``; each row keeps up to
      ``2 R - 1`` microbatches in flight and puts ``W`` ops into what would be bubbles
      (after ZB-H2 in Qi et al., "Zero Bubble Pipeline Parallelism", 2023). One stage per
      row; with equal costs and ``m >= R`` its bubble is ``(R - 1) / (3 m + R - 1)``.
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
    stage_to_row = tuple(s % rows_count for s in range(num_stages))
    rows, split = builder(rows_count, chunks, num_microbatches, custom)
    ordered = tuple(tuple(row) for row in rows)
    schedule = Schedule(ordered, num_stages, num_microbatches, split, name, stage_to_row)
    validate_schedule(schedule)
    return schedule


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
    if chunks > 1 and name in ("1f1b", "zero-bubble-h2"):
        raise errors.InvalidScheduleError(
            f"`name`={name!r} runs one stage per submesh, got {chunks} stages per submesh "
            f"(`num_stages`={num_stages} on {rows} submeshes). Use 'interleaved-1f1b' or "
            "'gpipe', or as many submeshes as stages."
        )
    return rows, chunks


_Rows = list[list[ScheduleOp]]


def _gpipe_rows(rows: int, chunks: int, m: int, custom: object) -> tuple[_Rows, bool]:
    """All forwards by (microbatch, stage), then all backwards by (microbatch, -stage)."""
    out: _Rows = []
    for r in range(rows):
        stages = [c * rows + r for c in range(chunks)]
        fwd = [ScheduleOp(s, i, "F") for i in range(m) for s in stages]
        bwd = [ScheduleOp(s, i, "B") for i in range(m) for s in reversed(stages)]
        out.append(fwd + bwd)
    return out, False


def _one_f_one_b_rows(rows: int, chunks: int, m: int, custom: object) -> tuple[_Rows, bool]:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    out: _Rows = []
    for r in range(rows):
        warmup = min(rows - r - 1, m)
        order = [ScheduleOp(r, i, "F") for i in range(warmup)]
        for i in range(m - warmup):
            order += [ScheduleOp(r, warmup + i, "F"), ScheduleOp(r, i, "B")]
        order += [ScheduleOp(r, i, "B") for i in range(m - warmup, m)]
        out.append(order)
    return out, False


def _interleaved_rows(rows: int, chunks: int, m: int, custom: object) -> tuple[_Rows, bool]:
    """Megatron-LM's interleaved 1F1B: 1F1B over ``m * chunks`` (chunk, microbatch) units."""
    if chunks == 1:
        return _one_f_one_b_rows(rows, chunks, m, custom)
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


def _zero_bubble_rows(rows: int, chunks: int, m: int, custom: object) -> tuple[_Rows, bool]:
    """Greedy ZB-H2 order, built by list scheduling with unit costs for F, B and W.

    At every time step an idle row runs, in priority order: its next backward if that is
    ready; its next forward if ready and fewer than ``2 rows - 1`` microbatches hold
    activations on the row (ZB-H2's memory budget; an activation is freed by ``W``); its
    oldest pending weight gradient. With equal costs and ``m >= rows`` this gives ZB-H2's
    parallelogram: row ``r`` works without a gap from ``r`` to ``r + 3m``. The order is
    deadlock-free by construction, since every op ran after its dependencies.
    """
    done_at: dict[ScheduleOp, int] = {}
    out: _Rows = [[] for _ in range(rows)]
    next_f, next_b, next_w = [0] * rows, [0] * rows, [0] * rows
    time = 0
    while len(done_at) < 3 * rows * m:
        for r in range(rows):
            if out[r] and done_at[out[r][-1]] > time:
                continue
            b_op, f_op = ScheduleOp(r, next_b[r], "B"), ScheduleOp(r, next_f[r], "F")
            if next_b[r] < m and _ready(b_op, done_at, time, rows):
                op, next_b[r] = b_op, next_b[r] + 1
            elif (
                next_f[r] < m
                and next_f[r] - next_w[r] < 2 * rows - 1
                and _ready(f_op, done_at, time, rows)
            ):
                op, next_f[r] = f_op, next_f[r] + 1
            elif next_w[r] < next_b[r]:
                op, next_w[r] = ScheduleOp(r, next_w[r], "W"), next_w[r] + 1
            else:
                continue
            out[r].append(op)
            done_at[op] = time + 1
        time += 1
    return out, True


def _ready(op: ScheduleOp, done_at: dict[ScheduleOp, int], time: int, num_stages: int) -> bool:
    return all(done_at.get(dep, time + 1) <= time for dep in op_deps(op, num_stages))


def _custom_rows(
    rows: int, chunks: int, m: int, custom: Sequence[Sequence[object]]
) -> tuple[_Rows, bool]:
    """Reads the user's per-row order; the backward is split when any op is a ``W``."""
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


_BUILDERS: dict[str, Callable[..., tuple[_Rows, bool]]] = {
    "gpipe": _gpipe_rows,
    "1f1b": _one_f_one_b_rows,
    "interleaved-1f1b": _interleaved_rows,
    "zero-bubble-h2": _zero_bubble_rows,
    "custom": _custom_rows,
}


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


def op_deps(op: ScheduleOp, num_stages: int) -> tuple[ScheduleOp, ...]:
    """The ops that must finish before ``op`` starts."""
    s, i = op.stage, op.microbatch
    if op.phase == "F":
        return (ScheduleOp(s - 1, i, "F"),) if s > 0 else ()
    if op.phase == "W":
        return (ScheduleOp(s, i, "B"),)
    upstream = (ScheduleOp(s + 1, i, "B"),) if s < num_stages - 1 else ()
    return (ScheduleOp(s, i, "F"), *upstream)


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
