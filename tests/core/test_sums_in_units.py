"""Gradient sums over microbatches run inside the units that make the gradients
(``fragment._sums``).

A two-stage model of three parameters per stage (devices 0 and 1), trained with SGD and
momentum, the state donated. Each program is built with the move on and off
(``_sums.ENABLED``): the moved one must train like the unparallelized step (no
microbatching, ``ignore_transforms``) and bit for bit like the unmoved one, run each
microbatch's additions in the unit that made its gradients, with one op fewer per
addition that ran as glue of its own, and compile no more programs. On one-device stages the
running sums are then packed into one flat array per chain (``fragment._packed_sums``): bit
for bit the same training, fewer arrays per gradient op, no op or program more, the final
sums sliced out at offsets the slicing glue takes as inputs (not literals). On stages
whose rows are sharded over all their devices (data parallel) the chains carry per-device
partial sums (``fragment._stacked_sums``): the units all-reduce nothing, the results equal
the unstacked and unparallelized steps' up to rounding. On stages whose rows are sharded
over ``data`` and parameters over ``model`` (tensor parallel too), each gradient keeps a
stack of its own in its layout: the units all-reduce only the activations over ``model``.
Other submeshes pack nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax.core.declare import Phase
from multimesh_flax.core.fragment import _packed_sums, _stacked_sums, _sums
from multimesh_flax.core.plan import is_bundle
from multimesh_flax.core.run import OpKind
from tests.core._chain import (
    backward_all_reduce_operands,
    tanh_stage,
    tanh_stages_data,
    train,
    train_step,
)

TOL = {"rtol": 2e-5, "atol": 2e-6}
M = 4
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


def _sharded_stage(p, x):
    """``tanh_stage`` with its rows sharded over the ``batch`` axes (``_loss``'s rules)."""
    return tanh_stage(p, mm.with_sharding_constraint(x, P("batch", None)))


def _loss(stages, devices=1, batch=None):
    """``stages`` stages of ``devices`` devices each, stage ``s`` on the ``s % 2``-th;
    ``batch``: the mesh axes (of ``data`` x ``model``) each stage shards its rows over."""
    shape = {"axis_sizes": (devices, 1), "axis_names": ("data", "model")}
    if batch == ("data",) and devices == 4:  # data parallel over two of the four devices
        shape["axis_sizes"] = (2, 2)
    meshes = [
        mm.TaskMesh(devices=[devices * (s % 2) + d for d in range(devices)], **shape)
        for s in range(2)
    ]
    stage = tanh_stage if batch is None else _sharded_stage
    rules = (("batch", batch),) if batch else None
    tasks = [
        mm.task(stage, name=f"stage{s}", mesh=meshes[s % 2], logical_axes=rules)
        for s in range(stages)
    ]

    def loss(params, x):
        for task, p in zip(tasks, params, strict=True):
            x = task(p, x)
        return jnp.mean(x**2)

    return loss


def _data(stages):
    return tanh_stages_data(3, stages)


def _build(schedule, stages, enabled, monkeypatch, pack=False, devices=1, batch=None, stack=True):
    """The step, its executable and the unmicrobatched loss; ``pack``: one flat running sum
    per chain (``_packed_sums``; off here, so the sums' structure shows), ``stack``: on
    data-parallel stages as per-device partial sums (``_stacked_sums``)."""
    monkeypatch.setattr(_sums, "ENABLED", enabled)
    monkeypatch.setattr(_sums, "PACK", pack)
    monkeypatch.setattr(_sums, "STACK", stack)
    loss = _loss(stages, devices, batch)
    options = {"interleave": 2} if schedule == "interleaved-1f1b" else {}
    mb_loss = mm.microbatch(loss, 0, M, argnum=1, schedule=schedule, reduce="mean", **options)
    step = mm.jit(train_step(mb_loss, OPTIMIZER), donate_argnums=(0, 1))
    params, x = _data(stages)
    return step, step.executable(params, OPTIMIZER.init(params), x), loss


def _train(step, stages):
    return train(step, OPTIMIZER, _data(stages))


def _reference(loss, stages):
    return train(loss, OPTIMIZER, _data(stages), unparallelized=True)


def _gradient_units(partition, schedule):
    """Per ``(place, stage)``, in dispatch order, the fragments running a unit that makes
    the stage's weight gradients: B, or W where the schedule splits the backward."""
    phase = Phase.W if schedule.startswith("zero-bubble") else Phase.B
    units: dict[tuple, list] = {}
    for f in partition.fragments:
        for p in f.parts or (f,):
            if p.unit is not None and p.unit.phase is phase:
                units.setdefault((f.place, p.unit.stage), []).append(f)
    return units


def _running_sum_glue(partition):
    """Glue fragments that hold only sums over microbatches, bundles among them."""
    return [
        f
        for f in partition.fragments
        if f.unit is None
        and all(is_bundle(e) or e.primitive.name in ("add", "add_any") for e in f.eqns)
        and any(is_bundle(e) for e in f.eqns)
    ]


def _programs(executable):
    return len({(id(op.program), op.place) for op in executable.ops if op.kind is OpKind.RUN})


LAYOUTS = [("gpipe", 2), ("1f1b", 2), ("zero-bubble-h1", 2), ("interleaved-1f1b", 4)]


@pytest.mark.parametrize(("schedule", "stages"), LAYOUTS)
def test_each_microbatch_sums_its_gradients_in_the_unit_making_them(schedule, stages, monkeypatch):
    step_off, off, _ = _build(schedule, stages, False, monkeypatch)
    step, on, loss = _build(schedule, stages, True, monkeypatch)
    trained = _train(step, stages)
    reference = _reference(loss, stages)
    for got, want in zip(jax.tree.leaves(trained), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, want, **TOL)
    unmoved = _train(step_off, stages)
    for got, want in zip(jax.tree.leaves(trained), jax.tree.leaves(unmoved), strict=True):
        np.testing.assert_array_equal(got, want)  # the same additions in the same order
    assert _running_sum_glue(off.partition)
    assert not _running_sum_glue(on.partition)
    units = _gradient_units(on.partition, schedule)
    assert len(units) == stages
    for key, frags in units.items():
        assert len(frags) == M, (key, [f.index for f in frags])
        # Every unit adds its three gradients to the running sums (in bundles, one per
        # block making some of them), consuming the running sums the previous unit returned;
        # the first one starts from zeros made by a glue fragment right before it. (The
        # loss's scalar sum is a bundle of its own.)
        counts = [
            sum(len(e.outvars) for e in f.eqns if is_bundle(e) and e.outvars[0].aval.shape)
            for f in frags
        ]
        assert counts == [3] * M, (key, counts)
        for before, after in zip(frags, frags[1:], strict=False):
            assert len(set(after.donate) & set(before.outvars)) == 3, (key, after.index)
        zeros = on.partition.fragments[on.partition.fragments.index(frags[0]) - 1]
        assert zeros.unit is None, zeros.index
        # Its one input is the constant 0 placed on its place: it fills the sums with it.
        assert [(v, int(x)) for v, x in zeros.consts] == [(zeros.invars[0], 0)], zeros.index
        assert len(set(frags[0].donate) & set(zeros.outvars)) == 3, key
    # Every microbatch's copy of a unit runs one program, as before.
    programs: dict[tuple, set] = {}
    for op in on.ops:
        if op.kind is OpKind.RUN and op.units:
            key = (op.place, tuple((u.stage, u.phase) for u in op.units))
            programs.setdefault(key, set()).add(id(op.program))
    assert all(len(p) == 1 for p in programs.values()), programs
    runs_off = [op for op in off.ops if op.kind is OpKind.RUN]
    runs_on = [op for op in on.ops if op.kind is OpKind.RUN]
    # One op fewer per addition that ran on its own, one more per chain's zeros.
    donated = {v for f in on.partition.fragments for v in f.donate}
    zeros = [
        f
        for f in on.partition.fragments
        if f.unit is None and f.consts and f.outvars and set(f.outvars) <= donated
    ]
    assert len(zeros) >= stages, [f.index for f in zeros]
    assert len(runs_on) == len(runs_off) - len(_running_sum_glue(off.partition)) + len(zeros)
    assert _programs(on) <= _programs(off)
    # Zeros of the same shapes are one program on both places: compiled for one, relocated
    # to the other (a program without inputs could not be). The stages are alike, so some
    # shapes are made on both.
    homes, made = on.slot_homes(), {v for f in zeros for v in f.outvars}
    zero_ops = [op for op in runs_on if op.outs and all(homes[s][0] in made for s in op.outs)]
    alike: dict[tuple, list] = {}
    for op in zero_ops:
        alike.setdefault(tuple(homes[s][0].aval.shape for s in op.outs), []).append(op)
    assert all(len({id(op.program) for op in ops}) == 1 for ops in alike.values()), alike
    if schedule in ("gpipe", "1f1b"):  # one chain of three gradient sums a place
        assert any(len({op.place for op in ops}) == 2 for ops in alike.values()), alike


def _arrays_per_op(executable, schedule):
    """Per RUN op of a unit making weight gradients (in dispatch order), its arrays in + out."""
    phase = Phase.W if schedule.startswith("zero-bubble") else Phase.B
    return [
        len(op.ins) + len(op.outs)
        for op in executable.ops
        if op.kind is OpKind.RUN and any(u.phase == phase for u in op.units)
    ]


@pytest.mark.parametrize(
    ("schedule", "stages"), [("1f1b", 2), ("zero-bubble-h1", 2), ("interleaved-1f1b", 4)]
)
def test_a_chain_on_one_device_carries_one_flat_running_sum(schedule, stages, monkeypatch):
    step_flat, flat, loss = _build(schedule, stages, True, monkeypatch, pack=True)
    step, unpacked, _ = _build(schedule, stages, True, monkeypatch, pack=False)
    trained = _train(step_flat, stages)
    for got, want in zip(
        jax.tree.leaves(trained), jax.tree.leaves(_train(step, stages)), strict=True
    ):
        np.testing.assert_array_equal(got, want)  # the same additions, element for element
    for got, want in zip(
        jax.tree.leaves(trained), jax.tree.leaves(_reference(loss, stages)), strict=True
    ):
        np.testing.assert_allclose(got, want, **TOL)
    for key, frags in _gradient_units(flat.partition, schedule).items():
        for before, after in zip(frags, frags[1:], strict=False):
            # One flat sum per chain, not a sum per gradient: 1F1B's backward makes all
            # three in one bundle (one flat sum of 78), zero-bubble's W makes w2's
            # gradient apart from w1's and b's (a flat sum of 42, and w2's sum unpacked).
            handed = set(after.donate) & set(before.outvars)
            flat_sums = [v.aval.size for v in handed if v.aval.ndim == 1]
            assert len(handed) < 3 and flat_sums, (key, after.index, handed)
            assert sum(v.aval.size for v in handed) == 6 * 6 + 6 + 6 * 6
    # Each gradient unit passes fewer arrays; the sums are sliced back inside the update's
    # glue: no op and no program more.
    packed_arrays, arrays = _arrays_per_op(flat, schedule), _arrays_per_op(unpacked, schedule)
    assert len(packed_arrays) == len(arrays) == stages * M
    assert all(a < b for a, b in zip(packed_arrays, arrays, strict=True)), (packed_arrays, arrays)
    assert len(flat.ops) == len(unpacked.ops)
    assert _programs(flat) == _programs(unpacked)
    _assert_offsets_are_inputs(flat)


def _makes_zeros(frag):
    """Whether ``frag`` fills a chain's first running sums from its one constant (``_sums``)."""
    (var, value), *more = frag.consts
    return not more and len(frag.eqns) == 1 and frag.eqns[0].invars == [var] and value == 0


def _assert_offsets_are_inputs(executable):
    """Each flat sum is sliced at offsets its glue takes as inputs, placed once (so XLA
    compiles one update kernel per gradient shape, not one per gradient): int32 scalars,
    the running sizes of the sums sliced out."""
    slicing = [f for f in executable.partition.fragments if f.consts and not _makes_zeros(f)]
    assert slicing
    for frag in slicing:
        assert frag.unit is None
        for var, value in frag.consts:
            assert var in frag.invars and var.aval.shape == () and value.dtype == np.int32
        consts = {id(v): value for v, value in frag.consts}
        unpacks = [e for e in frag.eqns if any(id(v) in consts for v in e.invars)]
        assert unpacks
        for eqn in unpacks:
            sizes = [v.aval.size for v in eqn.outvars]
            offsets = [int(consts[id(v)]) for v in eqn.invars[1:]]
            assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    assert len(executable.constant_slots()) >= sum(len(f.consts) for f in slicing)


def _all_reduces(executable, schedule, trained):
    """Per step, the all-reduces in the ops making weight gradients and in the other ops
    (the executable must have run: ``trained``)."""
    assert trained
    phase = Phase.W if schedule.startswith("zero-bubble") else Phase.B
    in_units = elsewhere = 0
    for index, op in enumerate(executable.ops):
        if op.kind is OpKind.RUN:
            count = executable.state.fns[index].as_text().count(" all-reduce(")
            if any(u.phase == phase for u in op.units):
                in_units += count
            else:
                elsewhere += count
    return in_units, elsewhere


@pytest.mark.parametrize(
    ("schedule", "stages"), [("1f1b", 2), ("zero-bubble-h1", 2), ("interleaved-1f1b", 4)]
)
def test_a_data_parallel_stage_sums_its_gradients_per_device(schedule, stages, monkeypatch):
    """Two devices a stage, rows sharded over both: the units all-reduce nothing, each
    device adds up its own rows' gradients over the microbatches, and the update's glue
    all-reduces each chain once. The same sums in another order: equal to the unstacked
    step's and the unparallelized step's results up to rounding, no op or program more."""
    args = {"devices": 2, "batch": ("data",), "pack": True}
    step, stacked, loss = _build(schedule, stages, True, monkeypatch, **args)
    step_apart, apart, _ = _build(schedule, stages, True, monkeypatch, stack=False, **args)
    trained, trained_apart = _train(step, stages), _train(step_apart, stages)
    reference = _reference(loss, stages)
    leaves = map(jax.tree.leaves, (trained, reference, trained_apart))
    for got, want, other in zip(*leaves, strict=True):
        np.testing.assert_allclose(got, want, **TOL)
        np.testing.assert_allclose(got, other, **TOL)
    in_units, elsewhere = _all_reduces(stacked, schedule, trained)
    in_units_apart, elsewhere_apart = _all_reduces(apart, schedule, trained_apart)
    assert in_units == 0 < in_units_apart, (in_units, in_units_apart)
    # At most one all-reduce more per chain, in the glue reading its sums (XLA combines a
    # fragment's into one): a chain a stage, two under zero-bubble (W makes w2's apart).
    chains = stages * (2 if schedule == "zero-bubble-h1" else 1)
    assert elsewhere - elsewhere_apart <= chains, (elsewhere, elsewhere_apart)
    assert elsewhere > elsewhere_apart
    assert len(stacked.ops) == len(apart.ops)
    assert _programs(stacked) == _programs(apart)
    _assert_offsets_are_inputs(stacked)


@pytest.mark.parametrize(
    ("devices", "batch"), [(2, None), (4, ("data",))], ids=["rows-unsharded", "tensor-parallel"]
)
def test_a_chain_on_a_submesh_not_data_parallel_keeps_a_running_sum_per_gradient(
    devices, batch, monkeypatch
):
    """Rows not sharded (nothing to keep per device), or sharded over only some of the
    devices (the others would gather a tensor-parallel stage's gradients to stack them):
    every gradient op passes the same arrays as unpacked."""
    args = {"devices": devices, "batch": batch}
    _, flat, _ = _build("1f1b", 2, True, monkeypatch, pack=True, **args)
    _, unpacked, _ = _build("1f1b", 2, True, monkeypatch, pack=False, **args)
    assert _arrays_per_op(flat, "1f1b") == _arrays_per_op(unpacked, "1f1b")


def _tensor_parallel_loss():
    """Two stages of four devices each, ``data`` 2 x ``model`` 2: rows over ``data``, each
    stage's parameters split over ``model`` (Megatron's column then row split) by
    constraints whose transposes lay each microbatch's gradients out the same way."""
    rules = (("batch", ("data",)), ("hidden", ("model",)))
    shape = {"axis_sizes": (2, 2), "axis_names": ("data", "model")}
    meshes = [mm.TaskMesh(devices=[4 * s + d for d in range(4)], **shape) for s in range(2)]

    def stage(p, x):
        x = mm.with_sharding_constraint(x, P("batch", None))
        w1 = mm.with_sharding_constraint(p["w1"], P(None, "hidden"))
        b = mm.with_sharding_constraint(p["b"], P("hidden"))
        w2 = mm.with_sharding_constraint(p["w2"], P("hidden", None))
        return jnp.tanh(x @ w1 + b) @ w2

    tasks = [
        mm.task(stage, name=f"stage{s}", mesh=mesh, logical_axes=rules)
        for s, mesh in enumerate(meshes)
    ]

    def loss(params, x):
        for task, p in zip(tasks, params, strict=True):
            x = task(p, x)
        return jnp.mean(x**2)

    return loss


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_tensor_parallel_stage_sums_its_gradients_per_data_row(schedule, monkeypatch):
    """Rows over ``data``, parameters over ``model``: each gradient's running sum is a stack
    of the ``data`` rows' partial sums laid out as the gradient (``P("data", *spec)``), so
    the backwards all-reduce only what the tensor split needs (activations over ``model``),
    not the gradients over ``data``; the update's glue adds the rows. Equal to the unstacked
    and unparallelized steps' results up to rounding, with no op or program more."""
    runs = _stacked_and_apart(
        _tensor_parallel_loss(), functools.partial(_data, 2), schedule, monkeypatch
    )
    executable, executable_apart = runs[True][1], runs[False][1]
    operands, operands_apart = map(backward_all_reduce_operands, (executable, executable_apart))
    # Three gradients a stage and microbatch no longer all-reduced over ``data``.
    assert operands_apart - operands == 3 * 2 * M, (operands, operands_apart)
    assert len(executable.ops) == len(executable_apart.ops)
    assert _programs(executable) == _programs(executable_apart)


def _stacked_and_apart(loss, data, schedule, monkeypatch):
    """Per ``STACK`` setting (chains packed), ``(trained, executable)``: ``loss``
    microbatched and trained on ``data()``; each run equal to the other and to the
    unparallelized training up to rounding."""
    monkeypatch.setattr(_sums, "PACK", True)
    mb_loss = mm.microbatch(loss, 0, M, argnum=1, schedule=schedule, reduce="mean")
    runs = {}
    for stack in (True, False):
        monkeypatch.setattr(_sums, "STACK", stack)
        step = mm.jit(train_step(mb_loss, OPTIMIZER), donate_argnums=(0, 1))
        params, batch = data()
        executable = step.executable(params, OPTIMIZER.init(params), batch)
        runs[stack] = train(step, OPTIMIZER, data()), executable
    reference = train(loss, OPTIMIZER, data(), unparallelized=True)
    stacked, apart = (jax.tree.leaves(runs[stack][0]) for stack in (True, False))
    for got, want, other in zip(stacked, jax.tree.leaves(reference), apart, strict=True):
        np.testing.assert_allclose(got, want, **TOL)
        np.testing.assert_allclose(got, other, **TOL)
    return runs


def _laid_out(mesh, *specs):
    return [jax.sharding.NamedSharding(mesh, spec) for spec in specs]


@pytest.mark.parametrize(
    ("specs", "accepted"),
    [
        ((P(None, "model"), P()), True),
        ((P(None, "model"), None), False),
        ((P("data", "model"),), False),
        ((P(("data", "model")),), False),
        ((P(None, P.UNCONSTRAINED),), False),
    ],
    ids=["tensor-parallel", "unconstrained", "split-over-rows", "split-over-both", "left-open"],
)
def test_a_stack_per_gradient_needs_each_layout_and_leaves_the_rows_axes_free(specs, accepted):
    """Where the rows span only some of a place's devices, each gradient is stacked in its
    own layout: every layout must be known in full (the zeros are made in it) and leave the
    rows' axes to the stack (a gradient already split over ``data``, ZeRO-style, is left
    alone)."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    batch = _stacked_sums.Batch(mesh, ("data",), 2)
    shardings = None if None in specs else _laid_out(mesh, *specs)
    assert _packed_sums._accepts(4, shardings, batch) is accepted
    assert _packed_sums._accepts(2, shardings, batch)  # the rows span the place: one flat sum


VOCAB, WIDTH = 8, 6


def _tied_loss(devices=2):
    """An embedding table looked up on stage 0 (its gradient a scatter-add of rows into
    zeros) and read again, transposed, by stage 1's output layer (a tied table: the head's
    gradient moves to stage 0, where the stem's is added to it), each stage data parallel
    over its ``devices`` devices."""
    rules = (("batch", ("data",)),)
    shape = {"axis_sizes": (devices, 1), "axis_names": ("data", "model")}
    meshes = [
        mm.TaskMesh(devices=list(range(devices * s, devices * (s + 1))), **shape) for s in range(2)
    ]

    def stem(p, table, ids):
        x = mm.with_sharding_constraint(table[ids], P("batch", None, None))
        return jnp.tanh(x @ p["w"] + p["b"])

    def head(p, table, x):
        x = mm.with_sharding_constraint(x, P("batch", None, None))
        logits = jnp.tanh(x @ p["w"] + p["b"]) @ table.T
        return jnp.mean(jax.nn.log_softmax(logits) ** 2)

    first, last = (
        mm.task(f, name=f.__name__, mesh=mesh, logical_axes=rules)
        for f, mesh in zip((stem, head), meshes, strict=True)
    )

    def loss(params, ids):
        return last(params["head"], params["table"], first(params["stem"], params["table"], ids))

    return loss


def _tied_data():
    keys = iter(jax.random.split(jax.random.key(5), 6))

    def normal(*shape):
        return jax.random.normal(next(keys), shape) / 3

    params = {
        "table": normal(VOCAB, WIDTH),
        **{s: {"w": normal(WIDTH, WIDTH), "b": normal(WIDTH)} for s in ("stem", "head")},
    }
    return params, jax.random.randint(next(keys), (16, 5), 0, VOCAB)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_embedding_and_a_tied_table_are_summed_per_device(schedule, monkeypatch):
    """The stem's embedding gradient (a scatter-add of its rows) and the head's gradient of
    the tied table (read by the first stage, after the last stage's update glue slices it
    out) are summed per device too: no backward all-reduces, each equal to the unstacked
    and unparallelized steps' up to rounding."""
    runs = _stacked_and_apart(_tied_loss(), _tied_data, schedule, monkeypatch)
    in_units, _ = _all_reduces(runs[True][1], schedule, runs[True][0])
    in_units_apart, _ = _all_reduces(runs[False][1], schedule, runs[False][0])
    assert in_units == 0 < in_units_apart, (in_units, in_units_apart)


@pytest.mark.parametrize(("start", "stacks"), [(0.0, True), (1.0, False)], ids=["zeros", "ones"])
def test_only_a_scatter_into_zeros_is_summed_per_device(start, stacks):
    """Each device scatters its own rows into a table of its own: right only where the table
    starts as zeros (a table of ones would be added once per device)."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batches = {4: _stacked_sums.Batch(mesh, ("data",), 2)}

    def scatter(ids, rows):
        return jnp.full((VOCAB, WIDTH), start).at[ids].add(rows)

    body = jax.make_jaxpr(scatter)(jnp.zeros((4, 3), int), jnp.zeros((4, 3, WIDTH)))
    plan = _stacked_sums.plan_body(body, (0,), (), batches)
    assert (plan is not None) is stacks
    if stacks:
        rewritten = _stacked_sums.stacked_body(body, (0,), plan, batches[4])
        ids = jax.random.randint(jax.random.key(0), (4, 3), 0, VOCAB)
        rows = jax.random.normal(jax.random.key(1), (4, 3, WIDTH))
        (partial,) = jax.core.eval_jaxpr(rewritten.jaxpr, rewritten.consts, ids, rows)
        assert partial.shape == (2, VOCAB, WIDTH)
        np.testing.assert_allclose(partial.sum(0), scatter(ids, rows), **TOL)


def _own_or_packed(monkeypatch, limit, fold=True):
    """``(trained, executable)`` of the data-parallel two-stage 1F1B step (two devices a
    stage, chains packed and stacked) with sums of ``limit`` bytes or more keeping their own
    (``_packed_sums.OWN_SUM_BYTES``); ``fold``: weight gradients' transposes folded into
    their per-device dots (``_stacked_sums._folded_transposes``)."""
    monkeypatch.setattr(_packed_sums, "OWN_SUM_BYTES", {jax.default_backend(): limit})
    if not fold:
        monkeypatch.setattr(_stacked_sums, "_folded_transposes", lambda *_: {})
    step, executable, _ = _build(
        "1f1b", 2, True, monkeypatch, pack=True, devices=2, batch=("data",)
    )
    return _train(step, 2), executable


def _handed_running_sums(executable):
    """The shapes of the running sums one gradient unit hands the next, per stage."""
    shapes = set()
    for frags in _gradient_units(executable.partition, "1f1b").values():
        for before, after in zip(frags, frags[1:], strict=False):
            handed = set(after.donate) & set(before.outvars)
            shapes.add(tuple(sorted(v.aval.shape for v in handed)))
    return shapes


def _gradient_transposes(executable):
    """How many transposes the compiled units making weight gradients run in a step."""
    return sum(
        executable.state.fns[i].as_text().count(" transpose(")
        for i, op in enumerate(executable.ops)
        if op.kind is OpKind.RUN and any(u.phase == Phase.B for u in op.units)
    )


def test_a_big_gradient_keeps_a_running_sum_of_its_own_and_its_transpose_is_folded(
    monkeypatch,
):
    """A data-parallel stage's gradients of ``OWN_SUM_BYTES`` or more (here the 6 x 6
    weights, the limit lowered to 100 bytes) keep a stack of their own instead of being
    concatenated into the chain's flat sum (which copies each twice a link on XLA's CPU
    backend); the bias still joins a flat one. Each weight gradient is made by its
    per-device dot directly, not transposed after it. Equal to the all-packed, unfolded and
    unparallelized trainings up to rounding, with no op or program more."""
    trained, own = _own_or_packed(monkeypatch, 100)
    trained_packed, packed = _own_or_packed(monkeypatch, float("inf"), fold=False)
    reference = _reference(_loss(2, 2, ("data",)), 2)
    leaves = map(jax.tree.leaves, (trained, reference, trained_packed))
    for got, want, other in zip(*leaves, strict=True):
        np.testing.assert_allclose(got, want, **TOL)
        np.testing.assert_allclose(got, other, **TOL)
    assert _handed_running_sums(packed) == {((2, 78),)}  # 6 x 6 + 6 + 6 x 6 per device
    assert _handed_running_sums(own) == {((2, 6), (2, 6, 6), (2, 6, 6))}
    assert _all_reduces(own, "1f1b", trained)[0] == 0  # still summed per device
    assert _gradient_transposes(packed) > 0 == _gradient_transposes(own)
    assert len(own.ops) == len(packed.ops)
    assert _programs(own) == _programs(packed)


@pytest.mark.parametrize(("limit", "fewer"), [(float("inf"), 4), (150, 2), (100, 0)])
def test_one_device_packs_only_the_sums_below_the_limit(limit, fewer, monkeypatch):
    """On one-device stages of the tied model (each stage's chain: the table's share of 192
    bytes, a weight's 144, a bias's 24), the sums under the limit join one flat sum, the
    others keep their own, and a lone small sum is not packed at all: ``fewer`` arrays in
    and out of each gradient op than unpacked (two per sum packed beyond the first), the
    same training bit for bit."""
    monkeypatch.setattr(_packed_sums, "OWN_SUM_BYTES", {jax.default_backend(): limit})
    monkeypatch.setattr(_sums, "ENABLED", True)
    runs = {}
    for pack in (True, False):
        monkeypatch.setattr(_sums, "PACK", pack)
        loss = _tied_loss(devices=1)
        mb_loss = mm.microbatch(loss, 0, M, argnum=1, schedule="1f1b", reduce="mean")
        step = mm.jit(train_step(mb_loss, OPTIMIZER), donate_argnums=(0, 1))
        params, ids = _tied_data()
        executable = step.executable(params, OPTIMIZER.init(params), ids)
        runs[pack] = train(step, OPTIMIZER, _tied_data()), _arrays_per_op(executable, "1f1b")
    packed, unpacked = runs[True][1], runs[False][1]
    assert [b - a for a, b in zip(packed, unpacked, strict=True)] == [fewer] * len(packed)
    for got, want in zip(*(jax.tree.leaves(runs[p][0]) for p in (True, False)), strict=True):
        np.testing.assert_array_equal(got, want)
