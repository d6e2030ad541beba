"""Registered tasks on ``MultiMesh`` slices, and unmodified Flax models placed by name."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.core.declare import forget_warnings

TOL = {"rtol": 2e-5, "atol": 2e-6}


def _ids(array) -> set[int]:
    return {d.id for d in array.devices()}


def _spec(array) -> P:
    """The array's ``PartitionSpec`` with one entry per dimension (trailing ``None``s kept)."""
    spec = tuple(array.sharding.spec)
    return P(*spec, *([None] * (array.ndim - len(spec))))


def _assert_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)


def _blocks(array, dim: int) -> dict[int, set[int]]:
    """``{start index along dim: device ids holding that block}``."""
    found: dict[int, set[int]] = {}
    for shard in array.addressable_shards:
        start = shard.index[dim].start or 0
        found.setdefault(start, set()).add(shard.device.id)
    return found


def _seed_mesh() -> mm.MultiMesh:
    return mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "batch", "model"))


def _by_stage(name: str, backprop: bool) -> mm.Task:
    return mm.Task(mesh_slice={"stage": int(name[-1])})


# --- MultiMesh as a Context -----------------------------------------------------------------


def _scoped(x):
    with jax.named_scope("layer1"):
        return x * 2


def test_multi_mesh_registrations_are_active_only_inside_it():
    mesh = _seed_mesh()
    assert isinstance(mesh, mm.Context)
    mesh.register_task("(layer[0-9])", callback=_by_stage)
    fun = mm.jit(_scoped)
    with mesh:
        inside = fun(jnp.ones(4))
    assert _ids(inside) == {4, 5, 6, 7}
    # Entered before, so outside its `with` it is simply inactive: no tasks, no warning
    # (strict mode, on in every test, would raise it).
    assert fun.describe(jnp.ones(4)).startswith("fast path")


def test_register_task_inside_a_multi_mesh_adds_to_it():
    mesh = _seed_mesh()
    with mesh:
        mm.register_task("layer1", task=mm.Task(mesh_slice={"stage": 0}))
        out = mm.jit(_scoped)(jnp.ones(4))
    assert len(mesh.registrations) == 1
    assert _ids(out) == {0, 1, 2, 3}


def test_inner_context_wins_over_the_multi_mesh():
    mesh = _seed_mesh()
    mesh.register_task("layer1", task=mm.Task(mesh_slice={"stage": 0}))
    with mesh, mm.Context():
        mm.register_task("layer1", task=mm.Task(mesh=mm.slice_global_mesh(stage=1, batch=0)))
        out = mm.jit(_scoped)(jnp.ones(4))
    assert _ids(out) == {4, 5}


def test_mesh_slice_keeps_global_axes_and_appends_extra_axes():
    def fun(x):
        with jax.named_scope("layer1"):
            return mm.with_sharding_constraint(x, P("hidden", "model"))

    task = mm.Task(mesh_slice={"stage": 1}, extra_axes=[("hidden", "batch")])
    with _seed_mesh() as mesh:
        mesh.register_task("layer1", task=task)
        out = mm.jit(fun)(jnp.ones((4, 4)))
    assert out.sharding.mesh.shape == {"stage": 1, "batch": 2, "model": 2}
    assert _spec(out) == P("batch", "model")
    assert _blocks(out, 0) == {0: {4, 5}, 2: {6, 7}}


# --- the seeds' MultiMesh example -----------------------------------------------------------


def _seed_program(params, x):
    w1, w2 = params
    with jax.named_scope("layer0"):
        w1 = mm.with_sharding_constraint(w1, P("model", None))
        h = jnp.tanh(x @ w1)
    with jax.named_scope("layer1"):
        w2 = mm.with_sharding_constraint(w2, P(None, "model"))
        h = h @ w2
    return jnp.mean(h**2)


def _seed_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (8, 8)) / 3, jax.random.normal(k2, (8, 8)) / 3


