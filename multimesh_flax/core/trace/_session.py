"""Trace sessions: what one trace learns, and the task stack while it runs.

``trace_program`` opens a ``TraceSession``; everything the trace finds out -- the tasks entered,
the ``microbatch`` calls, the Flax/NNX modules resolved, the name-registered matches -- is
recorded on it, and the traced program carries it on.

A task call (``task(fun)``, ``Task[Module]``) runs inside a reserved named scope -- its
*marker* -- entered by :func:`enter_task`, with the task's rules active for
``with_sharding_constraint``. JAX keeps name scopes on every equation, also through ``jax.grad``
(the backward appears as ``transpose(jvp(<marker>))``), so each equation can later be coloured
by the task whose marker is innermost in its name stack (a :class:`Label`).

At trace time a ``Task`` is *resolved* into a ``ResolvedTask``: a concrete
``jax.sharding.Mesh`` and a flat rule list. Resolution happens per call, so a ``TaskMesh``
follows the executable's device list and a ``mesh_slice`` follows the current ``MultiMesh``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    STATE,
    Match,
    Phase,
    PipelineOptions,
    Registration,
    Rule,
    Task,
    TaskMesh,
    get_device_list,
    get_multi_mesh,
    make_auto_mesh,
    warn_placement,
)

MARKER_RE = re.compile(r"mmtask(\d+)_")
MICROBATCH_RE = re.compile(r"mmmb(\d+)_(\d+)")  # the scope of microbatch k of call uid


class Label(NamedTuple):
    """The colour of one traced equation: the task (uid) it belongs to, and whether it is
    that task's forward (``Phase.F``) or backward (``Phase.B``). Glue has no label."""

    task: int
    phase: Phase


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedTask:
    """A task bound to concrete devices for one trace: its mesh, rules and marker."""

    uid: int
    name: str
    mesh: Mesh
    rules: tuple[Rule, ...]
    task: Task
    axis_types: tuple[AxisType, ...] = ()  # inside the task; () for all Auto

    @property
    def ambient_mesh(self) -> AbstractMesh:
        """The abstract mesh inside the task (as ``jax.set_mesh(submesh)`` would set it):
        the submesh's axes with the axis types the user chose."""
        mesh = self.mesh.abstract_mesh
        if not self.axis_types or all(t == AxisType.Auto for t in self.axis_types):
            return mesh
        return mesh.update_axis_types(dict(zip(mesh.axis_names, self.axis_types, strict=True)))

    @property
    def typed_mesh(self) -> Mesh:
        """The concrete submesh with the axis types the user chose (what ``jax.set_mesh``
        sets around an eager call of a task with Explicit axes)."""
        if not self.axis_types:
            return self.mesh
        return Mesh(self.mesh.devices, self.mesh.axis_names, axis_types=self.axis_types)

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
    index = STATE.microbatch_index
    has_home = spec.mesh is not None or spec.mesh_slice is not None
    if loop_slice is None or (index is None and has_home):
        return spec.mesh_slice
    session = current_session()
    if session is not None and index is not None:
        session.loop_dependent = True  # microbatches differ: ``microbatch`` must unroll
    return dict(loop_slice(index or 0))


class _Resolved(NamedTuple):
    mesh: Mesh  # concrete, all axes Auto (placement and compilation)
    identity: tuple[Rule, ...]  # the default rules: each mesh axis to itself
    axis_types: tuple[AxisType, ...]  # the axis types the user chose, inside the task


