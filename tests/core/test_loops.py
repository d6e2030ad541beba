"""The microbatch loop (``trace/_loops``): JAX traces one ``lax.scan``, our trace unrolls it.

The model is ``test_blocks``'s two-stage chain of residual layers, whose constraint on each
weight is a computation on loop constants alone (JAX hoists it out of the scan). The values
must equal the unparallelized step's (``ignore_transforms``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import multimesh_flax as mm
from multimesh_flax.core.plan import _pipeline, microbatch_of
from multimesh_flax.core.trace import _loops, is_sum, trace_session
from tests.core import test_blocks
from tests.core._chain import assert_matches_unparallelized, chain_loss

TOL = test_blocks.TOL


def _raw_program_size(m):
    """Equations of the program JAX traces for the step (before our unrolling)."""
    loss = test_blocks._loss()
    mean = mm.microbatch(loss, 0, test_blocks.BATCH // m, argnum=1, schedule="1f1b")
    params, batch = test_blocks._data()
    with trace_session():
        closed = jax.make_jaxpr(jax.value_and_grad(mean))(params, batch)
    return len(closed.jaxpr.eqns)


def test_jax_traces_the_same_program_for_any_number_of_microbatches():
    assert _raw_program_size(2) == _raw_program_size(8)


def _microbatch_of_each(traced):
    return [microbatch_of(s, traced.microbatch_calls) for s in traced.stacks]


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h2"])
def test_each_iteration_reads_its_own_microbatch_values(schedule):
    """Every microbatch is the same program, and a task equation of microbatch ``k`` reads
    values of microbatch ``k`` only: the backward's residuals are its own forward's, and what
    JAX hoisted out of the loop is recomputed in each iteration (no task equation outside
    every microbatch)."""
    step, _ = test_blocks._step(schedule)
    params, batch = test_blocks._data()
    traced = step.executable(params, batch).partition.traced
    mbs = _microbatch_of_each(traced)
    producer = traced.producer
    counts: dict[int, int] = {}
    for eqn, label, mb in zip(traced.jaxpr.eqns, traced.labels, mbs, strict=True):
        if label is not None:
            assert mb is not None, f"task equation outside every microbatch: {eqn}"
        if mb is None or is_sum(eqn):  # a gradient sum starts at the last microbatch
            continue
        counts[mb[1]] = counts.get(mb[1], 0) + 1
        if label is None:
            continue
        for v in eqn.invars:
            j = producer.get(v)
            if j is not None and mbs[j] is not None and traced.labels[j] is not None:
                assert mbs[j] == mb, f"microbatch {mb[1]} reads microbatch {mbs[j][1]}'s value"
    assert sorted(counts) == list(range(test_blocks.M))
    assert len(set(counts.values())) == 1, counts


def _outer_task_step(dim):
    """A task before the loop produces the split activation: its gradient comes back from
    every iteration as one stacked array (the loop's stacked output, concatenated)."""
    pre = mm.task(lambda w, x: jnp.tanh(x @ w), name="pre", mesh=mm.TaskMesh(devices=[0, 1, 2, 3]))
    loss = test_blocks._loss()

    def step_loss(params, batch):
        x, y = batch
        h = pre(params[0], x)
        if dim == 1:  # split the transposed activation along its columns
            body = lambda p, b: loss(p, (b[0].T, b[1].T))  # noqa: E731
            b = (h.T, y.T)
        else:
            body, b = loss, (h, y)
        mean = mm.microbatch(body, dim, test_blocks.BATCH // 4, argnum=1, reduce="mean")
        return mean(params[1:], b)

    return step_loss


@pytest.mark.parametrize("dim", [0, 1])
def test_a_split_activation_gets_its_gradient_back_from_every_iteration(dim):
    step_loss = _outer_task_step(dim)
    step = mm.jit(jax.value_and_grad(step_loss))
    assert_matches_unparallelized(step, step_loss, *test_blocks._data(stages=3), TOL)


def test_a_later_stage_with_hoisted_work_stays_a_later_stage():
    """Only the second stage computes something from its weight alone (``2 * w``, hoisted
    out of the scan and recomputed per iteration): it must still come after the first
    stage, which is the order of first forward use the schedule is built from."""
    first = mm.task(lambda w, h: jnp.tanh(h @ w), name="first", mesh=mm.TaskMesh(devices=[0]))
    second = mm.task(lambda w, h: h @ (2.0 * w), name="second", mesh=mm.TaskMesh(devices=[1]))
    loss = chain_loss([first, second])
    params, batch = test_blocks._data()
    mean = mm.microbatch(loss, 0, test_blocks.BATCH // 4, argnum=1, schedule="1f1b", reduce="mean")
    step = mm.jit(jax.value_and_grad(mean))
    (region,) = step.executable(params, batch).partition.plan.regions.values()
    assert [_pipeline.stage_name(t) for t in region.stage_tasks] == ["first", "second"]
    assert_matches_unparallelized(step, loss, params, batch, TOL)


def _chain_program(length):
    """``x + 1`` applied ``length`` times, then ``sin``: one long chain of equations."""

    def f(x):
        for _ in range(length):
            x = x + 1.0
        return jnp.sin(x)

    return jax.make_jaxpr(f)(0.0).jaxpr.eqns


def test_hoisted_values_move_to_their_first_reader_in_dependency_order():
    def f(x, y):
        a = x * 2.0  # hoisted
        a2 = a * 3.0  # hoisted, reads the first
        b = y + 1.0
        return jnp.sin(a2 + b)

    mul, mul2, add, add2, sin = jax.make_jaxpr(f)(1.0, 2.0).jaxpr.eqns
    late = [True, True, False, False, False]
    moved, stacks, labels = _loops.at_first_use(
        [mul, mul2, add, add2, sin], list("abcde"), list("ABCDE"), late
    )
    assert moved == [add, mul, mul2, add2, sin]
    assert stacks == list("cabde") and labels == list("CABDE")


def test_a_chain_of_hoisted_values_longer_than_the_recursion_limit_is_reordered():
    """Thousands of hoisted equations in one chain (a deep preprocessing of a weight) are
    released without recursion: Python's default limit is 1,000 frames."""
    length = 3000
    eqns = _chain_program(length)
    late = [True] * length + [False]
    moved, _, _ = _loops.at_first_use(eqns, [""] * len(eqns), [None] * len(eqns), late)
    assert moved == eqns  # each addition just before its reader, the chain's order kept
