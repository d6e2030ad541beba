"""Dropout through ``parallelize_step``: every step and every microbatch draws its own mask.

The derivation (``parallelize_step``'s ``rng`` argument): ``_, dropout_key = split(rng)``;
step ``i`` uses ``step_key = fold_in(dropout_key, i)``; microbatch ``k`` of step ``i`` uses
``fold_in(step_key, k)``. The reference below writes it out again in plain Flax + optax with a
Python loop over microbatches on one device.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import multimesh_flax as mm
from multimesh_flax import layers

TOL = dict(rtol=2e-5, atol=2e-6)
STEPS = 3


class DropBlock(nn.Module):
    rate: float = 0.3

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32)(x))
        h = nn.Dropout(self.rate, deterministic=False)(h)
        return nn.Dense(x.shape[-1])(h)


class DropPipeline(nn.Module):
    """``layer_0`` on devices 0-1 and ``layer_1`` on 2-3 (plain blocks with ``wrap=False``)."""

    wrap: bool = True

    @nn.compact
    def __call__(self, x, y):
        blocks = [DropBlock, DropBlock]
        if self.wrap:
            blocks = [
                layers.task(DropBlock, mesh=mm.TaskMesh(devices=[0, 1])),
                layers.task(DropBlock, mesh=mm.TaskMesh(devices=[2, 3])),
            ]
        for i, block in enumerate(blocks):
            x = block(name=f"layer_{i}")(x)
        return jnp.mean((x - y) ** 2)


def _batches():
    keys = jax.random.split(jax.random.key(7), 2 * STEPS)
    return [
        (jax.random.normal(keys[2 * i], (8, 16)), jax.random.normal(keys[2 * i + 1], (8, 16)))
        for i in range(STEPS)
    ]


def _reference(params, batches, rng, optimizer, microbatches):
    """Plain Flax + optax on device 0: per step, a Python loop over microbatches."""
    params = jax.device_put(jax.tree_util.tree_map(np.asarray, params), jax.devices()[0])
    opt_state = optimizer.init(params)
    _, dropout_key = jax.random.split(rng)
    model = DropPipeline(wrap=False)

    @jax.jit
    def loss_and_grad(p, x, y, key):
        return jax.value_and_grad(
            lambda p: model.apply({"params": p}, x, y, rngs={"dropout": key})
        )(p)

    losses = []
    for i, (x, y) in enumerate(batches):
        step_key = jax.random.fold_in(dropout_key, i)
        size = x.shape[0] // microbatches
        parts = [
            loss_and_grad(
                params,
                x[k * size : (k + 1) * size],
                y[k * size : (k + 1) * size],
                jax.random.fold_in(step_key, k),
            )
            for k in range(microbatches)
        ]
        loss = sum(p[0] for p in parts) / microbatches
        grads = jax.tree_util.tree_map(lambda *g: sum(g) / microbatches, *[p[1] for p in parts])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, params


@pytest.mark.parametrize("schedule", [None, "1f1b"])
def test_microbatched_dropout_matches_the_per_microbatch_reference(schedule):
    rng, batches = jax.random.key(3), _batches()
    optimizer = optax.sgd(0.05, momentum=0.9)
    step, state, _ = layers.parallelize_step(
        DropPipeline(),
        optimizer,
        global_batch=batches[0],
        rng=rng,
        microbatches=4,
        schedule=schedule,
    )
    start = jax.tree_util.tree_map(np.asarray, state.params)
    losses = []
    for batch in batches:
        loss, state = step(state, batch)
        losses.append(float(loss))
    ref_losses, ref_params = _reference(start, batches, rng, optimizer, 4)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOL), state.params, ref_params
    )


class MaskProbe(nn.Module):
    """``sum((x @ w) * dropout(ones))``: for one-hot rows ``x``, ``grad w[k]`` is row k's mask."""

    features: int = 64

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.zeros, (x.shape[-1], self.features))
        mask = nn.Dropout(0.5, deterministic=False)(jnp.ones((x.shape[0], self.features)))
        return jnp.sum((x @ w) * mask)


class Probe(nn.Module):
    @nn.compact
    def __call__(self, x):
        return layers.task(MaskProbe, mesh=mm.TaskMesh(devices=[1]))(name="probe")(x)


@pytest.mark.parametrize("microbatches", [None, 4])
def test_no_two_steps_or_microbatches_share_a_mask(microbatches):
    # Example k is the only example of microbatch k (one-hot row k); SGD with rate 1 from
    # w = 0 moves row k of w by minus its gradient, the mask (values 0 or 2) / microbatches.
    m = 4
    x = jnp.eye(m)
    step, state, _ = layers.parallelize_step(
        Probe(), optax.sgd(1.0), global_batch=x, microbatches=microbatches
    )
    masks = []
    for _ in range(STEPS):
        before = np.asarray(state.params["probe"]["w"])
        _, state = step(state, x)
        masks.extend((before - np.asarray(state.params["probe"]["w"])) * (microbatches or 1))
    assert len(masks) == STEPS * m
    for mask in masks:
        np.testing.assert_allclose(np.sort(np.unique(mask)), [0.0, 2.0], rtol=0, atol=1e-6)
    for (i, a), (j, b) in itertools.combinations(enumerate(masks), 2):
        assert not np.array_equal(a, b), (
            f"(step {i // m}, example {i % m}) and (step {j // m}, example {j % m}) share a "
            "dropout mask"
        )
