"""Tests for ``parallelize`` on one SPMD submesh (``multimesh_flax.core.front._parallelize``).

The function is the seeds' SPMD example: ``f(params, x)`` with a batch ``x`` of shape (16, 8)
constrained ``P("batch", None)``, ``param1`` (8, 16) constrained ``P("model", None)`` and
``param2`` (16, 8) constrained ``P(None, "model")``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors

RTOL, ATOL = 1e-5, 1e-5
MESH = mm.TaskMesh(devices=range(8), axis_names=("x",))
RULES = (("batch", "x"), ("model", "x"))


def f(params, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    param1 = mm.with_sharding_constraint(params["param1"], P("model", None))
    param2 = mm.with_sharding_constraint(params["param2"], P(None, "model"))
    return jnp.tanh(x @ param1) @ param2


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "param1": jax.random.normal(k1, (8, 16)) / 4,
        "param2": jax.random.normal(k2, (16, 8)) / 4,
    }


def get_input_batch():
    return jax.random.normal(jax.random.key(1), (16, 8))


def _reference():
    with mm.ignore_transforms():
        return np.asarray(f(init_params(), get_input_batch()))


def _spec(array):
    """The array's spec padded to its rank (``P('x')`` reads as ``('x', None)``)."""
    spec = tuple(array.sharding.spec)
    return spec + (None,) * (array.ndim - len(spec))


def _device_ids(array):
    return {d.id for d in array.sharding.device_set}


# --- no task: everything replicated ---------------------------------------------------------


def test_no_task_replicates_inputs_and_params():
    sharded_fun, sharded_init, sharded_batch = mm.parallelize(
        f, init_params=init_params, get_input_batch=get_input_batch
    )
    params, x = sharded_init(), sharded_batch()
    for leaf in [*jax.tree.leaves(params), x]:
        assert _device_ids(leaf) == set(range(8))
        assert leaf.sharding.is_fully_replicated
    y = sharded_fun(params, x)
    np.testing.assert_allclose(np.asarray(y), _reference(), rtol=RTOL, atol=ATOL)
    assert sharded_fun.describe(params, x).startswith("fast path")


def test_no_task_sharded_fun_runs_without_extra_context():
    # Regression (fixed in 2be0ad2): the task-free fast path was traced without `autoshard`,
    # so a constraint over logical names failed unless the caller entered `mm.autoshard()`.
    sharded_fun, sharded_init, sharded_batch = mm.parallelize(
        f, init_params=init_params, get_input_batch=get_input_batch
    )
    y = sharded_fun(sharded_init(), sharded_batch())
    np.testing.assert_allclose(np.asarray(y), _reference(), rtol=RTOL, atol=ATOL)


def test_no_task_fast_path_keeps_logical_names_away_from_a_set_mesh():
    # The task-free fast path traces under `autoshard`, where a constraint outside every task
    # leaves the value as it is. Traced without it, a mesh set with `jax.set_mesh` sends the
    # logical names to `jax.lax.with_sharding_constraint`, which rejects them ('batch' is not
    # an axis of this mesh).
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):  # traced in here: `parallelize` traces when it is called
        sharded_fun, sharded_init, sharded_batch = mm.parallelize(
            f, init_params=init_params, get_input_batch=get_input_batch
        )
        y = sharded_fun(sharded_init(), sharded_batch())
        y_jit = mm.jit(f)(init_params(), get_input_batch())
    np.testing.assert_allclose(np.asarray(y), _reference(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(y_jit), _reference(), rtol=RTOL, atol=ATOL)


# --- one task on a 1-D mesh of 8 devices ----------------------------------------------------


def _task_f():
    return mm.task(f, mesh=MESH, logical_axes=RULES)


def test_task_derives_input_and_param_shardings():
    sharded_fun, sharded_init, sharded_batch = mm.parallelize(
        _task_f(), init_params=init_params, get_input_batch=get_input_batch
    )
    params, x = sharded_init(), sharded_batch()
    assert _spec(x) == ("x", None)
    assert _spec(params["param1"]) == ("x", None)
    assert _spec(params["param2"]) == (None, "x")
    for leaf in [*jax.tree.leaves(params), x]:
        assert isinstance(leaf.sharding, NamedSharding)
        assert _device_ids(leaf) == set(range(8))
    y = sharded_fun(params, x)
    np.testing.assert_allclose(np.asarray(y), _reference(), rtol=RTOL, atol=ATOL)
    again = sharded_fun(params, x)
    np.testing.assert_allclose(np.asarray(again), np.asarray(y), rtol=0, atol=0)


def test_task_matches_plain_jax_jit_reference():
    sharded_fun, sharded_init, sharded_batch = mm.parallelize(
        _task_f(), init_params=init_params, get_input_batch=get_input_batch
    )
    with mm.ignore_transforms():
        reference = jax.jit(lambda *a: f(*a))(init_params(), get_input_batch())
    y = sharded_fun(sharded_init(), sharded_batch())
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference), rtol=RTOL, atol=ATOL)


