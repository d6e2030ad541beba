"""A training loss over a chain of tasks and its parity check, shared by the pipeline tests
of the core."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import multimesh_flax as mm
from benchmarks._collectives import hlo_collectives
from multimesh_flax.core.declare import Phase
from multimesh_flax.core.run import OpKind


def chain_loss(tasks: Sequence[Callable[..., Any]]) -> Callable[..., Any]:
    """``loss(params, (x, y))``: ``x`` through ``tasks[s](params[s], .)`` in order, then the
    mean squared error against ``y``."""

    def loss(params, batch):
        x, y = batch
        for layer, w in zip(tasks, params, strict=True):
            x = layer(w, x)
        return jnp.mean((x - y) ** 2)

    return loss


TOL = {"rtol": 2e-5, "atol": 2e-6}


def tanh_stage(p, x):
    """A stage of three parameters: ``tanh(x @ w1 + b) @ w2``."""
    return jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"]


def tanh_stages_data(seed: int, stages: int, width: int = 6, rows: int = 16):
    """``(params, x)`` for ``stages`` chained :func:`tanh_stage` s: each stage's weights
    normal / 3, then ``x`` of ``rows`` normal rows (keys split from ``seed`` in that order)."""
    keys = iter(jax.random.split(jax.random.key(seed), 3 * stages + 1))

    def normal(*shape):
        return jax.random.normal(next(keys), shape) / 3

    params = [
        {"w1": normal(width, width), "b": normal(width), "w2": normal(width, width)}
        for _ in range(stages)
    ]
    return params, jax.random.normal(next(keys), (rows, width))


def assert_matches_unparallelized(step, loss, params, batch, tol=TOL):
    """``step(params, batch)`` (a ``(value, grads)`` step) equals ``jax.value_and_grad(loss)``
    run unplaced (``ignore_transforms``), at ``tol``."""
    value, grads = step(params, batch)
    with mm.ignore_transforms():
        ref_value, ref_grads = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(value, ref_value, **tol)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, **tol)


def train_step(loss: Callable[..., Any], optimizer: Any) -> Callable[..., Any]:
    """``(params, opt_state, batch) -> (loss, new params, new opt_state)``: one optax step."""

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    return step


def train(step, optimizer, data, steps=2, *, unparallelized=False):
    """Each of ``steps`` optax steps' ``(loss, params, opt_state)`` as NumPy arrays, from
    ``data = (params, x)``: by ``step(params, opt_state, x)``, or with ``unparallelized``
    by ``train_step(step, optimizer)`` (``step`` a loss) under ``ignore_transforms``."""
    params, x = data
    state = optimizer.init(params)
    if unparallelized:
        step = train_step(step, optimizer)
    results = []
    with mm.ignore_transforms() if unparallelized else contextlib.nullcontext():
        for _ in range(steps):
            value, params, state = step(params, state, x)
            results.append(jax.tree.map(np.asarray, (value, params, state)))
    return results


def backward_all_reduce_operands(executable) -> int:
    """Per step, the operands all-reduced by the ops that run a backward unit, read from each
    op's compiled HLO (the executable must have run a step)."""
    total = 0
    for index, op in enumerate(executable.ops):
        if op.kind is OpKind.RUN and any(u.phase == Phase.B for u in op.units):
            text = executable.state.fns[index].as_text()
            total += hlo_collectives(text)["all-reduce"]["operands"]
    return total
