"""API edges (issue 34): tasks under JAX's cached traces, donation mistakes, two threads."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.core.run import MpmdExecutable, OpKind

TOL = {"rtol": 1e-6, "atol": 1e-6}

_first = mm.task(lambda x: jnp.sin(x) * 2, mesh=mm.TaskMesh(devices=[2]))
_second = mm.task(lambda x: jnp.cos(x) + 1, mesh=mm.TaskMesh(devices=[1]))


def _body(x):
    return jnp.sum(_second(_first(x)))


_jitted_body = jax.jit(_body)  # one function object: JAX caches its trace

# Each wrapper makes JAX trace ``_body`` once and serve later traces from its cache.
WRAPPERS = {
    "checkpoint": lambda x: jax.grad(jax.checkpoint(_body))(x),
    "remat": lambda x: jax.value_and_grad(jax.remat(_body))(x),
    "inner-jit": lambda x: jax.grad(_jitted_body)(x),
}


@pytest.mark.parametrize("clear", [False, True], ids=["cached", "cleared"])
@pytest.mark.parametrize("name", list(WRAPPERS))
def test_tasks_under_cached_traces_are_placed_by_every_jit(name, clear):
    fun = WRAPPERS[name]
    x = jnp.arange(4.0)
    with mm.ignore_transforms():
        want = jax.jit(fun)(x)
    for _ in range(2):  # two independent programs of one function
        if clear:
            jax.clear_caches()
        program = mm.jit(fun)
        got = program(x)
        exe = program.executable(x)
        assert isinstance(exe, MpmdExecutable)
        assert {op.place for op in exe.ops if op.kind is OpKind.RUN} >= {(1,), (2,)}
        grad = got[1] if name == "remat" else got
        assert {d.id for d in grad.devices()} == {2}  # the first task's backward
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)


# --- donation -------------------------------------------------------------------------------


def test_static_and_donated_argument_is_refused():
    with pytest.raises(errors.DonationError, match=r"Argument 1 is in both `static_argnums`"):
        mm.jit(lambda x, n: x * n, static_argnums=1, donate_argnums=(0, 1))


def test_donated_index_beyond_the_arguments_is_refused():
    x = jnp.ones(3)
    with pytest.raises(errors.DonationError, match=r"names argument 2, but the call has 1"):
        mm.jit(lambda x: x * 2, donate_argnums=2)(x)
    assert not x.is_deleted()


@pytest.mark.parametrize("mpmd", [False, True], ids=["fast-path", "mpmd"])
def test_one_array_donated_and_passed_again_is_refused(mpmd):
    def fun(state, batch, scale):
        w = _second(_first(state["w"])) if mpmd else state["w"] * 2
        return w * scale + batch[0]

    program = mm.jit(fun, static_argnums=2, donate_argnums=0)
    x = jnp.ones(4)
    with pytest.raises(errors.DonationError, match=r"`args\[0\]\['w'\]` and as `args\[1\]\[0\]`"):
        program({"w": x}, (x,), 3.0)
    assert not x.is_deleted()
    out = program({"w": x}, (jnp.copy(x),), 3.0)  # a copy: fine
    with mm.ignore_transforms():
        np.testing.assert_allclose(out, fun({"w": jnp.ones(4)}, (jnp.ones(4),), 3.0), **TOL)


def test_repeated_python_scalars_are_not_aliases():
    program = mm.jit(lambda state, n: state["w"] * state["n"] + n, donate_argnums=0)
    out = program({"w": jnp.ones(2), "n": 1}, 1)
    np.testing.assert_allclose(out, 2 * np.ones(2), **TOL)


# --- two threads, one state -----------------------------------------------------------------


def _step(state, batch):
    return {"w": _second(_first(state["w"])) + batch, "v": state["v"] * 2}


def test_a_claimed_state_is_refused_until_released():
    """Deterministic: a call in flight (its claim held) makes another call raise."""
    step = mm.jit(_step, donate_argnums=0)
    state, batch = {"w": jnp.ones(8), "v": jnp.ones(3)}, jnp.ones(8)
    (where, _), _ = step.input_shardings(state, batch)
    state = jax.device_put(state, where)  # where the program consumes it (no copy first)
    step(jax.tree.map(jnp.copy, state), batch)  # built and compiled
    entry, leaves = step._entry((state, batch), {})
    claimed = entry.donation.claim(leaves, str)  # as a call in another thread would
    try:
        with pytest.raises(errors.ConsumedArrayError, match="call in another thread"):
            step(state, batch)
    finally:
        entry.donation.release(claimed)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    step(state, batch)
    with pytest.raises(errors.ConsumedArrayError, match="consumed by an earlier call"):
        step(state, batch)


def test_two_threads_stepping_one_state():
    """The race itself: one thread steps, the other gets ``ConsumedArrayError`` (never a raw
    XLA error or a crash), whichever of the two checks catches it."""
    step = mm.jit(_step, donate_argnums=0)
    batch = jnp.ones((64, 64))
    (where, _), _ = step.input_shardings({"w": batch, "v": jnp.ones(3)}, batch)
    step(jax.device_put({"w": batch, "v": jnp.ones(3)}, where), batch)
    for _ in range(5):  # in place, so the call really consumes (deletes) the state
        state = jax.device_put({"w": jnp.ones((64, 64)), "v": jnp.ones(3)}, where)
        barrier = threading.Barrier(2)
        outcomes: list[object] = []

        def run(state=state, barrier=barrier, outcomes=outcomes):
            barrier.wait()
            try:
                outcomes.append(jax.block_until_ready(step(state, batch)))
            except Exception as e:  # collected, checked below
                outcomes.append(e)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        failed = [o for o in outcomes if isinstance(o, Exception)]
        assert len(outcomes) == 2 and len(failed) == 1, outcomes
        assert type(failed[0]) is errors.ConsumedArrayError, repr(failed[0])