def test_sharded_initializers_create_arrays_in_their_sharding():
    traced = []

    def init():
        params = init_params()
        traced.append(isinstance(params["param1"], jax.core.Tracer))
        return params

    _, sharded_init, sharded_batch = mm.parallelize(
        _task_f(), init_params=init, get_input_batch=get_input_batch
    )
    params = sharded_init()
    # The initializer only ever ran under a trace (traced once, then compiled with
    # out_shardings), never eagerly.
    assert traced and all(traced)
    shards = {
        "param1": (1, 16),
        "param2": (16, 1),
    }
    for name, shard_shape in shards.items():
        leaf = params[name]
        assert len(leaf.addressable_shards) == 8
        assert {s.data.shape for s in leaf.addressable_shards} == {shard_shape}
        np.testing.assert_allclose(
            np.asarray(leaf), np.asarray(init_params()[name]), rtol=0, atol=0
        )
    x = sharded_batch()
    assert {s.data.shape for s in x.addressable_shards} == {(2, 8)}
    np.testing.assert_allclose(np.asarray(x), np.asarray(get_input_batch()), rtol=0, atol=0)


def test_initial_batch_returns_two_functions():
    result = mm.parallelize(_task_f(), init_params=init_params, initial_batch=get_input_batch())
    assert len(result) == 2
    sharded_fun, sharded_init = result
    params = sharded_init()
    assert _spec(params["param1"]) == ("x", None)
    assert _spec(params["param2"]) == (None, "x")
    y = sharded_fun(params, get_input_batch())
    np.testing.assert_allclose(np.asarray(y), _reference(), rtol=RTOL, atol=ATOL)


def test_get_input_batch_returns_three_functions():
    result = mm.parallelize(_task_f(), init_params=init_params, get_input_batch=get_input_batch)
    assert len(result) == 3
    sharded_fun, sharded_init, sharded_batch = result
    params, x = sharded_init(), sharded_batch()
    np.testing.assert_allclose(np.asarray(x), np.asarray(get_input_batch()), rtol=0, atol=0)
    for name, leaf in init_params().items():
        np.testing.assert_allclose(np.asarray(params[name]), np.asarray(leaf), rtol=0, atol=0)
    y = sharded_fun(params, x)
    np.testing.assert_allclose(np.asarray(y), _reference(), rtol=RTOL, atol=ATOL)


def test_batch_only_function():
    g = mm.task(
        lambda x: mm.with_sharding_constraint(x, P("batch", None)) * 2,
        mesh=MESH,
        logical_axes=RULES,
    )
    sharded_fun, sharded_init, sharded_batch = mm.parallelize(g, get_input_batch=get_input_batch)
    assert sharded_init is None
    x = sharded_batch()
    assert _spec(x) == ("x", None)
    y = sharded_fun(x)
    np.testing.assert_allclose(
        np.asarray(y), 2 * np.asarray(get_input_batch()), rtol=RTOL, atol=ATOL
    )


def test_parallelize_over_given_devices():
    devices = jax.devices()[4:]
    g = mm.task(f, mesh=mm.TaskMesh(devices=range(4), axis_names=("x",)), logical_axes=RULES)
    sharded_fun, sharded_init, sharded_batch = mm.parallelize(
        g, init_params=init_params, get_input_batch=get_input_batch, devices=devices
    )
    params, x = sharded_init(), sharded_batch()
    assert _spec(x) == ("x", None)
    for leaf in [*jax.tree.leaves(params), x]:
        assert _device_ids(leaf) == {4, 5, 6, 7}
    y = sharded_fun(params, x)
    np.testing.assert_allclose(np.asarray(y), _reference(), rtol=RTOL, atol=ATOL)


# --- argument errors ------------------------------------------------------------------------


def test_both_batch_arguments():
    with pytest.raises(errors.ParallelizeArgumentError, match=re.escape("`initial_batch`")):
        mm.parallelize(
            f,
            init_params=init_params,
            get_input_batch=get_input_batch,
            initial_batch=get_input_batch(),
        )


@pytest.mark.parametrize("argument", ["init_params", "get_input_batch"])
def test_initializer_that_is_not_callable(argument):
    value = jnp.ones(3)
    kwargs = {"init_params": init_params, "get_input_batch": get_input_batch, argument: value}
    with pytest.raises(errors.ParallelizeArgumentError, match=re.escape(f"`{argument}`")) as info:
        mm.parallelize(f, **kwargs)
    assert repr(value) in str(info.value)


# --- jit with no tasks is jax.jit -----------------------------------------------------------


def _plain(x):
    return jnp.sin(x) @ x.T


def test_jit_without_tasks_is_the_fast_path():
    x = get_input_batch()
    jitted = mm.jit(_plain)
    assert jitted.describe(x).startswith("fast path")
    y = jitted(x)
    reference = jax.jit(lambda a: _plain(a))(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference), rtol=RTOL, atol=ATOL)


def test_jit_of_the_logical_function_without_tasks_is_the_fast_path():
    params, x = init_params(), get_input_batch()
    assert mm.jit(f).describe(params, x).startswith("fast path")


def test_jit_without_fast_path_still_matches():
    x = get_input_batch()
    with mm.enable_fast_path(False):
        jitted = mm.jit(_plain)
        assert not jitted.describe(x).startswith("fast path")
        y = jitted(x)
    reference = jax.jit(lambda a: _plain(a))(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference), rtol=RTOL, atol=ATOL)
