"""``parallelize_step(..., precision=...)``: bfloat16 compute tracks float32 training, keeps
the state where (and in the dtype) it belongs, sends bfloat16 between stages, and equals the
same bfloat16 computation on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import multimesh_flax as mm
from multimesh_flax import layers
from tests.layers._models import Pipeline

# One worker runs these tests (dev.py's --dist loadgroup): they share the fp32 and bf16 runs.
pytestmark = pytest.mark.xdist_group("test_precision")

X = jax.random.normal(jax.random.key(1), (8, 16))
Y = jax.random.normal(jax.random.key(2), (8, 16))
STEPS = 50
EARLY = 3  # parameters are compared with the one-device reference after this many steps
# bfloat16 keeps 8 bits of mantissa (relative rounding 2**-8 = 0.4%): over 50 Adam steps
# the losses of a run that computes in bfloat16 stay within 10% (or 0.005 absolute, once
# the loss is small) of the float32 run's; pure bfloat16 also rounds every update.
TRACK = {"bf16": dict(rtol=0.1, atol=5e-3), "pure-bf16": dict(rtol=0.3, atol=5e-3)}
# The pipelined bf16 step and its one-device twin round the same operations, but XLA may
# fuse (and so round) differently: a few bfloat16 ulps.
SAME_BF16 = dict(rtol=2e-2, atol=2e-3)
LEARNING_RATE = 1e-2
# Adam moves each parameter by about the learning rate whatever its gradient's size, so an
# element whose gradient is a few ulps from zero can step the other way when rounded
# differently: 2 learning rates apart per step (on jax 0.12: 1 element of 512 in one leaf
# and 2 in another differed by up to 0.02 after 3 steps).
FLIPPED_AT_MOST = 0.1  # fraction of a leaf's elements


def _run(precision, steps=STEPS):
    step, state, _ = mm.parallelize_step(
        Pipeline(),
        optax.adam(LEARNING_RATE),
        global_batch=(X, Y),
        microbatches=2,
        schedule="1f1b",
        precision=precision,
    )
    shardings = jax.tree.map(lambda a: a.sharding, state.params)
    initial = jax.tree.map(np.asarray, state.params)
    losses, early = [], None
    for i in range(steps):
        loss, state = step(state, (X, Y))
        losses.append(loss)
        if i + 1 == EARLY:
            early = jax.tree.map(np.asarray, state.params)
    return {
        "losses": np.array([float(x) for x in losses]),
        "loss_dtype": losses[-1].dtype,
        "state": state,
        "initial": initial,
        "early": early,
        "shardings": shardings,
        "executable": step.executable(state, (X, Y)),
    }


@pytest.fixture(scope="module")
def runs():
    return {"fp32": _run("fp32"), "bf16": _run(layers.Precision.BF16)}


def test_bf16_tracks_fp32_and_keeps_a_float32_state(runs):
    fp32, bf16 = runs["fp32"], runs["bf16"]
    np.testing.assert_allclose(bf16["losses"], fp32["losses"], **TRACK["bf16"])
    assert not np.array_equal(bf16["losses"], fp32["losses"])  # it did compute in bf16
    assert bf16["loss_dtype"] == jnp.float32
    dtypes = {str(a.dtype) for a in jax.tree.leaves(bf16["state"].params)}
    dtypes |= {str(a.dtype) for a in jax.tree.leaves(bf16["state"].opt_state) if a.ndim}
    assert dtypes == {"float32"}


def test_bf16_casts_stay_with_their_parameters(runs):
    """Every parameter stays on its stage, and only bfloat16 activations (and float32 loss
    scalars) move between stages: no parameter, and no cast of one, is sent anywhere."""
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert jax.tree.leaves(bf16["shardings"]) == jax.tree.leaves(fp32["shardings"])
    for run, dtype in ((fp32, "float32"), (bf16, "bfloat16")):
        exe = run["executable"]
        var_of = {slot: var for (var, _), slot in exe._slots.items()}
        sent = [var_of[s].aval for op in exe.ops if op.kind != 0 for s in op.outs]
        assert {str(a.dtype) for a in sent if a.shape} == {dtype}
        assert {a.shape for a in sent} <= {(), (4, 16)}  # a microbatch's activations
        assert {str(a.dtype) for a in sent if not a.shape} <= {"float32"}


def _one_device_bf16(params):
    """The bf16 step on one device under ``ignore_transforms``: parameters and batch cast
    to bfloat16, each of the 2 microbatches' gradients cast back to float32, averaged."""
    model, optimizer = Pipeline(wrap=False), optax.adam(LEARNING_RATE)
    opt_state = optimizer.init(params)

    def loss_of(p16, x, y):
        return model.apply({"params": p16}, x, y)

    @jax.jit
    def step(p, o):
        with mm.ignore_transforms():
            p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
            x, y = X.astype(jnp.bfloat16), Y.astype(jnp.bfloat16)
            halves = [(x[:4], y[:4]), (x[4:], y[4:])]
            values, grads = zip(
                *[jax.value_and_grad(loss_of)(p16, *b) for b in halves], strict=True
            )
            grads = [jax.tree.map(lambda g, a: g.astype(a.dtype), g, p) for g in grads]
            grads = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
        updates, o = optimizer.update(grads, o, p)
        loss = (values[0].astype(jnp.float32) + values[1].astype(jnp.float32)) / 2
        return loss, optax.apply_updates(p, updates), o

    losses = []
    for _ in range(EARLY):
        loss, params, opt_state = step(params, opt_state)
        losses.append(float(loss))
    return np.array(losses), params


def test_bf16_pipeline_matches_the_bf16_computation_on_one_device(runs):
    bf16 = runs["bf16"]
    losses, params = _one_device_bf16(bf16["initial"])
    np.testing.assert_allclose(bf16["losses"][:EARLY], losses, **SAME_BF16)
    for got, want in zip(jax.tree.leaves(bf16["early"]), jax.tree.leaves(params), strict=True):
        _assert_same_but_flipped_steps(np.asarray(got), np.asarray(want))


def _assert_same_but_flipped_steps(got, want):
    """``got`` equals ``want`` to ``SAME_BF16``, except at most ``FLIPPED_AT_MOST`` of the
    elements, each within 2 learning rates per step (see ``FLIPPED_AT_MOST``)."""
    off = ~np.isclose(got, want, **SAME_BF16)
    assert off.mean() <= FLIPPED_AT_MOST, f"{off.sum()} of {off.size} elements differ"
    np.testing.assert_allclose(got[off], want[off], rtol=0, atol=2 * LEARNING_RATE * EARLY)


def test_pure_bf16_stores_bf16_and_tracks_fp32(runs):
    pure = _run("pure-bf16")
    np.testing.assert_allclose(pure["losses"], runs["fp32"]["losses"], **TRACK["pure-bf16"])
    assert pure["loss_dtype"] == jnp.float32
    floats = [a for a in jax.tree.leaves(pure["state"]) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert floats and {str(a.dtype) for a in floats} == {"bfloat16"}
    assert jax.tree.leaves(pure["shardings"]) == jax.tree.leaves(runs["fp32"]["shardings"])
