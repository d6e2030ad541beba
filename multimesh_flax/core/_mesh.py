"""Meshes: the global ``MultiMesh``, submesh descriptions (``TaskMesh``) and the device list.

A ``MultiMesh`` is a named global device grid. A ``TaskMesh`` describes a submesh by device
*positions* ``0..N-1`` in the executable's device list, so the same description can be placed
on any devices. That list is, in priority order, the ``devices`` given to ``parallelize``/``jit``,
the devices of the innermost active ``MultiMesh``, or ``jax.devices()``.

Every mesh built here uses ``AxisType.Auto`` axes: Linen logical partitioning and
``with_sharding_constraint`` hints need them (``jax.make_mesh`` defaults to Explicit axes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from multimesh_flax import errors
from multimesh_flax.core._registry import Context, TaskCallback


def make_auto_mesh(devices: np.ndarray, axis_names: Sequence[str]) -> Mesh:
    """Builds a ``jax.sharding.Mesh`` whose axes are all ``AxisType.Auto``."""
    names = tuple(axis_names)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def _as_axes(axis_sizes: Any, axis_names: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Checks that sizes and names are sequences (not a bare int or string) and tuples them."""
    for arg, value, example in (
        ("axis_sizes", axis_sizes, "(8,)"),
        ("axis_names", axis_names, "('x',)"),
    ):
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
            raise errors.MeshShapeError(
                f"Expected `{arg}` as a sequence with one entry per mesh axis, got "
                f"{type(value).__name__}: {value!r}. Write a tuple, e.g. {example}."
            )
    bad_names = [n for n in axis_names if not isinstance(n, str)]
    if bad_names:
        raise errors.MeshShapeError(
            f"Expected mesh axis names as strings, got {bad_names[0]!r} in `axis_names`="
            f"{tuple(axis_names)!r}."
        )
    return tuple(axis_sizes), tuple(axis_names)


def _check_names_sizes(axis_sizes: Sequence[int], axis_names: Sequence[str]) -> None:
    if len(axis_sizes) != len(axis_names):
        raise errors.MeshShapeError(
            f"Expected one name per mesh axis, got `axis_sizes`={tuple(axis_sizes)} "
            f"({len(axis_sizes)} axes) and `axis_names`={tuple(axis_names)} "
            f"({len(axis_names)} names). Pass as many names as sizes."
        )
    if len(set(axis_names)) != len(axis_names):
        raise errors.MeshShapeError(
            f"Expected distinct mesh axis names, got `axis_names`={tuple(axis_names)}. "
            "Name every axis once."
        )
    bad = [s for s in axis_sizes if not isinstance(s, (int, np.integer)) or s < 1]
    if bad:
        raise errors.MeshShapeError(
            f"Expected positive integer axis sizes, got `axis_sizes`={tuple(axis_sizes)}."
        )


def _check_device_count(count: int, axis_sizes: Sequence[int], what: str) -> None:
    if count != math.prod(axis_sizes):
        raise errors.MeshShapeError(
            f"Expected {math.prod(axis_sizes)} {what} (the product of `axis_sizes`="
            f"{tuple(axis_sizes)}), got {count}. Change the sizes or the {what}."
        )


def check_unique(items: Sequence[Any], what: str) -> None:
    seen: set[Any] = set()
    dupes = [d for d in items if d in seen or seen.add(d)]
    if dupes:
        raise errors.DuplicateDeviceError(
            f"Expected distinct {what}, got {dupes[0]!r} more than once in {list(items)!r}. "
            f"List each one once."
        )


