"""Glue that another submesh runs too is split off, so both run one program
(``fragment._shared_glue``).

Three one-device stages of one block each; the first also runs an embedding, the last a
head. Trained with Adam under GPipe, each stage updates its block's parameters in the
step's last glue fragment. With the split, the first and last stages update their block in
the program the middle stage runs (one program, relocated), and their embedding or head in
a small one of their own: one op more per split stage, no distinct program more, the
training that of the unparallelized step at tolerance and that of the unsplit one up to
XLA's rounding (one ulp where it compiles the smaller program's arithmetic differently).
Where the shared part would be the program of no other submesh (stages of two blocks and of
one), nothing is split. A fragment made by hand shows the scalars two parts share computed
in each.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax

import multimesh_flax as mm
from multimesh_flax.core.fragment import Fragment, _shared_glue, fragment_jaxpr
from multimesh_flax.core.run import OpKind
from tests.core._chain import TOL, train, train_step

OPTIMIZER = optax.adam(0.01)
WIDTH = 6


def _block(p, x):
    return jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"]


def _embed(p, x):
    return x * p["scale"] + p["shift"]


def _head(p, x):
    return x @ p["out"]


def _loss(blocks_per_stage):
    """Stage ``s`` on device ``s`` runs ``blocks_per_stage[s]`` blocks; the first stage
    starts with the embedding, the last ends with the head."""
    meshes = [mm.TaskMesh(devices=[s], axis_sizes=(1,), axis_names=("x",)) for s in range(3)]
    last = len(blocks_per_stage) - 1
    embed = mm.task(_embed, name="embed", mesh=meshes[0])
    head = mm.task(_head, name="head", mesh=meshes[last])
    blocks = [
        mm.task(_block, name=f"block{s}_{i}", mesh=meshes[s])
        for s, n in enumerate(blocks_per_stage)
        for i in range(n)
    ]

    def loss(params, x):
        x = embed(params["embed"], x)
        for block, p in zip(blocks, params["blocks"], strict=True):
            x = block(p, x)
        return jnp.mean(head(params["head"], x) ** 2)

    return loss


def _data(blocks):
    keys = iter(jax.random.split(jax.random.key(7), 3 * blocks + 4))

    def normal(*shape, scale=1.0):
        return jax.random.normal(next(keys), shape) * scale

    params = {
        "embed": {"scale": normal(WIDTH), "shift": normal(WIDTH)},
        "blocks": [
            {"w1": normal(WIDTH, WIDTH, scale=0.3), "b": normal(WIDTH), "w2": normal(WIDTH, WIDTH)}
            for _ in range(blocks)
        ],
        "head": {"out": normal(WIDTH, 3)},
    }
    return params, normal(16, WIDTH)


def _build(blocks_per_stage, enabled, monkeypatch):
    monkeypatch.setattr(_shared_glue, "ENABLED", enabled)
    loss = _loss(blocks_per_stage)
    batched = mm.microbatch(loss, 0, 4, argnum=1, schedule="gpipe", reduce="mean")
    step = mm.jit(train_step(batched, OPTIMIZER))
    params, x = _data(sum(blocks_per_stage))
    return step, step.executable(params, OPTIMIZER.init(params), x), loss


def _train(step, blocks):
    return train(step, OPTIMIZER, _data(blocks))


def _reference(loss, blocks):
    return train(loss, OPTIMIZER, _data(blocks), unparallelized=True)


def _places_per_program(executable):
    """Per program that ops run, the places they run it on."""
    places: dict[int, set] = {}
    for op in executable.ops:
        if op.kind is OpKind.RUN:
            places.setdefault(id(op.program), set()).add(op.place)
    return places


def _updates(executable):
    """The glue fragments outside every microbatch that hold an optimizer's update (more
    than a handful of equations), per place."""
    found: dict[frozenset, list] = {}
    for f in executable.partition.fragments:
        if f.unit is None and f.microbatch is None and len(f.eqns) > 8:
            found.setdefault(f.place, []).append(f)
    return found


def test_end_stages_update_their_blocks_in_the_middle_stages_program(monkeypatch):
    step_off, off, _ = _build((1, 1, 1), False, monkeypatch)
    step, on, loss = _build((1, 1, 1), True, monkeypatch)
    trained = _train(step, 3)
    for got, want in zip(
        jax.tree.leaves(trained), jax.tree.leaves(_reference(loss, 3)), strict=True
    ):
        np.testing.assert_allclose(got, want, **TOL)
    unsplit = _train(step_off, 3)  # XLA may round a smaller program differently: 1 ulp
    for got, want in zip(jax.tree.leaves(trained), jax.tree.leaves(unsplit), strict=True):
        np.testing.assert_allclose(got, want, rtol=3e-7, atol=1e-8)
    assert [len(fs) for fs in _updates(off).values()] == [1, 1, 1]
    assert sorted(len(fs) for fs in _updates(on).values()) == [1, 2, 2]
    assert len(on.ops) == len(off.ops) + 2  # one op more on each end stage
    on_programs, off_programs = _places_per_program(on), _places_per_program(off)
    assert len(on_programs) == len(off_programs)  # no distinct program more
    assert max(len(places) for places in on_programs.values()) == 3  # the blocks' update
    updates = _updates(on)
    (middle,) = next(parts for parts in updates.values() if len(parts) == 1)
    for parts in updates.values():
        shared = parts[0]
        assert len(shared.eqns) == len(middle.eqns) and len(shared.invars) == len(middle.invars)
        if len(parts) == 2:  # both parts read Adam's bias corrections (scalar inputs)
            scalars = [{v for v in part.invars if v.aval.dtype == jnp.float32} for part in parts]
            assert {v.aval.shape for v in scalars[0] & scalars[1]} == {()}


def test_glue_whose_shared_part_no_other_submesh_runs_stays_whole(monkeypatch):
    # Stage 0 updates two blocks, stage 1 one: a block's update recurs, but neither
    # stage's blocks as a whole is another's program, so a split would share nothing.
    _, off, _ = _build((2, 1), False, monkeypatch)
    _, on, _ = _build((2, 1), True, monkeypatch)
    assert len(on.ops) == len(off.ops)
    assert [len(fs) for fs in _updates(on).values()] == [1, 1]


def _glue(fun, place, *shapes):
    """``fun``'s jaxpr on ``shapes`` (float32) as one glue fragment on ``place``."""
    jaxpr = jax.make_jaxpr(fun)(*(jnp.zeros(shape) for shape in shapes)).jaxpr
    eqns, invars, outvars = list(jaxpr.eqns), list(jaxpr.invars), list(jaxpr.outvars)
    return Fragment(index=place, place=frozenset({place}), label=None, eqns=eqns,
                    invars=invars, outvars=outvars)  # fmt: skip


