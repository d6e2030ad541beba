"""B7's function-path workload computes what the unpipelined model computes, on both sides.

``benchmarks._function_path``: ours (``mm.jit`` + ``mm.microbatch``, one task per stage) and
the hand-written SPMD peer (stacked weights, ``shard_map`` + ``ppermute``, the loop
unrolled) give the loss and gradients of plain ``jax.jit`` of the whole batch on one device,
and one training step of each moves the parameters alike. Tiny sizes: 4 layers of width
16, 32 tokens, 2 stages, 4 microbatches.
"""

import jax
import numpy as np
import pytest

import multimesh_flax as mm
from benchmarks import _function_path as fp

TINY = fp.FnWorkload(layers=4, width=16, tokens=32)
STAGES, MICROBATCHES = 2, 4
RTOL, ATOL = 1e-5, 1e-6  # float32; the pipelines only reorder sums over microbatches


def _assert_close(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def reference():
    """Loss and gradients of the whole batch, plain ``jax.jit`` on one device."""
    params, batch = fp.init_params(TINY), fp.batch_data(TINY)
    return jax.jit(jax.value_and_grad(fp.reference_loss))(params, batch)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ours_matches_plain_jit(reference, schedule):
    fn = fp.make_ours_value_and_grad(TINY, STAGES, MICROBATCHES, schedule)
    loss, grads = mm.jit(fn)(fp.init_params(TINY), fp.batch_data(TINY))
    _assert_close((loss, grads), reference)
    assert {d.id for d in grads[-1]["w1"].devices()} == {4, 5, 6, 7}  # the last stage's


def test_peer_matches_plain_jit(reference):
    mesh = fp.make_mesh(STAGES)
    stacked = fp.stack_params(fp.init_params(TINY), STAGES)
    loss_fn = fp.make_peer_loss(mesh, MICROBATCHES)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(stacked, fp.batch_data(TINY))
    _assert_close((loss, fp.unstack_params(grads)), reference)


def test_one_step_of_each_updates_alike():
    ours = fp.build_ours(STAGES, MICROBATCHES, "1f1b", TINY)
    peer = fp.build_peer(STAGES, MICROBATCHES, TINY)
    ours.step()
    peer.step()
    np.testing.assert_allclose(float(ours.loss), float(peer.loss), rtol=RTOL)
    _assert_close(ours.state, fp.unstack_params(peer.state))


def test_stack_and_unstack_are_inverse():
    params = fp.init_params(TINY)
    stacked = fp.stack_params(params, STAGES)
    assert stacked["w1"].shape == (STAGES, 2, 16, 16)
    np.testing.assert_array_equal(stacked["w2"][1, 0], params[2]["w2"])
    _assert_close(fp.unstack_params(stacked), params)


def test_sizes_that_do_not_split_raise():
    with pytest.raises(ValueError, match="divide"):
        fp.make_ours_value_and_grad(TINY, 3, MICROBATCHES, "gpipe")


def test_b7_measures_the_function_path_and_counts_its_collectives():
    from benchmarks import b7_spmd_peer as b7

    result = b7.measure_function(STAGES, MICROBATCHES, 1, ("1f1b",), TINY)
    assert result["1f1b_ratio"] > 0 and result["compiles_timed_steps"] == 0
    ours, peer = result["collectives"]["1f1b"], result["collectives"]["peer"]
    # Each stage is data parallel over 4 devices: its backwards keep their weight gradients
    # per device (``_stacked_sums``), and the stage all-reduces them once a step, as one
    # array; the last stage's backwards also all-reduce their microbatch's loss (a scalar).
    # The peer shifts activations with collective-permutes.
    assert STAGES <= ours["all-reduce"]["operands"] <= STAGES + MICROBATCHES
    assert ours["all-reduce"]["operands"] < MICROBATCHES * TINY.layers * 2  # one per gradient
    assert ours["fragments_with"] >= STAGES
    assert peer["collective-permute"]["ops"] > 0
    metrics = [r["metric"] for r in b7._rows(result)]
    assert any("collectives per step" in m for m in metrics)
