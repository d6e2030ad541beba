"""A pipelined Flax model called eagerly on its placed parameters (issue 17, item 13).

``Task[Module]`` called outside ``jit`` moves its array inputs next to its variables, as a
task function called eagerly moves them onto its submesh; the values are the unplaced
model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm

RULES = (("batch", "x"), ("data", "x"), ("model", "y"))
STAGE = mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("x", "y"))


class MLPBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = mm.with_sharding_constraint(x, P("batch", None))
        h = nn.relu(nn.Dense(32, kernel_init=mm.shard_axes("data", "model"))(x))
        return nn.Dense(x.shape[-1], kernel_init=mm.shard_axes("model", "data"))(h)


class Pipeline(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        for i, devices in enumerate((range(4), range(4, 8))):
            block = mm.task(MLPBlock, mesh=STAGE.place(devices), logical_axes=RULES)
            x = block(name=f"layer_{i}")(x)
        return jnp.mean((x - y) ** 2)


def test_pipelined_model_applied_eagerly_to_placed_parameters():
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jnp.zeros((8, 16))
    step, state, _ = mm.parallelize_step(Pipeline(), optax.adam(1e-3), global_batch=(x, y))
    loss, state = step(state, (x, y))
    placed = state.params
    assert {d.id for d in placed["layer_1"]["Dense_0"]["kernel"].devices()} == {4, 5, 6, 7}

    eager = Pipeline().apply({"params": placed}, x, y)
    with mm.ignore_transforms():
        expected = Pipeline().apply({"params": jax.device_get(placed)}, x, y)
    np.testing.assert_allclose(float(eager), float(expected), rtol=1e-6)
    assert not eager.committed  # stage 1's result handed back released, as a jnp result


def test_eager_call_on_unplaced_parameters_is_unchanged():
    x = jnp.ones((8, 16))
    params = Pipeline().init(jax.random.key(0), x, x)["params"]
    params = jax.device_get(nn.meta.unbox(params))
    eager = Pipeline().apply({"params": params}, x, 0 * x)
    with mm.ignore_transforms():
        expected = Pipeline().apply({"params": params}, x, 0 * x)
    np.testing.assert_allclose(float(eager), float(expected), rtol=1e-6)
