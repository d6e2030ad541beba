"""Transfers after their first call (``run._ops.Move``): one C++ copy where a value's shards
map one to one onto the target's devices, ``jax.device_put`` otherwise, and the same arrays
either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax.core.run._ops import Move, PutOp

AUTO = (AxisType.Auto,)


def _mesh(first: int):
    return jax.make_mesh((2,), ("x",), AUTO, devices=jax.devices()[first : first + 2])


def _values():
    a = _mesh(0)
    x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(a, P("x")))
    y = jax.device_put(jnp.asarray(3.0), NamedSharding(a, P()))  # weakly typed scalar
    z = jax.device_put(jnp.arange(6, dtype=jnp.int32), NamedSharding(a, P("x")))
    return [x, y, z]


def _assert_same_arrays(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.sharding == w.sharding
        assert g.aval == w.aval  # typed as device_put types it: no retrace downstream
        assert (g.dtype, g.shape, g.weak_type, g.committed) == (
            w.dtype,
            w.shape,
            w.weak_type,
            w.committed,
        )
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_move_between_equal_layouts_copies_as_device_put_does():
    values, b = _values(), _mesh(2)
    targets = [NamedSharding(b, P("x")), NamedSharding(b, P()), NamedSharding(b, P("x"))]
    move = Move(values, targets, jax.device_put(values, targets))
    assert move.direct
    _assert_same_arrays(move(values), jax.device_put(values, targets))
    _assert_same_arrays(move(tuple(values)), jax.device_put(values, targets))


def test_a_one_device_output_is_typed_and_committed_as_device_put_makes_it():
    # A program's output on one device: typed on no mesh, and not committed.
    values = [jax.jit(lambda a: a * 2)(jnp.arange(3.0))]
    one = jax.make_mesh((1,), ("devices",), AUTO, devices=jax.devices()[1:2])
    targets = [NamedSharding(one, P())]
    move = Move(values, targets, jax.device_put(values, targets))
    assert move.direct
    _assert_same_arrays(move(values), jax.device_put(values, targets))


def test_specs_that_shard_alike_move_directly():
    # P("x") and P("x", None) lay out a 2-D array alike: shard k is still shard k.
    values, b = _values(), _mesh(2)
    targets = [NamedSharding(b, P("x", None)), NamedSharding(b, P()), NamedSharding(b, P("x"))]
    move = Move(values, targets, jax.device_put(values, targets))
    assert move.direct
    _assert_same_arrays(move(values), jax.device_put(values, targets))


def test_equal_shardings_in_new_objects_keep_the_direct_copy(monkeypatch):
    # A step's inputs come from the caller at the first call and from the previous step's
    # outputs later: equal shardings and types, other sharding objects. Those calls still
    # copy directly; values typed otherwise (a weak scalar made strong) go to device_put.
    x, y, z = _values()
    b = _mesh(2)
    targets = [NamedSharding(b, P("x")), NamedSharding(b, P()), NamedSharding(b, P("x"))]
    move = Move([x, y, z], targets, jax.device_put([x, y, z], targets))
    fresh = [
        jax.device_put(np.asarray(v), NamedSharding(_mesh(0), v.sharding.spec)) for v in (x, y, z)
    ]
    assert all(a.sharding is not v.sharding for a, v in zip(fresh, (x, y, z), strict=True))
    again = [fresh[0], y, fresh[2]]
    fallbacks = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: fallbacks.append(a) or real_put(*a, **k))
    moved, retyped = move(again), move(fresh)
    monkeypatch.undo()
    assert len(fallbacks) == 1  # only the call with the strongly typed scalar
    _assert_same_arrays(moved, jax.device_put(again, targets))
    _assert_same_arrays(retyped, jax.device_put(fresh, targets))


def test_prng_key_arrays_go_through_device_put():
    # A typed key array is no array of JAX's C++ type: its copy is device_put's, every call.
    a, b = _mesh(0), _mesh(2)
    keys = [jax.device_put(jax.random.split(jax.random.key(0), 4), NamedSharding(a, P("x")))]
    targets = [NamedSharding(b, P("x"))]
    move = Move(keys, targets, jax.device_put(keys, targets))
    assert not move.direct
    again = [jax.device_put(jax.random.split(jax.random.key(1), 4), NamedSharding(a, P("x")))]
    got, want = move(again)[0], jax.device_put(again, targets)[0]
    assert got.sharding == want.sharding and got.dtype == want.dtype
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))


def test_a_move_to_another_layout_goes_through_device_put():
    values, b = _values(), _mesh(2)
    targets = [NamedSharding(b, P()), NamedSharding(b, P()), NamedSharding(b, P())]
    move = Move(values, targets, jax.device_put(values, targets))
    assert not move.direct
    _assert_same_arrays(move(values), jax.device_put(values, targets))


def test_values_arriving_in_another_layout_still_arrive_right():
    values, b = _values(), _mesh(2)
    targets = [NamedSharding(b, P("x")), NamedSharding(b, P()), NamedSharding(b, P("x"))]
    move = Move(values, targets, jax.device_put(values, targets))
    # A later call's values replicated, not split: copying their shards one to one would
    # mislabel them, so this call must not take the first call's direct copy.
    replicated = [jax.device_put(v, NamedSharding(_mesh(0), P())) for v in values]
    _assert_same_arrays(move(replicated), jax.device_put(replicated, targets))


def test_a_pipeline_s_transfers_move_directly_and_compute_the_same():
    f = mm.task(lambda x: jnp.sin(x) * 2, mesh=mm.TaskMesh(devices=[0]))
    g = mm.task(lambda x: x @ x.T + 1, mesh=mm.TaskMesh(devices=[1]))
    step = mm.jit(lambda x: g(f(x)))
    x = jnp.arange(12.0).reshape(3, 4) / 7
    want = jax.jit(lambda x: (jnp.sin(x) * 2) @ (jnp.sin(x) * 2).T + 1)(x)
    for _ in range(3):  # the first call fixes each transfer's move, later ones use it
        np.testing.assert_allclose(np.asarray(step(x)), np.asarray(want), rtol=1e-6, atol=1e-6)
    exe = step.executable(x)
    moves = [exe.state.fns[i] for i, op in enumerate(exe.ops) if isinstance(op, PutOp)]
    assert moves and all(isinstance(m, Move) and m.direct for m in moves)
