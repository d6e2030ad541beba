"""One task call: what every kind of task (function, Linen ``Task[Module]``, NNX
``Task[Block]``) does when it is called, written once.

A frontend describes its call as a :class:`TaskCall` -- the body, how the recomputation
checkpoint reaches the body's variables, which trees besides the arguments reveal a trace,
how it runs eagerly -- and hands it to :func:`call_task`, which decides, in this
order:

1. **under** ``ignore_transforms``: the body itself, nothing else;
2. **eager** (no trace session, and JAX traces nothing): the frontend's ``eager`` runner.
   Every kind runs the same way: op by op with transforms off, on the task's submesh, its
   array arguments moved there (:func:`call_on_submesh`; a Linen module's next to its
   committed variables, where those already are). The result is the plain computation's
   values, computed replicated on the submesh (constraints inside the task do not shard
   it), handed back released (:func:`release_results`: uncommitted, on the submesh's first
   device), so that JAX moves it to wherever it is used next -- a variable no task owns
   may sit on any submesh (a tied embedding where its first use is);
3. **traced by a transformation that is not ours** (``jax.jit``, ``jax.grad``, ``nnx.jit``
   outside ``multimesh_flax.jit``): when the call's arguments or the module's variables are
   tracers, a ``PlacementWarning`` naming ``multimesh_flax.jit`` (none inside
   ``shape_only_trace``); a foreign trace that hands the call constants only (Flax's own
   ``Module.tabulate`` traces ``init`` under ``jax.eval_shape``, closing over its inputs)
   is taken as a shape-only trace and not warned. Then as 4, except for a module task
   (``TaskCall.unstaged``), which runs as its eager call does (``jax.grad``, ``jax.vmap``,
   ``jax.checkpoint`` applied outside every jit): its arguments move to where it computes
   (:func:`move_array`) and their cotangents back; its results are released as in 2. The
   moves are one primitive (``_handoff``) that JAX's op-by-op evaluation of a staged
   program (an eager ``jax.checkpoint`` stages the model, then evaluates it equation by
   equation) carries out where the arrays then are, and that a compiled program ignores;
4. **traced** (by ``jit``/``parallelize``): as the task -- the task resolved once per trace
   (per module instance, for modules), its marker scope, its rules for
   ``with_sharding_constraint`` and for Flax's logical API with the task's submesh as the
   ambient mesh, and its body run through :func:`multimesh_flax.core.declare.call_recomputed`
   (checkpointed when the task's recomputation policy says so).

Errors are the same for every kind because they come from the same place: a task that
cannot be resolved (``mesh_slice`` with no ``MultiMesh``, a rule naming a missing mesh axis)
raises from :func:`call_task` whichever frontend made it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    RecomputeTransform,
    Task,
    call_recomputed,
    get_flag,
    ignore_transforms,
    jax_transform,
)
from multimesh_flax.core.front._handoff import RELEASED, handoff
from multimesh_flax.core.trace import (
    ResolvedTask,
    abstract_mesh,
    contains_tracer,
    current_session,
    enter_task,
    flax_rules,
    is_shape_only,
    leave_explicit_axes,
    resolve_task,
    warn_foreign_trace,
)

EagerRunner = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def _no_place(_resolved: ResolvedTask) -> AbstractContextManager[None]:
    return nullcontext()


@dataclasses.dataclass(frozen=True)
class TaskCall:
    """One call of a task, as a frontend hands it to :func:`call_task`.

    Attributes:
        spec: the task, with its display name filled in.
        body: the wrapped computation, ``body(*args, **kwargs)``.
        eager: runs the call outside every trace (``args, kwargs -> result``): op by op
            on the task's submesh (:func:`eager_on_submesh` for functions).
        transform: how the recomputation checkpoint wraps the body
            (:func:`~multimesh_flax.core.declare._recompute.jax_transform` for functions; the
            Linen and NNX transforms pass the module's variables in).
        key: memo key of a module instance: one task per instance per trace
            (``None``: a new task per call, as for functions).
        state: trees besides the arguments whose tracers mean the call is traced (a
            module's variables).
        place: a context manager factory entered inside the task around the body (NNX reads
            its variables through constraints on the submesh there).
        unstaged: how the call runs under a JAX transformation that is not ours (``jax.grad``,
            ``jax.vmap``, ``jax.checkpoint`` applied outside every jit), or ``None`` to run it
            as under ours, unplaced. A module whose variables live on its submesh runs op by
            op there (as its ``eager`` runner), so that modules on other submeshes do not meet
            in one operation.
    """

    spec: Task
    body: Callable[..., Any]
    eager: EagerRunner
    transform: RecomputeTransform = jax_transform
    key: Hashable | None = None
    state: Any = ()
    place: Callable[[ResolvedTask], AbstractContextManager[Any]] = _no_place
    unstaged: EagerRunner | None = None

    @property
    def name(self) -> str:
        return self.spec.name or "task"


def call_task(task_call: TaskCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs ``task_call`` on ``args``/``kwargs`` (see the module docstring for the cases).

    Raises:
        NoMultiMeshError: a ``mesh_slice`` task with no ``MultiMesh`` active.
        LogicalRulesError: a rule naming a mesh axis the task's mesh lacks.
        StrictModeError: under ``context(strict=True)``, a task traced by a foreign trace.
    """
    if get_flag("ignore_transforms"):
        with _explicit_ambient_while_tracing(task_call):
            return task_call.body(*args, **kwargs)
    session = current_session()
    inputs_traced = contains_tracer((args, kwargs, task_call.state))
    if session is None and not inputs_traced and not _jax_is_tracing():
        return release_results(task_call.eager(args, kwargs))
    if session is None and inputs_traced:
        warn_foreign_trace(task_call.name)
        if _runs_unstaged(task_call):
            return release_results(task_call.unstaged(args, kwargs))
    return run_as(resolve(task_call), task_call, args, kwargs)


def _runs_unstaged(task_call: TaskCall) -> bool:
    return task_call.unstaged is not None and not is_shape_only()


def _explicit_ambient_while_tracing(task_call: TaskCall) -> AbstractContextManager[Any]:
    """Under ``ignore_transforms``, a task whose axes are Explicit still sees its submesh as
    the ambient abstract mesh while JAX traces it (``parallelize_step`` initialises its
    model so), since ``reshard`` and ``out_sharding=`` need one; eagerly it runs as is."""
    if not _jax_is_tracing():
        return nullcontext()
    try:
        mesh = resolve_task(task_call.spec, task_call.name).ambient_mesh
    except errors.MultiMeshError:  # no MultiMesh for its slice: the plain body
        return nullcontext()
    return nullcontext() if mesh.are_all_axes_auto else abstract_mesh(mesh)


def eager_mesh(resolved: ResolvedTask) -> AbstractContextManager[Any]:
    """Around an eager call of a task with Explicit axes: ``jax.set_mesh`` of its submesh
    with those axes, so that ``reshard`` and ``out_sharding=`` resolve there."""
    mesh = resolved.typed_mesh
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return nullcontext()
    try:
        return jax.set_mesh(mesh)
    except ValueError:  # inside a trace (``jax.checkpoint``): its abstract mesh only
        return abstract_mesh(resolved.ambient_mesh)


def call_on_submesh(
    resolved: ResolvedTask, call: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
) -> Any:
    """``call(*args, **kwargs)`` eagerly on ``resolved``'s submesh: array arguments replicated
    there, its mesh ambient (:func:`eager_mesh`), no placement transforms inside."""
    replicated = NamedSharding(resolved.typed_mesh, PartitionSpec())
    args, kwargs = jax.tree_util.tree_map(lambda x: move_array(x, replicated), (args, kwargs))
    with ignore_transforms(), eager_mesh(resolved):
        return call(*args, **kwargs)


def concrete_array(x: Any) -> jax.Array | None:
    """The array holding ``x``'s value: ``x`` itself, or beneath a tracer of a transformation
    that computes as it goes (an eager ``jax.grad``/``jax.jvp``) its primal; ``None`` for a
    tracer with no value yet (``jax.jit``, ``jax.checkpoint``, ``jax.vmap``) or a non-array."""
    if isinstance(x, Tracer):
        from jax._src import core  # a tracer's concrete value has no public accessor (jax 0.10)

        x = core.to_concrete_value(x)
    return x if isinstance(x, jax.Array) and not isinstance(x, Tracer) else None


def committed_place(tree: Any) -> jax.sharding.Sharding | None:
    """Where the first committed array of ``tree`` lives (beneath tracers too, see
    :func:`concrete_array`), replicated there; ``None`` when no array is committed, or
    the first one spans devices without a mesh."""
    for leaf in jax.tree_util.tree_leaves(tree):
        value = _batched_array(leaf)
        if value is not None and value.committed:
            sharding = value.sharding
            if isinstance(sharding, NamedSharding):
                return NamedSharding(sharding.mesh, PartitionSpec())
            return sharding if len(sharding.device_set) == 1 else None
    return None


def _batched_array(x: Any) -> jax.Array | None:
    """:func:`concrete_array`, and under an eager ``jax.vmap`` the batched array that ``x``
    is a slice of (same devices): where ``x`` is computed, not its value."""
    from jax._src.interpreters import batching  # no public name for vmap's tracer (jax 0.10)

    while isinstance(x, batching.BatchTracer):
        x = x.val
    return concrete_array(x)


def move_array(x: Any, target: Any) -> Any:
    """``x`` put on ``target`` (a sharding or a device) unless it is there already or not an
    array, differentiably: under ``jax.grad`` its cotangent moves back to where ``x`` was,
    so that the backward of an eager task call meets the arrays of the surrounding
    computation on their own devices. Where ``x``'s place is unknown (staged by an eager
    ``jax.checkpoint``) or uncommitted, the cotangent is released instead (a fresh
    uncommitted array, which JAX moves to wherever it is added up; :mod:`._handoff`)."""
    if not isinstance(x, jax.Array):
        return x
    if not isinstance(target, jax.sharding.Sharding):  # a device
        target = jax.sharding.SingleDeviceSharding(target)
    value = concrete_array(x)
    if value is not None and value.committed:
        if value.sharding.is_equivalent_to(target, value.ndim):
            return x
        return jax.device_put(x, target, src=value.sharding)
    return handoff(x, target, RELEASED)


def release_results(tree: Any) -> Any:
    """The arrays of a task's results released (:func:`._handoff.release`): uncommitted
    where they were computed, so that JAX moves them to wherever the next operation needs
    them (next to a tied embedding on one submesh or a head on another); their cotangents
    released likewise."""
    return jax.tree_util.tree_map(
        lambda x: handoff(x, RELEASED, RELEASED) if isinstance(x, jax.Array) else x, tree
    )


def _jax_is_tracing() -> bool:
    """Whether JAX traces here even though the call's inputs are all constants (an
    initialiser under ``jax.eval_shape`` that closes over its inputs)."""
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def resolve(task_call: TaskCall) -> ResolvedTask:
    """The ``ResolvedTask`` of the call: per instance per trace session for modules."""
    session = current_session()
    if session is None or task_call.key is None:
        return resolve_task(task_call.spec, task_call.name)
    return session.resolve_module(task_call.key, task_call.spec, task_call.name)


def run_as(
    resolved: ResolvedTask,
    task_call: TaskCall,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The body run as ``resolved`` (entered, rules and ambient mesh set, recomputed per
    policy); also how name-registered NNX modules run as their matched task."""
    with _entered(resolved), task_call.place(resolved), explain_axis_types(resolved):
        out = call_recomputed(
            task_call.body, args, kwargs, resolved.task.recompute, task_call.transform
        )
    return leave_explicit_axes(out, resolved)


@contextlib.contextmanager
def _entered(resolved: ResolvedTask) -> Iterator[None]:
    """Inside ``resolved``: its marker scope, its rules, its submesh as the ambient mesh."""
    with enter_task(resolved), flax_rules(resolved):
        yield


@contextlib.contextmanager
def explain_axis_types(resolved: ResolvedTask) -> Iterator[None]:
    """Turns JAX's refusal of ``reshard``/``out_sharding=`` on Auto axes inside task
    ``resolved`` into an ``AxisTypeError`` that says how to get Explicit axes."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if not _refuses_auto_axes(e, resolved):
            raise
        mesh = resolved.ambient_mesh
        raise errors.AxisTypeError(
            f"Task {resolved.name!r} uses sharding in types (`jax.sharding.reshard` or "
            f"`out_sharding=`), but its submesh {dict(mesh.shape)} has axis types "
            f"{mesh.axis_types}: JAX says {str(e).splitlines()[0]!r}. Give the mesh Explicit "
            "axes: `MultiMesh(global_mesh=jax.make_mesh(...))` (Explicit by default), "
            "`MultiMesh(..., axis_types=(AxisType.Explicit,) * n)` or "
            "`TaskMesh(..., axis_types=...)`; or use `mm.with_sharding_constraint` with "
            "logical names on Auto axes."
        ) from e


def _refuses_auto_axes(error: Exception, resolved: ResolvedTask) -> bool:
    if isinstance(error, errors.MultiMeshError) or not resolved.ambient_mesh.are_all_axes_auto:
        return False
    text = str(error)
    return "of type Auto" in text or "AxisType.Auto" in text


def eager_on_submesh(spec: Task, fun: Callable[..., Any]) -> EagerRunner:
    """A function task's eager runner: ``fun`` op by op on the task's submesh
    (:func:`call_on_submesh`), as a module task's eager call runs."""

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return call_on_submesh(resolve_task(spec, spec.name or "task"), fun, args, kwargs)

    return run