def is_position(value: Any) -> bool:
    """Whether ``value`` is an integer device position (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_device_array(devices: Any, argument: str) -> np.ndarray:
    """``devices`` as an object array of jax devices; integers index ``jax.devices()``.

    Keeps the shape of ``devices`` (a ``range``, list, nested list or array).

    Raises:
        MeshIndexError: a position outside ``jax.devices()``.
        DevicePositionError: an entry that is neither a ``jax.Device`` nor an integer.
    """
    grid = np.asarray(list(devices) if isinstance(devices, range) else devices, dtype=object)
    pool = jax.devices()
    flat = []
    for d in grid.reshape(-1):
        if is_position(d):
            if not 0 <= d < len(pool):
                raise errors.MeshIndexError(
                    f"Device position {d} in `{argument}` is outside jax.devices() "
                    f"({len(pool)} devices, positions 0..{len(pool) - 1}). Use positions in "
                    "that range, or pass jax devices."
                )
            d = pool[int(d)]
        elif not isinstance(d, jax.Device):
            raise errors.DevicePositionError(
                f"Expected `{argument}` as jax devices or integer positions in jax.devices(), "
                f"got {type(d).__name__}: {d!r}. Pass e.g. jax.devices()[:4] or range(4)."
            )
        flat.append(d)
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(grid.shape)


# --- the executable's device list -----------------------------------------------------------


class _MeshState(threading.local):
    def __init__(self) -> None:
        self.device_lists: list[tuple[jax.Device, ...]] = []
        self.multi_meshes: list[MultiMesh] = []


_STATE = _MeshState()


@contextlib.contextmanager
def use_device_list(devices: Sequence[jax.Device] | np.ndarray | None) -> Iterator[None]:
    """Makes ``devices`` the list that ``TaskMesh`` positions index (``None``: no change)."""
    if devices is None:
        yield
        return
    flat = tuple(np.asarray(devices, dtype=object).reshape(-1))
    check_unique(flat, "devices")
    _STATE.device_lists.append(flat)
    try:
        yield
    finally:
        _STATE.device_lists.pop()


def get_device_list() -> tuple[jax.Device, ...]:
    """Returns the device list that ``TaskMesh`` positions refer to right now.

    Example:
        >>> import multimesh_flax as mm
        >>> len(mm.core.get_device_list())
        8
    """
    if _STATE.device_lists:
        return _STATE.device_lists[-1]
    if _STATE.multi_meshes:
        return tuple(_STATE.multi_meshes[-1].devices.reshape(-1))
    return tuple(jax.devices())


def get_multi_mesh() -> MultiMesh | None:
    """Returns the innermost active ``MultiMesh``, or ``None``."""
    return _STATE.multi_meshes[-1] if _STATE.multi_meshes else None


# --- TaskMesh -------------------------------------------------------------------------------


def _positions(devices: Any) -> tuple[int, ...]:
    """``devices`` as a flat tuple of ints; anything else is a ``DevicePositionError``."""
    flat = np.asarray(list(devices) if isinstance(devices, range) else devices, dtype=object)
    bad = [
        d
        for d in flat.reshape(-1)
        if not isinstance(d, (int, np.integer)) or isinstance(d, (bool, np.bool_))
    ]
    if bad:
        hint = (
            " To run on particular devices, pass a jax.sharding.Mesh as `mesh=`, or the devices "
            "as `task(..., devices=...)`."
            if isinstance(bad[0], jax.Device)
            else ""
        )
        raise errors.DevicePositionError(
            f"Expected `devices` as integer positions 0..N-1 in the executable's device list "
            f"(e.g. range(4)), got {type(bad[0]).__name__}: {bad[0]!r}.{hint}"
        )
    return tuple(int(d) for d in flat.reshape(-1))


@dataclasses.dataclass(frozen=True, init=False)
class TaskMesh:
    """A submesh: device positions in the executable's device list, shaped and named.

    Args:
        devices: positions ``0..N-1`` in the executable's device list (not device ids).
        axis_sizes: sizes of the submesh axes; default ``(len(devices),)``.
        axis_names: names of the submesh axes; default ``("devices",)`` for one axis,
            ``("axis_0", "axis_1", ...)`` otherwise.
        abstract: a ``jax.sharding.AbstractMesh`` replacing ``axis_sizes``/``axis_names``.

    Raises:
        MeshShapeError: sizes and names disagree, or the device count is not their product.
        DuplicateDeviceError: a position appears twice.

    Example:
        >>> import multimesh_flax as mm
        >>> tm = mm.TaskMesh(devices=[0, 1, 2, 3], axis_sizes=(2, 2), axis_names=("x", "y"))
        >>> tm.place([4, 5, 6, 7]).to_mesh().device_ids.tolist()
        [[4, 5], [6, 7]]
    """

    devices: tuple[int, ...]
    axis_sizes: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __init__(
        self,
        *,
        devices: Sequence[int],
        axis_sizes: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        abstract: AbstractMesh | None = None,
    ) -> None:
        positions = _positions(devices)
        if abstract is not None:
            axis_sizes, axis_names = abstract.axis_sizes, abstract.axis_names
        if axis_sizes is None:
            axis_sizes = (len(positions),)
        if axis_names is None:
            axis_names = (
                ("devices",)
                if len(axis_sizes) == 1
                else tuple(f"axis_{i}" for i in range(len(axis_sizes)))
            )
        axis_sizes, axis_names = _as_axes(axis_sizes, axis_names)
        _check_names_sizes(axis_sizes, axis_names)
        _check_device_count(len(positions), axis_sizes, "device positions")
        check_unique(positions, "device positions")
        if any(p < 0 for p in positions):
            raise errors.MeshIndexError(
                f"Expected device positions >= 0, got `devices`={list(positions)}. Use "
                "positions 0..N-1 in the executable's device list."
            )
        object.__setattr__(self, "devices", positions)
        object.__setattr__(self, "axis_sizes", tuple(int(s) for s in axis_sizes))
        object.__setattr__(self, "axis_names", tuple(axis_names))

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def abstract_mesh(self) -> AbstractMesh:
        """The device-free ``AbstractMesh`` with this submesh's axes (all ``Auto``)."""
        return AbstractMesh(
            self.axis_sizes, self.axis_names, axis_types=(AxisType.Auto,) * len(self.axis_names)
        )

    def place(self, devices: Sequence[int]) -> TaskMesh:
        """Returns a task mesh with the same axes on other device positions."""
        return TaskMesh(devices=devices, axis_sizes=self.axis_sizes, axis_names=self.axis_names)

    def to_mesh(self, device_list: Sequence[jax.Device] | None = None) -> Mesh:
        """Resolves the positions against ``device_list`` (default: the current device list).

        Raises:
            MeshIndexError: a position lies beyond the device list.
        """
        pool = tuple(device_list) if device_list is not None else get_device_list()
        beyond = [p for p in self.devices if p >= len(pool)]
        if beyond:
            raise errors.MeshIndexError(
                f"TaskMesh position {beyond[0]} is beyond the executable's device list of "
                f"{len(pool)} devices (positions 0..{len(pool) - 1}); `devices`="
                f"{list(self.devices)}. Use positions below {len(pool)}, or pass more "
                f"`devices` to `parallelize`/`jit`."
            )
        grid = np.array([pool[p] for p in self.devices], dtype=object).reshape(self.axis_sizes)
        return make_auto_mesh(grid, self.axis_names)


# --- MultiMesh ------------------------------------------------------------------------------


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
        global_mesh: an existing ``jax.sharding.Mesh`` to wrap; the other arguments must then
            be omitted.

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
    ) -> None:
        super().__init__()
        self._exits: list[Any] = []
        if global_mesh is not None:
            if axis_sizes is not None or axis_names is not None or devices is not None:
                raise errors.MeshShapeError(
                    "Expected either `global_mesh` or `axis_sizes`/`axis_names`/`devices`, "
                    "got both. Pass only `global_mesh` to wrap an existing mesh."
                )
            self._mesh = make_auto_mesh(global_mesh.devices, global_mesh.axis_names)
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
        )

    def register_task(
        self, matcher: Any, *, callback: TaskCallback | None = None, task: Any = None
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
        super().register_task(matcher, callback=callback, task=task)

    def __enter__(self) -> MultiMesh:
        from multimesh_flax.core import _config

        autoshard = _config.autoshard()
        autoshard.__enter__()
        _STATE.multi_meshes.append(self)
        super().__enter__()
        self._exits.append(autoshard)
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _STATE.multi_meshes.pop()
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