def _resolve_mesh(spec: Task, name: str) -> _Resolved:
    multi = get_multi_mesh()
    mesh_slice = _mesh_slice(spec)
    if mesh_slice is not None:
        if multi is None:
            raise errors.NoMultiMeshError(
                f"Task {name!r} has `mesh_slice`={mesh_slice!r} but no MultiMesh "
                "is active. Call it inside `with multi_mesh:` or give it a `mesh`."
            )
        identity = tuple((n, n) for n in multi.axis_names)
        return _Resolved(multi.slice(**mesh_slice), identity, multi.axis_types)
    types: tuple[AxisType, ...] = ()
    if isinstance(spec.mesh, TaskMesh):
        mesh, types = spec.mesh.to_mesh(), spec.mesh.axis_types
    elif isinstance(spec.mesh, Mesh):
        mesh = make_auto_mesh(spec.mesh.devices, spec.mesh.axis_names)
        types = tuple(spec.mesh.axis_types)
    elif multi is not None:
        mesh, types = multi.mesh, multi.axis_types
    else:
        mesh = make_auto_mesh(np.array(get_device_list(), dtype=object), ("devices",))
    return _Resolved(mesh, tuple((n, n) for n in mesh.axis_names), types)


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
    mesh, identity, types = _resolve_mesh(spec, name)
    rules = spec.logical_axes if spec.logical_axes is not None else identity
    rules = tuple(rules) + tuple(spec.extra_axes or ())
    _check_rules(rules, mesh, name)
    return ResolvedTask(
        uid=next(_UIDS), name=name, mesh=mesh, rules=rules, task=spec, axis_types=types
    )


# --- trace sessions and the task stack ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MicrobatchCall:
    """One traced call of a microbatched function: its options and microbatch count."""

    options: PipelineOptions
    num_microbatches: int


@dataclasses.dataclass
class RegisteredTasks:
    """What a trace learns about name-registered tasks (``trace/_colour`` fills it in)."""

    used: bool = False  # whether any registered matching ran in this trace
    resolved: dict[tuple[Registration, str, bool], ResolvedTask] = dataclasses.field(
        default_factory=dict
    )  # (registration, matched name, backprop) -> its task
    origin: dict[int, Match] = dataclasses.field(default_factory=dict)  # uid -> match
    # (names, module class or None) -> the winning registration
    matches: dict[tuple[tuple[str, ...], type | None], Match | None] = dataclasses.field(
        default_factory=dict
    )  # scope or module names -> the winning registration
    labels: dict[str, Label | None] = dataclasses.field(default_factory=dict)  # by name stack
    modules: set[int] = dataclasses.field(default_factory=set)  # uids entered by a Flax module


_CALL_UIDS = itertools.count(1)  # process-wide, so scope names never collide across traces


class TraceSession:
    """What one ``jit``/``parallelize`` trace learns; returned with the traced program.

    Attributes:
        tasks: every task entered, by uid (the number in its marker scope ``mmtask<uid>_``).
        microbatch_calls: every ``microbatch`` call traced, by the uid in its chunks' scopes
            ``mmmb<uid>_<k>``.
        module_tasks: Linen/NNX task modules resolved once per trace (see ``resolve_module``).
        registered: name-registered tasks matched and resolved in this trace.
        loop_dependent: whether a task resolved its mesh from the microbatch index: then the
            microbatches of one ``microbatch`` call differ and cannot share one traced body.
    """

    def __init__(self) -> None:
        self.tasks: dict[int, ResolvedTask] = {}
        self.microbatch_calls: dict[int, MicrobatchCall] = {}
        self.module_tasks: dict[tuple[Any, ...], ResolvedTask] = {}
        self.registered = RegisteredTasks()
        self.loop_dependent = False

    def resolve_module(self, key: tuple[Any, ...], spec: Task, name: str) -> ResolvedTask:
        """The task of a Flax module, resolved once per trace under ``key`` (a Linen module
        path or an NNX instance), and once per microbatch when its slice depends on it."""
        if spec.loop_dependent_mesh_slice is not None:
            key += (current_microbatch_index(),)
        if key not in self.module_tasks:
            self.module_tasks[key] = resolve_task(spec, name)
        return self.module_tasks[key]

    def add_microbatch_call(self, options: PipelineOptions, num_microbatches: int) -> int:
        """Records a traced ``microbatch`` call; returns the uid its scopes carry."""
        uid = next(_CALL_UIDS)
        self.microbatch_calls[uid] = MicrobatchCall(options, num_microbatches)
        return uid


