"""Placement-aware ``tabulate``: what it reports equals where ``parallelize_step`` puts
parameters, and producing it compiles nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import layers
from tests.layers._models import RULES, STAGE0, MLPBlock, Pipeline

X, Y = jnp.ones((8, 16)), jnp.zeros((8, 16))


def test_table_has_flax_summary_and_placement():
    text = layers.tabulate(Pipeline(), jax.random.key(0), X, Y, depth=1)
    for expected in ("Pipeline Summary", "Task[MLPBlock]", "Parameter placement", "Per device"):
        assert expected in text
    assert "layer_0/Dense_0/kernel" in text and "P('x', 'y')" in text


def test_rows_give_specs_tasks_devices_and_bytes():
    placement = layers.get_placement(Pipeline(), jax.random.key(0), X, Y)
    rows = {p.path: p for p in placement.params}
    kernel = rows["layer_1/Dense_0/kernel"]
    assert kernel.logical == P("data", "model")
    assert kernel.mesh_spec == P("x", "y")
    assert kernel.task == "layer_1"
    assert kernel.device_ids == (4, 5, 6, 7)
    assert kernel.bytes_per_device == 16 * 32 * 4 // 4
    per_task = placement.per_task()
    assert per_task["layer_0"]["devices"] == (0, 1, 2, 3)
    assert per_task["layer_0"]["params"] == per_task["layer_1"]["params"] == 2 * (16 * 32) + 48


class WithGlueHead(nn.Module):
    """A task body followed by a plain (untasked) Dense: it sits where it is first used."""

    @nn.compact
    def __call__(self, x):
        x = layers.task(MLPBlock, mesh=STAGE0, logical_axes=RULES)(name="body")(x)
        return jnp.mean(nn.Dense(4, name="head")(x) ** 2)


def _state_bytes_per_device(params):
    totals = {}
    for leaf in jax.tree_util.tree_leaves(params):
        for shard in leaf.addressable_shards:
            totals[shard.device.id] = totals.get(shard.device.id, 0) + shard.data.nbytes
    return dict(sorted(totals.items()))


def test_report_equals_parallelize_step_placement():
    for model, batch in ((Pipeline(), (X, Y)), (WithGlueHead(), X)):
        args = batch if isinstance(batch, tuple) else (batch,)
        placement = layers.get_placement(model, jax.random.key(0), *args)
        _, state, _ = layers.parallelize_step(model, optax.sgd(0.1), global_batch=batch)
        assert placement.bytes_per_device() == _state_bytes_per_device(state.params)
        flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
        for row, (_, leaf) in zip(placement.params, flat, strict=True):
            assert row.sharding.is_equivalent_to(leaf.sharding, leaf.ndim), row.path


def test_untasked_parameters_report_no_task_and_their_first_use():
    placement = layers.get_placement(WithGlueHead(), jax.random.key(0), X)
    head = {p.path: p for p in placement.params}["head/kernel"]
    assert head.task is None
    assert head.device_ids == (0, 1, 2, 3)


def test_uneven_logical_spec_is_reported_not_raised():
    mesh = mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("x", "y"))
    model = layers.task(nn.Dense, mesh=mesh)(features=16, kernel_init=layers.shard_axes("x", None))
    text = layers.tabulate(model, jax.random.key(0), jnp.ones((16, 9)))
    assert "does not divide evenly" in text


def test_placement_only_traces():
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    key = jax.random.key(0)
    model = Pipeline()
    x, y = jax.ShapeDtypeStruct((8, 16), np.float32), jax.ShapeDtypeStruct((8, 16), np.float32)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        layers.get_placement(model, key, x, y)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
