"""Determinism: the same seed gives the same training run, whatever the schedule or process.

The tiny GPT is pipelined over 2 stages x (2 data x 2 model) devices with 4 microbatches,
dropout on (so the step's PRNG plumbing matters) and SGD with momentum. Findings these tests
pin down (measured on the 8-device CPU backend):

* two fresh ``parallelize_step`` runs with the same ``rng`` give bit-for-bit identical losses
  and parameters. Runs in other processes are bit-for-bit identical too: that is checked
  where it matters, by ``tests/test_cli_faults.py`` (runs killed at random points and resumed
  in new processes end with the parameters of one uninterrupted run in the test's process)
  and ``tests/distributed/test_multiprocess_train.py`` (2 processes against 1);
* 1F1B and ZB-H2 give bit-for-bit identical losses over the steps run here, and
  parameters equal to float32 rounding (measured max abs difference 1.2e-7; with AdamW, whose
  normalisation amplifies rounding in near-zero gradients, 4e-5). The schedules run the same
  fragments in another order and cut the backward differently (ZB-H2 splits it into
  activation- and weight-gradient parts), so the per-microbatch gradient sums may round
  differently; they are not promised to be bitwise equal.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

import multimesh_flax as mm
from models import GPT, cross_entropy_loss, get_config
from models.pipeline import make_multimesh

# One worker runs these tests (dev.py's --dist loadgroup): they share the cached training runs.
pytestmark = pytest.mark.xdist_group("test_determinism")

STEPS = 4


def _loss_fn(model_fn, batch):
    return cross_entropy_loss(model_fn(batch["inputs"], deterministic=False), batch["targets"])


def _batches():
    out = []
    for seed in range(STEPS):
        tokens = jax.random.randint(jax.random.key(100 + seed), (8, 17), 0, 259)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def train(schedule: str, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """Losses of ``STEPS`` steps and the final parameters, from a fresh ``parallelize_step``."""
    batches = _batches()
    step, state, _ = mm.parallelize_step(
        GPT(get_config("gpt-tiny", dropout_rate=0.1), stages=2),
        optax.sgd(0.1, momentum=0.9),
        make_multimesh(2, 2, 2),
        batches[0],
        loss_fn=_loss_fn,
        rng=jax.random.key(seed),
        microbatches=4,
        schedule=schedule,
    )
    losses = []
    for batch in batches:
        loss, state = step(state, batch)
        losses.append(np.asarray(loss))  # blocks: one step at a time
    return np.array(losses), [np.asarray(p) for p in jax.tree.leaves(state.params)]


@functools.cache
def _cached(schedule: str, run: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    del run  # distinct runs are distinct cache entries, each a fresh build
    return train(schedule)


def _assert_bitwise(a, b):
    losses_a, params_a = a
    losses_b, params_b = b
    np.testing.assert_array_equal(losses_a, losses_b)
    for x, y in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_same_seed_gives_bitwise_identical_runs():
    first, second = _cached("1f1b", 0), _cached("1f1b", 1)
    _assert_bitwise(first, second)
    assert len(set(first[0].tolist())) == STEPS  # the losses move: the runs really trained


def test_schedules_give_the_same_run():
    # GPipe against one device: tests/models/test_pipeline.py and tests/core/test_pipeline_parity.py
    losses, params = _cached("zero-bubble-h2")
    ref_losses, ref_params = _cached("1f1b")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for x, y in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
