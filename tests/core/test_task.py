"""Tests for tasks (``multimesh_flax.core.declare._task``): validation, placement, eager calls."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors

RTOL, ATOL = 1e-5, 1e-6


def _ids(array):
    return {d.id for d in array.devices()}


def _computed_on(array, device_ids):
    """Whether an eager task result came from the submesh ``device_ids``: handed back
    released (uncommitted) on its first device."""
    return not array.committed and _ids(array) == {min(device_ids)}


def _body(a, b, *, scale):
    return jnp.sin(a) * b * scale


def _inputs():
    a = jnp.linspace(-1.0, 1.0, 8)
    b = jnp.arange(8.0)
    return a, b


def _reference(a, b, scale):
    return np.sin(np.asarray(a, np.float64)) * np.asarray(b, np.float64) * scale


# --- Task validation ------------------------------------------------------------------------


def test_task_defaults():
    t = mm.Task()
    assert t.name is None and t.mesh is None and t.logical_axes is None
    assert t.mesh_slice is None and t.extra_axes is None and t.split_backprop is None


def test_task_normalises_rules_and_slice():
    t = mm.Task(
        logical_axes=[["batch", "x"], ("model", ("x", "y"))],
        extra_axes=[("embed", None)],
        mesh_slice={"stage": 1},
    )
    assert t.logical_axes == (("batch", "x"), ("model", ("x", "y")))
    assert t.extra_axes == (("embed", None),)
    assert t.mesh_slice == {"stage": 1}


def test_task_with_mesh_and_mesh_slice():
    with pytest.raises(errors.InvalidTaskError, match=re.escape("{'stage': 1}")):
        mm.Task(mesh=mm.TaskMesh(devices=[0]), mesh_slice={"stage": 1})


@pytest.mark.parametrize("mesh", ["devices", [0, 1], np.arange(2)])
def test_task_with_wrong_mesh_type(mesh):
    fragment = f"{type(mesh).__name__}: {mesh!r}"
    with pytest.raises(errors.TaskTypeError, match=re.escape(fragment)) as info:
        mm.Task(mesh=mesh)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("rules", "fragment"),
    [
        ([("batch",)], "[('batch',)]"),
        ("ab", "'ab'"),
        ([(1, "x")], "[(1, 'x')]"),
        ([("batch", 3)], "[('batch', 3)]"),
        (5, "got 5"),
    ],
)
def test_task_with_malformed_logical_axes(rules, fragment):
    with pytest.raises(errors.LogicalRulesError, match=re.escape(fragment)):
        mm.Task(logical_axes=rules)


def test_task_with_malformed_extra_axes():
    with pytest.raises(errors.LogicalRulesError, match=re.escape("`extra_axes`")):
        mm.Task(extra_axes=[("a", "x", "y")])


def test_task_with_malformed_split_backprop():
    with pytest.raises(errors.InvalidTaskError, match=re.escape("('dx',)")):
        mm.Task(split_backprop=("dx",))


def test_task_function_with_unknown_option():
    with pytest.raises(errors.InvalidTaskError, match=re.escape("'stages'")):
        mm.task(lambda x: x, stages=2)


def test_task_function_with_task_and_options():
    with pytest.raises(errors.InvalidTaskError, match=re.escape("['logical_axes']")):
        mm.task(lambda x: x, task=mm.Task(), logical_axes=(("a", "b"),))


def test_task_function_with_a_task_of_wrong_type():
    with pytest.raises(errors.TaskTypeError, match=re.escape("{'mesh': None}")):
        mm.task(lambda x: x, task={"mesh": None})


def test_task_function_with_mesh_and_devices():
    with pytest.raises(errors.InvalidTaskError, match=re.escape("`devices`")):
        mm.task(lambda x: x, mesh=mm.TaskMesh(devices=[0]), devices=jax.devices()[:1])


def test_task_function_with_devices_and_wrong_device_axes():
    with pytest.raises(errors.MeshShapeError, match=re.escape("('a', 'b')")):
        mm.task(lambda x: x, devices=jax.devices()[:2], device_axes=("a", "b"))


def test_mesh_slice_without_multi_mesh():
    fun = mm.task(lambda x: x, mesh_slice={"stage": 1})
    with pytest.raises(errors.NoMultiMeshError, match=re.escape("{'stage': 1}")):
        fun(jnp.zeros(2))


@pytest.mark.parametrize(
    ("mesh_slice", "error", "fragment"),
    [
        ({"stag": 1}, errors.UnknownMeshAxisError, "'stag'"),
        ({"stage": 2}, errors.MeshIndexError, "stage=2"),
    ],
)
def test_bad_mesh_slice(mesh_slice, error, fragment):
    fun = mm.task(lambda x: x, mesh_slice=mesh_slice)
    with (
        mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data")),
        pytest.raises(error, match=re.escape(fragment)),
    ):
        fun(jnp.zeros(2))


# --- where a task runs ----------------------------------------------------------------------


def _placements():
    devices = jax.devices()
    return {
        "task_mesh": (dict(mesh=mm.TaskMesh(devices=[2, 3])), {2, 3}),
        "jax_mesh": (
            dict(mesh=Mesh(np.array(devices[4:6]), ("m",), axis_types=(AxisType.Explicit,))),
            {4, 5},
        ),
        "devices": (dict(devices=np.array(devices[4:8]).reshape(2, 2)), {4, 5, 6, 7}),
        "devices_and_axes": (
            dict(devices=np.array(devices[4:8]).reshape(2, 2), device_axes=("p", "q")),
            {4, 5, 6, 7},
        ),
        "task": (dict(task=mm.Task(mesh=mm.TaskMesh(devices=[7]))), {7}),
    }


@pytest.mark.parametrize("kind", sorted(_placements()))
def test_eager_call_runs_on_the_task_submesh(kind):
    kwargs, expected = _placements()[kind]
    fun = mm.task(_body, **kwargs)
    a, b = _inputs()
    y = fun(a, b, scale=3.0)
    assert _computed_on(y, expected)
    np.testing.assert_allclose(np.asarray(y), _reference(a, b, 3.0), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("index", "expected"), [(0, {0, 1, 2, 3}), (1, {4, 5, 6, 7})])
def test_eager_call_with_mesh_slice(index, expected):
    fun = mm.task(_body, mesh_slice={"stage": index})
    a, b = _inputs()
    with mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data")):
        y = fun(a, b, scale=0.5)
    assert _computed_on(y, expected)
    np.testing.assert_allclose(np.asarray(y), _reference(a, b, 0.5), rtol=RTOL, atol=ATOL)


def test_mesh_slice_task_uses_the_multi_mesh_axes_as_rules():
    fun = mm.task(lambda x: mm.with_sharding_constraint(x, P("data")), mesh_slice={"stage": 1})
    with mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data")):
        y = mm.jit(fun)(jnp.arange(8.0))  # eagerly it runs unconstrained (test_task_kinds)
    assert tuple(y.sharding.spec) == ("data",)
    assert _ids(y) == {4, 5, 6, 7}
    assert all(s.data.shape == (2,) for s in y.addressable_shards)


def test_task_without_mesh_uses_the_whole_multi_mesh():
    fun = mm.task(lambda x: x * 2)
    with mm.MultiMesh(axis_sizes=(2, 2), axis_names=("a", "b")):
        y = fun(jnp.ones(4))
    assert _computed_on(y, {0, 1, 2, 3})


def test_devices_without_device_axes_replicate_constraints():
    fun = mm.task(
        lambda x: mm.with_sharding_constraint(x, P("devices")), devices=jax.devices()[4:8]
    )
    y = fun(jnp.arange(8.0))
    assert _computed_on(y, {4, 5, 6, 7})
    np.testing.assert_array_equal(np.asarray(y), np.arange(8.0))


def test_name_and_task_attribute():
    spec = mm.Task(mesh=mm.TaskMesh(devices=[1]))
    fun = mm.task(_body, "renamed", task=spec)
    assert fun.task.name == "renamed"
    assert fun.task.mesh == spec.mesh
    assert fun.__name__ == "_body"


def test_kwargs_and_several_positional_args():
    def body(a, b, c, *, shift, scale=1.0):
        return (a @ b + c) * scale + shift

    fun = mm.task(body, mesh=mm.TaskMesh(devices=[5]))
    a = jax.random.normal(jax.random.key(0), (3, 4))
    b = jax.random.normal(jax.random.key(1), (4, 2))
    c = jnp.arange(2.0)
    y = fun(a, b, c, shift=jnp.float32(1.5), scale=2.0)
    with mm.ignore_transforms():
        reference = fun(a, b, c, shift=jnp.float32(1.5), scale=2.0)
    assert _ids(y) == {5}
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference), rtol=RTOL, atol=ATOL)


def test_pytree_arguments_and_outputs():
    fun = mm.task(
        lambda t: {"s": t["a"] + t["b"][0], "p": t["b"][1] * 2}, devices=[jax.devices()[6]]
    )
    tree = {"a": jnp.ones(3), "b": (jnp.arange(3.0), jnp.full((2,), 4.0))}
    out = fun(tree)
    assert _ids(out["s"]) == _ids(out["p"]) == {6}
    np.testing.assert_allclose(np.asarray(out["s"]), [1.0, 2.0, 3.0], rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(out["p"]), [8.0, 8.0], rtol=0, atol=0)


def test_nested_tasks():
    inner = mm.task(lambda x: jnp.cos(x) * 2, mesh=mm.TaskMesh(devices=[1]), name="inner")
    outer = mm.task(lambda x: inner(x) + 1, mesh=mm.TaskMesh(devices=[0]), name="outer")
    x = jnp.linspace(0.0, 1.0, 8)
    reference = np.cos(np.asarray(x, np.float64)) * 2 + 1
    eager = outer(x)
    jitted = mm.jit(lambda v: outer(v) * 3)(x)
    assert _ids(eager) == {0}
    np.testing.assert_allclose(np.asarray(eager), reference, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(jitted), 3 * reference, rtol=RTOL, atol=ATOL)


def test_tasks_in_sequence_leave_the_result_on_the_last_submesh():
    first = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[0, 1]), name="first")
    second = mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[6]), name="second")
    y = mm.jit(lambda x: second(first(x)))(jnp.arange(4.0))
    assert _ids(y) == {6}
    np.testing.assert_allclose(np.asarray(y), [1.0, 3.0, 5.0, 7.0], rtol=0, atol=0)


# --- recomputation --------------------------------------------------------------------------


def _two_task_loss():
    layer = mm.task(lambda w, x: jnp.tanh(x @ w), mesh=mm.TaskMesh(devices=[0, 1]), name="layer")
    head = mm.task(lambda h: jnp.sum(h**2), mesh=mm.TaskMesh(devices=[2, 3]), name="head")
    return lambda w, x: head(layer(w, x))


def _loss_inputs():
    w = 0.3 * jax.random.normal(jax.random.key(0), (4, 4))
    x = jax.random.normal(jax.random.key(1), (2, 4))
    return w, x


@pytest.mark.parametrize("recompute", [False, True])
def test_recomputation_gives_equal_values_and_gradients(recompute):
    loss = _two_task_loss()
    w, x = _loss_inputs()
    with mm.ignore_transforms():
        ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    with mm.enable_recomputation(recompute):
        value, grad = mm.jit(jax.value_and_grad(loss))(w, x)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=RTOL, atol=ATOL)
    assert _ids(grad) == {0, 1}


@pytest.mark.filterwarnings("ignore::multimesh_flax.errors.PlacementWarning")  # make_jaxpr
def test_recomputation_wraps_the_task_in_checkpoint():
    loss = _two_task_loss()
    w, x = _loss_inputs()
    with mm.autoshard(), mm.context(strict=False):  # jax.make_jaxpr: a foreign trace
        plain = str(jax.make_jaxpr(jax.grad(loss))(w, x))
        with mm.enable_recomputation():
            recomputed = str(jax.make_jaxpr(jax.grad(loss))(w, x))
    assert "remat" not in plain and "checkpoint" not in plain
    assert "remat" in recomputed or "checkpoint" in recomputed
