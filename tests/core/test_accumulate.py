"""Gradient sums over microbatches under a schedule: where they run, what they move.

Each test compares values and gradients with the unparallelized full-batch computation
(under ``ignore_transforms``), then checks the shape of the program built for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh_flax as mm
from multimesh_flax.core.fragment import _sums
from multimesh_flax.core.plan import is_bundle
from tests.core._chain import tanh_stage, tanh_stages_data

TOL = {"rtol": 2e-5, "atol": 2e-6}
M = 4


def _assert_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)


def _tied_model():
    """An embedding table used by the first stage (device 0) and, transposed, by the last
    (device 1): its gradient has a share from each submesh in every microbatch."""
    embed = mm.task(lambda t, x: jnp.tanh(x @ t), name="embed", mesh=mm.TaskMesh(devices=[0]))
    head = mm.task(
        lambda t, w, h: jnp.tanh(h @ w) @ t.T, name="head", mesh=mm.TaskMesh(devices=[1])
    )

    def loss(params, x):
        table, w = params
        return jnp.mean((head(table, w, embed(table, x)) - x) ** 2)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = (jax.random.normal(k1, (12, 5)) / 3, jax.random.normal(k2, (5, 5)) / 2)
    return loss, params, jax.random.normal(k3, (16, 12))


def _step(loss, schedule):
    mean = mm.microbatch(loss, 0, M, argnum=1, schedule=schedule, reduce="mean")
    return mm.jit(jax.value_and_grad(mean))


def _moves_of_shape(exe, shape):
    var_of = {slot: var for (var, _), slot in exe._slots.items()}
    return [
        op for op in exe.ops if op.kind == 1 and any(var_of[s].aval.shape == shape for s in op.outs)
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tied_gradient_is_summed_per_submesh_before_it_moves(schedule):
    loss, params, x = _tied_model()
    step = _step(loss, schedule)
    _assert_close(step(params, x), _reference(loss, params, x))
    moves = _moves_of_shape(step.executable(params, x), (12, 5))
    # The table goes to the head once; of its gradient, at most the head's partial sum and
    # the last microbatch's share cross back -- not one share per microbatch.
    assert len(moves) <= 3 < M + 1, [op.name for op in moves]


def _reference(loss, params, x):
    with mm.ignore_transforms():
        return jax.value_and_grad(loss)(params, x)


def _two_stage_model():
    """Two stages (devices 0 and 1) of three parameters each."""
    stages = [
        mm.task(tanh_stage, name=f"stage{s}", mesh=mm.TaskMesh(devices=[s])) for s in range(2)
    ]

    def loss(params, x):
        for stage, p in zip(stages, params, strict=True):
            x = stage(p, x)
        return jnp.mean(x**2)

    params, x = tanh_stages_data(1, 2)
    return loss, params, x


def _inner_step(loss, schedule):
    """Each microbatch's gradient taken inside the loop, the loop averaging them (as
    ``parallelize_step`` does): the sums over microbatches are the loop's own reduction."""
    mean = mm.microbatch(jax.value_and_grad(loss), 0, M, argnum=1, schedule=schedule)
    return mm.jit(lambda p, x: jax.tree.map(lambda v: v / M, mean(p, x)))


def _sums_of_two_calls(part):
    """Sums whose operands both come from calls (blocks or bundles): unbundled gradient sums."""
    made_by = {v: e for f in part.fragments for e in f.eqns for v in e.outvars}
    return [
        e
        for f in part.fragments
        for e in f.eqns
        if e.primitive.name in ("add", "add_any")
        and all(
            getattr(made_by.get(v), "primitive", None) is jax.extend.core.primitives.closed_call_p
            for v in e.invars
        )
    ]


@pytest.mark.parametrize("make_step", [_step, _inner_step], ids=["grad-outside", "grad-inside"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_microbatch_sums_a_stage_gradients_in_one_bundle(schedule, make_step, monkeypatch):
    # The bundles as ``plan._accumulate`` makes them: packed into one flat running sum per
    # chain on one-device stages (``fragment._packed_sums``, tested in test_sums_in_units).
    monkeypatch.setattr(_sums, "PACK", False)
    loss, params, x = _two_stage_model()
    step = make_step(loss, schedule)
    _assert_close(step(params, x), _reference(loss, params, x))
    part = step.executable(params, x).partition
    placed = {v: f.place for f in part.fragments for e in f.eqns for v in e.outvars}
    bundles = [(e, f.place) for f in part.fragments for e in f.eqns if is_bundle(e)]
    # Per stage, M additions of its 3 gradients (M - 1, and the first onto zeros: see
    # ``fragment._sums``): one bundle each, not one sum each. (Inside its units the loss's
    # sum over microbatches is a bundle of one.)
    assert sorted(len(e.outvars) for e, _ in bundles if len(e.outvars) > 1) == [3] * (2 * M)
    for eqn, place in bundles:  # a bundle runs where its gradients were made
        assert {placed.get(v, place) for v in eqn.invars} == {place}
    sums = _sums_of_two_calls(part)
    assert not sums, sums  # no gradient sum over microbatches is left on its own
