"""Recorded pipeline timelines: replay, bubble, measured costs, and Gantt charts.

:func:`~._runtime.record_timeline` waits for every op before dispatching the next, so each
event's duration is real but the submeshes never overlap. :func:`replay_timeline` rebuilds
the overlapped timeline those durations give: every op starts when its submesh is free
(runs only; a transfer occupies no submesh) and the ops whose outputs it reads have ended,
in the program's dispatch order -- what the submeshes do when they run in parallel.
:func:`recorded_bubble` is the idle fraction of that replay, comparable with
``simulate(schedule).bubble_fraction``; :func:`measured_costs` turns the recorded durations
into the simulator's per-phase costs; :func:`plot_timeline` draws the replay and the
simulator's prediction as Gantt charts (matplotlib, imported on first use).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from multimesh_flax import errors
from multimesh_flax.core.declare import Schedule
from multimesh_flax.core.plan import simulate
from multimesh_flax.core.run._dispatch import Timeline, TimelineEvent

_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", None: "#9a9a9a"}


def _call_events(timeline: Timeline, call: int) -> list[TimelineEvent]:
    calls = sorted({e.call for e in timeline.events})
    if not calls:
        raise errors.TimelineDataError(
            "The timeline holds no events; call a `jit` program inside `record_timeline`."
        )
    if not -len(calls) <= call < len(calls):
        raise errors.TimelineDataError(
            f"`call`={call}, but the timeline holds {len(calls)} call(s); use an index in "
            f"[-{len(calls)}, {len(calls)})."
        )
    chosen = calls[call]
    return sorted((e for e in timeline.events if e.call == chosen), key=lambda e: e.index)


def replay_timeline(timeline: Timeline, call: int = -1) -> list[TimelineEvent]:
    """The events of one recorded call, re-timed as if the submeshes ran in parallel.

    Args:
        timeline: a timeline from :func:`record_timeline`.
        call: which recorded call (default: the last).

    Returns:
        The call's events in dispatch order, with ``start``/``end`` (seconds from the
        first start) replayed from the recorded durations.

    Example:
        >>> import multimesh_flax as mm
        >>> from multimesh_flax.core import Timeline, TimelineEvent
        >>> ev = lambda i, place, dur, deps=(): TimelineEvent(
        ...     place, "run", f"op{i}", 0.0, dur, index=i, deps=deps)
        >>> recorded = Timeline([ev(0, (0,), 1.0), ev(1, (1,), 2.0), ev(2, (1,), 1.0, (0,))])
        >>> [(e.start, e.end) for e in replay_timeline(recorded)]
        [(0.0, 1.0), (0.0, 2.0), (2.0, 3.0)]
    """
    free: dict[tuple[int, ...], float] = {}
    end: dict[int, float] = {}
    out = []
    for e in _call_events(timeline, call):
        ready = max((end[d] for d in e.deps if d in end), default=0.0)
        start = max(ready, free.get(e.place, 0.0)) if e.kind == "run" else ready
        end[e.index] = start + (e.end - e.start)
        if e.kind == "run":
            free[e.place] = end[e.index]
        out.append(dataclasses.replace(e, start=start, end=end[e.index]))
    return out


def _pipeline_rows(events: Sequence[TimelineEvent]) -> list[tuple[int, ...]]:
    """The places that ran pipeline units, ordered by the lowest stage they ran."""
    lowest: dict[tuple[int, ...], int] = {}
    for e in events:
        if e.kind == "run" and e.stage is not None:
            lowest[e.place] = min(lowest.get(e.place, e.stage), e.stage)
    return sorted(lowest, key=lowest.__getitem__)


def recorded_bubble(timeline: Timeline, call: int = -1) -> float:
    """The idle fraction of the submeshes that run pipeline stages, from recorded durations.

    Over the submeshes that ran a (stage, microbatch, phase) unit: ``1 - busy / (rows *
    span)``, where ``busy`` sums the durations of all their runs (units and glue) and
    ``span`` runs from the first start to the last end among those runs, in
    :func:`replay_timeline`'s parallel re-timing.

    Args:
        timeline: a timeline from :func:`record_timeline` of a pipelined program.
        call: which recorded call (default: the last).

    Returns:
        The bubble fraction in ``[0, 1)``.

    Raises:
        TimelineDataError: no such call, or it ran no pipeline unit (no ``microbatch`` with
            tasks).

    Example:
        >>> from multimesh_flax.core import Timeline, TimelineEvent
        >>> ev = lambda i, place, stage, deps=(): TimelineEvent(
        ...     place, "run", f"op{i}", 0.0, 1.0, stage=stage, index=i, deps=deps)
        >>> chain = Timeline([ev(0, (0,), 0), ev(1, (1,), 1, (0,))])
        >>> recorded_bubble(chain)  # each row idles half of the span 2
        0.5
    """
    events = replay_timeline(timeline, call)
    rows = set(_pipeline_rows(events))
    if not rows:
        raise errors.TimelineDataError(
            "The recorded call ran no pipeline unit; record a `jit` call of a function that "
            "uses `microbatch` with tasks."
        )
    runs = [e for e in events if e.kind == "run" and e.place in rows]
    span = max(e.end for e in runs) - min(e.start for e in runs)
    busy = sum(e.end - e.start for e in runs)
    return 1.0 - busy / (len(rows) * span) if span > 0 else 0.0


def measured_costs(timeline: Timeline, call: int = -1) -> dict[str, float]:
    """Median recorded durations per phase, as ``simulate``'s ``costs``.

    ``"transfer"`` is the median transfer time. When the backward was not split, the whole
    backward's median is ``"B"`` and ``"W"`` is 0 (the simulator charges an unsplit
    backward ``B + W``). Fused ops (``TimelineEvent.fused``: a unit run together with the
    next unit or glue on its submesh) count only for a phase that never ran alone, each
    with its duration shared equally among its units (an approximation: it includes any
    glue fused in).

    Example:
        >>> from multimesh_flax.core import Timeline, TimelineEvent
        >>> ev = lambda phase, dur: TimelineEvent((0,), "run", "x", 0.0, dur, phase=phase)
        >>> measured_costs(Timeline([ev("F", 1.0), ev("F", 3.0), ev("B", 4.0)]))
        {'F': 2.0, 'B': 4.0, 'W': 0.0, 'transfer': 0.0}
    """
    events = _call_events(timeline, call)
    costs = {}
    runs = [e for e in events if e.kind == "run"]
    for phase in ("F", "B", "W"):
        durations = [e.end - e.start for e in runs if not e.fused and e.phase == phase]
        if not durations:  # the phase ran only fused with other work
            durations = [
                (e.end - e.start) / len(e.units)
                for e in runs
                if e.fused and any(u[2] == phase for u in e.units)
            ]
        costs[phase] = statistics.median(durations) if durations else 0.0
    moves = [e.end - e.start for e in events if e.kind == "transfer"]
    costs["transfer"] = statistics.median(moves) if moves else 0.0
    return costs


# --- drawing --------------------------------------------------------------------------------


def _bar_label(stage: Any, microbatch: Any, phase: Any) -> str:
    return "" if phase is None else f"{phase}{stage}.{microbatch}"


def _event_label(e: TimelineEvent) -> str:
    """``F1.0``; a fused op names each of its units: ``F1.0+B1.0``."""
    if e.fused and e.units:
        return "+".join(_bar_label(*unit) for unit in e.units)
    return _bar_label(e.stage, e.microbatch, e.phase)


def _draw(axes: Any, rows: list[Any], bars: list[tuple[int, float, float, Any, str]]) -> None:
    """Draws ``(row, start, end, phase, label)`` bars, one lane per row."""
    for row, start, end, phase, label in bars:
        axes.barh(row, end - start, left=start, height=0.8, color=_COLOURS.get(phase, "#999"))
        if label:
            axes.text((start + end) / 2, row, label, ha="center", va="center", fontsize=6)
    axes.set_yticks(range(len(rows)), [str(r) for r in rows])
    axes.invert_yaxis()


def _recorded_bars(events: Sequence[TimelineEvent]) -> tuple[list[Any], list[Any]]:
    rows = _pipeline_rows(events)
    rows += sorted({e.place for e in events if e.kind == "run"} - set(rows))
    lane = {place: i for i, place in enumerate(rows)}
    scale = 1e3  # milliseconds
    bars = [
        (
            lane[e.place],
            e.start * scale,
            e.end * scale,
            e.phase,
            _event_label(e),
        )
        for e in events
        if e.kind == "run"
    ]
    return [f"devices {list(p)}" for p in rows], bars


def _predicted_bars(schedule: Schedule, costs: Any) -> tuple[list[Any], list[Any], Any]:
    result = simulate(schedule, costs=costs)
    scale = 1.0 if costs is None else 1e3  # given costs are seconds: draw milliseconds
    bars = [
        (row, start * scale, end * scale, op.phase, _bar_label(op.stage, op.microbatch, op.phase))
        for row, op, start, end in result.timeline
    ]
    rows = [f"submesh {r}" for r in range(schedule.num_submeshes)]
    return rows, bars, result


def plot_timeline(
    timeline: Timeline,
    schedule: Schedule | None = None,
    path: str | None = None,
    costs: Mapping[str, float] | None = None,
    *,
    call: int = -1,
) -> Any:
    """Draws a recorded pipeline step as a Gantt chart, with the simulator's prediction.

    The top panel shows :func:`replay_timeline` of the recorded call (one lane per submesh,
    milliseconds; F blue, B orange, W green, glue grey; a fused op in its first unit's
    colour, labelled with all its units) and its :func:`recorded_bubble`. With
    ``schedule``, a second panel shows ``simulate(schedule, costs=costs)``: its bubble, its
    bubble when steps overlap (``steady_bubble_fraction``) and each submesh's peak
    activation sets.

    Args:
        timeline: a timeline from :func:`record_timeline`.
        schedule: the schedule to predict (for example ``mm.jit(f).executable(...).schedule``).
        path: where to write the PNG (optional).
        costs: the simulator's costs in seconds (drawn in milliseconds); default: unit costs
            F = B = W = 1, transfer = 0. :func:`measured_costs` gives the recorded ones.
        call: which recorded call to draw (default: the last).

    Returns:
        The ``matplotlib.figure.Figure``.

    Example:
        >>> from multimesh_flax.core import Timeline, TimelineEvent
        >>> from multimesh_flax.core import make_schedule
        >>> ev = lambda i, place, stage, phase, deps=(): TimelineEvent(
        ...     place, "run", "x", 0.0, 1e-3, stage=stage, microbatch=0, phase=phase,
        ...     index=i, deps=deps)
        >>> recorded = Timeline([ev(0, (0,), 0, "F"), ev(1, (1,), 1, "F", (0,)),
        ...                      ev(2, (1,), 1, "B", (1,)), ev(3, (0,), 0, "B", (2,))])
        >>> figure = plot_timeline(recorded, make_schedule("gpipe", 2, 1))
        >>> len(figure.axes)
        2
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    events = replay_timeline(timeline, call)
    figure = Figure(figsize=(12, 3 + 2 * (schedule is not None)), layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(2 if schedule is not None else 1, 1, squeeze=False)[:, 0]
    rows, bars = _recorded_bars(events)
    _draw(panels[0], rows, bars)
    bubble = recorded_bubble(timeline, call) if any(e.stage is not None for e in events) else None
    title = "recorded durations, replayed in dispatch order (ms)"
    panels[0].set_title(title + ("" if bubble is None else f" -- bubble {bubble:.3f}"))
    if schedule is not None:
        rows, bars, predicted = _predicted_bars(schedule, costs)
        _draw(panels[1], rows, bars)
        units = "unit costs" if costs is None else "given costs, ms"
        panels[1].set_title(
            f"simulated {schedule.name!r} ({units}) -- bubble {predicted.bubble_fraction:.3f}, "
            f"overlapped steps {predicted.steady_bubble_fraction:.3f}, peak activation sets "
            f"per submesh {list(predicted.peak_in_flight)}"
        )
    if path is not None:
        figure.savefig(path, dpi=120)
    return figure
