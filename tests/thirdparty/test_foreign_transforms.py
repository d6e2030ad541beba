"""JAX's own transformations applied outside ``mm.jit`` to a model whose tasks live on two
submeshes (NNX tasks born there; a Linen ``parallelize_step`` state): they run the model
unplaced, as the ``PlacementWarning`` says, and compute what the plain model computes on one
device -- never a device error. Also with the state placed (a tied embedding moved next to
its first use by ``mm.tabulate``), under ``jax.checkpoint`` (which stages the model, then
evaluates it op by op), and called plainly (no transformation)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import multimesh_flax as mm
from multimesh_flax.core.declare import forget_warnings
from multimesh_flax.errors import PlacementWarning
from tests.thirdparty._idioms import (
    TOL,
    D,
    NormNet,
    TiedNet,
    assert_trees_close,
    auto_multi_mesh,
    batch,
)

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


def _grad_of_checkpointed(graphdef, state):
    return nnx.to_pure_dict(jax.grad(jax.checkpoint(lambda s: _loss(graphdef, s, IDS)))(state))


def _eager(graphdef, state):
    return _loss(graphdef, state, IDS)


TRANSFORMS = (_value_and_grad, _checkpointed, _vmapped, _grad_of_checkpointed, _eager)


def test_jax_transforms_outside_mm_jit_run_unplaced():
    """One model, four transforms (one test: eager op-by-op runs compile each operation
    once, and the transforms share them)."""
    forget_warnings()  # once per cause: another test may have warned for this task name
    with auto_multi_mesh(), mm.context(strict=False):
        model = TiedNet(16, D, rngs=nnx.Rngs(0))
        with pytest.warns(PlacementWarning, match="not placed on its submesh"):
            got = [transform(*nnx.split(model)) for transform in TRANSFORMS]
        # Placed (the table moves the tied embedding to devices 0-3): a task hands its
        # results back released (uncommitted), which JAX moves next to the embedding.
        mm.layers.get_placement(model, IDS)
        placed = [transform(*nnx.split(model)) for transform in TRANSFORMS]
    plain = TiedNet(16, D, rngs=nnx.Rngs(0), wrap=False)
    for result, transform in zip(got, TRANSFORMS, strict=True):
        expected = transform(*nnx.split(plain))
        assert_trees_close(jax.tree.map(np.asarray, result), expected, TOL)
    assert {d.id for d in model.embed.embedding.get_value().devices()} == {0, 1, 2, 3}
    assert {d.id for d in model.blocks[1].kernel.get_value().devices()} == {4, 5, 6, 7}
    for result, transform in zip(placed, TRANSFORMS, strict=True):
        expected = transform(*nnx.split(plain))
        assert_trees_close(jax.tree.map(np.asarray, result), expected, TOL)


def _linen_value_and_grad(model, variables, data, checkpoint=False):
    """A reference gradient as a user computes it next to training: eager, in train mode
    (BatchNorm's ``batch_stats`` updated as an auxiliary output); ``checkpoint``: of the
    ``jax.checkpoint``-ed loss."""
    x, y = data

    def loss(params):
        return model.apply({**variables, "params": params}, x, y, mutable=["batch_stats"])

    loss = jax.checkpoint(loss) if checkpoint else loss
    return jax.value_and_grad(loss, has_aux=True)(variables["params"])


def test_linen_eager_value_and_grad_of_a_placed_state():
    """A ``parallelize_step`` state spread over two submeshes (stem and stage 0 on devices
    0-3, stage 1 and head on 4-7) under an eager ``jax.value_and_grad`` (of the loss and of
    its ``jax.checkpoint``) and ``jax.vmap``."""
    data, model = batch(), NormNet()
    forget_warnings()
    with auto_multi_mesh(), mm.context(strict=False):
        _, state, _ = mm.parallelize_step(
            model, optax.sgd(0.1), global_batch=data, rng=jax.random.key(0)
        )
        variables = {"params": state.params, **state.model_state}
        with pytest.warns(PlacementWarning, match="gradients moved back"):
            got = _linen_value_and_grad(model, variables, data)
        checkpointed = _linen_value_and_grad(model, variables, data, checkpoint=True)
        per_row = _linen_vmapped(variables, data)
    assert {d.id for d in state.params["head"]["kernel"].devices()} == {4, 5, 6, 7}
    one_device = jax.tree.map(lambda a: jax.device_put(np.asarray(a), jax.devices()[0]), variables)
    with mm.ignore_transforms():
        expected = jax.jit(_linen_value_and_grad, static_argnums=0)(model, one_device, data)
        expected_per_row = jax.jit(_linen_vmapped)(one_device, data)
    assert_trees_close(jax.tree.map(np.asarray, got), expected, TOL)
    assert_trees_close(jax.tree.map(np.asarray, checkpointed), expected, TOL)
    assert_trees_close(np.asarray(per_row), expected_per_row, TOL)


def _linen_vmapped(variables, data):
    """Per-example losses of the model in eval mode, by ``jax.vmap`` over the batch."""
    model = NormNet(train=False)
    return jax.vmap(lambda x, y: model.apply(variables, x[None], y[None]))(*data)
