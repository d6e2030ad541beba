"""The global ``MultiMesh``: a named device grid whose slices are submeshes.

A ``MultiMesh`` is also a ``Context`` (``_registry``): entering it activates the tasks
registered on it, turns on autosharding and makes it the mesh that ``mesh_slice`` and
``slice_global_mesh`` slice.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh

from multimesh_flax import errors
from multimesh_flax.core.declare import _config, _thread
from multimesh_flax.core.declare._devices import (
    TaskMesh,
    _as_axes,
    _check_device_count,
    _check_names_sizes,
    as_device_array,
    check_axis_types,
    check_unique,
    make_auto_mesh,
    no_ambient_mesh,
)
from multimesh_flax.core.declare._registry import Context, TaskCallback


def _ambient_mesh() -> Mesh:
    """The mesh ``jax.set_mesh`` set, for ``MultiMesh()`` with no arguments.

    Raises:
        MeshShapeError: no mesh is set.
    """
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        raise errors.MeshShapeError(
            "Expected `axis_sizes` and `axis_names` (or `global_mesh`), got neither, and no "
            "mesh is set with jax.set_mesh. Pass them, or call MultiMesh() under "
            "`jax.set_mesh(mesh)` to wrap that mesh."
        )
    return mesh


def get_multi_mesh() -> MultiMesh | None:
    """Returns the innermost active ``MultiMesh``, or ``None``."""
    return _thread.STATE.multi_meshes[-1] if _thread.STATE.multi_meshes else None  # type: ignore[return-value]


def _int_hint(value: Any) -> int:
    """An integer to suggest in place of a mistyped index (``1.0`` -> ``1``)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class MultiMesh(Context):
    """A global device mesh with named submeshes.

    Builds a mesh from ``axis_sizes``/``axis_names`` (devices default to ``jax.devices()``,
    reshaped) or wraps ``global_mesh``. Used as a context manager it turns on autosharding,
    becomes the mesh that ``Task(mesh_slice=...)`` and ``slice_global_mesh`` slice, and
    activates the tasks registered with :meth:`register_task` (a ``MultiMesh`` is a
    ``Context``).

    Args:
        axis_sizes: the size of each global axis.
        axis_names: the name of each global axis.
        devices: devices to use (any shape with the right count), as jax devices or integer
            positions in ``jax.devices()`` (``range(8)``); default ``jax.devices()``.
        global_mesh: an existing ``jax.sharding.Mesh`` to wrap (its axis types kept); the
            other arguments must then be omitted. With no arguments at all, the mesh set
            with ``jax.set_mesh`` is wrapped.
        axis_types: the ``jax.sharding.AxisType`` of each axis, as tasks on its slices see
            them (default all ``Auto``; ``AxisType.Explicit`` for sharding in types).

    Raises:
        MeshShapeError: sizes, names and device count disagree.
        DuplicateDeviceError: a device appears twice.

    Example:
        >>> import multimesh_flax as mm
        >>> mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "batch", "model"))
        >>> mesh.slice(stage=1).device_ids.tolist()
        [[[4, 5], [6, 7]]]
    """

    def __init__(
        self,
        *,
        axis_sizes: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        devices: Sequence[jax.Device] | np.ndarray | None = None,
        global_mesh: Mesh | None = None,
        axis_types: Sequence[AxisType] | None = None,
    ) -> None:
        super().__init__()
        self._exits: list[Any] = []
        if global_mesh is None and axis_sizes is None and axis_names is None and devices is None:
            global_mesh = _ambient_mesh()
        if global_mesh is not None:
            if axis_sizes is not None or axis_names is not None or devices is not None:
                raise errors.MeshShapeError(
                    "Expected either `global_mesh` or `axis_sizes`/`axis_names`/`devices`, "
                    "got both. Pass only `global_mesh` to wrap an existing mesh."
                )
            self._mesh = make_auto_mesh(global_mesh.devices, global_mesh.axis_names)
            types = global_mesh.axis_types if axis_types is None else axis_types
            self._axis_types = check_axis_types(types, self.axis_names)
            return
        if axis_sizes is None or axis_names is None:
            raise errors.MeshShapeError(
                f"Expected `axis_sizes` and `axis_names` (or `global_mesh`), got "
                f"`axis_sizes`={axis_sizes!r}, `axis_names`={axis_names!r}."
            )
        sizes, names = _as_axes(axis_sizes, axis_names)
        _check_names_sizes(sizes, names)
        pool = as_device_array(jax.devices() if devices is None else devices, "devices")
        flat = pool.reshape(-1)
        if devices is None and flat.size > math.prod(sizes):
            flat = flat[: math.prod(sizes)]
        _check_device_count(flat.size, sizes, "devices")
        check_unique(list(flat), "devices")
        self._mesh = make_auto_mesh(flat.reshape(sizes), names)
        self._axis_types = check_axis_types(axis_types, names)

    @property
    def axis_types(self) -> tuple[AxisType, ...]:
        """Each axis's ``AxisType`` inside tasks on this mesh's slices."""
        return self._axis_types

    @property
    def mesh(self) -> Mesh:
        """The global ``jax.sharding.Mesh``."""
        return self._mesh

    @property
    def shape(self) -> Mapping[str, int]:
        return self._mesh.shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self._mesh.axis_names)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(self._mesh.axis_sizes)

    @property
    def devices(self) -> np.ndarray:
        return self._mesh.devices

    @property
    def size(self) -> int:
        return self._mesh.size

    @property
    def abstract_mesh(self) -> AbstractMesh:
        return self._mesh.abstract_mesh

    def _slice_index(self, **indices: int) -> tuple[Any, ...]:
        unknown = [a for a in indices if a not in self.axis_names]
        if unknown:
            raise errors.UnknownMeshAxisError(
                f"Unknown mesh axis {unknown[0]!r} in slice {indices!r}; this mesh has axes "
                f"{self.axis_names}. Slice along one of those."
            )
        index: list[Any] = []
        for name, size in zip(self.axis_names, self.axis_sizes, strict=True):
            if name not in indices:
                index.append(slice(None))
                continue
            i = indices[name]
            if not isinstance(i, (int, np.integer)) or isinstance(i, (bool, np.bool_)):
                raise errors.MeshIndexError(
                    f"Expected an integer index for mesh axis {name!r}, got "
                    f"{type(i).__name__}: {name}={i!r}. Pass an int, e.g. {name}={_int_hint(i)}."
                )
            if not 0 <= i < size:
                raise errors.MeshIndexError(
                    f"Index {name}={i!r} is out of range for mesh axis {name!r} of size "
                    f"{size}. Use an index in [0, {size})."
                )
            index.append(slice(int(i), int(i) + 1))
        return tuple(index)

    def slice(self, **indices: int) -> Mesh:
        """The submesh at ``{axis: index}``; sliced axes keep size 1.

        Raises:
            UnknownMeshAxisError: an axis name the mesh does not have.
            MeshIndexError: an index outside the axis.
        """
        sub = self._mesh.devices[self._slice_index(**indices)]
        return make_auto_mesh(sub, self.axis_names)

    def slice_positions(self, **indices: int) -> TaskMesh:
        """The same slice as :meth:`slice`, as a ``TaskMesh`` of positions in this mesh."""
        positions = np.arange(self.size).reshape(self.axis_sizes)[self._slice_index(**indices)]
        return TaskMesh(
            devices=positions.reshape(-1).tolist(),
            axis_sizes=positions.shape,
            axis_names=self.axis_names,
            axis_types=self.axis_types,
        )

    def register_task(
        self,
        matcher: Any = None,
        *,
        callback: TaskCallback | None = None,
        task: Any = None,
        module_class: type | None = None,
    ) -> None:
        """Registers a name-based task, active inside ``with self:`` (see ``register_task``).

        A ``task`` with a ``mesh_slice`` is checked against this mesh right away.

        Raises:
            UnknownMeshAxisError: ``task.mesh_slice`` names an axis this mesh lacks.
            MeshIndexError: ``task.mesh_slice`` indexes outside an axis.

        Example:
            >>> import multimesh_flax as mm
            >>> mesh = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
            >>> mesh.register_task("head", task=mm.Task(mesh_slice={"stage": 1}))
            >>> def f(x):
            ...     with jax.named_scope("head"):
            ...         return x * 2
            >>> with mesh:
            ...     y = mm.jit(f)(jnp.ones(4))
            >>> sorted(d.id for d in y.devices())
            [4, 5, 6, 7]
        """
        if task is not None and getattr(task, "mesh_slice", None) is not None:
            self._slice_index(**task.mesh_slice)
        super().register_task(matcher, callback=callback, task=task, module_class=module_class)

    def __enter__(self) -> MultiMesh:
        entered = contextlib.ExitStack()
        entered.enter_context(_config.autoshard())
        # A ``jax.set_mesh`` mesh around it (perhaps the one it wraps) is set aside: tasks
        # see their own submesh as the ambient mesh, glue none.
        entered.enter_context(no_ambient_mesh())
        # Variables with ``out_sharding`` metadata that no task owns are made unsharded here
        # (NNX would need an ambient mesh to shard them at birth); ``jit`` places them.
        entered.enter_context(nnx.use_eager_sharding(False))
        _thread.STATE.multi_meshes.append(self)
        super().__enter__()
        self._exits.append(entered)
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _thread.STATE.multi_meshes.pop()
        self._exits.pop().__exit__(*exc)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes, strict=True))
        return f"MultiMesh({axes})"


def slice_global_mesh(**indices: int) -> TaskMesh:
    """A slice of the current ``MultiMesh`` as a ``TaskMesh`` (sliced axes keep size 1).

    Raises:
        NoMultiMeshError: no ``MultiMesh`` context is active.

    Example:
        >>> import multimesh_flax as mm
        >>> with mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data")):
        ...     mm.slice_global_mesh(stage=1)
        TaskMesh(devices=(4, 5, 6, 7), axis_sizes=(1, 4), axis_names=('stage', 'data'))
    """
    multi = get_multi_mesh()
    if multi is None:
        raise errors.NoMultiMeshError(
            f"`slice_global_mesh({indices!r})` needs an active MultiMesh, got none. "
            "Call it inside `with multi_mesh:`."
        )
    return multi.slice_positions(**indices)
