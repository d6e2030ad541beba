"""JAX's own transformations applied outside ``mm.jit`` to a model whose NNX tasks were
born on two submeshes: they run the model unplaced, as the ``PlacementWarning`` says, and
compute what the plain model computes -- never a device error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import multimesh_flax as mm
from multimesh_flax.core.declare import forget_warnings
from multimesh_flax.errors import PlacementWarning
from tests.thirdparty._idioms import TOL, D, TiedNet, assert_trees_close, auto_multi_mesh

IDS = jnp.arange(8) % 16


def _loss(graphdef, state, ids):
    return jnp.mean(nnx.merge(graphdef, state)(ids) ** 2)


def _value_and_grad(graphdef, state):
    loss, grads = jax.value_and_grad(lambda s: _loss(graphdef, s, IDS))(state)
    return loss, nnx.to_pure_dict(grads)


def _checkpointed(graphdef, state):
    return jax.checkpoint(lambda s: _loss(graphdef, s, IDS))(state)


def _vmapped(graphdef, state):
    return jax.vmap(lambda i: _loss(graphdef, state, i[None]))(IDS)


TRANSFORMS = (_value_and_grad, _checkpointed, _vmapped)


def test_jax_transforms_outside_mm_jit_run_unplaced():
    """One model, three transforms (one test: eager op-by-op runs compile each operation
    once, and the transforms share them)."""
    forget_warnings()  # once per cause: another test may have warned for this task name
    with auto_multi_mesh(), mm.context(strict=False):
        model = TiedNet(16, D, rngs=nnx.Rngs(0))
        with pytest.warns(PlacementWarning, match="not placed on its submesh"):
            got = [transform(*nnx.split(model)) for transform in TRANSFORMS]
    plain = TiedNet(16, D, rngs=nnx.Rngs(0), wrap=False)
    for result, transform in zip(got, TRANSFORMS, strict=True):
        expected = transform(*nnx.split(plain))
        assert_trees_close(jax.tree.map(np.asarray, result), expected, TOL)
