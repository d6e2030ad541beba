"""``tabulate`` / ``get_placement`` on NNX models: NNX's table plus placement columns."""

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors
from tests.layers._nnx_models import Net, device_ids, multi_mesh


def _placement():
    with multi_mesh():
        model = Net(16, rngs=nnx.Rngs(0))
        return model, mm.layers.get_placement(model, jnp.ones((8, 16)))


def test_every_variable_has_its_logical_spec_task_and_submesh():
    model, placement = _placement()
    rows = {p.path: p for p in placement.params}
    assert sorted(rows) == sorted(
        f"blocks/{s}/{layer}/{name}"
        for s in (0, 1)
        for layer in ("up", "down")
        for name in ("kernel", "bias")
    )
    up = rows["blocks/1/up/kernel"]
    assert up.logical == P("embed", "mlp") and up.mesh_spec == P(None, "model")
    assert up.task == "blocks/1" and up.device_ids == (4, 5, 6, 7)
    assert up.bytes_per_device == 16 * 64 * 4 // 2  # the model axis (2) splits the columns
    # the placement is where the variables really live
    kernel = model.blocks[1].up.kernel.get_value()
    assert tuple(device_ids(kernel)) == up.device_ids
    assert kernel.sharding.is_equivalent_to(up.sharding, 2)


def test_totals_per_task_and_device_add_up():
    _, placement = _placement()
    per_device = placement.bytes_per_device()
    assert sorted(per_device) == list(range(8))
    for device in range(8):
        stage = device // 4
        expected = sum(
            p.bytes_per_device for p in placement.params if p.path.startswith(f"blocks/{stage}/")
        )
        assert per_device[device] == expected
    assert set(placement.per_task()) == {"blocks/0", "blocks/1"}


def test_tabulate_prints_the_nnx_table_and_the_placement():
    with multi_mesh():
        model = Net(16, rngs=nnx.Rngs(0))
        text = mm.tabulate(model, jnp.ones((8, 16)))
    for expected in (
        "Net Summary",
        "Parameter placement",
        "P('embed', 'mlp')",
        "P(None, 'model')",
        "blocks/1",
        "4-7",
        "Per task",
        "Per device",
    ):
        assert expected in text


def test_a_class_is_a_typed_error():
    with pytest.raises(errors.TaskTypeError, match="NNX module instance"):
        mm.tabulate(Net, jnp.ones((8, 16)))
