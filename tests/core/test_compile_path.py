"""The compile path: how often a program is traced and partitioned, what is shared, and the
persistent compilation cache.

Each test counts Python executions of the traced function (a trace runs it once) or reads
JAX's compile events, and checks values against the unparallelized computation.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import multimesh_flax as mm
from multimesh_flax.core.front import collector_paused
from multimesh_flax.core.run import MpmdExecutable
from multimesh_flax.core.trace import structural_key, trace_program

TOL = {"rtol": 2e-5, "atol": 2e-6}
ROOT = Path(__file__).resolve().parents[2]


def _close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)


def _two_stages(calls):
    def layer(w, h):
        calls.append(1)  # one per trace of the stage body
        return jnp.tanh(h @ w)

    first = mm.task(layer, name="first", mesh=mm.TaskMesh(devices=[0, 1]))
    second = mm.task(layer, name="second", mesh=mm.TaskMesh(devices=[2, 3]))

    def loss(ws, x):
        return jnp.mean(second(ws[1], first(ws[0], x)) ** 2)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    ws = (jax.random.normal(k1, (6, 6)) / 3, jax.random.normal(k2, (6, 6)) / 3)
    return loss, ws, jax.random.normal(k3, (16, 6))


@pytest.mark.parametrize("m", [1, 4, 16])
def test_microbatched_body_is_traced_once_whatever_the_count(m):
    calls = []
    loss, ws, x = _two_stages(calls)
    step = mm.jit(
        jax.value_and_grad(
            mm.microbatch(loss, 0, 16 // m, argnum=1, schedule="1f1b", reduce="mean")
        )
    )
    out = step(ws, x)
    assert len(calls) == 2  # each stage's body once, not once per microbatch
    with mm.ignore_transforms():
        _close(out, jax.value_and_grad(loss)(ws, x))


def test_trace_once_false_traces_every_microbatch_and_agrees():
    calls = []
    loss, ws, x = _two_stages(calls)
    f = lambda flag: mm.jit(  # noqa: E731
        jax.grad(mm.microbatch(loss, 0, 4, argnum=1, schedule="gpipe", trace_once=flag))
    )
    once = f(True)(ws, x)
    assert len(calls) == 2
    calls.clear()
    unrolled = f(False)(ws, x)
    assert len(calls) == 2 * 4
    _close(once, unrolled)


def test_loop_dependent_tasks_are_traced_per_microbatch():
    calls = []
    multi = mm.MultiMesh(axis_sizes=(4, 2), axis_names=("stage", "x"))

    def embed(w, h):
        calls.append(1)
        return h @ w

    moving = mm.task(embed, name="embed", loop_dependent_mesh_slice=lambda i: {"stage": i % 4})

    def loss(w, x):
        return jnp.sum(moving(w, x) ** 2)

    w, x = jnp.ones((3, 3)) / 3, jnp.arange(24.0).reshape(8, 3) / 24
    with multi:
        grads = mm.jit(jax.grad(mm.microbatch(loss, 0, 2, argnum=1)))(w, x)
    assert len(calls) == 4  # the task's mesh depends on the microbatch index
    with mm.ignore_transforms():
        _close(grads, jax.grad(loss)(w, x))


_BLOCK_TRACES = []  # one entry per Python run of _Block (a trace runs it once)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        _BLOCK_TRACES.append(1)
        return nn.tanh(nn.Dense(8)(x))


class _Pipe(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        for i, devices in enumerate((range(4), range(4, 8))):
            x = mm.task(_Block, mesh=mm.TaskMesh(devices=devices))(name=f"block_{i}")(x)
        return jnp.mean((x - y) ** 2)


@pytest.mark.parametrize("m", [1, 4])
def test_parallelize_step_traces_the_step_once_and_the_first_call_not_again(m):
    _BLOCK_TRACES.clear()
    x, y = jnp.ones((8, 8)), jnp.zeros((8, 8))
    step, state, _ = mm.parallelize_step(
        _Pipe(), optax.sgd(0.1), global_batch=(x, y), microbatches=m, schedule="1f1b"
    )
    built = len(_BLOCK_TRACES)
    # Two blocks, each traced by: the state initializer (which also records the parameters'
    # owners and logical names), the step.
    assert built == 2 * 2
    loss, state = step(state, (x, y))
    loss, state = step(state, (x, y))
    assert len(_BLOCK_TRACES) == built  # the calls run the program built above
    assert np.isfinite(float(loss))


def test_parallelize_step_differentiates_each_microbatch_inside_the_loop():
    """JAX differentiates one microbatch's body (traced once), not the loop over them: every
    backward equation sits in its own microbatch's scope, none under a transposed loop
    (whose partial evaluation and transpose would add a fixed cost to every trace)."""
    x, y = jnp.arange(64.0).reshape(8, 8) / 64, jnp.zeros((8, 8))
    step, state, _ = mm.parallelize_step(
        _Pipe(), optax.sgd(0.1), global_batch=(x, y), microbatches=4, schedule="1f1b"
    )
    with mm.ignore_transforms():  # the same step, unplaced and unsplit
        params = jax.tree.map(np.asarray, state.params)
        expected = jax.value_and_grad(lambda p: _Pipe().apply({"params": p}, x, y))(params)
    traced = step.executable(state, (x, y)).partition.traced
    backward = [s for s in traced.stacks if "transpose(" in s]
    scopes = [re.match(r"mmmb\d+_(\d+)/", s) for s in backward]
    assert backward and all(scopes), [s for s, m in zip(backward, scopes, strict=True) if not m][:3]
    assert {int(m[1]) for m in scopes} == {0, 1, 2, 3}
    loss, new_state = step(state, (x, y))
    np.testing.assert_allclose(float(loss), float(expected[0]), **TOL)
    sgd = jax.tree.map(lambda p, g: p - 0.1 * g, params, expected[1])
    _close(new_state.params, sgd)


def test_parallelize_reads_shardings_from_the_program_its_function_runs():
    calls = []
    loss, ws, x = _two_stages(calls)
    sharded, init = mm.parallelize(jax.grad(loss), init_params=lambda: ws, initial_batch=x)
    assert len(calls) == 2
    params = init()
    assert [sorted(d.id for d in w.devices()) for w in params] == [[0, 1], [2, 3]]
    grads = sharded(params, x)
    assert len(calls) == 2
    with mm.ignore_transforms():
        _close(grads, jax.grad(loss)(ws, x))


def test_input_shardings_match_where_the_program_puts_its_inputs():
    loss, ws, x = _two_stages([])
    jitted = mm.jit(jax.grad(loss))
    (w_sh, x_sh), kwargs = jitted.input_shardings(ws, x)
    assert kwargs == {}
    assert [sorted(d.id for d in s.device_set) for s in w_sh] == [[0, 1], [2, 3]]
    assert sorted(d.id for d in x_sh.device_set) == [0, 1]
    seconds = jitted.build_seconds(ws, x)
    assert set(seconds) == {"trace", "partition"} and all(v >= 0 for v in seconds.values())


def test_inlined_calls_of_one_body_are_renamed_copies_with_their_own_name_stacks():
    table = jnp.arange(6.0).reshape(2, 3)  # closed over: a constant of the body

    @jax.jit
    def body(h):
        inner = jax.jit(lambda z: jnp.tanh(z) * 2.0)  # a nested call inside the body
        return inner(h @ table.T) + table.sum()

    def fun(x):
        with jax.named_scope("first"):
            a = body(x)
        h = a[:, :1] * jnp.ones((1, 3))
        with jax.named_scope("second"):
            b = body(h)
        return a, b

    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    traced = trace_program(fun, (x,))
    eqns, stacks = traced.jaxpr.eqns, traced.stacks
    firsts = [i for i, s in enumerate(stacks) if s.startswith("first")]
    seconds = [i for i, s in enumerate(stacks) if s.startswith("second")]
    assert len(firsts) == len(seconds) > 3  # one copy of the body (and its call) each
    assert [eqns[i].primitive for i in firsts] == [eqns[i].primitive for i in seconds]
    assert [stacks[i][len("first") :] for i in firsts] == [
        stacks[i][len("second") :] for i in seconds
    ]
    produced = [v for e in eqns for v in e.outvars]
    assert len(produced) == len(set(produced))  # every copy writes fresh variables
    run = jex.jaxpr_as_fun(jex.ClosedJaxpr(traced.jaxpr, traced.consts))
    _close(run(x), jax.tree.leaves(jax.jit(fun)(x)))


def test_a_build_and_first_call_pause_the_garbage_collector_and_restore_it(monkeypatch):
    seen, calls = [], []

    def layer(w, h):
        seen.append(gc.isenabled())  # runs while the program is traced
        return h @ w

    run = MpmdExecutable.__call__

    def recording(self, args):
        calls.append(gc.isenabled())
        return run(self, args)

    monkeypatch.setattr(MpmdExecutable, "__call__", recording)
    f = mm.jit(mm.task(layer, name="layer", mesh=mm.TaskMesh(devices=[1])))
    assert gc.isenabled()
    f(jnp.ones((2, 2)), jnp.ones((3, 2)))
    f(jnp.ones((2, 2)), jnp.ones((3, 2)))
    assert seen == [False] and calls == [False, True] and gc.isenabled()
    gc.disable()  # a caller's own pause is left as it is
    try:
        f(jnp.ones((2, 2)), jnp.ones((5, 2)))
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_builds_in_two_threads_keep_the_collector_paused_until_the_last_ends():
    """Thread A's build ends while thread B's is still running: the collector stays paused
    for B, and runs again once B ends."""
    b_inside, a_done, observed = threading.Event(), threading.Event(), []

    def build_b() -> None:
        with collector_paused():
            b_inside.set()
            assert a_done.wait(timeout=30)
            observed.append(gc.isenabled())  # A has ended; B is still building

    thread = threading.Thread(target=build_b)
    with collector_paused():
        thread.start()
        assert b_inside.wait(timeout=30)
    a_done.set()
    thread.join(timeout=30)
    assert observed == [False]
    assert gc.isenabled()


def test_structural_key_ignores_names_but_not_values_or_shapes():
    def key(f, *args):
        return structural_key(jax.make_jaxpr(f)(*args).jaxpr)

    base = key(lambda a: jnp.sin(a) + 1.0, jnp.ones(3))
    assert base == key(lambda b: jnp.sin(b) + 1.0, jnp.ones(3))
    assert base != key(lambda a: jnp.sin(a) + 2.0, jnp.ones(3))  # another literal
    assert base != key(lambda a: jnp.sin(a) + 1.0, jnp.ones(4))  # another shape
    assert base != key(lambda a: jnp.cos(a) + 1.0, jnp.ones(3))  # another primitive
    assert key(lambda a: a.sum(0), jnp.ones((2, 3))) != key(lambda a: a.sum(1), jnp.ones((2, 3)))


def test_enable_compilation_cache_directory_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFLAX_COMPILATION_CACHE", "off")
    assert mm.enable_compilation_cache() is None
    assert mm.enable_compilation_cache("OFF") is None


_CACHED_RUN = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import multimesh_flax as mm
    from multimesh_flax._compilation_cache import compilation_counter
    path = mm.enable_compilation_cache(sys.argv[1])
    read = compilation_counter()
    f = mm.task(lambda w, x: jnp.tanh(x @ w), name="f", mesh=mm.TaskMesh(devices=[0, 1]))
    g = mm.task(lambda w, x: x @ w, name="g", mesh=mm.TaskMesh(devices=[2, 3]))
    step = mm.jit(jax.grad(lambda ws, x: jnp.mean(g(ws[1], f(ws[0], x)) ** 2)))
    grads = step((jnp.ones((4, 4)), jnp.ones((4, 2))), jnp.ones((8, 4)))
    print("RESULT" + json.dumps({"path": str(path), **read(),
                                 "grad": float(grads[0].sum())}))
    """
)


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    def run():
        proc = subprocess.run(
            [sys.executable, "-c", _CACHED_RUN, str(tmp_path / "cache")],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
        return json.loads(line[len("RESULT") :])

    first, second = run(), run()
    assert first["path"] == str(tmp_path / "cache")
    assert first["compiles"] >= 2 and first["cache_hits"] == 0
    assert second["compiles"] == 0 and second["cache_hits"] == first["compiles"]
    assert second["grad"] == first["grad"]
