"""Per-op durations for simulating and building schedules: ``(stage, phase) -> seconds``.

:func:`make_cost_fn` turns what a user passes as ``costs`` (to ``simulate`` or to
``make_schedule("zero-bubble-auto", ...)``) into one checked function: a mapping of phase
to duration, the same for every stage, or a callable per stage and phase. Phase
``"transfer"`` is the time to send a stage's output to another row; phase ``"F+B"`` (asked
only by ``simulate(..., fused=True)``) the time of a stage's ``F`` and the same microbatch's
``B`` run as one program.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from multimesh_flax import errors

_DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0, "transfer": 0.0}

CostFn = Callable[[int, str], float]


def make_cost_fn(costs: Mapping[str, float] | CostFn | None) -> CostFn:
    """Turns ``costs`` into a checked ``(stage, phase) -> float``.

    Args:
      costs: ``None`` (unit costs), a mapping with any of the keys ``"F"``, ``"B"``, ``"W"``,
        ``"transfer"`` (defaults 1, 1, 1 and 0) and ``"F+B"`` (no default: ``simulate`` then
        prices a fused pair as its two ops apart), or a callable ``(stage, phase) ->
        float``.

    Returns:
      The cost function; it raises for a negative or non-finite duration.

    Raises:
      InvalidScheduleError: An unknown key, or ``costs`` of another type.

    Example:
      >>> from multimesh_flax.core.declare import make_cost_fn
      >>> cost = make_cost_fn({"W": 0.5})
      >>> cost(0, "F"), cost(3, "W"), cost(1, "transfer")
      (1.0, 0.5, 0.0)
    """
    if costs is None or isinstance(costs, Mapping):
        unknown = set(costs or {}) - {*_DEFAULT_COSTS, "F+B"}
        if unknown:
            raise errors.InvalidScheduleError(
                f"Unknown keys {sorted(unknown)} in `costs`; use {sorted(_DEFAULT_COSTS)} or 'F+B'."
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
