"""B7's SPMD pipeline peer trains like the unpipelined model.

The peer (`benchmarks._spmd_pipeline`: stacked blocks on a ``stage`` axis, ``shard_map`` +
``ppermute``, GPipe order) is compared with plain ``jax.jit`` of ``GPT(config)`` on one
device, from the same initial parameters, over two AdamW steps: the losses and the updated
parameters (mapped back from the stacked layout) agree within float32 tolerance.
"""

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn

from benchmarks import _common
from benchmarks import _spmd_pipeline as spmd
from models import GPT, cross_entropy_loss

RTOL, ATOL = 1e-5, 1e-6  # float32; the pipeline only reorders sums over microbatches
# AdamW divides each gradient by its own magnitude, so a gradient that is zero up to rounding
# (attention key biases, a few weights) moves its weight by up to lr = 1e-3 either way: the
# updated parameters agree to 5% of one step, the gradients themselves to float32 rounding.
PARAM_ATOL = 5e-5


def _reference_loss(model):
    def loss(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        return cross_entropy_loss(logits, batch["targets"])

    return loss


def _reference_step(model, optimizer):
    def train(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(_reference_loss(model))(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, (optax.apply_updates(params, updates), opt_state)

    return jax.jit(train)  # uncommitted inputs: one device, jax.devices()[0]


def test_stack_and_unstack_are_inverse():
    params = {
        "stem": {"w": np.ones(3)},
        **{f"blocks_{i}": {"k": np.full((2, 2), i)} for i in range(4)},
        "head": {"b": np.zeros(1)},
    }
    stacked = spmd.stack_params(params, stages=2)
    assert stacked["blocks"]["k"].shape == (2, 2, 2, 2)
    np.testing.assert_array_equal(stacked["blocks"]["k"][1, 0], params["blocks_2"]["k"])
    back = spmd.unstack_params(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(got, want)


def _assert_trees_close(got, want, atol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=atol)


def _initial_params(workload):
    model = GPT(workload.config())
    params = model.init(jax.random.key(0), workload.batch_data()["inputs"])
    return model, nn.unbox(params)["params"]


@pytest.mark.heavy
@pytest.mark.parametrize("microbatches", [16])
def test_peer_gradients_equal_the_unpipelined_gradients(microbatches):
    # m=16: microbatches of 2 sequences on 2 of a stage's 4 devices, repeated on a replica
    # axis. (m=4, no replica axis, is checked by the step test below: its losses and updated
    # parameters follow from these gradients.)
    workload, stages = _common.TINY, 2
    model, params = _initial_params(workload)
    batch = workload.batch_data()
    mesh = spmd.make_mesh(stages, data=_common.stage_layout(workload, stages, microbatches)[0])
    assert mesh.axis_names == (
        ("stage", "data") if microbatches == 4 else ("stage", "data", "replica")
    )
    peer_loss = spmd.make_loss(workload.config(), mesh, microbatches)
    stacked = spmd.stack_params(params, stages)
    loss, grads = jax.jit(jax.value_and_grad(peer_loss))(stacked, batch)
    want_loss, want_grads = jax.jit(jax.value_and_grad(_reference_loss(model)))(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=RTOL, atol=ATOL)
    _assert_trees_close(spmd.unstack_params(grads), want_grads, ATOL)


@pytest.mark.heavy
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4)])
def test_peer_steps_equal_the_unpipelined_step(stages, microbatches):
    workload = _common.TINY
    runner = spmd.build_peer(workload, stages, microbatches)
    model, params = _initial_params(workload)
    optimizer = workload.make_optimizer()
    state = (params, optimizer.init(params))
    step = _reference_step(model, optimizer)
    batch = jax.device_put(workload.batch_data(), jax.devices()[0])
    for _ in range(2):
        runner.step()
        loss, state = step(state, batch)
        np.testing.assert_allclose(float(runner.loss), float(loss), rtol=RTOL, atol=ATOL)
    _assert_trees_close(spmd.unstack_params(runner.state[0]), state[0], PARAM_ATOL)
