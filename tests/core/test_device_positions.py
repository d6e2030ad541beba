"""Integer device positions are accepted wherever devices are (issue 17, item 7).

``task(devices=[0, 1])`` means ``mesh=TaskMesh(devices=[0, 1])`` (positions in the
executable's device list); ``jit``/``parallelize``/``MultiMesh(devices=...)`` take positions
in ``jax.devices()``. Each is compared with the same program given jax devices, and with the
unplaced program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import multimesh_flax as mm


def _ids(x):
    return sorted(d.id for d in x.devices())


def test_multimesh_takes_positions():
    by_position = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("a", "b"), devices=range(8))
    by_device = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("a", "b"), devices=jax.devices())
    assert by_position.devices.tolist() == by_device.devices.tolist()
    reversed_ = mm.MultiMesh(axis_sizes=(8,), axis_names=("x",), devices=range(7, -1, -1))
    assert [d.id for d in reversed_.devices] == list(range(7, -1, -1))


def test_task_devices_as_positions_equal_a_task_mesh():
    x = jnp.arange(8.0)
    by_position = mm.task(lambda v: v * 3, devices=[2, 3])
    by_mesh = mm.task(lambda v: v * 3, mesh=mm.TaskMesh(devices=[2, 3]))
    by_device = mm.task(lambda v: v * 3, devices=jax.devices()[2:4])
    outs = [mm.jit(lambda v, t=t: t(v) + 1)(x) for t in (by_position, by_mesh, by_device)]
    for out in outs:
        np.testing.assert_array_equal(out, x * 3 + 1)
        assert _ids(out) == [2, 3]
    eager = by_position(x)  # computed on devices 2-3, handed back uncommitted on the first
    assert _ids(eager) == [2] and not eager.committed


def test_task_positions_follow_jit_devices():
    shifted = mm.jit(mm.task(lambda v: v + 1, devices=[0]), devices=range(4, 8))
    out = shifted(jnp.zeros(2))
    assert _ids(out) == [4]


def test_jit_and_parallelize_take_positions():
    first = mm.task(lambda v: v * 2, mesh=mm.TaskMesh(devices=[0]))
    second = mm.task(lambda v: v + 1, mesh=mm.TaskMesh(devices=[1]))
    out = mm.jit(lambda v: second(first(v)), devices=[4, 5])(jnp.arange(3.0))
    np.testing.assert_array_equal(out, [1.0, 3.0, 5.0])
    assert _ids(out) == [5]
    fun, init = mm.parallelize(
        lambda w, b: second(first(w * b)),
        init_params=lambda: jnp.ones(3),
        initial_batch=jnp.ones(3),
        devices=[6, 7],
    )
    out = fun(init(), jnp.full(3, 2.0))
    np.testing.assert_array_equal(out, [5.0, 5.0, 5.0])
    assert _ids(out) == [7]


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = mm.layers.task(nn.Dense, devices=[4, 5])(4)(x)
        return (mm.layers.task(nn.Dense, devices=[6])(1)(x) ** 2).mean()


def test_flax_task_takes_positions():
    x = jnp.ones((8, 3))
    step, state, _ = mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=x)
    assert _ids(state.params["Dense_0"]["kernel"]) == [4, 5]
    assert _ids(state.params["Dense_1"]["kernel"]) == [6]
    params = jax.device_get(state.params)
    loss, _ = step(state, x)
    with mm.ignore_transforms():
        expected = _Net().apply({"params": params}, x)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)
