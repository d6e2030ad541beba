"""Blocks (``trace/_blocks``): each microbatch's copy of a body traced once, as a few calls.

A two-stage chain of residual ``tanh`` layers, each stage on four devices with its input and
weight constrained inside the task, trained under a schedule over ``M`` microbatches. The
program keeps one ``closed_call`` per run of a task label for every microbatch, all copies
sharing one body; the results must equal the unparallelized step's (``ignore_transforms``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax.core.declare import Phase
from multimesh_flax.core.plan import microbatch_of
from multimesh_flax.core.run import OpKind
from multimesh_flax.core.trace import _blocks, block_body, is_block
from tests.core._chain import assert_matches_unparallelized, chain_loss

TOL = {"rtol": 2e-5, "atol": 2e-6}
BATCH, M = 16, 4
RULES = (("batch", "x"), ("model", "x"))


def _layer(w, h):
    h = mm.with_sharding_constraint(h, P("batch", None))
    w = mm.with_sharding_constraint(w, P(None, "model"))
    return h + 0.5 * jnp.tanh(h @ w) * jnp.cos(h @ w)


def _loss(stages=2):
    size = 8 // stages
    meshes = [
        mm.TaskMesh(devices=list(range(size * s, size * s + size)), axis_names=("x",))
        for s in range(stages)
    ]
    tasks = [
        mm.task(_layer, name=f"layer{s}", mesh=meshes[s], logical_axes=RULES) for s in range(stages)
    ]

    return chain_loss(tasks)


def _data(stages=2):
    keys = jax.random.split(jax.random.key(11), stages + 2)
    params = [jax.random.normal(k, (8, 8)) / 3 for k in keys[:stages]]
    batch = (jax.random.normal(keys[-2], (BATCH, 8)), jax.random.normal(keys[-1], (BATCH, 8)))
    return params, batch


def _step(schedule, m=M, stages=2):
    loss = _loss(stages)
    mean = mm.microbatch(loss, 0, BATCH // m, argnum=1, schedule=schedule, reduce="mean")
    return mm.jit(jax.value_and_grad(mean)), loss


def _by_microbatch(traced):
    """The program's task equations (glue and sums left out) grouped by microbatch index."""
    groups: dict[int, list] = {}
    for eqn, stack, label in zip(traced.jaxpr.eqns, traced.stacks, traced.labels, strict=True):
        mb = microbatch_of(stack, traced.microbatch_calls)
        if mb is not None and label is not None:
            groups.setdefault(mb[1], []).append(eqn)
    return groups


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h2"])
def test_blocked_steps_compute_what_the_unparallelized_step_computes(schedule):
    step, loss = _step(schedule)
    assert_matches_unparallelized(step, loss, *_data(), TOL)


def test_each_microbatch_is_a_few_blocks_sharing_one_body_per_run():
    step, _ = _step("1f1b")
    params, batch = _data()
    traced = step.executable(params, batch).partition.traced
    # A task's constraint on its loop-invariant weight is hoisted out of the microbatch loop
    # and recomputed per microbatch (trace/_loops): one equation, not a block.
    groups = {
        k: [e for e in eqns if e.primitive.name != "sharding_constraint"]
        for k, eqns in _by_microbatch(traced).items()
    }
    assert sorted(groups) == list(range(M))
    # Forward and backward of each of the two tasks: one block per run.
    assert all(_blocks.is_block(e) for e in groups[0]) and len(groups[0]) >= 4
    bodies = {k: [block_body(e) for e in eqns] for k, eqns in groups.items()}
    for k in range(1, M):
        assert len(bodies[k]) == len(bodies[0])
        assert all(a is b for a, b in zip(bodies[k], bodies[0], strict=True))
    assert sum(len(body.eqns) for body in bodies[0]) > 4 * len(bodies[0])


def test_zero_bubble_blocks_keep_activation_and_weight_gradients_apart():
    """``zero-bubble-h2`` splits each backward into B (feeding the previous stage) and W
    after tracing; a block mixing the two would be all B, leaving W nothing to fill bubbles."""
    step, _ = _step("zero-bubble-h2")
    params, batch = _data()
    part = step.executable(params, batch).partition
    phases = {
        (label.task, facts.unit.phase)
        for eqn, label, facts in zip(
            part.traced.jaxpr.eqns, part.traced.labels, part.plan.equations, strict=True
        )
        if is_block(eqn) and facts.unit is not None
    }
    first, last = sorted({task for task, _ in phases})
    # The last stage's backward has both halves; the first stage's feeds no other stage.
    assert {(last, Phase.F), (last, Phase.B), (last, Phase.W)} <= phases
    assert {(first, Phase.F), (first, Phase.W)} <= phases


