"""Tests for meshes (``core.declare._devices``, ``_multimesh``): MultiMesh, TaskMesh, slices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh

import multimesh_flax as mm
from multimesh_flax import errors


def _ids(mesh):
    return np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices).tolist()


# --- MultiMesh ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "names"),
    [((8,), ("x",)), ((2, 4), ("stage", "data")), ((2, 2, 2), ("stage", "batch", "model"))],
)
def test_multi_mesh_from_sizes_and_names(sizes, names):
    multi = mm.MultiMesh(axis_sizes=sizes, axis_names=names)
    assert multi.axis_names == names
    assert multi.axis_sizes == sizes
    assert dict(multi.shape) == dict(zip(names, sizes, strict=True))
    assert multi.size == 8
    assert multi.devices.shape == sizes
    assert multi.devices.reshape(-1).tolist() == jax.devices()
    assert isinstance(multi.mesh, Mesh)
    assert multi.mesh.axis_types == (AxisType.Auto,) * len(names)
    abstract = multi.abstract_mesh
    assert isinstance(abstract, AbstractMesh)
    assert abstract.axis_names == names
    assert tuple(abstract.axis_sizes) == sizes


def test_multi_mesh_uses_a_prefix_of_the_default_devices():
    multi = mm.MultiMesh(axis_sizes=(2, 2), axis_names=("a", "b"))
    assert _ids(multi) == [[0, 1], [2, 3]]


def test_multi_mesh_with_explicit_devices_in_any_shape():
    devices = np.array(jax.devices()[::-1]).reshape(2, 2, 2)
    multi = mm.MultiMesh(axis_sizes=(4, 2), axis_names=("a", "b"), devices=devices)
    assert _ids(multi) == [[7, 6], [5, 4], [3, 2], [1, 0]]


def test_multi_mesh_wraps_global_mesh_with_auto_axes():
    global_mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    multi = mm.MultiMesh(global_mesh=global_mesh)
    assert multi.axis_names == ("a", "b")
    assert multi.axis_sizes == (2, 4)
    assert _ids(multi) == _ids(global_mesh)
    assert multi.mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert multi.abstract_mesh.axis_types == (AxisType.Auto, AxisType.Auto)


@pytest.mark.parametrize(
    ("indices", "shape", "ids"),
    [
        ({"stage": 0}, (1, 2, 2), [[[0, 1], [2, 3]]]),
        ({"stage": 1}, (1, 2, 2), [[[4, 5], [6, 7]]]),
        ({"batch": 1}, (2, 1, 2), [[[2, 3]], [[6, 7]]]),
        ({"stage": 1, "model": 0}, (1, 2, 1), [[[4], [6]]]),
        ({}, (2, 2, 2), [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]),
    ],
)
def test_slice_keeps_sliced_axes_with_size_one(indices, shape, ids):
    multi = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "batch", "model"))
    sub = multi.slice(**indices)
    assert isinstance(sub, Mesh)
    assert sub.axis_names == ("stage", "batch", "model")
    assert sub.devices.shape == shape
    assert _ids(sub) == ids
    assert sub.axis_types == (AxisType.Auto,) * 3


# --- TaskMesh -------------------------------------------------------------------------------


def test_task_mesh_defaults_to_one_axis_named_devices():
    tm = mm.TaskMesh(devices=[3, 1])
    assert tm.devices == (3, 1)
    assert tm.axis_sizes == (2,)
    assert tm.axis_names == ("devices",)
    assert tm.shape == {"devices": 2}
    assert tm.size == 2


def test_task_mesh_default_names_for_several_axes():
    tm = mm.TaskMesh(devices=range(4), axis_sizes=(2, 2))
    assert tm.axis_names == ("axis_0", "axis_1")


def test_task_mesh_from_abstract_mesh():
    abstract = AbstractMesh((2, 2), ("p", "q"), axis_types=(AxisType.Auto,) * 2)
    tm = mm.TaskMesh(devices=[4, 5, 6, 7], abstract=abstract)
    assert tm.axis_sizes == (2, 2)
    assert tm.axis_names == ("p", "q")
    assert isinstance(tm.abstract_mesh, AbstractMesh)
    assert tm.abstract_mesh.axis_names == ("p", "q")
    assert tuple(tm.abstract_mesh.axis_sizes) == (2, 2)
    assert tm.abstract_mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_task_mesh_place_keeps_axes():
    tm = mm.TaskMesh(devices=[0, 1, 2, 3], axis_sizes=(2, 2), axis_names=("x", "y"))
    moved = tm.place([7, 6, 5, 4])
    assert moved.devices == (7, 6, 5, 4)
    assert moved.axis_sizes == tm.axis_sizes
    assert moved.axis_names == tm.axis_names
    assert tm.devices == (0, 1, 2, 3)


def test_task_mesh_to_mesh_default_device_list():
    mesh = mm.TaskMesh(devices=[4, 5, 6, 7], axis_sizes=(2, 2), axis_names=("x", "y")).to_mesh()
    assert isinstance(mesh, Mesh)
    assert mesh.axis_names == ("x", "y")
    assert _ids(mesh) == [[4, 5], [6, 7]]
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_task_mesh_to_mesh_with_explicit_device_list():
    pool = [jax.devices()[i] for i in (5, 3, 1)]
    mesh = mm.TaskMesh(devices=[2, 0]).to_mesh(pool)
    assert _ids(mesh) == [1, 5]


def test_task_mesh_positions_index_the_current_multi_mesh():
    reversed_devices = list(reversed(jax.devices()))
    tm = mm.TaskMesh(devices=[0, 1])
    with mm.MultiMesh(axis_sizes=(8,), axis_names=("x",), devices=reversed_devices):
        assert mm.core.get_device_list() == tuple(reversed_devices)
        assert _ids(tm.to_mesh()) == [7, 6]
        y = mm.task(lambda x: x + 1, mesh=tm)(jnp.zeros(4))
        # An eager result comes back uncommitted on its submesh's first device.
        assert [d.id for d in y.devices()] == [7] and not y.committed
    assert _ids(tm.to_mesh()) == [0, 1]


def test_jit_devices_override_the_device_list():
    pool = [jax.devices()[i] for i in (6, 2)]
    double = mm.task(lambda x: 2 * x, mesh=mm.TaskMesh(devices=[1]))
    y = mm.jit(lambda x: double(x), devices=pool)(jnp.arange(3.0))
    assert {d.id for d in y.devices()} == {2}
    np.testing.assert_allclose(np.asarray(y), [0.0, 2.0, 4.0], rtol=0, atol=0)


# --- slice_global_mesh and the context manager ----------------------------------------------


def test_slice_global_mesh_gives_positions_in_the_multi_mesh():
    multi = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    with multi:
        tm = mm.slice_global_mesh(stage=1)
        assert tm == mm.TaskMesh(
            devices=[4, 5, 6, 7], axis_sizes=(1, 4), axis_names=("stage", "data")
        )
        assert _ids(tm.to_mesh()) == _ids(multi.slice(stage=1))


def test_slice_global_mesh_follows_a_reordered_multi_mesh():
    devices = list(reversed(jax.devices()))
    multi = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"), devices=devices)
    with multi:
        tm = mm.slice_global_mesh(data=2)
        assert tm.devices == (2, 6)
        assert _ids(tm.to_mesh()) == _ids(multi.slice(data=2)) == [[5], [1]]


def test_multi_mesh_context_nesting_restores():
    outer = mm.MultiMesh(axis_sizes=(8,), axis_names=("x",))
    inner = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("a", "b"))
    assert mm.core.get_multi_mesh() is None
    assert not mm.core.get_flag("autoshard")
    with outer as entered:
        assert entered is outer
        assert mm.core.get_multi_mesh() is outer
        assert mm.core.get_flag("autoshard")
        with inner:
            assert mm.core.get_multi_mesh() is inner
            with outer:
                assert mm.core.get_multi_mesh() is outer
            assert mm.core.get_multi_mesh() is inner
        assert mm.core.get_multi_mesh() is outer
        assert mm.core.get_flag("autoshard")
    assert mm.core.get_multi_mesh() is None
    assert not mm.core.get_flag("autoshard")
    assert mm.core.get_device_list() == tuple(jax.devices())


def test_multi_mesh_context_restores_on_exception():
    outer = mm.MultiMesh(axis_sizes=(8,), axis_names=("x",))
    inner = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("a", "b"))
    with outer:
        with pytest.raises(RuntimeError, match="boom"), inner:
            raise RuntimeError("boom")
        assert mm.core.get_multi_mesh() is outer
    assert mm.core.get_multi_mesh() is None
    assert not mm.core.get_flag("autoshard")


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (dict(axis_sizes=(16,), axis_names=("x",)), errors.MeshShapeError, "got 8"),
        (
            dict(axis_sizes=(2, 2), axis_names=("x", "y"), devices=jax.devices()[:3]),
            errors.MeshShapeError,
            "`axis_sizes`=(2, 2)",
        ),
        (dict(axis_sizes=(2, 4), axis_names=("a",)), errors.MeshShapeError, "('a',)"),
        (dict(axis_sizes=(8,), axis_names=("a", "b")), errors.MeshShapeError, "('a', 'b')"),
        (dict(axis_sizes=(2, 4), axis_names=("a", "a")), errors.MeshShapeError, "('a', 'a')"),
        (
            dict(axis_sizes=(2,), axis_names=("x",), devices=[jax.devices()[3]] * 2),
            errors.DuplicateDeviceError,
            repr(jax.devices()[3]),
        ),
    ],
)
def test_multi_mesh_rejects_bad_arguments(kwargs, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        mm.MultiMesh(**kwargs)


def test_multi_mesh_errors_are_value_errors():
    with pytest.raises(ValueError):
        mm.MultiMesh(axis_sizes=(3,), axis_names=("x",), devices=jax.devices()[:2])


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (dict(devices=[0, 1, 2], axis_sizes=(2, 2)), errors.MeshShapeError, "got 3"),
        (
            dict(devices=[0, 1], axis_sizes=(2,), axis_names=("a", "b")),
            errors.MeshShapeError,
            "('a', 'b')",
        ),
        (dict(devices=[0, 5, 5, 1]), errors.DuplicateDeviceError, "got 5 more than once"),
        (dict(devices=[0, -1]), errors.MeshIndexError, "[0, -1]"),
    ],
)
def test_task_mesh_rejects_bad_arguments(kwargs, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        mm.TaskMesh(**kwargs)


def test_slice_rejects_unknown_axis():
    multi = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    with pytest.raises(errors.UnknownMeshAxisError, match=re.escape("'stag'")):
        multi.slice(stag=0)


@pytest.mark.parametrize("index", [2, -1, 7])
def test_slice_rejects_index_out_of_range(index):
    multi = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    with pytest.raises(errors.MeshIndexError, match=re.escape(f"stage={index}")):
        multi.slice(stage=index)


def test_task_mesh_position_beyond_device_list():
    tm = mm.TaskMesh(devices=[0, 9])
    with pytest.raises(errors.MeshIndexError, match=re.escape("position 9")):
        tm.to_mesh()
    with pytest.raises(errors.MeshIndexError, match=re.escape("position 2")):
        mm.TaskMesh(devices=[2]).to_mesh(jax.devices()[:2])


def test_task_mesh_position_beyond_the_multi_mesh():
    tm = mm.TaskMesh(devices=[3])
    with (
        mm.MultiMesh(axis_sizes=(2,), axis_names=("x",)),
        pytest.raises(errors.MeshIndexError, match=re.escape("position 3")),
    ):
        mm.task(lambda x: x, mesh=tm)(jnp.zeros(2))


def test_slice_global_mesh_without_multi_mesh():
    with pytest.raises(errors.NoMultiMeshError, match=re.escape("{'stage': 1}")):
        mm.slice_global_mesh(stage=1)
