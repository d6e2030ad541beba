"""Tasks: where a piece of a program runs, and the logical rules it shards with.

``Task`` is a plain description (a mesh or a ``MultiMesh`` slice, plus logical rules).
``task(fun, ...)`` returns a function that, when traced, runs ``fun`` inside a reserved named
scope -- its *marker* -- with the task's rules active for ``with_sharding_constraint``. JAX keeps
name scopes on every equation, also through ``jax.grad`` (the backward appears as
``transpose(jvp(<marker>))``), so the partitioner can later colour each equation by the task
whose marker is innermost in its name stack.

At trace time a ``Task`` is *resolved* into a ``ResolvedTask``: a concrete
``jax.sharding.Mesh`` and a flat rule list. Resolution happens per call, so a ``TaskMesh``
follows the executable's device list and a ``mesh_slice`` follows the current ``MultiMesh``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from multimesh_flax import errors
from multimesh_flax.core import _config, _mesh, _warnings

Rule = tuple[str, "str | tuple[str, ...] | None"]
MARKER_RE = re.compile(r"mmtask(\d+)_")


def normalise_rules(rules: Any, argument: str) -> tuple[Rule, ...]:
    """Checks that ``rules`` are ``(logical_name, mesh_axis)`` pairs and tuples them."""
    if rules is None:
        return ()
    try:
        pairs = [tuple(r) for r in rules]
    except TypeError:
        pairs = None
    bad = pairs is None or any(len(p) != 2 or not isinstance(p[0], str) for p in pairs)
    if not bad:
        bad = any(not (p[1] is None or isinstance(p[1], (str, tuple))) for p in pairs)
    if bad:
        raise errors.LogicalRulesError(
            f"Expected `{argument}` as a sequence of (logical_name, mesh_axis) pairs, got "
            f"{rules!r}. Example: (('batch', 'x'), ('model', 'y'))."
        )
    return tuple(pairs)  # type: ignore[return-value]


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

    Raises:
        InvalidTaskError: both ``mesh`` and ``mesh_slice``, a ``name`` that is not a string,
            or a ``mesh_slice`` that is not a mapping.
        TaskTypeError: ``mesh`` is neither a ``TaskMesh`` nor a ``jax.sharding.Mesh``.
        LogicalRulesError: malformed ``logical_axes`` or ``extra_axes``.

    Example:
        >>> import multimesh_flax as mm
        >>> t = mm.Task(name="head", mesh=mm.TaskMesh(devices=[4, 5, 6, 7]),
        ...             logical_axes=[("batch", "devices")])
        >>> t.logical_axes
        (('batch', 'devices'),)
    """

    name: str | None = None
    mesh: _mesh.TaskMesh | Mesh | None = None
    logical_axes: Sequence[Rule] | None = None
    mesh_slice: Mapping[str, int] | None = None
    extra_axes: Sequence[Rule] | None = None
    split_backprop: tuple[str, str] | None = None
    loop_dependent_mesh_slice: Callable[[int], Mapping[str, int]] | None = None

    def __post_init__(self) -> None:
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
        if self.mesh is not None and not isinstance(self.mesh, (_mesh.TaskMesh, Mesh)):
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


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedTask:
    """A task bound to concrete devices for one trace: its mesh, rules and marker."""

    uid: int
    name: str
    mesh: Mesh
    rules: tuple[Rule, ...]
    task: Task

    @property
    def marker(self) -> str:
        """The named-scope component that tags this task's equations."""
        return f"mmtask{self.uid}_{self.name}"


def _mesh_slice(spec: Task) -> Mapping[str, int] | None:
    """``mesh_slice``, or ``loop_dependent_mesh_slice(i)`` in microbatch iteration ``i``.

    Outside microbatching a loop-dependent task uses its ``mesh``/``mesh_slice`` if it has
    one, else iteration 0's slice.
    """
    loop_slice = spec.loop_dependent_mesh_slice
    index = _STATE.microbatch_index
    has_home = spec.mesh is not None or spec.mesh_slice is not None
    if loop_slice is None or (index is None and has_home):
        return spec.mesh_slice
    session = current_session()
    if session is not None and index is not None:
        session.loop_dependent = True  # microbatches differ: ``microbatch`` must unroll
    return dict(loop_slice(index or 0))


