"""Recomputation policies: their forms, their precedence, and what a function task's
backward keeps under each (values unchanged, fewer residuals handed from forward to backward)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.core.declare import _recompute, make_recompute, step_policy

TOL = dict(rtol=2e-5, atol=2e-6)
DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@pytest.mark.parametrize(
    ("value", "name", "policy"),
    [
        (False, "none", None),
        ("none", "none", None),
        (True, "full", None),
        ("full", "full", None),
        ("dots", "dots", DOTS),
        (jax.checkpoint_policies.checkpoint_dots, "custom", "same"),
    ],
)
def test_policy_forms(value, name, policy):
    made = make_recompute(value)
    custom = getattr(value, "__name__", repr(value))  # jax 0.10's checkpoint_dots has none
    assert made.name == (custom if name == "custom" else name)
    assert made.policy is (value if policy == "same" else policy)
    assert made.enabled == (name != "none")
    assert mm.Task(recompute=value).recompute == made
    assert _recompute.make_recompute(None) is None


@pytest.mark.parametrize("value", ["all", 1.5, 2, object, ["full"]])
def test_bad_policies_raise(value):
    with pytest.raises(errors.RecomputePolicyError, match="recompute"):
        mm.Task(recompute=value)


@pytest.mark.parametrize(
    ("task", "step", "switch", "expected"),
    [
        (None, None, False, "none"),
        (None, None, True, "full"),  # the switch means "full"
        (None, "dots", True, "dots"),  # the step-wide policy wins over the switch
        (None, False, True, "none"),  # ... also when it turns recomputation off
        ("full", "dots", False, "full"),  # the task's own policy wins over both
        (False, "full", True, "none"),
    ],
)
def test_precedence(task, step, switch, expected):
    setting = make_recompute(task)
    with mm.enable_recomputation(switch), step_policy(make_recompute(step)):
        assert _recompute.effective(setting).name == expected
    assert _recompute.effective(None).name == "none"  # restored


# --- a function task's backward -------------------------------------------------------------


def _model(recompute):
    def block(w, x):
        h = jnp.tanh(x @ w[0])
        return jnp.tanh(h @ w[1])

    first = mm.task(block, mesh=mm.TaskMesh(devices=[0, 1]), name="first", recompute=recompute)
    second = mm.task(block, mesh=mm.TaskMesh(devices=[2, 3]), name="second", recompute=recompute)

    def loss(params, x):
        return jnp.mean(second(params[1], first(params[0], x)) ** 2)

    return loss


def _params():
    keys = jax.random.split(jax.random.key(0), 4)
    w = [0.3 * jax.random.normal(k, s) for k, s in zip(keys, [(8, 16), (16, 8)] * 2, strict=True)]
    return [w[:2], w[2:]], jax.random.normal(jax.random.key(1), (4, 8))


def forward_outputs(executable):
    """Values the forward fragments hand on (to the backward, the next stage or out)."""
    return sum(len(op.outs) for op in executable.ops if op.kind == 0 and ".fwd" in op.name)


def _train(loss, params, x, jit=mm.jit, steps=3):
    """``steps`` SGD steps: losses, final parameters, and the program."""

    def step(p):
        value, grads = jax.value_and_grad(loss)(p, x)
        return value, jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

    program = jit(step)
    losses = []
    for _ in range(steps):
        value, params = program(params)
        losses.append(float(value))
    return losses, params, program


@pytest.fixture(scope="module")
def plain_run():
    params, x = _params()
    with mm.ignore_transforms():  # the reference: every transform the identity, jax.jit
        reference = _train(_model(None), params, x, jit=jax.jit)[:2]
    losses, params, program = _train(_model(None), params, x)
    return (losses, params, forward_outputs(program.executable(params))), reference


@pytest.mark.parametrize("recompute", ["full", "dots"])
def test_function_task_recomputes_with_the_same_values(plain_run, recompute):
    (plain_losses, plain_params, plain_outs), (ref_losses, ref_params) = plain_run
    params, x = _params()
    losses, params, program = _train(_model(recompute), params, x)
    outs = forward_outputs(program.executable(params))
    np.testing.assert_allclose(losses, plain_losses, **TOL)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    for got, want, ref in zip(
        jax.tree.leaves(params),
        jax.tree.leaves(plain_params),
        jax.tree.leaves(ref_params),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), **TOL)
    assert outs < plain_outs  # fewer residuals saved between forward and backward


def test_policies_keep_different_residuals():
    """``"full"`` keeps only inputs; ``"dots"`` also keeps the matrix products."""
    params, x = _params()
    counts = {}
    for recompute in [None, "dots", "full"]:
        program = mm.jit(jax.grad(_model(recompute)))
        counts[recompute] = forward_outputs(program.executable(params, x))
    assert counts["full"] < counts["dots"] < counts[None]


def test_task_false_overrides_the_switch():
    params, x = _params()
    with mm.enable_recomputation():
        on = forward_outputs(mm.jit(jax.grad(_model(None))).executable(params, x))
        off = forward_outputs(mm.jit(jax.grad(_model(False))).executable(params, x))
    assert on < off


def test_registered_linen_module_recomputes():
    """A ``register_task`` task with ``recompute`` recomputes the matched Flax module."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(8)(jnp.tanh(nn.Dense(16)(x))))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.mean(Block(name="block_1")(Block(name="block_0")(x)) ** 2)

    x = jnp.ones((4, 8))
    variables = Net().init(jax.random.key(0), x)

    def grads_and_outputs(recompute):
        ctx = mm.Context()
        ctx.register_task(
            r"block_(\d)",
            callback=lambda name, backprop: mm.Task(
                mesh=mm.TaskMesh(devices=[int(name)]), recompute=recompute
            ),
        )
        with ctx:
            program = mm.jit(jax.grad(lambda v: Net().apply(v, x)))
            return program(variables), forward_outputs(program.executable(variables))

    (plain, plain_outs), (remat, remat_outs) = grads_and_outputs(None), grads_and_outputs(True)
    for got, want in zip(jax.tree.leaves(remat), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    assert remat_outs < plain_outs


def _scoped(x):
    with jax.named_scope("layer1"):
        return jnp.sin(x).sum()


def test_a_named_scope_task_cannot_recompute():
    """A scope has no call to wrap: its own `recompute` is refused, a step-wide one warned."""
    multi = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "batch"))
    with multi:
        multi.register_task("layer1", task=mm.Task(mesh_slice={"stage": 1}, recompute="full"))
        with pytest.raises(errors.RecomputePolicyError, match="named scope 'layer1'"):
            mm.jit(jax.grad(_scoped))(jnp.ones(4))
    multi = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "batch"))
    with multi, mm.enable_recomputation(), mm.context(strict=False):
        multi.register_task("layer1", task=mm.Task(mesh_slice={"stage": 1}))
        with pytest.warns(errors.PlacementWarning, match="named scope 'layer1' is not recomputed"):
            mm.jit(jax.grad(_scoped))(jnp.ones(4))
