"""``mm.tabulate`` on the models Flax's tabulate handles (BatchNorm, Dropout, mutable
collections; Linen and NNX), its paths shown whole, and what it says is where parameters
live -- owned and unowned, before and after training steps -- with the steps compared to
the same model on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import multimesh_flax as mm
from tests.thirdparty._idioms import (
    TOL,
    D,
    NnxNormBlock,
    NormNet,
    TiedNet,
    assert_trees_close,
    auto_multi_mesh,
    batch,
    live_placement,
    table_placement,
    tied_step,
)

STEPS = 2
RNGS = {"params": jax.random.key(0), "dropout": jax.random.key(1)}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_tabulate_linen_batchnorm_dropout(train):
    x, y = batch()
    with auto_multi_mesh():
        text = mm.tabulate(NormNet(train, dropout=0.5), RNGS, x, y)
        wide = mm.tabulate(NormNet(train), RNGS, x, y, console_kwargs={"width": 200})
    assert "batch_stats" in text and "Parameter placement" in text
    assert "…" not in text.split("Parameter placement")[1]  # paths wrap, never cut
    for leaf in ("kernel", "bias"):
        assert f"stage_1_residual_block/dense_with_a_rather_long_name/{leaf}" in wide


def test_tabulate_nnx_batchnorm_dropout():
    with auto_multi_mesh():
        block = mm.task(NnxNormBlock, mesh_slice={"stage": 1})(D, rngs=nnx.Rngs(0))
        text = mm.tabulate(block, jnp.ones((8, D)), console_kwargs={"width": 200})
    assert "BatchNorm" in text and "Dropout" in text
    assert "norm/scale" in text and "4-7" in text


def _linen_reference(data):
    x, y = data
    model = NormNet(wrap=False)
    params_key = jax.random.split(jax.random.key(0))[0]
    variables = model.init(params_key, x, y)
    params, stats = variables["params"], variables["batch_stats"]

    def loss_fn(p, s):
        return model.apply({"params": p, "batch_stats": s}, x, y, mutable=["batch_stats"])

    losses = []
    for _ in range(STEPS):
        (loss, updates), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, stats)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        stats = updates["batch_stats"]
        losses.append(float(loss))
    return losses, params, stats


def test_linen_table_is_where_parameters_live_before_and_after_steps():
    data = batch()
    with auto_multi_mesh():
        table = table_placement(mm.layers.get_placement(NormNet(), RNGS, *data))
        step, state, _ = mm.parallelize_step(
            NormNet(), optax.sgd(0.1), global_batch=data, rng=jax.random.key(0)
        )
        assert live_placement(state.params) == table
        losses = []
        for _ in range(STEPS):
            loss, state = step(state, data)
            losses.append(float(loss))
    assert live_placement(state.params) == table
    assert table["stem/kernel"][0] == (0, 1, 2, 3) and table["head/kernel"][0] == (4, 5, 6, 7)
    ref_losses, ref_params, ref_stats = _linen_reference(data)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(state.params, ref_params)
    assert_trees_close(state.model_state["batch_stats"], ref_stats)


def test_nnx_tied_embedding_stays_where_the_table_says():
    ids = jnp.arange(8) % 16
    with auto_multi_mesh():
        model = TiedNet(16, D, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        table = table_placement(mm.layers.get_placement(model, ids))
        assert live_placement(nnx.state(model, nnx.Param).to_pure_dict()) == table  # before
        jitted = mm.jit(tied_step)
        losses = [float(jitted(model, optimizer, ids)) for _ in range(STEPS)]
        eager = model(ids)  # a plain call after the steps: the embedding meets stage 1's output
    params = nnx.state(model, nnx.Param).to_pure_dict()
    assert live_placement(params) == table
    assert table["embed/embedding"][0] == (0, 1, 2, 3)
    reference = TiedNet(16, D, rngs=nnx.Rngs(0), wrap=False)
    ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    with mm.ignore_transforms():
        ref_losses = [float(nnx.jit(tied_step)(reference, ref_optimizer, ids)) for _ in range(2)]
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(params, nnx.state(reference, nnx.Param).to_pure_dict())
    with mm.ignore_transforms():
        np.testing.assert_allclose(np.asarray(eager), np.asarray(reference(ids)), **TOL)
