"""MPMD programs: tasks on submeshes of different sizes, against the unparallelized step."""

from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors

TOL = {"rtol": 2e-5, "atol": 2e-6}

# Submesh layouts of the chain: (positions, axis sizes, axis names), one per task.
LAYOUTS = {
    "2x2_then_4x1": [
        ([0, 1, 2, 3], (2, 2), ("x", "y")),
        ([4, 5, 6, 7], (4, 1), ("x", "y")),
    ],
    "4_2_2": [
        ([0, 1, 2, 3], (4,), ("x",)),
        ([4, 5], (2,), ("x",)),
        ([6, 7], (2,), ("x",)),
    ],
    "1_2_4_1": [
        ([0], (1,), ("x",)),
        ([1, 2], (2, 1), ("x", "y")),
        ([3, 4, 5, 6], (2, 2), ("x", "y")),
        ([7], (1,), ("x",)),
    ],
}


def _rules(names: tuple[str, ...]) -> list[tuple[str, str]]:
    return [("batch", "x"), ("model", names[-1])]


def _layer(w: jax.Array, h: jax.Array) -> jax.Array:
    h = mm.with_sharding_constraint(h, P("batch", None))
    return jnp.tanh(h @ mm.with_sharding_constraint(w, P(None, "model")))


def _chain(layout_name: str):
    layout = LAYOUTS[layout_name]
    tasks = [
        mm.task(
            _layer,
            name=f"layer{i}",
            mesh=mm.TaskMesh(devices=pos, axis_sizes=sizes, axis_names=names),
            logical_axes=_rules(names),
        )
        for i, (pos, sizes, names) in enumerate(layout)
    ]

    def loss(params, batch):
        x, y = batch
        for layer, w in zip(tasks, params, strict=True):
            x = layer(w, x)
        return jnp.mean((x - y) ** 2)

    key = jax.random.key(len(layout))
    keys = jax.random.split(key, len(layout) + 2)
    params = [jax.random.normal(k, (8, 8)) / 3 for k in keys[: len(layout)]]
    batch = (jax.random.normal(keys[-2], (8, 8)), jax.random.normal(keys[-1], (8, 8)))
    return loss, params, batch, layout


def _assert_trees_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)


def _devices(array) -> list[int]:
    return sorted(d.id for d in array.devices())


def test_hello_world_result_lives_on_second_device_only():
    f = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[0]))
    g = mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[1]))
    out = mm.jit(lambda x: g(f(x)))(jnp.arange(4.0))
    np.testing.assert_array_equal(out, [1.0, 3.0, 5.0, 7.0])
    assert _devices(out) == [1]


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_value_and_grad_match_unparallelized(layout_name):
    loss, params, batch, layout = _chain(layout_name)
    step = mm.jit(jax.value_and_grad(loss))
    value, grads = step(params, batch)
    with mm.ignore_transforms():
        ref_value, ref_grads = jax.value_and_grad(loss)(params, batch)
    _assert_trees_close((value, grads), (ref_value, ref_grads))
    for g, (positions, _, _) in zip(grads, layout, strict=True):
        assert _devices(g) == sorted(positions)


def _train_step(loss, optimizer):
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    return step


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_training_steps_match_unparallelized(layout_name, optimizer_name):
    loss, params, batch, layout = _chain(layout_name)
    optimizer = optax.sgd(0.1) if optimizer_name == "sgd" else optax.adam(1e-2)
    step = _train_step(loss, optimizer)
    parallel = mm.jit(step)
    p, s = params, optimizer.init(params)
    ref_p, ref_s = params, optimizer.init(params)
    for _ in range(3):
        value, p, s = parallel(p, s, batch)
        with mm.ignore_transforms():
            ref_value, ref_p, ref_s = step(ref_p, ref_s, batch)
        _assert_trees_close((value, p), (ref_value, ref_p))
    for w, (positions, _, _) in zip(p, layout, strict=True):
        assert _devices(w) == sorted(positions), "parameters stay on their task's submesh"


def test_inputs_on_wrong_devices_are_resharded():
    loss, params, batch, layout = _chain("4_2_2")
    everywhere = jax.make_mesh((8,), ("all",), axis_types=(jax.sharding.AxisType.Auto,))
    wrong_params = [jax.device_put(w, jax.devices()[7]) for w in params]
    wrong_batch = jax.device_put(batch, NamedSharding(everywhere, P("all")))
    value, grads = mm.jit(jax.value_and_grad(loss))(wrong_params, wrong_batch)
    with mm.ignore_transforms():
        ref = jax.value_and_grad(loss)(params, batch)
    _assert_trees_close((value, grads), ref)


