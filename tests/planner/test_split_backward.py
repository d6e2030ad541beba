"""The planner's B/W cut of a unit's backward computes the whole backward's gradients."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from multimesh_flax.planner._split_backward import split_backward


def _layers(params, x):
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return x


def test_b_and_w_halves_give_the_whole_backwards_gradients():
    keys = jax.random.split(jax.random.key(0), 5)
    params = [
        (jax.random.normal(keys[i], (8, 8)) * 0.3, jax.random.normal(keys[i + 1], (8,)) * 0.1)
        for i in (0, 2)
    ]
    x = jax.random.normal(keys[4], (4, 8))
    out, vjp = jax.vjp(_layers, params, x)
    res, tree = jax.tree_util.tree_flatten(vjp)
    ct = jnp.ones_like(out)

    def whole(res, ct):
        grads = jax.tree_util.tree_unflatten(tree, res)(ct)
        return jax.tree_util.tree_leaves(grads[0]), grads[1]

    closed = jax.make_jaxpr(whole)(res, ct)
    halves = split_backward(closed, num_weight_grads=4)
    flat = [*res, ct]
    b_out = jex_core.jaxpr_as_fun(halves.b)(*flat)
    extra = b_out[1:]
    w_in = [flat[i] if kind == "in" else extra[i] for kind, i in halves.crossing]
    w_out = jex_core.jaxpr_as_fun(halves.w)(*w_in)
    # against plain jax.grad of the same sum (the cotangent of ones)
    want_p, want_x = jax.grad(lambda p, x: _layers(p, x).sum(), argnums=(0, 1))(params, x)
    np.testing.assert_allclose(b_out[0], want_x, rtol=1e-6, atol=1e-6)
    for got, want in zip(w_out, jax.tree_util.tree_leaves(want_p), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # W reads cotangents B made (not only the backward's inputs), and does not redo B's work
    assert any(kind == "b" for kind, _ in halves.crossing)
    assert len(halves.w.jaxpr.eqns) < len(closed.jaxpr.eqns)
