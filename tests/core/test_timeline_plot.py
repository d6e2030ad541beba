"""Recorded pipeline timelines: replay, bubble, measured costs and the Gantt chart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.core import Timeline, TimelineEvent, make_schedule, simulate
from multimesh_flax.core.declare import op_deps
from multimesh_flax.core.run import replay_timeline


def _events_from_simulation(schedule, costs=None):
    """The simulator's ops as recorded events: durations from it, deps from the schedule.

    Start times are deliberately scrambled (serial, as recording produces them); only the
    durations, the dispatch order and the dependencies may matter to the replay.
    """
    result = simulate(schedule, costs=costs)
    index = {op: i for i, (_, op, _, _) in enumerate(result.timeline)}
    events, clock = [], 100.0
    for i, (row, op, start, end) in enumerate(result.timeline):
        deps = tuple(sorted(index[d] for d in op_deps(op, schedule.num_stages)))
        events.append(
            TimelineEvent(
                (row,),
                "run",
                str(op),
                clock,
                clock + (end - start),
                stage=op.stage,
                microbatch=op.microbatch,
                phase=op.phase,
                index=i,
                deps=deps,
            )
        )
        clock += end - start + 0.5
    return Timeline(events=events, calls=1), result


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("gpipe", {}),
        ("1f1b", {}),
        ("zero-bubble-h1", {}),
        ("zero-bubble-h2", {}),
        ("zero-bubble-auto", {"costs": {"F": 1.0, "B": 1.5, "W": 0.5}}),
        ("zero-bubble-v", {}),
        ("interleaved-1f1b", {"interleave": 2}),
    ],
)
def test_replay_of_simulated_ops_reproduces_the_simulation(name, options):
    stages = 8 if name in ("interleaved-1f1b", "zero-bubble-v") else 4
    schedule = make_schedule(name, stages, 8, **options)
    timeline, result = _events_from_simulation(schedule, costs={"F": 1.0, "B": 1.5, "W": 0.5})
    replayed = replay_timeline(timeline)
    np.testing.assert_allclose(max(e.end for e in replayed), result.makespan)
    np.testing.assert_allclose(mm.recorded_bubble(timeline), result.bubble_fraction)
    costs = mm.measured_costs(timeline)
    assert costs["F"] == 1.0 and costs["transfer"] == 0.0
    assert costs["B"] == (1.5 if name.startswith("zero-bubble") else 2.0)


@pytest.mark.parametrize("name", ["zero-bubble-h1", "zero-bubble-auto", "zero-bubble-v"])
def test_plot_timeline_draws_the_zero_bubble_schedules(name):
    schedule = make_schedule(name, 4, 4)
    timeline, result = _events_from_simulation(schedule)
    figure = mm.plot_timeline(timeline, schedule)
    predicted = figure.axes[1]
    assert len(predicted.patches) == len(result.timeline) == 3 * 4 * 4
    assert f"'{name}'" in predicted.get_title()
    assert f"overlapped steps {result.steady_bubble_fraction:.3f}" in predicted.get_title()


def _pipeline():
    tasks = [
        mm.task(lambda w, h: jnp.tanh(h @ w), name=f"stage{s}", mesh=mm.TaskMesh(devices=[s]))
        for s in range(4)
    ]

    def loss(params, x):
        for t, w in zip(tasks, params, strict=True):
            x = t(w, x)
        return jnp.mean(x**2)

    params = [jnp.eye(16) * 0.9 for _ in range(4)]
    return loss, params, jnp.ones((32, 16))


@pytest.fixture(scope="module")
def recorded():
    loss, params, x = _pipeline()
    step = mm.jit(jax.grad(mm.microbatch(loss, 0, 4, argnum=1, schedule="1f1b")))
    jax.block_until_ready(step(params, x))
    with mm.record_timeline() as timeline:
        jax.block_until_ready(step(params, x))
        jax.block_until_ready(step(params, x))
    return timeline, step.executable(params, x).schedule


def test_recorded_events_name_their_units(recorded):
    timeline, schedule = recorded
    assert timeline.calls == 2 and {e.call for e in timeline.events} == {0, 1}
    units = {  # a fused event runs several units (the last stage's F and B)
        unit
        for e in timeline.events
        if e.call == 1 and e.kind == "run" and e.phase is not None
        for unit in e.units
    }
    assert units == {(op.stage, op.microbatch, op.phase) for _, op in schedule.ops()}
    for e in timeline.events:
        assert all(d < e.index for d in e.deps)


def test_replay_respects_dependencies_and_submesh_queues(recorded):
    timeline, _ = recorded
    events = replay_timeline(timeline)
    end = {e.index: e.end for e in events}
    for e in events:
        assert all(end[d] <= e.start + 1e-12 for d in e.deps)
    for place in {e.place for e in events if e.kind == "run"}:
        runs = [e for e in events if e.kind == "run" and e.place == place]
        for a, b in zip(runs, runs[1:], strict=False):
            assert a.end <= b.start + 1e-12, "a submesh runs one op at a time, in order"
    bubble = mm.recorded_bubble(timeline)
    assert 0.0 <= bubble < 1.0
    costs = mm.measured_costs(timeline)
    assert costs["F"] > 0 and costs["B"] > 0 and costs["W"] == 0.0


def test_plot_timeline_writes_a_png(recorded, tmp_path):
    timeline, schedule = recorded
    path = tmp_path / "timeline.png"
    figure = mm.plot_timeline(timeline, schedule, path=str(path), costs=mm.measured_costs(timeline))
    assert len(figure.axes) == 2
    assert "bubble" in figure.axes[0].get_title() and "'1f1b'" in figure.axes[1].get_title()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(mm.plot_timeline(timeline).axes) == 1


def test_timeline_without_events_or_units_raises():
    with pytest.raises(errors.TimelineDataError, match="no events"):
        mm.recorded_bubble(Timeline())
    f = mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[1]))
    program = mm.jit(lambda x: f(x) * 2)
    with mm.record_timeline() as timeline:
        program(jnp.ones(2))
    with pytest.raises(errors.TimelineDataError, match="no pipeline unit"):
        mm.recorded_bubble(timeline)
    with pytest.raises(errors.TimelineDataError, match="`call`=3"):
        mm.measured_costs(timeline, call=3)