def test_each_part_computes_the_scalars_its_pieces_share():
    # Place 0 updates two arrays with one scalar it computes, place 1 the first array alone,
    # its equations written in another order: place 0 splits, each part with its own copy
    # of the scalar's equations, and both places run the first array's update in one order.
    def both(c, a, b):
        scale = jnp.cos(c) * 2.0
        moved = a * scale
        return moved + a**2, b * scale

    def one(c, a):
        square = a**2
        return (a * (jnp.cos(c) * 2.0) + square,)

    first, second = _glue(both, 0, (), (3,), (4,)), _glue(one, 1, (), (3,))
    outputs = [*first.outvars, *second.outvars]
    traced = types.SimpleNamespace(jaxpr=types.SimpleNamespace(outvars=outputs))
    split = _shared_glue.split_shared_glue(traced, [first, second], lambda place: ())
    assert split is not None and len(split) == 3
    shared, rest, same = split
    assert shared.outvars == first.outvars[:1] and rest.outvars == first.outvars[1:]
    assert rest.index != shared.index and same.outvars == second.outvars
    update = ["cos", "mul", "mul", "integer_pow", "add"]  # operands first, in operand order
    assert [e.primitive.name for e in shared.eqns] == update
    assert [e.primitive.name for e in same.eqns] == update
    assert [e.primitive.name for e in rest.eqns] == ["cos", "mul", "mul"]
    assert not {v for e in shared.eqns for v in e.outvars} & {
        v for e in rest.eqns for v in e.outvars
    }
    c, a, b = first.invars
    assert shared.invars == [c, a] and rest.invars == [c, b]
    x = [jnp.asarray(0.3), jnp.arange(3.0), jnp.arange(4.0)]
    run = lambda f, *args: jax.core.eval_jaxpr(fragment_jaxpr(f), [], *args)  # noqa: E731
    np.testing.assert_array_equal(run(shared, x[0], x[1])[0], run(first, *x)[0])
    np.testing.assert_array_equal(run(rest, x[0], x[2])[0], run(first, *x)[1])
    np.testing.assert_array_equal(run(same, x[0], x[1])[0], run(second, x[0], x[1])[0])
    alone = _shared_glue.split_shared_glue(traced, [first], lambda place: ())
    assert alone is None  # nothing else runs either part