def test_a_constraint_inside_a_block_sets_where_the_parameter_arrives():
    step, _ = _step("gpipe")
    params, batch = _data()
    (w_shardings, _), _ = step.input_shardings(params, batch)
    for s, sharding in enumerate(w_shardings):
        assert sorted(d.id for d in sharding.device_set) == list(range(4 * s, 4 * s + 4))
        assert sharding.spec == P(None, "x")


def test_identical_stages_and_microbatches_share_executables():
    """The middle stages of four run the same blocks on different submeshes: one program,
    with the constraints inside their blocks on the abstract mesh (``run/_compile``)."""
    programs = {}
    for m in (2, 4):
        step, _ = _step("gpipe", m, stages=4)
        params, batch = _data(stages=4)
        exe = step.executable(params, batch)
        runs = [op for op in exe.ops if op.kind is OpKind.RUN and op.name.startswith("layer")]
        programs[m] = {(op.name.split("[")[0], op.place): op.program for op in runs}
    assert programs[2].keys() == programs[4].keys()
    middle = {name: fn for (name, _), fn in programs[4].items() if name[:6] in ("layer1", "layer2")}
    assert set(middle) == {"layer1.fwd", "layer2.fwd", "layer1.bwd", "layer2.bwd"}
    assert middle["layer1.fwd"] is middle["layer2.fwd"]
    assert middle["layer1.bwd"] is middle["layer2.bwd"]


def _pinned_step(onto):
    """``_step("1f1b")`` with each stage's weight also constrained outside its task onto
    the submesh of stage ``onto(s)`` (as ``parallelize_step`` lays gradients out): each
    microbatch's backward then constrains the weight's gradient there, outside every task."""
    meshes = [
        Mesh(np.array(jax.devices()[4 * s : 4 * s + 4]), ("x",), axis_types=(AxisType.Auto,))
        for s in range(2)
    ]
    tasks = [
        mm.task(_layer, name=f"layer{s}", mesh=meshes[s], logical_axes=RULES) for s in range(2)
    ]

    def loss(params, batch):
        pinned = [
            jax.lax.with_sharding_constraint(w, NamedSharding(meshes[onto(s)], P(None, "x")))
            for s, w in enumerate(params)
        ]
        return chain_loss(tasks)(pinned, batch)

    mean = mm.microbatch(loss, 0, BATCH // M, argnum=1, schedule="1f1b", reduce="mean")
    return mm.jit(jax.value_and_grad(mean))


def _glue_constraints_of_task_results(step):
    """Per microbatch, the glue ``sharding_constraint``\\ s reading a block's result."""
    traced = step.executable(*_data()).partition.traced
    made_by_block = {v for e in traced.jaxpr.eqns if is_block(e) for v in e.outvars}
    found: dict[int, int] = {}
    for eqn, stack, label in zip(traced.jaxpr.eqns, traced.stacks, traced.labels, strict=True):
        mb = microbatch_of(stack, traced.microbatch_calls)
        constraint = eqn.primitive.name == "sharding_constraint"
        if mb is not None and label is None and constraint and eqn.invars[0] in made_by_block:
            found[mb[1]] = found.get(mb[1], 0) + 1
    return found


def test_a_gradient_constraint_onto_its_own_stage_joins_the_backward_block():
    """``_blocks._constraints_joining_their_task``: constrained onto its own stage's submesh,
    each microbatch's weight gradient is constrained inside the backward's block (no glue
    equation per parameter and microbatch); onto the other stage's, it stays glue and moves
    there. Either way the step equals the unparallelized one (the loss without the pins:
    on one device they change nothing)."""
    own, other = _pinned_step(lambda s: s), _pinned_step(lambda s: 1 - s)
    assert _glue_constraints_of_task_results(own) == {}
    assert _glue_constraints_of_task_results(other) == dict.fromkeys(range(M), 2)
    for step in (own, other):
        assert_matches_unparallelized(step, _loss(), *_data(), TOL)
