"""The seeds' MPMD example: two layers on two submeshes, placed by ``parallelize``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm

RULES = (("batch", "x"), ("model", "x"))
STAGE0 = mm.TaskMesh(devices=[0, 1, 2, 3], axis_sizes=(4, 1), axis_names=("x", "y"))


def _layer1(w, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    return jnp.tanh(x @ mm.with_sharding_constraint(w, P("model", None)))


def _layer2(w, h):
    h = mm.with_sharding_constraint(h, P("batch", None))
    return h @ mm.with_sharding_constraint(w, P(None, "model"))


layer1 = mm.task(_layer1, mesh=STAGE0, logical_axes=RULES)
layer2 = mm.task(_layer2, mesh=STAGE0.place((4, 5, 6, 7)), logical_axes=RULES)


def fun(params, x):
    return layer2(params[1], layer1(params[0], x))


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (16, 32)), jax.random.normal(k2, (32, 8))


def get_input_batch():
    return jax.random.normal(jax.random.key(1), (8, 16))


def _ids(array):
    return sorted(d.id for d in array.devices())


@pytest.fixture(scope="module")
def parallel():
    return mm.parallelize(fun, init_params=init_params, get_input_batch=get_input_batch)


def test_parameters_and_input_are_placed_on_their_submeshes(parallel):
    _, sharded_init, sharded_batch = parallel
    w1, w2 = sharded_init()
    x = sharded_batch()
    assert _ids(w1) == [0, 1, 2, 3] and w1.sharding.spec == P("x")
    assert _ids(w2) == [4, 5, 6, 7] and w2.sharding.spec == P(None, "x")
    assert _ids(x) == [0, 1, 2, 3] and x.sharding.spec == P("x")
    assert w1.addressable_shards[0].data.shape == (4, 32), "rows split over devices 0-3"
    assert w2.addressable_shards[0].data.shape == (32, 2), "columns split over devices 4-7"


def test_values_match_unparallelized_and_output_stays_on_stage_1(parallel):
    sharded_fun, sharded_init, sharded_batch = parallel
    out = sharded_fun(sharded_init(), sharded_batch())
    with mm.ignore_transforms():
        expected = fun(init_params(), get_input_batch())
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert _ids(out) == [4, 5, 6, 7]


def test_input_sharded_over_all_devices_is_resharded(parallel):
    sharded_fun, sharded_init, _ = parallel
    everywhere = jax.make_mesh((8,), ("all",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(get_input_batch(), NamedSharding(everywhere, P("all")))
    out = sharded_fun(sharded_init(), x)
    with mm.ignore_transforms():
        expected = fun(init_params(), get_input_batch())
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
