"""Placing classes inside modules we do not own: ``register_task(module_class=...)`` places
every instance of a class wherever the model creates it (no namespace patching), pipelined
against one device; and a pattern that matches nothing names the nearest full NNX paths."""

import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import multimesh_flax as mm
from multimesh_flax.errors import PlacementWarning
from tests.thirdparty._idioms import (
    TOL,
    D,
    PlainBlock,
    PlainNet,
    assert_trees_close,
    auto_multi_mesh,
    batch,
    live_placement,
    nnx_loss,
    nnx_params,
    table_placement,
)


def _step(model, optimizer, data):
    loss, grads = nnx.value_and_grad(nnx_loss)(model, data)
    optimizer.update(model, grads)
    return loss


def _stage_of(path, backprop):
    return mm.Task(mesh_slice={"stage": int(path.rsplit("/", 1)[-1]) // 2})


def test_register_by_class_places_every_instance_and_matches_one_device():
    data = batch()
    multi = auto_multi_mesh()
    multi.register_task(module_class=PlainBlock, callback=_stage_of)
    with multi:
        model = PlainNet(D, 4, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        table = table_placement(mm.layers.get_placement(model, data[0]))
        assert live_placement(nnx_params(model)) == table  # placed when tabulated
        step = mm.jit(_step)
        with warnings.catch_warnings(record=True) as caught:  # the suite ignores Flax's
            warnings.simplefilter("always", DeprecationWarning)
            losses = [float(step(model, optimizer, data)) for _ in range(2)]
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert live_placement(nnx_params(model)) == table  # and kept there by the steps
    layers = model.transformer_blocks["layers"]
    for i, devices in enumerate(([0, 1, 2, 3],) * 2 + ([4, 5, 6, 7],) * 2):
        assert sorted(d.id for d in layers[i].proj.kernel.get_value().devices()) == devices
    reference = PlainNet(D, 4, rngs=nnx.Rngs(0))
    ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    ref_losses = [float(nnx.jit(_step)(reference, ref_optimizer, data)) for _ in range(2)]
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(nnx_params(model), nnx_params(reference))


def test_unmatched_pattern_lists_the_nearest_full_nnx_paths():
    multi = auto_multi_mesh()
    multi.register_task(r"transformer_block_(\d+)", task=mm.Task(mesh_slice={"stage": 1}))
    with multi, mm.context(strict=False):
        model = PlainNet(D, 2, rngs=nnx.Rngs(0))
        with pytest.warns(PlacementWarning, match="matched no name") as caught:
            mm.jit(lambda m, x: m(x)).executable(model, jax.numpy.ones((8, D)))
    message = str(caught[0].message)
    nearest = message.split("nearest first")[1]
    assert nearest.index("transformer_blocks/layers/0") < nearest.index("proj")