def test_seed_example_places_each_layer_on_its_stage():
    x = jax.random.normal(jax.random.key(1), (4, 8))
    mesh = _seed_mesh()
    mesh.register_task("(layer[0-9])", callback=_by_stage)
    with mesh:
        step, init = mm.parallelize(
            jax.value_and_grad(_seed_program), init_params=_seed_params, initial_batch=x
        )
        w1, w2 = init()
        loss, (g1, g2) = step((w1, w2), x)
    assert _spec(w1) == P("model", None)
    assert _blocks(w1, 0) == {0: {0, 2}, 4: {1, 3}}
    assert _spec(w2) == P(None, "model")
    assert _blocks(w2, 1) == {0: {4, 6}, 4: {5, 7}}
    assert _ids(g1) == {0, 1, 2, 3}
    assert _ids(g2) == {4, 5, 6, 7}
    with mm.ignore_transforms():
        expected = jax.value_and_grad(_seed_program)(_seed_params(), x)
    _assert_close((loss, (g1, g2)), expected)


# --- bad mesh slices ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh_slice", "error", "fragment"),
    [
        ({"stag": 0}, errors.UnknownMeshAxisError, "'stag'"),
        ({"stage": 2}, errors.MeshIndexError, "stage=2"),
    ],
)
def test_bad_mesh_slice_from_a_callback(mesh_slice, error, fragment):
    mesh = _seed_mesh()
    mesh.register_task("layer1", callback=lambda name, backprop: mm.Task(mesh_slice=mesh_slice))
    with mesh, pytest.raises(error, match=re.escape(fragment) + ".*matcher 'layer1'"):
        mm.jit(_scoped)(jnp.ones(4))


@pytest.mark.parametrize(
    ("mesh_slice", "error"),
    [({"stag": 0}, errors.UnknownMeshAxisError), ({"stage": -1}, errors.MeshIndexError)],
)
def test_bad_mesh_slice_is_rejected_when_registered_on_a_multi_mesh(mesh_slice, error):
    mesh = _seed_mesh()
    with pytest.raises(error):
        mesh.register_task("layer1", task=mm.Task(mesh_slice=mesh_slice))
    assert mesh.registrations == ()


def test_mesh_and_mesh_slice_together_are_rejected():
    def callback(name, backprop):
        return mm.Task(mesh=mm.TaskMesh(devices=[0]), mesh_slice={"stage": 0})

    mesh = _seed_mesh()
    mesh.register_task("layer1", callback=callback)
    with mesh, pytest.raises(errors.InvalidTaskError, match="`mesh_slice`"):
        mm.jit(_scoped)(jnp.ones(4))


def test_mesh_slice_without_a_multi_mesh():
    with mm.Context():
        mm.register_task("layer1", task=mm.Task(mesh_slice={"stage": 0}))
        with pytest.raises(errors.NoMultiMeshError, match="matcher 'layer1'"):
            mm.jit(_scoped)(jnp.ones(4))


# --- unmodified Flax models -----------------------------------------------------------------

RULES = [("batch", "data"), ("mlp", "model")]


class Layer(nn.Module):
    """A Dense layer written with Flax's own logical API only."""

    names: tuple[str, str]

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), self.names)
        x = nn.Dense(8, kernel_init=init)(x)
        return jnp.tanh(nn.with_logical_constraint(x, ("batch", self.names[1])))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = Layer(("embed", "mlp"), name="layer_0")(x)
        return Layer(("mlp", "embed"), name="layer_1")(x)


STAGES = {"layer_0": (0, 1, 2, 3), "layer_1": (4, 5, 6, 7)}


def _by_layer(name: str, backprop: bool) -> mm.Task:
    mesh = mm.TaskMesh(devices=STAGES[name], axis_sizes=(2, 2), axis_names=("data", "model"))
    return mm.Task(mesh=mesh, logical_axes=RULES)


def _data():
    x = jax.random.normal(jax.random.key(1), (8, 8))
    y = jax.random.normal(jax.random.key(2), (8, 8))
    return x, y