def _resolve_mesh(spec: Task, name: str) -> tuple[Mesh, tuple[Rule, ...]]:
    multi = _mesh.get_multi_mesh()
    mesh_slice = _mesh_slice(spec)
    if mesh_slice is not None:
        if multi is None:
            raise errors.NoMultiMeshError(
                f"Task {name!r} has `mesh_slice`={mesh_slice!r} but no MultiMesh "
                "is active. Call it inside `with multi_mesh:` or give it a `mesh`."
            )
        identity = tuple((n, n) for n in multi.axis_names)
        return multi.slice(**mesh_slice), identity
    if isinstance(spec.mesh, _mesh.TaskMesh):
        mesh = spec.mesh.to_mesh()
    elif isinstance(spec.mesh, Mesh):
        mesh = _mesh.make_auto_mesh(spec.mesh.devices, spec.mesh.axis_names)
    elif multi is not None:
        mesh = multi.mesh
    else:
        mesh = _mesh.make_auto_mesh(np.array(_mesh.get_device_list(), dtype=object), ("devices",))
    return mesh, tuple((n, n) for n in mesh.axis_names)


def _check_rules(rules: tuple[Rule, ...], mesh: Mesh, name: str) -> None:
    for logical, axes in rules:
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        unknown = [a for a in names if a not in mesh.axis_names]
        if unknown:
            raise errors.LogicalRulesError(
                f"Rule ({logical!r}, {axes!r}) of task {name!r} names mesh axis "
                f"{unknown[0]!r}, but the task mesh has axes {tuple(mesh.axis_names)}. "
                "Map logical names onto those axes."
            )


_UIDS = itertools.count(1)


def resolve_task(spec: Task, fallback_name: str = "task") -> ResolvedTask:
    """Binds ``spec`` to concrete devices and rules for the current trace.

    Raises:
        NoMultiMeshError: ``mesh_slice`` with no active ``MultiMesh``.
        LogicalRulesError: a rule names a mesh axis the task mesh lacks.
    """
    name = re.sub(r"\W", "_", spec.name or fallback_name)
    mesh, identity = _resolve_mesh(spec, name)
    rules = spec.logical_axes if spec.logical_axes is not None else identity
    rules = tuple(rules) + tuple(spec.extra_axes or ())
    _check_rules(rules, mesh, name)
    return ResolvedTask(uid=next(_UIDS), name=name, mesh=mesh, rules=rules, task=spec)


# --- trace sessions and the task stack ------------------------------------------------------


class TraceSession:
    """Collects the tasks entered while ``jit``/``parallelize`` traces a program."""

    def __init__(self) -> None:
        self.tasks: dict[int, ResolvedTask] = {}
        # Per-trace memo for callers that resolve one task once per trace (Flax modules).
        self.cache: dict[Any, ResolvedTask] = {}
        # Whether a task resolved its mesh from the microbatch index: then the microbatches
        # of one ``microbatch`` call differ and cannot share one traced body.
        self.loop_dependent = False


class _TaskState(threading.local):
    def __init__(self) -> None:
        self.stack: list[ResolvedTask] = []
        self.sessions: list[TraceSession] = []
        self.microbatch_index: int | None = None
        self.shape_only = 0  # > 0 inside traces that only compute shapes or variables


_STATE = _TaskState()


@contextlib.contextmanager
def shape_only_trace() -> Iterator[None]:
    """Marks the body as a trace for shapes or variables only (``jax.eval_shape`` of an
    initializer): tasks met there are not placed, by design, so nothing is warned."""
    _STATE.shape_only += 1
    try:
        yield
    finally:
        _STATE.shape_only -= 1


def warn_foreign_trace(name: str) -> None:
    """Warns (once per task) that task ``name`` is traced by a transformation not ours.

    Raises:
        StrictModeError: under ``context(strict=True)``.
    """
    if _STATE.shape_only:
        return
    _warnings.warn_placement(
        ("foreign-trace", name),
        f"Task {name!r} is traced by a JAX transformation that is not multimesh_flax's "
        "(jax.jit, jax.grad, jax.vmap, ... outside `multimesh_flax.jit`), so it is not placed "
        "on its submesh: it runs wherever that transformation runs (usually device 0). "
        "Compile the function with `multimesh_flax.jit`, `multimesh_flax.parallelize` or "
        "`parallelize_step` instead (under jax.eval_shape, for shapes only, this is harmless).",
    )