@contextlib.contextmanager
def _jax_log():
    """Collects JAX's compile-log messages (tracing, lowering, compiling) inside the block."""
    messages: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Handler(level=logging.DEBUG)
    root = logging.getLogger("jax")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            yield messages
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def _compiles(messages):
    return [m for m in messages if m.startswith("Compiling")]


def _lowerings(messages):
    return [m for m in messages if "to MLIR module conversion" in m]


def test_repeated_calls_compile_nothing():
    loss, params, batch, _ = _chain("2x2_then_4x1")
    step = mm.jit(_train_step(loss, optax.adam(1e-2)))
    state = optax.adam(1e-2).init(params)
    _, params, state = step(params, state, batch)
    with _jax_log() as messages:
        for _ in range(3):
            _, params, state = step(params, state, batch)
        jax.block_until_ready(params)
    assert _compiles(messages) == []


def test_arguments_differing_only_in_placement_share_one_program():
    loss, params, batch, _ = _chain("4_2_2")
    step = mm.jit(jax.value_and_grad(loss))
    pair = jax.make_mesh(
        (2,), ("p",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[6:]
    )
    elsewhere = [jax.device_put(w, NamedSharding(pair, P("p"))) for w in params]
    first = step(params, batch)
    _assert_trees_close(step(elsewhere, batch), first)
    assert step.cache_size() == 1, "a placement change must move inputs, not rebuild"
    halves = (batch[0][:4], batch[1][:4])
    _assert_trees_close(step(params, halves), _reference_value_and_grad(loss, params, halves))
    assert step.cache_size() == 2


def test_a_function_keeps_its_most_recently_used_programs(monkeypatch):
    from multimesh_flax.core.front import _jit

    monkeypatch.setattr(_jit, "PROGRAMS_PER_FUNCTION", 2)
    traced = []

    def double(x):
        traced.append(x.shape[0])
        return 2 * x

    jitted = mm.jit(double)
    for n in (1, 2, 1, 3, 1, 2):  # 1 is used again before 3 arrives: 2 is the one forgotten
        np.testing.assert_array_equal(jitted(jnp.ones(n)), 2 * np.ones(n))
    assert traced == [1, 2, 3, 2] and jitted.cache_size() == 2


def _reference_value_and_grad(loss, params, batch):
    with mm.ignore_transforms():
        return jax.value_and_grad(loss)(params, batch)


def test_compile_counter_sees_compiles():
    with _jax_log() as messages:
        jax.jit(lambda x: x * 3.5 + 1)(jnp.ones(3))
    assert _compiles(messages) and _lowerings(messages), "the log counters must work"


def test_value_used_twice_on_another_submesh_is_transferred_once():
    f = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[0, 1]))
    g = mm.task(lambda a, b: a + b, mesh=mm.TaskMesh(devices=[2, 3]))
    h = mm.task(lambda a: a - 1, mesh=mm.TaskMesh(devices=[2, 3]))

    def fn(x):
        y = f(x)
        return g(y, y), h(y)

    program = mm.jit(fn)
    out = program(jnp.ones(4))
    np.testing.assert_array_equal(out[0], 4 * np.ones(4))
    np.testing.assert_array_equal(out[1], np.ones(4))
    assert program.describe(jnp.ones(4)).count("put  1 value(s) to devices [2, 3]") == 1


def test_describe_lists_fragments_transfers_and_compiles():
    loss, params, batch, _ = _chain("4_2_2")
    program = mm.jit(jax.value_and_grad(loss))
    program(params, batch)
    text = program.describe(params, batch)
    assert "layer0.fwd" in text and "layer2.bwd" in text
    assert "on devices [4, 5]" in text
    assert "bytes" in text and "compiled executables" in text


def test_recomputation_keeps_values_and_recomputes_in_backward():
    loss, params, batch, _ = _chain("4_2_2")
    plain = mm.jit(jax.value_and_grad(loss))
    with mm.enable_recomputation():
        remat = mm.jit(jax.value_and_grad(loss))
        remat_out = remat(params, batch)
        remat_text = remat.describe(params, batch)
    _assert_trees_close(remat_out, plain(params, batch))

    def bwd_eqns(text):
        lines = [ln for ln in text.splitlines() if "layer1.bwd" in ln]
        return int(lines[0].split(": ")[1].split(" eqns")[0])

    assert bwd_eqns(remat_text) > bwd_eqns(plain.describe(params, batch))


