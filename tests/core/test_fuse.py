"""Fusing adjacent fragments on a submesh (``fragment/_fuse``) in pipelined training steps.

A two-stage chain of ``tanh(h @ w)`` layers on devices 0 and 1, trained with SGD + momentum
under a schedule. Each program is built with fusion on and off (``_fuse.ENABLED``); the
fused one must compute what the unparallelized step computes (``ignore_transforms``, no
microbatching), fuse exactly the pairs the rule allows, and compile fewer executables.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import multimesh_flax as mm
from multimesh_flax.core import ScheduleOp
from multimesh_flax.core.fragment import _fuse
from multimesh_flax.core.run import OpKind, Timeline, TimelineEvent
from tests.core._chain import chain_loss, train_step

TOL = {"rtol": 2e-5, "atol": 2e-6}
BATCH = 16
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


def _layer(w, h):
    return jnp.tanh(h @ w)


def _loss_fn():
    tasks = [mm.task(_layer, name=f"layer{s}", mesh=mm.TaskMesh(devices=[s])) for s in range(2)]

    return chain_loss(tasks)


def _data():
    keys = jax.random.split(jax.random.key(7), 4)
    params = [jax.random.normal(k, (8, 8)) / 2 for k in keys[:2]]
    batch = (jax.random.normal(keys[2], (BATCH, 8)), jax.random.normal(keys[3], (BATCH, 8)))
    return params, batch


def _program(schedule, m, fuse, monkeypatch):
    """The jitted training step (state donated) and its executable, with fusion on or off."""
    monkeypatch.setattr(_fuse, "ENABLED", fuse)
    loss = _loss_fn()
    mb_loss = mm.microbatch(loss, 0, BATCH // m, argnum=1, schedule=schedule, reduce="mean")
    step = mm.jit(train_step(mb_loss, OPTIMIZER), donate_argnums=(0, 1))
    params, batch = _data()
    return step, step.executable(params, OPTIMIZER.init(params), batch), loss


def _runs(executable):
    return [op for op in executable.ops if op.kind is OpKind.RUN]


def _executables(executable):
    """Distinct compiled programs per device set (``compile_count`` also counts shardings
    other programs of this process compiled for a shared fragment)."""
    return len({(id(op.program), op.place) for op in _runs(executable)})


def _fused_units(executable):
    """``(stage, microbatch, phase)`` tuples of every op that runs more than one unit."""
    return [tuple(op.units) for op in _runs(executable) if len(op.units) > 1]


def _assert_trains_like_reference(step, loss, steps=2):
    """Runs ``steps`` steps against the unparallelized step; returns, per step, which
    leaves of the donated ``(params, opt_state)`` the step consumed."""
    params, batch = _data()
    state = OPTIMIZER.init(params)
    ref_params, ref_state = _data()[0], OPTIMIZER.init(params)
    consumed = []
    for _ in range(steps):
        given = (params, state)
        value, params, state = jax.block_until_ready(step(params, state, batch))
        consumed.append([x.is_deleted() for x in jax.tree.leaves(given)])
        with mm.ignore_transforms():
            ref_value, ref_params, ref_state = train_step(loss, OPTIMIZER)(
                ref_params, ref_state, batch
            )
        for a, e in zip(
            jax.tree.leaves((value, params, state)),
            jax.tree.leaves((ref_value, ref_params, ref_state)),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)
    assert [[d.id for d in w.devices()] for w in params] == [[0], [1]]
    return consumed


def test_one_microbatch_fuses_every_allowed_pair(monkeypatch):
    _, unfused, _ = _program("1f1b", 1, False, monkeypatch)
    step, fused, loss = _program("1f1b", 1, True, monkeypatch)
    names = [op.name for op in _runs(fused)]
    # The last stage's forward hands its residuals to its backward on the same device.
    assert any(re.fullmatch(r"layer1\.fwd\[0\]#\d+\+layer1\.bwd\[0\]#\d+", n) for n in names)
    assert [ScheduleOp(1, 0, "F"), ScheduleOp(1, 0, "B")] in [
        [ScheduleOp(*u) for u in units] for units in _fused_units(fused)
    ]
    # The first stage's last backward runs with the optimizer update of its parameters.
    assert any(re.fullmatch(r"layer0\.bwd\[0\]#\d+\+glue#\d+", n) for n in names), names
    # The first stage's forward feeds device 1, which does not wait for its backward: apart.
    assert not any("layer0.fwd" in n and "layer0.bwd" in n for n in names)
    # The last stage's backward sends a cotangent to device 0: not fused with its update.
    assert not any("layer1.bwd" in n and "glue" in n for n in names)
    assert len(_runs(fused)) < len(_runs(unfused))
    assert _executables(fused) < _executables(unfused)
    _assert_trains_like_reference(step, loss)


def test_1f1b_fuses_the_last_stage_forward_and_backward_of_every_microbatch(monkeypatch):
    m = 4
    _, unfused, _ = _program("1f1b", m, False, monkeypatch)
    step, fused, loss = _program("1f1b", m, True, monkeypatch)
    pairs = {tuple(ScheduleOp(*u) for u in units) for units in _fused_units(fused)}
    assert pairs == {(ScheduleOp(1, k, "F"), ScheduleOp(1, k, "B")) for k in range(m)}
    assert len(_runs(fused)) <= len(_runs(unfused)) - m
    assert _executables(fused) < _executables(unfused)
    # The residuals handed from F_k to B_k are no longer outputs of any op.
    fused_outs = sum(len(op.outs) for op in _runs(fused) if op.fused and op.units)
    unfused_outs = sum(len(op.outs) for op in _runs(unfused) if op.unit.stage == 1)
    assert fused_outs < unfused_outs
    _assert_trains_like_reference(step, loss)


def test_gpipe_fuses_no_forward_with_a_backward(monkeypatch):
    # Only the last microbatch's F and B are adjacent on the last stage: fusing that one
    # pair would add an executable (the other F_k and B_k still need theirs).
    _, unfused, _ = _program("gpipe", 4, False, monkeypatch)
    step, fused, loss = _program("gpipe", 4, True, monkeypatch)
    assert _fused_units(fused) == []
    assert _executables(fused) <= _executables(unfused)
    _assert_trains_like_reference(step, loss)


def test_fused_ops_keep_their_units_in_timelines(monkeypatch):
    m = 4
    step, executable, _ = _program("1f1b", m, True, monkeypatch)
    params, batch = _data()
    state = OPTIMIZER.init(params)
    with mm.record_timeline() as timeline:
        jax.block_until_ready(step(params, state, batch))
    runs = sorted((e for e in timeline.events if e.kind == "run"), key=lambda e: e.index)
    fused = [e for e in runs if e.fused and len(e.units) > 1]
    assert [e.units for e in fused] == [((1, k, "F"), (1, k, "B")) for k in range(m)]
    assert all((e.stage, e.microbatch, e.phase) == e.units[0] for e in fused)
    rows: dict[tuple[int, ...], list[ScheduleOp]] = {}
    for e in runs:
        rows.setdefault(e.place, []).extend(ScheduleOp(*u) for u in e.units)
    for r, row in enumerate(executable.schedule.rows):
        assert rows[(r,)] == list(row), f"device {r} runs its schedule row in order"
    costs = mm.measured_costs(timeline)
    assert costs["F"] > 0 and costs["B"] > 0
    assert 0.0 <= mm.recorded_bubble(timeline) < 1.0


@pytest.mark.parametrize("m", [1, 2])
def test_fusing_keeps_donation_and_frees(m, monkeypatch):
    consumed = {}
    for fuse in (False, True):
        step, executable, loss = _program("1f1b", m, fuse, monkeypatch)
        consumed[fuse] = _assert_trains_like_reference(step, loss, steps=3)
        # Every slot an op reads is freed after its last reader, unless the program returns it.
        last = {s: i for i, op in enumerate(executable.ops) for s in op.ins}
        kept = set(executable.output_slots) | executable.constant_slots()
        freed = {s: i for i, op in enumerate(executable.ops) for s in op.frees}
        assert freed == {s: i for s, i in last.items() if s not in kept}
    assert consumed[True] == consumed[False]
    # From the second step on, both momentum buffers arrive in place and are consumed (the
    # parameters are read by several fragments, so they are not donated).
    assert consumed[True][1] == [False, False, True, True]


def test_measured_costs_count_fused_ops_only_for_phases_never_run_alone():
    def event(duration, units, fused=False):
        stage, microbatch, phase = units[0]
        return TimelineEvent(
            (stage,),
            "run",
            "x",
            0.0,
            duration,
            stage=stage,
            microbatch=microbatch,
            phase=phase,
            units=units,
            fused=fused,
        )

    timeline = Timeline(
        [
            event(1.0, ((0, 0, "F"),)),
            event(3.0, ((0, 1, "F"),)),
            event(5.0, ((1, 0, "F"), (1, 0, "B")), fused=True),
            event(7.0, ((1, 1, "F"), (1, 1, "B")), fused=True),
        ]
    )
    costs = mm.measured_costs(timeline)
    assert costs["F"] == 2.0  # the unfused forwards only
    assert costs["B"] == 3.0  # backwards ran only fused: each op's time shared by its units
    assert costs["W"] == 0.0
    figure = mm.plot_timeline(timeline)
    labels = {text.get_text() for text in figure.axes[0].texts}
    assert {"F0.0", "F1.0+B1.0", "F1.1+B1.1"} <= labels
