"""Models and profiles the planner tests share."""

import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn

import multimesh_flax as mm
from models import GPT, get_config
from models.pipeline import LOGICAL_RULES

ROWS, LENGTH = 4, 32


class MLP(nn.Module):
    """Four identical dense layers: a model with equal stages and no stem or head."""

    layers: int = 4

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = nn.Dense(x.shape[-1], name=f"layer_{i}")(x)
        return x


def tokens(rows=ROWS):
    return jnp.zeros((rows, LENGTH), jnp.int32)


@pytest.fixture(scope="session")
def gpt_profile():
    """gpt-tiny with 4 blocks on a (data 2, model 2) submesh, AdamW, no/full recompute."""
    return mm.profile_units(
        GPT(get_config("gpt-tiny", num_layers=4)),
        tokens(),
        mesh_shape={"data": 2, "model": 2},
        rules=LOGICAL_RULES,
        optimizer=optax.adamw(1e-3),
        recompute=(None, "full"),
    )


@pytest.fixture(scope="session")
def mlp_profile():
    return mm.profile_units(MLP(), jnp.ones((8, 16)), patterns=[r"layer_\d+"])