def _sgd_step(model, optimizer):
    def step(params, opt_state, x, y):
        def loss(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    return step


def test_unmodified_flax_mlp_is_placed_by_name_and_trained():
    model, optimizer = MLP(), optax.sgd(0.1)
    x, y = _data()
    params = model.init(jax.random.key(0), x)
    step = _sgd_step(model, optimizer)
    jitted = mm.jit(step)
    with mm.Context():
        mm.register_task("layer_[01]", callback=_by_layer)
        state = (params, optimizer.init(params))
        for _ in range(3):
            loss, *state = jitted(*state, x, y)
            jax.block_until_ready(loss)
        traced = jitted.executable(params, optimizer.init(params), x, y).partition.traced
    expected = (params, optimizer.init(params))
    with mm.ignore_transforms():
        for _ in range(3):
            expected_loss, *expected = step(*expected, x, y)
    _assert_close((loss, state[0]), (expected_loss, expected[0]))
    trained = nn.meta.unbox(state[0])["params"]
    kernel_0, kernel_1 = (
        trained["layer_0"]["Dense_0"]["kernel"],
        trained["layer_1"]["Dense_0"]["kernel"],
    )
    assert _ids(kernel_0) == set(STAGES["layer_0"]) and _spec(kernel_0) == P(None, "model")
    assert _ids(kernel_1) == set(STAGES["layer_1"]) and _spec(kernel_1) == P("model", None)
    # Flax's activation constraint ("batch", "mlp") in layer_0 resolved on layer_0's devices.
    constraints = [
        e.params["sharding"] for e in traced.jaxpr.eqns if e.primitive.name == "sharding_constraint"
    ]
    layer_0 = [s for s in constraints if _ids_of(s) == set(STAGES["layer_0"])]
    assert any(s.spec == P("data", "model") for s in layer_0)


def _ids_of(sharding: NamedSharding) -> set[int]:
    return {d.id for d in sharding.device_set}


def test_flax_partitioning_metadata_gives_parallelize_input_shardings():
    model = MLP()
    x, _ = _data()
    with mm.Context():
        mm.register_task("layer_[01]", callback=_by_layer)
        apply, init = mm.parallelize(
            model.apply, init_params=lambda: model.init(jax.random.key(0), x), initial_batch=x
        )
        params = init()
        out = apply(params, x)
    kernels = nn.meta.unbox(params)["params"]
    assert _spec(kernels["layer_0"]["Dense_0"]["kernel"]) == P(None, "model")
    assert _spec(kernels["layer_1"]["Dense_0"]["kernel"]) == P("model", None)
    assert _ids(kernels["layer_1"]["Dense_0"]["kernel"]) == set(STAGES["layer_1"])
    assert _ids(out) == set(STAGES["layer_1"])
    _assert_close(out, model.apply(jax.device_get(params), x))


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="proj")(x)


class TwoEncoders(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Encoder(name="enc_b")(Encoder(name="enc_a")(x))


@pytest.mark.parametrize(
    ("matcher", "tasks", "matmuls"),
    [
        ("enc_b/proj", ["enc_b_proj"], 1),  # a module path (the whole match names the task)
        ("proj", ["proj"], 2),  # a module name, at two paths: one matched name, one task
        ("enc_(a)", ["a"], 1),  # the group names the task
        ("TwoEncoders", ["TwoEncoders"], 2),  # the top-level module, by class name
        ("Encoder", [], 0),  # class names of submodules are not matched
    ],
)
def test_flax_modules_match_by_path_or_name(matcher, tasks, matmuls):
    model, x = TwoEncoders(), jnp.ones((2, 8))
    params = model.init(jax.random.key(0), x)
    apply = mm.jit(model.apply)
    forget_warnings()
    with mm.context(strict=False), mm.Context(), contextlib.ExitStack() as stack:
        mm.register_task(matcher, task=mm.Task(mesh=mm.TaskMesh(devices=[5])))
        if not tasks:  # a matcher that matches nothing is said so
            stack.enter_context(pytest.warns(errors.PlacementWarning, match="matched no name"))
        out = apply(params, x)
        traced = apply.executable(params, x).partition.traced if tasks else None
    if tasks:
        assert sorted(t.name for t in traced.tasks.values()) == tasks
        placed = [
            e
            for e, label in zip(traced.jaxpr.eqns, traced.labels, strict=True)
            if label is not None and e.primitive.name == "dot_general"
        ]
        assert len(placed) == matmuls
        assert _ids(out) == {5}
    else:
        assert _ids(out) == {0}
    _assert_close(out, model.apply(params, x))


def test_flax_module_inside_a_matched_named_scope_uses_its_rules():
    class Constrained(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.with_logical_constraint(x * 2, ("batch", None))

    def fun(x):
        with jax.named_scope("head"):
            return Constrained().apply({}, x)

    task = mm.Task(
        mesh=mm.TaskMesh(devices=[4, 5, 6, 7], axis_names=("y",)), logical_axes=[("batch", "y")]
    )
    with mm.Context():
        mm.register_task("head", task=task)
        out = mm.jit(fun)(jnp.ones((8, 2)))
    assert _spec(out) == P("y", None)
    assert _ids(out) == {4, 5, 6, 7}
