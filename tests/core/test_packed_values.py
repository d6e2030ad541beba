"""Small values a unit hands to another unit on its place travel as one array per dtype
(``fragment._packed_values``).

A two-stage MLP (devices 0 and 1, or two data-parallel devices a stage), trained with SGD and
momentum, built with the packing on and off (``_packed_values.ENABLED``). Packed, it must
train like the unparallelized step at tolerance and bit for bit like the unpacked one; every
forward hands its backward one array per dtype (and a value the zero-bubble schedule's B and
W both read, as it is); the ops and programs are as many as before. On data-parallel stages
each device packs its own rows: the units' programs communicate nothing they did not before.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax.core.fragment import _packed_values
from multimesh_flax.core.fragment._stacked_sums import Batch
from multimesh_flax.core.run import OpKind
from tests.core._chain import TOL, tanh_stage, tanh_stages_data, train, train_step

OPTIMIZER = optax.sgd(0.1, momentum=0.9)
M = 4


def _loss(devices):
    """Two stages of ``devices`` devices each; on two, rows sharded over ``data``."""
    meshes = [
        mm.TaskMesh(
            devices=[devices * s + d for d in range(devices)],
            axis_sizes=(devices,),
            axis_names=("data",),
        )
        for s in range(2)
    ]

    def stage(p, x):
        if devices > 1:
            x = mm.with_sharding_constraint(x, P("batch", None))
        return tanh_stage(p, x)

    rules = (("batch", "data"),) if devices > 1 else None
    tasks = [mm.task(stage, name=f"stage{s}", mesh=meshes[s], logical_axes=rules) for s in (0, 1)]

    def loss(params, x):
        for task, p in zip(tasks, params, strict=True):
            x = task(p, x)
        return jnp.mean(x**2)

    return loss


def _data():
    return tanh_stages_data(5, 2)


def _build(schedule, devices, enabled, monkeypatch):
    monkeypatch.setattr(_packed_values, "ENABLED", enabled)
    loss = _loss(devices)
    mb_loss = mm.microbatch(loss, 0, M, argnum=1, schedule=schedule, reduce="mean")
    step = mm.jit(train_step(mb_loss, OPTIMIZER))
    params, x = _data()
    return step, step.executable(params, OPTIMIZER.init(params), x), loss


def _handovers(partition):
    """Per pair of units on one place, the values the first hands to the second."""
    units = [f for f in partition.fragments if f.unit is not None]
    found = {}
    for maker in units:
        for reader in units:
            if reader is not maker and reader.place == maker.place:
                values = [v for v in reader.invars if v in set(maker.outvars)]
                if values:
                    found[(maker.index, reader.index)] = values
    return found


def _alone(executable, pair, values):
    """Of ``values`` handed over at ``pair``, those its reader alone reads (no other
    fragment, not the program's result) and does not donate."""
    fragments = executable.partition.fragments
    reader = next(f for f in fragments if f.index == pair[1])
    returned = set(executable.partition.traced.jaxpr.outvars)
    return [
        v
        for v in values
        if v not in reader.donate
        and v not in returned
        and sum(v in f.invars for f in fragments) == 1
    ]


def _run_ops(executable):
    return [op for op in executable.ops if op.kind is OpKind.RUN]


def _collectives(executable):
    """The collective instructions in every compiled program of ``executable``'s units."""
    found = []
    for op in _run_ops(executable):
        if op.units:
            for made in op.program._executables.values():
                for entry in made:
                    text = entry.compiled.as_text()
                    found += re.findall(r"(all-gather|all-to-all|collective-permute)\(", text)
    return found


CASES = [("gpipe", 1), ("zero-bubble-h1", 1), ("1f1b", 2)]


@pytest.mark.parametrize(("schedule", "devices"), CASES)
def test_a_forward_hands_its_backward_one_array_per_dtype(schedule, devices, monkeypatch):
    step_off, off, loss = _build(schedule, devices, False, monkeypatch)
    step, on, _ = _build(schedule, devices, True, monkeypatch)
    trained = train(step, OPTIMIZER, _data())
    reference = train(loss, OPTIMIZER, _data(), unparallelized=True)
    for got, want in zip(jax.tree.leaves(trained), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, want, **TOL)
    unpacked = train(step_off, OPTIMIZER, _data())
    for got, want in zip(jax.tree.leaves(trained), jax.tree.leaves(unpacked), strict=True):
        np.testing.assert_array_equal(got, want)  # the same computation, values moved
    before, after = _handovers(off.partition), _handovers(on.partition)
    assert before.keys() == after.keys()
    packed = 0
    for pair, values in before.items():
        alone, alone_after = _alone(off, pair, values), _alone(on, pair, after[pair])
        if len(alone) >= 2:  # all small, one dtype: one array instead
            assert len(alone_after) == 1, (pair, alone_after)
            assert len(after[pair]) == len(values) - len(alone) + 1, pair
            packed += 1
        else:  # a running sum, or values another unit reads too (zero-bubble's B and W)
            assert len(after[pair]) == len(values), pair
    assert packed >= M, before
    assert len(_run_ops(on)) == len(_run_ops(off))
    programs = {(id(op.program), op.place) for op in _run_ops(on)}
    assert len(programs) == len({(id(op.program), op.place) for op in _run_ops(off)})
    if devices > 1:  # each device packs its own rows: nothing is communicated for them
        assert sorted(_collectives(on)) == sorted(_collectives(off))


def test_values_too_large_or_not_laid_out_by_rows_stay_apart(monkeypatch):
    batch = Batch(
        mesh=jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,)), axes=("data",), size=2
    )
    small = jax.core.ShapedArray((4, 6), jnp.float32)
    assert _packed_values._layout(small, 1, {}) is None  # one device: raveled
    assert _packed_values._layout(small, 2, {4: batch}) is batch  # two: rows per device
    apart = _packed_values._APART
    assert _packed_values._layout(small, 2, {}) is apart  # no batch of its leading size
    assert _packed_values._layout(jax.core.ShapedArray((), jnp.float32), 2, {4: batch}) is apart
    monkeypatch.setattr(_packed_values, "SMALL_BYTES", 95)  # 96 bytes, 48 per device
    assert _packed_values._layout(small, 1, {}) is apart
    assert _packed_values._layout(small, 2, {4: batch}) is batch
