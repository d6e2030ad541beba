"""Pipelined ``microbatch`` under ``jit``: every schedule against the full-batch computation.

A chain of ``tanh(h @ w)`` stages on single-device submeshes, microbatched with each
schedule, must give the values and gradients of the unparallelized full-batch loss (computed
under ``ignore_transforms`` without microbatching), keep gradients on their stage's submesh,
and dispatch each submesh's ops in the order of the schedule's row for that submesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.core import ScheduleOp
from multimesh_flax.core.declare import Phase

TOL = {"rtol": 2e-5, "atol": 2e-6}
BATCH = 16
SCHEDULES = [None, "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h2", "custom"]


def _layer(w, h):
    return jnp.tanh(h @ w)


def _chain(num_stages, num_submeshes, devices=None, **task_options):
    """Stage ``s`` on device ``s % num_submeshes`` (or ``devices[s]``); MSE loss at the end."""
    devices = devices or [s % num_submeshes for s in range(num_stages)]
    tasks = [
        mm.task(_layer, name=f"layer{s}", mesh=mm.TaskMesh(devices=[d]), **task_options)
        for s, d in enumerate(devices)
    ]

    def loss(params, batch):
        x, y = batch
        for layer, w in zip(tasks, params, strict=True):
            x = layer(w, x)
        return jnp.mean((x - y) ** 2)

    keys = jax.random.split(jax.random.key(num_stages), num_stages + 2)
    params = [jax.random.normal(k, (8, 8)) / 2 for k in keys[:num_stages]]
    batch = (jax.random.normal(keys[-2], (BATCH, 8)), jax.random.normal(keys[-1], (BATCH, 8)))
    return loss, params, batch


def _layout(schedule, m):
    """(stages, submeshes, microbatch options) for a 4-submesh pipeline (2 for m=2 interleaved)."""
    if schedule == "zero-bubble-v":
        return 8, 4, {}
    if schedule == "interleaved-1f1b":
        submeshes = 4 if m % 4 == 0 else 2  # interleaved needs m to be a multiple of them
        return 2 * submeshes, submeshes, {"interleave": 2}
    if schedule == "custom":
        return 4, 4, {"custom_schedule": _reverse_gpipe(4, m)}
    return 4, 4, {}


def _reverse_gpipe(stages, m):
    """A custom order by task name: all forwards, then the backwards from the last microbatch."""
    return [
        [(f"layer{s}", i, "F") for i in range(m)]
        + [(f"layer{s}", i, "B") for i in reversed(range(m))]
        for s in range(stages)
    ]


def _assert_trees_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)


def _reference(loss, params, batch, scale=1.0):
    """``value_and_grad`` of ``scale * loss`` on the full batch, unparallelized.

    ``microbatch(..., reduce="sum")`` over ``m`` equal chunks of a mean loss is ``m`` times
    the full-batch mean: pass ``scale=m`` for it.
    """
    with mm.ignore_transforms():
        return jax.value_and_grad(lambda p, b: scale * loss(p, b))(params, batch)


def _units(timeline):
    """Every (stage, microbatch, phase) unit run, in dispatch order (a fused op runs several)."""
    events = sorted(timeline.events, key=lambda e: e.index)
    return [(e, ScheduleOp(*unit)) for e in events if e.kind == "run" for unit in e.units]


def _dispatched_rows(timeline):
    """Per place, the (stage, microbatch, phase) units in dispatch order (repeats merged)."""
    rows: dict[tuple[int, ...], list[ScheduleOp]] = {}
    for event, op in _units(timeline):
        row = rows.setdefault(event.place, [])
        if not row or row[-1] != op:
            row.append(op)
    return rows


def _assert_dispatch_follows(schedule, timeline, stage_places):
    rows = _dispatched_rows(timeline)
    ran = {op for ops in rows.values() for op in ops}
    for r, ops in enumerate(schedule.rows):
        place = stage_places[schedule.rows[r][0].stage]
        expected = [op for op in ops if op in ran]
        assert rows[place] == expected, f"submesh {r} ({place}) dispatch differs from row {r}"


@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_value_and_grad_match_full_batch(schedule, m):
    _check_against_full_batch(schedule, m)


@pytest.mark.parametrize("schedule", ["zero-bubble-h1", "zero-bubble-auto", "zero-bubble-v"])
def test_new_zero_bubble_schedules_match_full_batch(schedule):
    _check_against_full_batch(schedule, 4)


def test_pipeline_options_take_the_schedule_its_costs_and_memory_limit():
    """One ``PipelineOptions`` record: the count instead of a size, and the costs,
    activation-set limit and ``w_memory`` that ``"zero-bubble-auto"`` orders for reach
    ``make_schedule``."""
    costs, m = {"F": 1.0, "B": 2.0, "W": 0.5}, 8
    options = mm.PipelineOptions(
        microbatches=m, schedule="zero-bubble-auto", costs=costs, max_in_flight=8, w_memory=0.5
    )
    loss, params, batch = _chain(4, 4)
    step = mm.jit(
        jax.value_and_grad(mm.microbatch(loss, 0, argnum=1, pipeline=options, reduce="mean"))
    )
    _assert_trees_close(step(params, batch), _reference(loss, params, batch))
    built = step.executable(params, batch).schedule
    wanted = mm.make_schedule("zero-bubble-auto", 4, m, costs=costs, max_in_flight=8, w_memory=0.5)
    assert built.rows == wanted.rows
    assert built.rows != mm.make_schedule("zero-bubble-auto", 4, m).rows  # the costs mattered


@pytest.mark.parametrize(
    ("size", "options", "match"),
    [
        (2, mm.PipelineOptions(microbatches=4), "exactly one of them"),
        (None, mm.PipelineOptions(schedule="1f1b"), "exactly one of them"),
        (
            None,
            mm.PipelineOptions(microbatches=4, schedule="1f1b", costs={"F": 2.0}),
            "`costs`, `max_in_flight` and `w_memory` shape",
        ),
        (None, {"microbatches": 4}, "Expected `pipeline` to be a PipelineOptions"),
    ],
    ids=["size-and-count", "neither", "costs-on-a-fixed-order", "not-a-record"],
)
def test_pipeline_options_mistakes(size, options, match):
    with pytest.raises(errors.MicrobatchArgumentError, match=match):
        mm.microbatch(lambda x: x, 0, size, pipeline=options)


def test_pipeline_options_and_the_same_keywords_at_once_are_refused():
    with pytest.raises(errors.MicrobatchArgumentError, match="got `pipeline` and also"):
        mm.microbatch(lambda x: x, 0, pipeline=mm.PipelineOptions(microbatches=2), schedule="1f1b")


def test_a_count_that_does_not_divide_the_batch_says_so():
    f = mm.microbatch(lambda x: x.sum(), 0, pipeline=mm.PipelineOptions(microbatches=3))
    with pytest.raises(errors.UnevenMicrobatchError, match="`microbatches`=3 does not divide"):
        f(jnp.ones((8, 2)))


def _check_against_full_batch(schedule, m):
    stages, submeshes, options = _layout(schedule, m)
    devices = list(mm.core.declare.stage_rows(schedule or "gpipe", stages, submeshes))
    loss, params, batch = _chain(stages, submeshes, devices)
    step = mm.jit(
        jax.value_and_grad(
            mm.microbatch(
                loss, 0, BATCH // m, argnum=1, schedule=schedule, reduce="mean", **options
            )
        )
    )
    value, grads = step(params, batch)
    _assert_trees_close((value, grads), _reference(loss, params, batch))
    for s, g in enumerate(grads):
        assert [d.id for d in g.devices()] == [devices[s]], "gradients stay with their stage"
    executable = step.executable(params, batch)
    if schedule is None:
        assert executable.schedule is None
        return
    assert executable.schedule.name == schedule
    assert executable.schedule.num_stages == stages
    assert executable.schedule.num_microbatches == m
    with mm.record_timeline() as timeline:
        jax.block_until_ready(step(params, batch))
    places = [(d,) for d in devices]
    _assert_dispatch_follows(executable.schedule, timeline, places)
    runs = [op for _, op in _units(timeline)]
    assert len(runs) == len(set(runs)), "every unit runs as one fragment"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h2"])
def test_gradient_inside_microbatch_accumulates(schedule):
    loss, params, batch = _chain(4, 4)
    step = mm.jit(
        mm.microbatch(jax.value_and_grad(loss), 0, 4, argnum=1, schedule=schedule, reduce="mean")
    )
    value, grads = step(params, batch)
    _assert_trees_close((value, grads), _reference(loss, params, batch))
    with mm.record_timeline() as timeline:
        jax.block_until_ready(step(params, batch))
    schedule = step.executable(params, batch).schedule
    _assert_dispatch_follows(schedule, timeline, [(0,), (1,), (2,), (3,)])


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_gradient_sums_follow_the_schedule(where):
    # A backward outside sums gradients from the last microbatch down, `microbatch` sums from
    # the first up. Run each against a schedule that finishes microbatches in the other
    # order: the sums are re-associated so that each addition runs right after its
    # microbatch's backward, not all of them after the last one.
    loss, params, batch = _chain(4, 4)
    if where == "outside":
        mb = mm.microbatch(loss, 0, 2, argnum=1, schedule="1f1b", reduce="mean")
        step = mm.jit(jax.grad(mb))
    else:
        custom = _reverse_gpipe(4, 8)  # finishes microbatch 7 first
        mb = mm.microbatch(jax.grad(loss), 0, 2, argnum=1, custom_schedule=custom, reduce="mean")
        step = mm.jit(mb)
    _assert_trees_close(step(params, batch), _reference(loss, params, batch)[1])
    with mm.record_timeline() as timeline:
        jax.block_until_ready(step(params, batch))
    for s in range(4):
        runs = sorted(
            (e for e in timeline.events if e.kind == "run" and e.place == (s,)),
            key=lambda e: e.index,
        )
        backwards = [i for i, e in enumerate(runs) if "B" in {u[2] for u in e.units}]
        # The last sum runs after the last backward; where F_k and B_k are fused (the last
        # stage), the loss sum that ran between them runs after them too.
        tail = 2 if any(e.fused for e in runs) else 1
        assert len(runs) - 1 - backwards[-1] <= tail, [e.name for e in runs]
    # From the second gradient on, the addition runs at the end of the backward making it
    # (``fragment._sums``), consuming the running sum of the backward before it.
    fragments = step.executable(params, batch).partition.fragments
    for s in range(4):
        backwards = [
            f
            for f in fragments
            if f.place == (s,) and any(p.unit and p.unit.phase is Phase.B for p in f.parts or (f,))
        ]
        for before, after in zip(backwards, backwards[1:], strict=False):
            assert set(after.donate) & set(before.outvars), (s, after.index)


def test_zero_bubble_splits_backward_into_named_halves():
    loss, params, batch = _chain(4, 4, split_backprop=("act_grad", "weight_grad"))
    step = mm.jit(jax.grad(mm.microbatch(loss, 0, 4, argnum=1, schedule="zero-bubble-h2")))
    grads = step(params, batch)
    _assert_trees_close(grads, _reference(loss, params, batch, scale=4)[1])
    text = step.describe(params, batch)
    assert "schedule 'zero-bubble-h2': 4 stages on 4 submeshes, 4 microbatches" in text
    assert "layer2.act_grad[3]" in text and "layer2.weight_grad[3]" in text
    # Stage 0 sends no gradient to a previous stage: its backward is all weight gradient.
    assert "layer0.weight_grad[0]" in text and "layer0.act_grad" not in text
    with mm.record_timeline() as timeline:
        jax.block_until_ready(step(params, batch))
    phases = {(op.stage, op.phase) for _, op in _units(timeline)}
    assert {(s, "W") for s in range(4)} <= phases
    assert {(s, "B") for s in range(1, 4)} <= phases and (0, "B") not in phases
    runs = [op for _, op in _units(timeline)]
    assert len(runs) == len(set(runs)), "every unit, each half of a backward too, is one run"


def test_training_steps_with_1f1b_match_unparallelized():
    loss, params, batch = _chain(4, 4)
    optimizer = optax.sgd(0.2)

    def train_step(params, opt_state, batch, mb_loss):
        value, grads = jax.value_and_grad(mb_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    mb_loss = mm.microbatch(loss, 0, 4, argnum=1, schedule="1f1b", reduce="mean")
    step = mm.jit(lambda p, s, b: train_step(p, s, b, mb_loss))
    p, s = params, optimizer.init(params)
    ref_p, ref_s = params, optimizer.init(params)
    for _ in range(2):
        value, p, s = jax.block_until_ready(step(p, s, batch))
        with mm.ignore_transforms():
            ref_value, ref_p, ref_s = train_step(ref_p, ref_s, batch, loss)
        _assert_trees_close((value, p), (ref_value, ref_p))
    assert [[d.id for d in w.devices()] for w in p] == [[0], [1], [2], [3]]


def test_sharded_stages_on_two_device_submeshes():
    def layer(w, h):
        h = mm.with_sharding_constraint(h, P("batch", None))
        return jnp.tanh(h @ mm.with_sharding_constraint(w, P(None, "model")))

    tasks = [
        mm.task(
            layer,
            name=f"block{s}",
            mesh=mm.TaskMesh(devices=[2 * s, 2 * s + 1], axis_names=("x",)),
            logical_axes=[("batch", "x"), ("model", None)],
        )
        for s in range(4)
    ]

    def loss(params, x):
        for block, w in zip(tasks, params, strict=True):
            x = block(w, x)
        return jnp.mean(x**2)

    params = [jnp.eye(8) * (1 + s / 10) for s in range(4)]
    x = jax.random.normal(jax.random.key(3), (BATCH, 8))
    step = mm.jit(jax.value_and_grad(mm.microbatch(loss, 0, 4, argnum=1, schedule="1f1b")))
    value, grads = step(params, x)
    _assert_trees_close((value, grads), _reference(loss, params, x, scale=4))
    for s, g in enumerate(grads):
        assert sorted(d.id for d in g.devices()) == [2 * s, 2 * s + 1]


def test_loop_dependent_mesh_slice_moves_the_task_per_microbatch():
    multi = mm.MultiMesh(axis_sizes=(4, 2), axis_names=("stage", "x"))
    embed = mm.task(
        lambda w, x: x @ w, name="embed", loop_dependent_mesh_slice=lambda i: {"stage": i % 4}
    )
    blocks = [mm.task(_layer, name=f"block{s}", mesh_slice={"stage": s}) for s in range(4)]

    def loss(params, x):
        h = embed(params[0], x)
        for block, w in zip(blocks, params[1:], strict=True):
            h = block(w, h)
        return jnp.mean(h**2)

    keys = jax.random.split(jax.random.key(5), 6)
    params = [jax.random.normal(k, (8, 8)) / 2 for k in keys[:5]]
    x = jax.random.normal(keys[5], (BATCH, 8))
    with multi:
        step = mm.jit(jax.value_and_grad(mm.microbatch(loss, 0, 4, argnum=1, schedule="1f1b")))
        value, grads = step(params, x)
        with mm.record_timeline() as timeline:
            jax.block_until_ready(step(params, x))
        schedule = step.executable(params, x).schedule
    _assert_trees_close((value, grads), _reference(loss, params, x, scale=4))
    assert schedule.num_stages == 4, "the moving embedding is not a pipeline stage"
    devices = np.asarray(multi.devices).reshape(4, 2)
    # A fused op is named after its parts ("block0.bwd[0]#48+embed.bwd[0]#49").
    embeds = [e for e in timeline.events if any(p.startswith("embed.") for p in e.name.split("+"))]
    for event in embeds:
        if "embed.fwd" in event.name:
            i = event.microbatch
            assert event.place == tuple(sorted(d.id for d in devices[i % 4])), event.name
    assert {e.microbatch for e in embeds} == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_stages": 3}, r"`num_stages`=3, but `fun` runs 4 task"),
        ({"schedule": "1f1b", "interleave": 2}, r"`interleave`=2"),
        ({"custom_schedule": [[f"F{s}.0"] for s in range(4)]}, "lacks"),
        ({"custom_schedule": [[("layer9", 0, "F")]] * 4}, "'layer9' in `custom_schedule`"),
    ],
)
def test_schedule_that_does_not_fit_the_program_raises(options, match):
    loss, params, batch = _chain(4, 4)
    options = {"schedule": "gpipe", **options}
    if "custom_schedule" in options:
        options["schedule"] = "custom"
    mb_loss = mm.microbatch(loss, 0, 4, argnum=1, **options)
    with pytest.raises(errors.InvalidScheduleError, match=match):
        mm.jit(jax.grad(mb_loss))(params, batch)


@pytest.mark.parametrize(
    ("devices", "schedule", "match"),
    [
        ([0, 1, 0, 2], "gpipe", r"stage 3 \('layer3'\) runs on devices \[2\], stage 0 on"),
        ([0, 1, 2, 3, 0, 1, 2, 3], "1f1b", "one stage per submesh"),
        ([0, 1, 0, 1], "interleaved-1f1b", "multiple of the number of submeshes"),
    ],
)
def test_stage_layout_that_does_not_fit_the_schedule_raises(devices, schedule, match):
    loss, params, batch = _chain(len(devices), 4, devices=devices)
    options = {"interleave": 2} if schedule == "interleaved-1f1b" else {}
    mb_loss = mm.microbatch(loss, 0, 2, argnum=1, schedule=schedule, **options)
    batch = jax.tree.map(lambda a: a[:6], batch)  # 3 microbatches of 2
    with pytest.raises(errors.InvalidScheduleError, match=match):
        mm.jit(jax.grad(mb_loss))(params, batch)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_consecutive_tasks_on_one_submesh_are_one_stage(schedule):
    loss, params, batch = _chain(4, 2, devices=[0, 0, 1, 1])
    mb_loss = mm.microbatch(loss, 0, 4, argnum=1, schedule=schedule, reduce="mean")
    step = mm.jit(jax.value_and_grad(mb_loss))
    _assert_trees_close(step(params, batch), _reference(loss, params, batch))
    plan = step.executable(params, batch).schedule
    assert plan.num_stages == 2 and plan.name == schedule
