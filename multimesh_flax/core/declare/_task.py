"""Tasks: where a piece of a program runs, and the logical rules it shards with.

``Task`` is a plain description (a mesh or a ``MultiMesh`` slice, plus logical rules);
``make_task`` builds one from ``task(...)``/``register_task`` keyword arguments. At trace time
(``trace/_session``) a ``Task`` is *resolved* into a ``ResolvedTask`` on concrete devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from multimesh_flax import errors
from multimesh_flax.core.declare import _devices, _recompute
from multimesh_flax.core.declare._rules import Rule, normalise_rules


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """Everything that says where a task runs and how it shards.

    Args:
        name: a display name (used in program dumps, timelines and tables).
        mesh: a ``TaskMesh`` (positions in the executable's device list) or a
            ``jax.sharding.Mesh``. ``None`` with no ``mesh_slice``: the whole current
            ``MultiMesh``, else all devices of the executable as one axis ``"devices"``.
        logical_axes: priority-ordered ``(logical_name, mesh_axis)`` pairs; default: the
            identity over the mesh's axis names.
        mesh_slice: ``{axis: index}`` of the current ``MultiMesh``.
        extra_axes: rules appended after ``logical_axes``.
        split_backprop: ``(critical_suffix, noncritical_suffix)`` names of the two halves of
            the backward task (activation gradients, weight gradients).
        loop_dependent_mesh_slice: ``i -> {axis: index}``, the slice microbatch ``i`` uses.
        recompute: what the task's backward keeps (``multimesh_flax.core.declare._recompute``):
            ``None`` (unset: ``parallelize_step``'s ``recompute``, else the
            ``enable_recomputation`` switch), ``False``/``"none"`` (off), ``True``/``"full"``
            (only the inputs), ``"dots"`` (also matrix products without batch dimensions)
            or a ``jax.checkpoint_policies`` callable. Stored as a ``Recompute``. A
            registered task recomputes the Flax and NNX modules it matches; code matched
            only by a ``jax.named_scope`` name has no call to wrap, so a ``recompute`` of
            its own raises ``RecomputePolicyError`` when traced (a step-wide policy warns).

    Raises:
        InvalidTaskError: both ``mesh`` and ``mesh_slice``, a ``name`` that is not a string,
            or a ``mesh_slice`` that is not a mapping.
        TaskTypeError: ``mesh`` is neither a ``TaskMesh`` nor a ``jax.sharding.Mesh``.
        LogicalRulesError: malformed ``logical_axes`` or ``extra_axes``.
        RecomputePolicyError: ``recompute`` is not one of the forms above.

    Example:
        >>> import multimesh_flax as mm
        >>> t = mm.Task(name="head", mesh=mm.TaskMesh(devices=[4, 5, 6, 7]),
        ...             logical_axes=[("batch", "devices")])
        >>> t.logical_axes
        (('batch', 'devices'),)
    """

    name: str | None = None
    mesh: _devices.TaskMesh | Mesh | None = None
    logical_axes: Sequence[Rule] | None = None
    mesh_slice: Mapping[str, int] | None = None
    extra_axes: Sequence[Rule] | None = None
    split_backprop: tuple[str, str] | None = None
    loop_dependent_mesh_slice: Callable[[int], Mapping[str, int]] | None = None
    recompute: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", _recompute.make_recompute(self.recompute))
        if self.name is not None and not isinstance(self.name, str):
            raise errors.InvalidTaskError(
                f"Expected `name` to be a string, got {type(self.name).__name__}: {self.name!r}. "
                f"Write name={str(self.name)!r}."
            )
        if self.mesh_slice is not None and not isinstance(self.mesh_slice, Mapping):
            raise errors.InvalidTaskError(
                f"Expected `mesh_slice` as a mapping {{axis: index}} of the current MultiMesh, "
                f"got {type(self.mesh_slice).__name__}: {self.mesh_slice!r}. Example: "
                "mesh_slice={'stage': 0}."
            )
        if self.mesh is not None and not isinstance(self.mesh, (_devices.TaskMesh, Mesh)):
            raise errors.TaskTypeError(
                f"Expected `mesh` to be a TaskMesh or jax.sharding.Mesh, got "
                f"{type(self.mesh).__name__}: {self.mesh!r}. Wrap device positions as "
                "`TaskMesh(devices=[0, 1])`."
            )
        if self.mesh is not None and self.mesh_slice is not None:
            raise errors.InvalidTaskError(
                f"Expected either `mesh` or `mesh_slice`, got both (`mesh_slice`="
                f"{dict(self.mesh_slice)!r}). A mesh slice already names the devices; drop one."
            )
        if self.logical_axes is not None:
            rules = normalise_rules(self.logical_axes, "logical_axes")
            object.__setattr__(self, "logical_axes", rules)
        if self.extra_axes is not None:
            object.__setattr__(self, "extra_axes", normalise_rules(self.extra_axes, "extra_axes"))
        if self.mesh_slice is not None:
            object.__setattr__(self, "mesh_slice", dict(self.mesh_slice))
        sb = self.split_backprop
        if sb is not None and (len(sb) != 2 or not all(isinstance(s, str) for s in sb)):
            raise errors.InvalidTaskError(
                f"Expected `split_backprop` as two name suffixes (critical, noncritical), "
                f"got {sb!r}. Pass two strings, e.g. ('act_grad', 'weight_grad')."
            )


def _mesh_from_devices(devices: Any, device_axes: Sequence[str] | None) -> Mesh | _devices.TaskMesh:
    """The mesh that ``task(devices=...)`` stands for.

    Integer entries are positions in the executable's device list, as in ``TaskMesh``:
    ``devices=[0, 1]`` is ``mesh=TaskMesh(devices=[0, 1])``. Anything else must be jax devices.
    """
    grid = np.asarray(list(devices) if isinstance(devices, range) else devices, dtype=object)
    if device_axes is None:
        names = ("devices",) if grid.ndim == 1 else tuple(f"axis_{i}" for i in range(grid.ndim))
    else:
        names = tuple(device_axes)
    if len(names) != grid.ndim:
        raise errors.MeshShapeError(
            f"Expected one name per axis of `devices` (shape {grid.shape}), got "
            f"`device_axes`={names!r}. Give one name per axis."
        )
    if grid.size and all(_devices.is_position(d) for d in grid.reshape(-1)):
        return _devices.TaskMesh(
            devices=grid.reshape(-1).tolist(), axis_sizes=grid.shape, axis_names=names
        )
    return _devices.make_auto_mesh(_devices.as_device_array(grid, "devices"), names)


def check_rules_have_mesh(kwargs: dict[str, Any]) -> None:
    """Refuses task options that name logical axes but no mesh axes to map them onto."""
    has_axes = (
        kwargs.get("mesh") is not None
        or kwargs.get("mesh_slice") is not None
        or kwargs.get("device_axes") is not None
    )
    if kwargs.get("logical_axes") is not None and not has_axes:
        raise errors.InvalidTaskError(
            f"Got `logical_axes`={kwargs['logical_axes']!r} but no mesh axes to map them onto. "
            "Give `mesh` (a TaskMesh or jax.sharding.Mesh), `mesh_slice`, or `devices` with "
            "`device_axes`."
        )


def make_task(name: str | None, task: Task | None, kwargs: dict[str, Any]) -> Task:
    """Builds the ``Task`` described by ``task(...)``'s arguments.

    ``kwargs`` are ``Task`` fields, or ``devices`` (+ ``device_axes``) standing for a mesh.
    With ``devices`` but no ``device_axes``, constraints inside the task replicate.
    """
    if task is not None:
        if kwargs:
            raise errors.InvalidTaskError(
                f"Expected either `task` or task options, got both (options "
                f"{sorted(kwargs)}). Put the options into the Task."
            )
        if not isinstance(task, Task):
            raise errors.TaskTypeError(
                f"Expected `task` to be a Task, got {type(task).__name__}: {task!r}. Build "
                "one with `Task(mesh=..., logical_axes=...)`, or pass those options as keywords."
            )
        return task if name is None else dataclasses.replace(task, name=name)
    kwargs = dict(kwargs)
    devices, device_axes = kwargs.pop("devices", None), kwargs.pop("device_axes", None)
    if devices is not None:
        if kwargs.get("mesh") is not None:
            raise errors.InvalidTaskError(
                "Expected either `mesh` or `devices`, got both. Pass one of them."
            )
        kwargs["mesh"] = _mesh_from_devices(devices, device_axes)
        if device_axes is None and kwargs.get("logical_axes") is None:
            kwargs["logical_axes"] = ()
    fields = {f.name for f in dataclasses.fields(Task)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise errors.InvalidTaskError(
            f"Unknown task option {unknown[0]!r}; expected one of {sorted(fields)} or "
            "`devices`/`device_axes`."
        )
    return Task(name=name, **kwargs)