def test_donated_arguments_are_consumed():
    f = mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[0]))
    g = mm.task(lambda x: x * 3, mesh=mm.TaskMesh(devices=[1]))
    program = mm.jit(lambda x: g(f(x)), donate_argnums=0)
    x = jax.device_put(jnp.ones(4), jax.devices()[0])
    out = program(x)
    np.testing.assert_array_equal(out, 6 * np.ones(4))
    assert x.is_deleted()


def test_timeline_records_every_op():
    loss, params, batch, _ = _chain("4_2_2")
    program = mm.jit(jax.value_and_grad(loss))
    program(params, batch)
    with mm.record_timeline() as timeline:
        program(params, batch)
    runs = [e for e in timeline.events if e.kind == "run"]
    assert {e.place for e in runs} == {(0, 1, 2, 3), (4, 5), (6, 7)}
    assert all(e.end >= e.start for e in timeline.events)
    assert any(e.kind == "transfer" for e in timeline.events)


def test_task_inside_scan_is_rejected():
    inner = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[1]))

    def looped(x):
        return jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=2)[0]

    with pytest.raises(errors.TaskInControlFlowError, match="scan"):
        mm.jit(looped)(jnp.ones(2))


def test_fast_path_without_tasks_is_plain_jit():
    program = mm.jit(lambda x: jnp.sin(x) * 2)
    x = jnp.linspace(0, 1, 8)
    np.testing.assert_allclose(program(x), np.sin(np.asarray(x)) * 2, rtol=1e-6)
    assert program.describe(x).startswith("fast path")
    with mm.enable_fast_path(False):
        slow = mm.jit(lambda x: jnp.sin(x) * 2)
        np.testing.assert_allclose(slow(x), np.sin(np.asarray(x)) * 2, rtol=1e-6)
        assert "1 fragments" in slow.describe(x)


def test_static_argnums_and_kwargs():
    f = mm.task(lambda x, scale=1.0: x * scale, mesh=mm.TaskMesh(devices=[3]))
    program = mm.jit(lambda x, n, scale: f(x, scale=scale) + n, static_argnums=1)
    out = program(jnp.ones(2), 5, scale=jnp.float32(2.0))
    np.testing.assert_array_equal(out, [7.0, 7.0])
    assert _devices(out) == [3]


def test_unhashable_static_argument_is_rejected():
    program = mm.jit(lambda x, n: x, static_argnums=1)
    with pytest.raises(errors.StaticArgumentError, match=r"\[1, 2\]"):
        program(jnp.ones(2), [1, 2])


def test_identical_stages_on_different_submeshes_compile_once():
    stage = mm.TaskMesh(devices=[0, 1], axis_names=("x",))
    blocks = [
        mm.task(
            _layer,
            name=f"block{i}",
            mesh=stage.place(pos),
            logical_axes=[("batch", "x"), ("model", "x")],
        )
        for i, pos in enumerate(([0, 1], [2, 3], [4, 5]))
    ]

    def forward(ws, x):
        for block, w in zip(blocks, ws, strict=True):
            x = block(w, x)
        return x

    ws = [jnp.eye(8) * (i + 1) for i in range(3)]
    x = jnp.ones((4, 8))
    program = mm.jit(forward)
    with _jax_log() as messages:
        out = program(ws, x)
    with mm.ignore_transforms():
        np.testing.assert_allclose(out, forward(ws, x), **TOL)
    fragment_compiles = [m for m in messages if "XLA compilation of jit(fragment)" in m]
    fragment_lowerings = [m for m in _lowerings(messages) if "jit(fragment)" in m]
    assert len(fragment_compiles) == 1, "compiled once"
    assert len(fragment_lowerings) == 1, "traced and lowered once for all three"
    exe = program.executable(ws, x)
    assert (exe.compile_count(), exe.relocation_count()) == (3, 2), "relocated to 2 submeshes"
    assert _devices(out) == [4, 5]


def test_vmap_of_a_task_chain_keeps_placement():
    f = mm.task(lambda x: jnp.sin(x) * 2, mesh=mm.TaskMesh(devices=[0, 1]))
    g = mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[2]))
    program = mm.jit(jax.vmap(lambda x: g(f(x))))
    x = jnp.arange(8.0).reshape(4, 2)
    out = program(x)
    np.testing.assert_allclose(out, np.sin(np.asarray(x)) * 2 + 1, **TOL)
    assert _devices(out) == [2]
    assert "2 fragments, 1 transfers" in program.describe(x)
