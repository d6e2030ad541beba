"""``layers.task``: Task[Module] classes, placement, call signatures, parameter trees."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import Mesh

import multimesh_flax as mm
from multimesh_flax import errors, layers
from tests.layers._models import Pipeline, device_ids

TOL = dict(rtol=1e-6, atol=1e-6)


def _mesh_2x2(start=0):
    return Mesh(np.array(jax.devices()[start : start + 4]).reshape(2, 2), ("x", "y"))


def test_class_is_a_named_subclass_with_the_wrapped_fields():
    cls = layers.task(nn.Dense, mesh=_mesh_2x2())
    model = cls(features=16, use_bias=False)
    assert cls.__name__ == "Task[Dense]"
    assert issubclass(cls, nn.Dense)
    assert model.features == 16 and model.use_bias is False


def test_seed_tabulate_example_prints_the_task_table():
    model = layers.task(nn.Dense, mesh=_mesh_2x2())(
        features=16, kernel_init=layers.shard_axes("x", None)
    )
    text = model.tabulate(
        jax.random.key(0), jnp.ones((16, 9)), console_kwargs={"width": 200, "force_terminal": False}
    )
    for expected in (
        "Task[Dense] Summary",
        "float32[16,9]",
        "float32[16,16]",
        "kernel: float32[9,16] P(x, None)",
        "160 (640 B)",
    ):
        assert expected in text


@pytest.mark.parametrize(
    "options",
    [
        dict(mesh=mm.TaskMesh(devices=[4, 5, 6, 7], axis_sizes=(2, 2), axis_names=("x", "y"))),
        dict(mesh=_mesh_2x2(4)),
        dict(devices=np.array(jax.devices()[4:]).reshape(2, 2), device_axes=("x", "y")),
        dict(devices=jax.devices()[4:]),
    ],
    ids=["TaskMesh", "Mesh", "device-array", "device-list"],
)
def test_every_way_to_give_the_mesh_places_the_module(options):
    model = layers.task(nn.Dense, **options)(features=8)
    x = jnp.ones((4, 3))
    params = model.init(jax.random.key(0), x)
    out = mm.jit(lambda p, x: model.apply(p, x))(params, x)
    assert device_ids(out) == [4, 5, 6, 7]
    with mm.ignore_transforms():
        expected = nn.Dense(8).apply(params, x)
    np.testing.assert_allclose(out, expected, **TOL)


def test_logical_axes_without_mesh_axes_raises():
    with pytest.raises(errors.InvalidTaskError, match="logical_axes"):
        layers.task(nn.Dense, logical_axes=[("batch", "x")])
    with pytest.raises(ValueError, match="device_axes"):
        layers.task(nn.Dense, devices=jax.devices()[:2], logical_axes=[("batch", "x")])


@pytest.mark.parametrize("bad", [nn.Dense(3), lambda x: x, "Dense"])
def test_non_module_classes_are_rejected(bad):
    with pytest.raises(errors.TaskTypeError, match="Flax module class"):
        layers.task(bad, mesh=_mesh_2x2())


def test_front_door_task_dispatches_on_modules():
    assert mm.task(nn.Dense, mesh=_mesh_2x2()).__name__ == "Task[Dense]"
    assert callable(mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[0])))


class Net(nn.Module):
    """Several positional and keyword inputs, dropout and batch statistics."""

    @nn.compact
    def __call__(self, x, scale, *, bias=0.0, train: bool):
        x = nn.Dense(8)(x) * scale + bias
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dropout(0.5, deterministic=not train)(x)


def test_any_call_signature_rngs_and_mutable_collections():
    wrapped = layers.task(Net, mesh=mm.TaskMesh(devices=[2, 3], axis_names=("x",)))()
    x = jax.random.normal(jax.random.key(1), (4, 3))
    variables = Net().init(jax.random.key(0), x, 2.0, train=False)

    def run(model, variables, x):
        return model.apply(
            variables,
            x,
            2.0,
            bias=1.0,
            train=True,
            rngs={"dropout": jax.random.key(7)},
            mutable=["batch_stats"],
        )

    out, updates = mm.jit(lambda v, x: run(wrapped, v, x))(variables, x)
    with mm.ignore_transforms():
        ref_out, ref_updates = run(Net(), variables, x)
    assert device_ids(out) == [2, 3]
    np.testing.assert_allclose(out, ref_out, **TOL)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOL), updates, ref_updates
    )


def test_plain_checkpoint_loads_into_the_wrapped_model():
    x, y = jnp.ones((8, 16)), jnp.zeros((8, 16))
    with mm.ignore_transforms():  # the plain blocks' logical constraints need a task
        plain = Pipeline(wrap=False).init(jax.random.key(0), x, y)
    wrapped = Pipeline(wrap=True).init(jax.random.key(0), x, y)
    plain = nn.meta.unbox(plain)
    assert jax.tree_util.tree_structure(plain) == jax.tree_util.tree_structure(
        nn.meta.unbox(wrapped)
    )
    loss = mm.jit(lambda p: Pipeline(wrap=True).apply(p, x, y))(plain)
    with mm.ignore_transforms():
        expected = Pipeline(wrap=False).apply(plain, x, y)
    np.testing.assert_allclose(loss, expected, **TOL)


def test_autonames_follow_the_wrapped_class():
    class TwoDense(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[0]))(4)(x)
            return nn.Dense(2)(x)

    params = TwoDense().init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    assert sorted(params) == ["Dense_0", "Dense_1"]


def test_eager_apply_computes_the_plain_values_without_moving_data():
    model = layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[5]))(features=4)
    x = jnp.arange(6.0).reshape(2, 3)
    params = model.init(jax.random.key(0), x)
    out = model.apply(params, x)
    np.testing.assert_allclose(out, nn.Dense(4).apply(params, x), **TOL)


def test_a_module_called_twice_is_one_task():
    class Shared(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[1]), name="shared")(3)
            return dense(dense(x))

    x = jnp.ones((2, 3))
    params = Shared().init(jax.random.key(0), x)
    step = mm.jit(lambda p, x: Shared().apply(p, x))
    out = step(params, x)
    tasks = step.executable(params, x).partition.traced.tasks
    assert [t.name for t in tasks.values()] == ["shared"]
    assert device_ids(out) == [1]


def test_ignore_transforms_is_the_plain_module():
    model = layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[3]))(features=2)
    x = jnp.ones((2, 3))
    params = model.init(jax.random.key(0), x)
    with mm.ignore_transforms():
        out = jax.jit(lambda p, x: model.apply(p, x))(params, x)
    np.testing.assert_allclose(out, nn.Dense(2).apply(params, x), **TOL)


def test_loop_dependent_mesh_slice_moves_a_flax_task_per_microbatch():
    multi = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))
    dense = layers.task(nn.Dense, loop_dependent_mesh_slice=lambda i: {"stage": i % 2})

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return dense(4, name="d")(x).sum()

    x = jnp.arange(12.0).reshape(4, 3)
    params = Net().init(jax.random.key(0), x)
    run = mm.jit(mm.microbatch(lambda p, x: Net().apply(p, x), 0, 1, argnum=1))
    with multi:
        out = run(params, x)
        tasks = run.executable(params, x).partition.traced.tasks.values()
    places = {tuple(sorted(int(i) for i in t.mesh.device_ids.flat)) for t in tasks}
    assert places == {(0, 1, 2, 3), (4, 5, 6, 7)}
    with mm.ignore_transforms():
        expected = Net().apply(params, x)
    np.testing.assert_allclose(out, expected, **TOL)


class _Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="own")(x)
        return layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[5]))(3, name="inner")(x)


class _Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        outer = layers.task(_Outer, mesh=mm.TaskMesh(devices=[2]))(name="outer")
        return (outer(x) ** 2).mean()


def test_a_parameter_belongs_to_its_innermost_task():
    x = jnp.arange(12.0).reshape(4, 3) / 10
    rows = {r.path: r for r in layers.get_placement(_Nested(), jax.random.key(0), x).params}
    assert rows["outer/inner/kernel"].device_ids == (5,)
    assert rows["outer/own/kernel"].device_ids == (2,)
    step, state, _ = layers.parallelize_step(_Nested(), optax.sgd(0.1), global_batch=x)
    assert device_ids(state.params["outer"]["inner"]["kernel"]) == [5]
    assert device_ids(state.params["outer"]["own"]["kernel"]) == [2]
    start = jax.tree.map(np.asarray, state.params)
    loss, state = step(state, x)
    with mm.ignore_transforms():
        expected = _Nested().apply({"params": start}, x)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5, atol=1e-6)
    assert device_ids(state.params["outer"]["inner"]["kernel"]) == [5]