@contextlib.contextmanager
def microbatch_iteration(index: int) -> Iterator[None]:
    """Marks the body as microbatch iteration ``index`` (for ``loop_dependent_mesh_slice``)."""
    previous = _STATE.microbatch_index
    _STATE.microbatch_index = index
    try:
        yield
    finally:
        _STATE.microbatch_index = previous


def current_microbatch_index() -> int | None:
    """The microbatch iteration being traced (see :func:`microbatch_iteration`), or ``None``."""
    return _STATE.microbatch_index


def current_task() -> ResolvedTask | None:
    """The innermost task being traced, or ``None`` outside every task."""
    return _STATE.stack[-1] if _STATE.stack else None


def current_session() -> TraceSession | None:
    return _STATE.sessions[-1] if _STATE.sessions else None


@contextlib.contextmanager
def trace_session() -> Iterator[TraceSession]:
    """Opens a session that records every task traced inside it."""
    session = TraceSession()
    _STATE.sessions.append(session)
    try:
        yield session
    finally:
        _STATE.sessions.pop()


@contextlib.contextmanager
def enter_task(resolved: ResolvedTask) -> Iterator[ResolvedTask]:
    """Runs the body as ``resolved``: its marker scope, its rules, its registration."""
    session = current_session()
    if session is not None:
        session.tasks[resolved.uid] = resolved
    _STATE.stack.append(resolved)
    try:
        with jax.named_scope(resolved.marker):
            yield resolved
    finally:
        _STATE.stack.pop()


# --- task(fun) ------------------------------------------------------------------------------


def _mesh_from_devices(devices: Any, device_axes: Sequence[str] | None) -> Mesh | _mesh.TaskMesh:
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
    if grid.size and all(_mesh.is_position(d) for d in grid.reshape(-1)):
        return _mesh.TaskMesh(
            devices=grid.reshape(-1).tolist(), axis_sizes=grid.shape, axis_names=names
        )
    return _mesh.make_auto_mesh(_mesh.as_device_array(grid, "devices"), names)


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


def contains_tracer(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a tracer (the call is being traced)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def task(
    fun: Callable[..., Any], name: str | None = None, *, task: Task | None = None, **kwargs: Any
) -> Callable[..., Any]:
    """Wraps ``fun`` so that it (forward and backward) runs on the task's submesh.

    Inside ``jit``/``parallelize`` the task becomes its own units of the MPMD program. Called
    eagerly, the task runs as a one-task program: inputs move to its submesh and the result
    stays there. Under ``ignore_transforms`` it is ``fun`` itself.

    Args:
        fun: the function to run as a task.
        name: display name (default: ``fun.__name__``).
        task: a ready ``Task``; exclusive with ``kwargs``.
        **kwargs: ``Task`` fields (``mesh``, ``logical_axes``, ``mesh_slice``, ...), or
            ``devices`` (an array of jax devices, or of integer positions in the executable's
            device list as in ``TaskMesh``) with ``device_axes``.

    Returns:
        A function with ``fun``'s signature.

    Raises:
        InvalidTaskError: contradictory options.
        TaskTypeError: ``fun`` is not callable, or ``task`` is not a ``Task``.

    Example:
        >>> import multimesh_flax as mm
        >>> g = mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[1]))
        >>> y = g(jnp.zeros(3))
        >>> y.tolist(), [d.id for d in y.devices()]
        ([1.0, 1.0, 1.0], [1])
    """
    if not callable(fun):
        raise errors.TaskTypeError(
            f"Expected `fun` to be a function to run as a task, got {type(fun).__name__}: "
            f"{fun!r}. Pass the function itself."
        )
    spec = make_task(name, task, kwargs)
    display = spec.name or getattr(fun, "__name__", "task")
    eager_cache: dict[str, Any] = {}

    @functools.wraps(fun)
    def run_task(*args: Any, **kw: Any) -> Any:
        if _config.get_flag("ignore_transforms"):
            return fun(*args, **kw)
        if current_session() is None and not contains_tracer((args, kw)):
            if "jit" not in eager_cache:
                from multimesh_flax.core._jit import jit

                eager_cache["jit"] = jit(run_task)
            return eager_cache["jit"](*args, **kw)
        if current_session() is None:
            warn_foreign_trace(display)
        body = jax.checkpoint(fun) if _config.get_flag("enable_recomputation") else fun
        with enter_task(resolve_task(spec, display)):
            return body(*args, **kw)

    run_task.task = spec  # type: ignore[attr-defined]
    return run_task
