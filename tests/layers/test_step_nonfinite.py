"""``parallelize_step(..., nonfinite=...)``: a NaN/inf loss or gradient norm leaves the state
unchanged ("skip") or raises ``NonFiniteError`` with that state ("raise"); finite runs are
unchanged against the step without the option and plain Flax + optax on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import multimesh_flax as mm
from multimesh_flax import errors, layers
from tests.layers._models import Pipeline, device_ids
from tests.layers.test_step import TOL, X, Y, _initial_params, _reference_run, _train

NAN_BATCH = (X.at[0, 0].set(jnp.nan), Y)


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def _assert_same(a, b, **tol):
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, **tol), a, b)


def _placements(state):
    return jax.tree_util.tree_map(lambda a: device_ids(a), state.params)


@pytest.mark.parametrize("pipelined", [False, True], ids=["full-batch", "1f1b-m2"])
def test_finite_steps_match_the_step_without_the_option(pipelined):
    options = dict(microbatches=2, schedule="1f1b") if pipelined else {}
    batches = [(X * (1 + i / 10), Y) for i in range(2)]
    plain, state, _ = layers.parallelize_step(
        Pipeline(), optax.adam(1e-2), global_batch=(X, Y), **options
    )
    start = _initial_params(state)
    losses, plain_state = _train(plain, state, batches)
    step, state, _ = layers.parallelize_step(
        Pipeline(), optax.adam(1e-2), global_batch=(X, Y), nonfinite="raise", **options
    )
    checked, state = _train(step, state, batches)
    np.testing.assert_allclose(checked, losses, rtol=1e-6, atol=1e-6)
    _assert_same(state.params, plain_state.params, rtol=1e-6, atol=1e-6)
    assert int(state.step) == 2 and bool(step.last_check.applied)
    if pipelined:  # the full-batch run is checked against the reference below
        return
    ref_losses, ref_params = _reference_run(Pipeline(wrap=False), optax.adam(1e-2), start, batches)
    np.testing.assert_allclose(checked, ref_losses, **TOL)
    _assert_same(state.params, ref_params, **TOL)


def test_last_check_holds_the_gradient_norm():
    step, state, _ = layers.parallelize_step(
        Pipeline(), optax.sgd(0.02), global_batch=(X, Y), nonfinite="skip"
    )
    start = _initial_params(state)
    loss, state = step(state, (X, Y))

    @jax.jit
    def reference_norm(params):
        with mm.ignore_transforms():
            grads = jax.grad(lambda p: Pipeline(wrap=False).apply({"params": p}, X, Y))(params)
        return optax.tree.norm(grads)

    norm = reference_norm(jax.device_put(start, jax.devices()[0]))
    np.testing.assert_allclose(float(step.last_check.grad_norm), float(norm), **TOL)
    assert float(step.last_check.loss) == float(loss) and bool(step.last_check.applied)


@pytest.mark.parametrize("pipelined", [False, True], ids=["full-batch", "1f1b-m2"])
def test_skip_leaves_the_state_unchanged_on_its_submeshes(pipelined):
    options = dict(microbatches=2, schedule="1f1b") if pipelined else {}
    step, state, _ = layers.parallelize_step(
        Pipeline(), optax.adam(1e-2), global_batch=(X, Y), nonfinite="skip", **options
    )
    _, state = step(state, (X, Y))
    before, placed = _host(state), _placements(state)
    executable = step.executable(state, (X, Y))
    compiled = executable.compile_count()
    loss, state = step(state, NAN_BATCH)
    assert np.isnan(float(loss)) and not bool(step.last_check.applied)
    assert np.isnan(float(step.last_check.grad_norm))
    _assert_same(_host(state), before, rtol=0, atol=0)  # bit-identical, step included
    assert int(state.step) == 1 and _placements(state) == placed
    loss, state = step(state, (X, Y))  # training goes on from the kept state
    assert np.isfinite(float(loss)) and int(state.step) == 2
    assert executable.compile_count() == compiled


def test_raise_names_the_step_and_attaches_the_unchanged_state():
    step, state, _ = layers.parallelize_step(
        Pipeline(), optax.sgd(0.02), global_batch=(X, Y), nonfinite=layers.NonFinite.RAISE
    )
    _, state = step(state, (X, Y))
    before = _host(state.params)
    with pytest.raises(errors.NonFiniteError, match=r"loss nan and gradient norm nan") as info:
        step(state, NAN_BATCH)
    error = info.value
    assert "`state.step`=1" in str(error) and "nonfinite='skip'" in str(error)
    assert error.step == 1 and np.isnan(error.loss) and np.isnan(error.grad_norm)
    _assert_same(_host(error.state.params), before, rtol=0, atol=0)
    assert device_ids(error.state.params["layer_1"]["Dense_0"]["kernel"]) == [4, 5, 6, 7]
    _, state = step(error.state, (X, Y))  # the attached state is live (the input was donated)
    assert int(state.step) == 2


def test_raise_tells_a_non_finite_gradient_from_a_finite_loss():
    def loss_fn(model_fn, batch):  # value sqrt(0) = 0, gradient 0 * inf = nan
        return jnp.sqrt(model_fn(*batch) * 0.0)

    step, state, _ = layers.parallelize_step(
        Pipeline(), optax.sgd(0.02), global_batch=(X, Y), loss_fn=loss_fn, nonfinite="raise"
    )
    with pytest.raises(errors.NonFiniteError, match="Non-finite gradient norm nan in") as info:
        step(state, (X, Y))
    assert info.value.loss == 0.0 and info.value.step == 0


def test_nonfinite_rejects_other_values():
    with pytest.raises(errors.ParallelizeArgumentError, match="got str: 'warn'"):
        layers.parallelize_step(Pipeline(), optax.sgd(0.1), global_batch=(X, Y), nonfinite="warn")