@contextlib.contextmanager
def shape_only_trace() -> Iterator[None]:
    """Marks the body as a trace for shapes or variables only (``jax.eval_shape`` of an
    initializer): tasks met there are not placed, by design, so nothing is warned."""
    STATE.shape_only += 1
    try:
        yield
    finally:
        STATE.shape_only -= 1


def is_shape_only() -> bool:
    """Whether the current trace only reads shapes (``shape_only_trace``)."""
    return bool(STATE.shape_only)


def warn_foreign_trace(name: str) -> None:
    """Warns (once per task) that task ``name`` is traced by a transformation not ours.

    Raises:
        StrictModeError: under ``context(strict=True)``.
    """
    if STATE.shape_only:
        return
    warn_placement(
        ("foreign-trace", name),
        f"Task {name!r} is traced by a JAX transformation that is not multimesh_flax's "
        "(jax.jit, jax.grad, jax.vmap, ... outside `multimesh_flax.jit`), so it is not placed "
        "on its submesh: it runs wherever that transformation runs (usually device 0). "
        "Compile the function with `multimesh_flax.jit`, `multimesh_flax.parallelize` or "
        "`parallelize_step` instead (under jax.eval_shape, for shapes only, this is harmless). "
        "Applied eagerly (jax.grad, jax.vmap, jax.checkpoint outside every jit), the task "
        "runs op by op on the submesh its variables live on, its arguments moved there and "
        "their gradients moved back, and hands its results back uncommitted (as jnp results "
        "are), so that JAX moves them to wherever they are used next. jax.jit itself refuses "
        "arguments committed to different submeshes (a placed state): use "
        "`multimesh_flax.jit`, or `jax.device_put` the state onto one device first.",
    )


@contextlib.contextmanager
def microbatch_iteration(index: int) -> Iterator[None]:
    """Marks the body as microbatch iteration ``index`` (for ``loop_dependent_mesh_slice``)."""
    previous = STATE.microbatch_index
    STATE.microbatch_index = index
    try:
        yield
    finally:
        STATE.microbatch_index = previous


def current_microbatch_index() -> int | None:
    """The microbatch iteration being traced (see :func:`microbatch_iteration`), or ``None``."""
    return STATE.microbatch_index


def current_task() -> ResolvedTask | None:
    """The innermost task being traced, or ``None`` outside every task."""
    return STATE.task_stack[-1] if STATE.task_stack else None


def current_session() -> TraceSession | None:
    return STATE.sessions[-1] if STATE.sessions else None


# JAX caches the jaxprs it traces for ``jax.checkpoint``, an inner ``jax.jit``, loop and
# custom-derivative bodies, keyed on the function and its avals. A body served from that
# cache does not run its Python, so its tasks would never be entered in this session: their
# markers would name the tasks of an earlier session (placed by the first ``jit`` only, the
# next one silently falling back to one device). The cache key includes this user context,
# set to a new value per session, so a session sees only the traces it made itself (calls
# repeated within one session still share one trace). Entries left by earlier sessions age
# out of JAX's LRU caches (2,048 entries each); trace_program's own wrapper is fresh anyway.
_SESSION_CACHE_KEY = jax.make_user_context(None)
_SESSION_UIDS = itertools.count(1)


@contextlib.contextmanager
def trace_session() -> Iterator[TraceSession]:
    """Opens a session that records every task traced inside it.

    Inside it JAX's trace caches miss for every function first traced outside it (see
    ``_SESSION_CACHE_KEY``), so every task met is entered in this session.
    """
    session = TraceSession()
    STATE.sessions.append(session)
    try:
        with _SESSION_CACHE_KEY(next(_SESSION_UIDS)):
            yield session
    finally:
        STATE.sessions.pop()


@contextlib.contextmanager
def enter_task(resolved: ResolvedTask) -> Iterator[ResolvedTask]:
    """Runs the body as ``resolved``: its marker scope, its rules, its registration."""
    session = current_session()
    if session is not None:
        session.tasks[resolved.uid] = resolved
    STATE.task_stack.append(resolved)
    try:
        with jax.named_scope(resolved.marker):
            yield resolved
    finally:
        STATE.task_stack.pop()


def contains_tracer(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a tracer (the call is being traced)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))
