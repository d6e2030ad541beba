"""The same checks through every kind of task: a function, a Linen ``Task[Module]`` and an
NNX ``Task[Block]`` all run through ``core/front/_task_call.call`` (issue 36, part 5).

Each kind computes ``tanh(x @ w)`` with ``w`` a (3, 3) parameter on device 5, its result
constrained to ``P("batch", None)``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.core.declare import forget_warnings

TOL = dict(rtol=1e-6, atol=1e-6)
MESH = mm.TaskMesh(devices=[5])
W = 0.5 * jnp.arange(9.0).reshape(3, 3) / 9.0
X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
DEVICES = np.array(jax.devices())


def _layer(x, w):
    return mm.with_sharding_constraint(jnp.tanh(x @ w), P("batch", None))


def _reference(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _layer(x, self.param("w", lambda *_: W))


class _Block(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(W)

    def __call__(self, x):
        return _layer(x, self.w[...])


def _function(**options):
    """``(loss(w, x), call(x))`` for each kind: ``w`` a parameter tree of that kind."""
    body = mm.task(lambda w, x: _layer(x, w), name="layer", **options)
    return (lambda w, x: jnp.sum(body(w, x) ** 2)), (lambda x: body(W, x)), W


def _linen(**options):
    model = mm.task(_Dense, name="layer", **options)()
    params = {"params": {"w": W}}
    return (
        (lambda p, x: jnp.sum(model.apply(p, x) ** 2)),
        (lambda x: model.apply(params, x)),
        params,
    )


def _nnx(**options):
    block = mm.task(_Block, name="layer", **options)()
    graphdef, state = nnx.split(block)
    return (
        (lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2)),
        (lambda x: block(x)),
        state,
    )


KINDS = {"function": _function, "linen": _linen, "nnx": _nnx}


def _ids(tree):
    return {d.id for leaf in jax.tree_util.tree_leaves(tree) for d in leaf.devices()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_values_gradients_and_placement_match_the_plain_computation(kind):
    loss, _, params = KINDS[kind](mesh=MESH)
    value, grads = mm.jit(jax.value_and_grad(loss))(params, X)
    ref_value, ref_grad = jax.jit(jax.value_and_grad(_reference))(W, X)
    np.testing.assert_allclose(float(value), float(ref_value), **TOL)
    np.testing.assert_allclose(jax.tree_util.tree_leaves(grads)[0], ref_grad, **TOL)
    assert _ids(grads) == {5}  # the parameter's gradient is made on the task's submesh
    out = mm.jit(loss)(params, X)
    assert _ids(out) == {5}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_recomputation_changes_the_backward_not_the_values(kind):
    results, texts = [], []
    for recompute in ("none", "full"):
        loss, _, params = KINDS[kind](mesh=MESH, recompute=recompute)
        grad = mm.jit(jax.grad(loss))
        results.append(jax.tree_util.tree_leaves(grad(params, X))[0])
        with mm.autoshard(), mm.context(strict=False), warnings.catch_warnings():
            warnings.simplefilter("ignore", errors.PlacementWarning)
            texts.append(str(jax.make_jaxpr(jax.grad(loss))(params, X)))
    np.testing.assert_allclose(results[0], results[1], **TOL)
    assert "remat" not in texts[0] and "checkpoint" not in texts[0]
    assert "remat" in texts[1] or "checkpoint" in texts[1]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_foreign_trace_warns_once_and_computes_the_values(kind):
    loss, _, params = KINDS[kind](mesh=MESH)
    forget_warnings()  # once per cause: forget the other kinds' warning
    warned = pytest.warns(errors.PlacementWarning, match="'layer' is traced by a JAX")
    with mm.context(strict=False), warned:  # the suite runs strict (conftest.py)
        value = jax.jit(lambda p, x: loss(p, x))(params, X)
    np.testing.assert_allclose(float(value), float(_reference(W, X)), **TOL)
    with mm.context(strict=True), pytest.raises(errors.StrictModeError, match="'layer'"):
        jax.jit(lambda p, x: loss(p, x))(params, X)
    forget_warnings()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_eager_call_hands_back_its_result_released_on_the_submesh(kind):
    # Computed on the task's submesh, handed back uncommitted (as a ``jnp`` result), so
    # that JAX moves it to wherever it is used next.
    _, call, _ = KINDS[kind](mesh=MESH)
    out = call(X)
    assert _ids(out) == {5} and not out.committed
    np.testing.assert_allclose(out, jnp.tanh(X @ W), **TOL)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_eager_result_meets_arrays_committed_elsewhere(kind):
    # Run on devices 4-5; the result meets an array committed to devices 0-1.
    _, call, _ = KINDS[kind](mesh=mm.TaskMesh(devices=[4, 5], axis_names=("batch",)))
    out = call(X)
    assert _ids(out) == {4} and not out.committed  # the submesh's first device
    elsewhere = jax.device_put(jnp.ones_like(X), NamedSharding(Mesh(DEVICES[:2], ("d",)), P()))
    total = out + elsewhere
    assert _ids(total) == {0, 1}
    np.testing.assert_allclose(total, jnp.tanh(X @ W) + 1, **TOL)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ignore_transforms_is_the_plain_computation(kind):
    loss, _, params = KINDS[kind](mesh=MESH)
    with mm.ignore_transforms():
        value = jax.jit(loss)(params, X)  # no warning: nothing is a task
    np.testing.assert_allclose(float(value), float(_reference(W, X)), **TOL)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_rule_naming_a_missing_mesh_axis_is_the_same_error(kind):
    bad = dict(mesh=mm.TaskMesh(devices=[0, 1], axis_names=("x",)), logical_axes=[("e", "y")])
    with pytest.raises(errors.LogicalRulesError, match=r"\('e', 'y'\).*axes \('x',\)"):
        loss, _, params = KINDS[kind](**bad)
        mm.jit(loss)(params, X)
