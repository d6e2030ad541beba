"""Small Flax models shared by the layer tests: the seeds' MLP pipeline and friends."""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import layers

RULES = (("batch", "x"), ("data", "x"), ("model", "y"))
STAGE0 = mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("x", "y"))
STAGE1 = STAGE0.place(range(4, 8))


class MLPBlock(nn.Module):
    """Two dense layers with logical names on activations and kernels."""

    hidden: int = 32

    @nn.compact
    def __call__(self, x):
        x = mm.with_sharding_constraint(x, P("batch", None))
        h = nn.Dense(self.hidden, kernel_init=layers.shard_axes("data", "model"))(x)
        h = mm.with_sharding_constraint(nn.relu(h), P("batch", "model"))
        return nn.Dense(x.shape[-1], kernel_init=layers.shard_axes("model", "data"))(h)


class Pipeline(nn.Module):
    """``layer_0`` on devices 0-3 and ``layer_1`` on 4-7 (plain blocks with ``wrap=False``)."""

    wrap: bool = True
    hidden: int = 32

    @nn.compact
    def __call__(self, x, y):
        blocks = [MLPBlock, MLPBlock]
        if self.wrap:
            blocks = [
                layers.task(MLPBlock, mesh=STAGE0, logical_axes=RULES),
                layers.task(MLPBlock, mesh=STAGE1, logical_axes=RULES),
            ]
        for i, block in enumerate(blocks):
            x = block(hidden=self.hidden, name=f"layer_{i}")(x)
        return jnp.mean((x - y) ** 2)


def device_ids(array):
    return sorted(d.id for d in array.devices())
