"""Devices: the executable's device list, submesh descriptions (``TaskMesh``).

A ``TaskMesh`` describes a submesh by device *positions* ``0..N-1`` in the executable's device
list, so the same description can be placed on any devices. That list is, in priority order,
the ``devices`` given to ``parallelize``/``jit``, the devices of the innermost active
``MultiMesh`` (``_multimesh``), or ``jax.devices()``.

Every mesh built here uses ``AxisType.Auto`` axes: Linen logical partitioning and
``with_sharding_constraint`` hints need them (``jax.make_mesh`` defaults to Explicit axes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from multimesh_flax import errors
from multimesh_flax.core.declare import _thread


def make_auto_mesh(devices: np.ndarray, axis_names: Sequence[str]) -> Mesh:
    """Builds a ``jax.sharding.Mesh`` whose axes are all ``AxisType.Auto``."""
    names = tuple(axis_names)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def check_axis_types(axis_types: Any, axis_names: Sequence[str]) -> tuple[AxisType, ...]:
    """``axis_types`` as one ``AxisType`` per axis (``None``: all ``Auto``).

    Raises:
        MeshShapeError: not one ``AxisType`` per axis, or a ``Manual`` axis.
    """
    if axis_types is None:
        return (AxisType.Auto,) * len(axis_names)
    types = (axis_types,) if isinstance(axis_types, AxisType) else tuple(axis_types)
    if len(types) != len(axis_names) or not all(isinstance(t, AxisType) for t in types):
        raise errors.MeshShapeError(
            f"Expected one jax.sharding.AxisType per axis of {tuple(axis_names)}, got "
            f"`axis_types`={axis_types!r}. Pass e.g. (AxisType.Explicit,) * "
            f"{len(axis_names)}."
        )
    if AxisType.Manual in types:
        raise errors.MeshShapeError(
            f"Got a Manual axis in `axis_types`={types}; a task mesh's axes are Auto or "
            "Explicit (enter Manual axes with jax.shard_map inside the task)."
        )
    return types


def is_all_auto(axis_types: Sequence[AxisType]) -> bool:
    return all(t == AxisType.Auto for t in axis_types)


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


Place = tuple[int, ...]  # a submesh's devices: their sorted ids


def place_of(mesh: Any) -> Place:
    """The place (sorted device ids) of a mesh."""
    return tuple(sorted(int(i) for i in mesh.device_ids.reshape(-1)))


# --- the executable's device list -----------------------------------------------------------


@contextlib.contextmanager
def use_device_list(devices: Sequence[jax.Device] | np.ndarray | None) -> Iterator[None]:
    """Makes ``devices`` the list that ``TaskMesh`` positions index (``None``: no change).

    Raises:
        DuplicateDeviceError: a device is listed twice.
    """
    flat = None if devices is None else tuple(np.asarray(devices, dtype=object).reshape(-1))
    if flat is not None:
        check_unique(flat, "devices")
    with DeviceListScope(flat):
        yield


class DeviceListScope:
    """``with scope:`` makes ``devices``, a flat tuple of distinct devices checked by the
    caller, the list that ``TaskMesh`` positions index (``None``: no change).

    ``use_device_list`` for a list already checked: ``jit`` makes one per function and
    enters it on every call. It holds no state of its own, so one scope may be entered by
    several threads, or again inside itself.

    Example:
        >>> scope = DeviceListScope(tuple(jax.devices()[2:4]))
        >>> with scope:
        ...     [d.id for d in get_device_list()]
        [2, 3]
    """

    __slots__ = ("devices",)

    def __init__(self, devices: tuple[jax.Device, ...] | None) -> None:
        self.devices = devices

    def __enter__(self) -> None:
        if self.devices is not None:
            _thread.STATE.device_lists.append(self.devices)

    def __exit__(self, *exc: object) -> None:
        if self.devices is not None:
            _thread.STATE.device_lists.pop()


def no_ambient_mesh() -> contextlib.AbstractContextManager[Any]:
    """Clears the mesh that ``jax.set_mesh`` made ambient, for the span of an MPMD program.

    ``multimesh_flax.jit`` places every value itself: outside tasks a ``jax.set_mesh`` mesh
    would give the traced arrays that mesh's type (and make each fragment's ``jax.jit``
    insist its arguments live on all of it), inside a task the task's submesh is the ambient
    mesh instead. Outside every trace this is ``jax.set_mesh(None)``; inside one (where
    ``jax.set_mesh`` is refused) only the abstract mesh is cleared. With no mesh set it does
    nothing: the check costs less than ``jax.set_mesh(None)`` (benchmark B2 times both).
    """
    if jax.sharding.get_abstract_mesh().empty and jax.sharding.get_mesh().empty:
        return _NOTHING_TO_CLEAR
    try:
        return jax.set_mesh(None)  # refused inside a trace: a ValueError
    except ValueError:
        return jax.sharding.use_abstract_mesh(_EMPTY_ABSTRACT_MESH)


_EMPTY_ABSTRACT_MESH = AbstractMesh((), ())
_NOTHING_TO_CLEAR = contextlib.nullcontext()


def get_device_list() -> tuple[jax.Device, ...]:
    """Returns the device list that ``TaskMesh`` positions refer to right now.

    Example:
        >>> import multimesh_flax as mm
        >>> len(mm.core.get_device_list())
        8
    """
    if _thread.STATE.device_lists:
        return _thread.STATE.device_lists[-1]
    if _thread.STATE.multi_meshes:
        return tuple(_thread.STATE.multi_meshes[-1].devices.reshape(-1))
    return tuple(jax.devices())


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
        abstract: a ``jax.sharding.AbstractMesh`` replacing ``axis_sizes``/``axis_names``
            (and ``axis_types``).
        axis_types: the ``jax.sharding.AxisType`` of each axis inside the task, where the
            submesh is the ambient mesh (``AxisType.Explicit`` for sharding in types:
            ``jax.sharding.reshard``, ``out_sharding=``); default all ``Auto``.

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
    axis_types: tuple[AxisType, ...]

    def __init__(
        self,
        *,
        devices: Sequence[int],
        axis_sizes: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        abstract: AbstractMesh | None = None,
        axis_types: Sequence[AxisType] | None = None,
    ) -> None:
        positions = _positions(devices)
        if abstract is not None:
            axis_sizes, axis_names = abstract.axis_sizes, abstract.axis_names
            axis_types = abstract.axis_types
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
        object.__setattr__(self, "axis_types", check_axis_types(axis_types, axis_names))

    def __repr__(self) -> str:
        types = "" if is_all_auto(self.axis_types) else f", axis_types={self.axis_types}"
        return (
            f"TaskMesh(devices={self.devices}, axis_sizes={self.axis_sizes}, "
            f"axis_names={self.axis_names}{types})"
        )

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def abstract_mesh(self) -> AbstractMesh:
        """The device-free ``AbstractMesh`` with this submesh's axes and axis types."""
        return AbstractMesh(self.axis_sizes, self.axis_names, axis_types=self.axis_types)

    def place(self, devices: Sequence[int]) -> TaskMesh:
        """Returns a task mesh with the same axes on other device positions."""
        return TaskMesh(
            devices=devices,
            axis_sizes=self.axis_sizes,
            axis_names=self.axis_names,
            axis_types=self.axis_types,
        )

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
