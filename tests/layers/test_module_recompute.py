"""Recomputation of Linen ``Task[Module]`` and NNX ``Task[Block]`` tasks: the backward keeps
fewer residuals, and training gives the same losses and parameters as without it and as the
unparallelized model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import multimesh_flax as mm
from multimesh_flax import layers
from tests.layers import _nnx_models
from tests.layers._models import RULES, STAGE0, STAGE1, MLPBlock, Pipeline

TOL = dict(rtol=2e-5, atol=2e-6)
X = jax.random.normal(jax.random.key(1), (8, 16))
Y = jax.random.normal(jax.random.key(2), (8, 16))
STEPS = 3


def forward_outputs(executable):
    """Values the forward fragments hand on (to the backward, the next stage or out)."""
    return sum(len(op.outs) for op in executable.ops if op.kind == 0 and ".fwd" in op.name)


def _assert_trees_close(a, b, tol=TOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


# --- Linen: parallelize_step ------------------------------------------------------------------


class TaskRecompute(nn.Module):
    """``Pipeline`` with a ``recompute`` policy on each task itself."""

    recompute: object = None

    @nn.compact
    def __call__(self, x, y):
        for i, mesh in enumerate((STAGE0, STAGE1)):
            block = layers.task(MLPBlock, mesh=mesh, logical_axes=RULES, recompute=self.recompute)
            x = block(name=f"layer_{i}")(x)
        return jnp.mean((x - y) ** 2)


def _linen_run(model, **options):
    pipeline = mm.PipelineOptions(microbatches=2, schedule="1f1b")  # the record form
    step, state, _ = mm.parallelize_step(
        model, optax.adam(1e-2), global_batch=(X, Y), pipeline=pipeline, **options
    )
    losses = []
    for _ in range(STEPS):
        loss, state = step(state, (X, Y))
        losses.append(float(loss))
    return losses, state.params, forward_outputs(step.executable(state, (X, Y)))


def _linen_reference():
    """The same steps on one device: plain ``jax.jit`` under ``ignore_transforms``."""
    model, optimizer = Pipeline(wrap=False), optax.adam(1e-2)
    with mm.ignore_transforms():
        params = jax.jit(model.init)(jax.random.split(jax.random.key(0))[0], X, Y)["params"]
    opt_state = optimizer.init(params)

    @jax.jit
    def step(p, o):
        with mm.ignore_transforms():
            halves = [(X[:4], Y[:4]), (X[4:], Y[4:])]  # the step's mean over 2 microbatches
            loss_of = jax.value_and_grad(lambda q, x, y: model.apply({"params": q}, x, y))
            values, grads = zip(*[loss_of(p, *b) for b in halves], strict=True)
            grads = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
        updates, o = optimizer.update(grads, o, p)
        return (values[0] + values[1]) / 2, optax.apply_updates(p, updates), o

    losses = []
    for _ in range(STEPS):
        loss, params, opt_state = step(params, opt_state)
        losses.append(float(loss))
    return losses, params


@pytest.fixture(scope="module")
def linen_plain():
    return _linen_run(Pipeline()), _linen_reference()


@pytest.mark.parametrize(
    ("model", "options"),
    [
        (Pipeline(), {"recompute": "full"}),
        (Pipeline(), {"recompute": "dots"}),
        (TaskRecompute("full"), {"recompute": False}),  # the task's own policy wins
    ],
    ids=["step-full", "step-dots", "task-full"],
)
def test_linen_tasks_recompute_with_the_same_training(linen_plain, model, options):
    (plain_losses, plain_params, plain_outs), (ref_losses, ref_params) = linen_plain
    losses, params, outs = _linen_run(model, **options)
    np.testing.assert_allclose(losses, plain_losses, **TOL)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    _assert_trees_close(params, plain_params)
    _assert_trees_close(params, ref_params)
    assert outs < plain_outs  # the forward hands fewer residuals to the backward


def test_linen_switch_and_step_policy():
    """``enable_recomputation`` now reaches ``Task[Module]``; ``recompute=False`` on the
    step turns it off again (tracing only: nothing is compiled)."""

    def outputs(**options):
        step, state, _ = mm.parallelize_step(Pipeline(), optax.sgd(0.1), global_batch=(X, Y),
                                             **options)  # fmt: skip
        return forward_outputs(step.executable(state, (X, Y)))

    plain = outputs()
    with mm.enable_recomputation():
        switched, overridden = outputs(), outputs(recompute=False)
    assert switched < plain
    assert overridden == plain


# --- NNX: mm.jit ------------------------------------------------------------------------------


class NnxNet(nnx.Module):
    """``_nnx_models.Net`` with a ``recompute`` policy on each task."""

    def __init__(self, d, recompute, *, rngs):
        def make(s):
            return mm.task(
                _nnx_models.Block,
                mesh_slice={"stage": s},
                logical_axes=_nnx_models.RULES,
                recompute=recompute,
            )

        self.blocks = nnx.List([make(s)(d, rngs=rngs) for s in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _nnx_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_nnx_models.loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def _nnx_run(recompute):
    data = _nnx_models.batch()
    with _nnx_models.multi_mesh():
        model = NnxNet(16, recompute, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        jitted = mm.jit(_nnx_step)
        losses = [float(jitted(model, optimizer, data)) for _ in range(STEPS)]
        outs = forward_outputs(jitted.executable(model, optimizer, data))
    return losses, model, outs


@pytest.fixture(scope="module")
def nnx_plain():
    model = _nnx_models.plain_net()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with mm.ignore_transforms():
        step = nnx.jit(_nnx_step)
        ref_losses = [float(step(model, optimizer, _nnx_models.batch())) for _ in range(STEPS)]
    return _nnx_run(None), (ref_losses, model)


@pytest.mark.parametrize("recompute", ["full", "dots"])
def test_nnx_tasks_recompute_with_the_same_training(nnx_plain, recompute):
    (plain_losses, plain_model, plain_outs), (ref_losses, ref_model) = nnx_plain
    losses, model, outs = _nnx_run(recompute)
    np.testing.assert_allclose(losses, plain_losses, **TOL)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    _nnx_models.assert_states_close(model, plain_model)
    _nnx_models.assert_states_close(model, ref_model)
    assert outs < plain_outs
