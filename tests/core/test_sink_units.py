"""``_sink.sink_into_units``: a microbatch's input-only glue runs in the unit that reads it.

With the gradient taken inside the microbatch loop, the loss's backward through integer
targets (a vocabulary-sized scatter) depends only on the batch. Left in the free fragment it
would be computed for every microbatch up front, held until each backward, and compiled as
one program growing with the number of microbatches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import multimesh_flax as mm
from multimesh_flax.core.fragment import Fragment, fragment_jaxpr
from multimesh_flax.core.trace import structural_key

TOL = {"rtol": 2e-5, "atol": 2e-6}
VOCAB = 16


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(8)(x))


class _LM(nn.Module):
    """Two stages; cross-entropy over integer targets (the scatter in its backward)."""

    @nn.compact
    def __call__(self, x, targets):
        h = mm.task(_Block, mesh=mm.TaskMesh(devices=range(4)))(name="block")(x)
        head = mm.task(nn.Dense, mesh=mm.TaskMesh(devices=range(4, 8)))
        logp = jax.nn.log_softmax(head(VOCAB, name="head")(h))
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _batch():
    x = jax.random.normal(jax.random.key(1), (8, 8))
    targets = jax.random.randint(jax.random.key(2), (8,), 0, VOCAB)
    return x, targets


def _step(m, schedule="1f1b"):
    x, targets = _batch()
    return mm.parallelize_step(
        _LM(),
        optax.sgd(0.1),
        global_batch=(x, targets),
        microbatches=m,
        schedule=schedule,
        loss_fn=lambda model, batch: model(*batch),
    )


def _primitives(frag: Fragment) -> set[str]:
    return {e.primitive.name for e in frag.eqns}


@pytest.mark.parametrize(("m", "schedule"), [(2, "1f1b"), (4, "1f1b"), (4, None)])
def test_target_only_backward_runs_in_each_microbatch_unit(m, schedule):
    """Also without a schedule (microbatches in program order): the pool is the same."""
    step, state, _ = _step(m, schedule)
    x, targets = _batch()
    part = step.executable(state, (x, targets)).partition
    scatters = [f for f in part.fragments if "scatter-add" in _primitives(f)]
    assert scatters, "the loss's backward should scatter into the logits' gradient"
    assert all(f.unit is not None for f in scatters), [f.index for f in scatters]
    # What the last stage's glue hands its units before the first of them: per microbatch
    # the target slice only, nothing vocabulary-sized (the head's parameters pass too).
    last = (4, 5, 6, 7)
    first_unit = next(i for i, f in enumerate(part.fragments) if f.place == last and f.unit)
    handed = [
        v.aval.shape
        for f in part.fragments[:first_unit]
        if f.place == last and f.unit is None
        for v in f.outvars
    ]
    assert handed.count((8 // m,)) == m, handed
    assert (8 // m, VOCAB) not in handed, handed


@pytest.mark.parametrize(("m", "schedule"), [(2, "1f1b"), (4, "1f1b"), (4, None)])
def test_units_of_a_stage_stay_structurally_equal(m, schedule):
    """What moves is the same in every microbatch: the slices (offsets differ) stay."""
    step, state, _ = _step(m, schedule)
    part = step.executable(state, _batch()).partition
    keys: dict[tuple, set] = {}
    memo: dict = {}
    for f in part.fragments:
        if f.unit is not None:
            group = (f.unit.stage, f.unit.phase, f.place, len(f.parts))
            keys.setdefault(group, set()).add(structural_key(fragment_jaxpr(f), memo))
    assert keys and all(len(k) == 1 for k in keys.values()), {g: len(k) for g, k in keys.items()}
    slices = [f for f in part.fragments if "slice" in _primitives(f)]
    assert slices and all(f.unit is None for f in slices)


@pytest.mark.parametrize("schedule", ["1f1b", None])
def test_moving_glue_into_units_keeps_loss_and_update_exact(schedule):
    step, state, _ = _step(4, schedule)
    x, targets = _batch()
    params = jax.tree.map(np.asarray, state.params)
    with mm.ignore_transforms():  # the same step, unplaced and unsplit
        expected = jax.value_and_grad(lambda p: _LM().apply({"params": p}, x, targets))(params)
    loss, new_state = step(state, (x, targets))
    np.testing.assert_allclose(float(loss), float(expected[0]), **TOL)
    sgd = jax.tree.map(lambda p, g: p - 0.1 * g, params, expected[1])
    for a, e in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(sgd), strict=True):
        np.testing.assert_allclose(np.asarray(a), e, **TOL)
