"""``Task[Module]``: a Flax module class that runs as a task on its own submesh.

``task(nn.Dense, mesh=...)`` returns a *subclass* of ``nn.Dense`` named ``Task[Dense]``. It
takes the wrapped module's own fields (``features=16, kernel_init=...``) and any call
signature, and its ``__call__`` runs the wrapped ``__call__`` inside the task (the task's
named-scope marker, its logical rules for ``with_sharding_constraint`` and for Flax's
``nn.logical_axis_rules``).

**Parameter tree.** Because ``Task[Dense]`` *is* a ``Dense`` with the same fields, its
parameters are exactly the wrapped module's: same names, same nesting, and an auto-named
``Task[Dense]`` inside a compact parent is called ``Dense_0`` like the plain module would be.
A checkpoint of the plain model therefore loads into the task-wrapped one and back.

Where the call runs (decided once for every kind of task by ``core/front/_task_call.call_task``;
this module is the Linen adapter):

* inside ``multimesh_flax.jit`` / ``parallelize`` / ``parallelize_step`` (or any trace): as the
  task, on its submesh; each module instance is one task per trace, however often it is
  called (weight sharing, microbatches);
* called eagerly on concrete arrays (``model.apply`` outside ``jit``): exactly the wrapped
  module's values; like an eager task function it first moves its array inputs next to its
  variables (else onto its submesh, when that resolves) and hands its results back
  uncommitted, so a pipelined model applied eagerly to its placed parameters works (no
  mesh or ``MultiMesh`` is needed);
* traced by a JAX transformation that is not ours (``jax.grad``, ``jax.vmap``,
  ``jax.checkpoint``, ``jax.jit`` outside every jit of ours): with a ``PlacementWarning``
  naming ``multimesh_flax.jit``, as an eager call (recomputed as its policy says): its
  inputs moved next to its variables, so a ``parallelize_step`` state spread over
  submeshes gives the unplaced model's values and gradients (under ``jax.checkpoint``,
  which stages the model and evaluates it op by op, by ``core/front/_handoff``);
* under ``ignore_transforms``: exactly the wrapped module.

While a task-wrapped module runs, it records its module path, so that tools that trace a
model (``tabulate``, ``parallelize_step``) know which parameters belong to which task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    Task,
    call_recomputed,
    check_rules_have_mesh,
    ignore_transforms,
    linen_transform,
    make_task,
)
from multimesh_flax.core.front import (
    EagerRunner,
    TaskCall,
    call_on_submesh,
    call_task,
    committed_place,
    move_array,
)
from multimesh_flax.core.trace import ResolvedTask, current_session, resolve_task
from multimesh_flax.layers import _nnx_task  # NNX classes get ``Task[Block]``

ModulePath = tuple[str, ...]


# --- recording which module paths are tasks ------------------------------------------------


class _Recorder(threading.local):
    def __init__(self) -> None:
        self.owners: list[dict[ModulePath, Task]] = []


_RECORDER = _Recorder()


@contextlib.contextmanager
def record_task_paths() -> Iterator[dict[ModulePath, Task]]:
    """Collects ``{module path: Task}`` for every task-wrapped module called in the block.

    Example:
        >>> from flax import linen as nn
        >>> from multimesh_flax.layers import task
        >>> import multimesh_flax as mm
        >>> class Net(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return task(nn.Dense, mesh=mm.TaskMesh(devices=[1]))(4)(x)
        >>> from multimesh_flax.core.trace import shape_only_trace
        >>> with record_task_paths() as owners, shape_only_trace():  # shapes: nothing placed
        ...     _ = jax.eval_shape(Net().init, jax.random.key(0), jnp.ones((2, 3)))
        >>> {path: spec.name for path, spec in owners.items()}
        {('Dense_0',): 'Dense_0'}
    """
    owners: dict[ModulePath, Task] = {}
    _RECORDER.owners.append(owners)
    try:
        yield owners
    finally:
        _RECORDER.owners.pop()


def _record(path: ModulePath, spec: Task) -> None:
    if _RECORDER.owners:
        _RECORDER.owners[-1].setdefault(path, spec)


# --- running a module call as a task -------------------------------------------------------


def resolve_path(spec: Task, path: ModulePath) -> ResolvedTask:
    """The ``ResolvedTask`` of the task module at ``path``: one per trace session."""
    name = spec.name or "task"
    session = current_session()
    if session is None:
        return resolve_task(spec, name)
    # Keyed by path: a module class may be re-created per call.
    return session.resolve_module(("flax", tuple(path)), spec, name)


def call_as_task(
    module: nn.Module, spec: Task, method: Callable[..., Any], args: Any = ((), {})
) -> Any:
    """Runs ``method(module, *args[0], **args[1])`` (the wrapped module's method, unbound)
    as ``spec``'s task, through the one task call (``core/front/_task_call.call_task``).

    The Linen adapter: one task per module path per trace, the module's variables reveal a
    trace, recomputation goes through Flax's lifted ``nn.checkpoint``, and an eager call runs
    the method op by op next to the module's variables (:func:`_eager_runner`).
    """
    positional, keywords = args
    if spec.name is None:  # unnamed: the module's name (``layer_0``), else its class's
        display = module.name or type(module).wrapped_module.__name__
        spec = dataclasses.replace(spec, name=display)
    _record(tuple(module.path), spec)  # only inside ``record_task_paths``
    fun, transform = linen_transform(module, method)

    def recomputed(*positional: Any, **keywords: Any) -> Any:
        return call_recomputed(fun, positional, keywords, spec.recompute, transform)

    task_call = TaskCall(
        spec=spec,
        body=fun,
        eager=_eager_runner(module, spec, functools.partial(method, module)),
        transform=transform,
        key=("flax", tuple(module.path)),
        state=module.variables,
        unstaged=_eager_runner(module, spec, recomputed),  # under jax.grad, jax.checkpoint
    )
    return call_task(task_call, positional, keywords)


def _eager_runner(module: nn.Module, spec: Task, call: Callable[..., Any]) -> EagerRunner:
    """An eager Linen call: ``call`` (the wrapped method on ``module``) op by op, transforms
    off, its array inputs moved next to the module's variables (else onto the task's
    submesh)."""

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        explicit = _explicit_task(spec)
        if explicit is not None:  # sharding in types: on its submesh, as ``jax.set_mesh``
            return call_on_submesh(explicit, call, args, kwargs)
        positional, keywords = _eager_inputs(module, spec, (args, kwargs))
        with ignore_transforms():
            return call(*positional, **keywords)

    return run


def _explicit_task(spec: Task) -> ResolvedTask | None:
    """The task resolved, where its submesh has Explicit axes (else ``None``)."""
    try:
        resolved = resolve_task(spec, spec.name or "task")
    except errors.MultiMeshError:
        return None
    return None if resolved.ambient_mesh.are_all_axes_auto else resolved


def _eager_target(module: nn.Module, spec: Task) -> jax.sharding.Sharding | None:
    """Where an eager call computes: next to the module's (committed) variables, else on the
    task's submesh; ``None`` when neither is known (no variables, no resolvable mesh)."""
    committed = committed_place(module.variables)  # beneath an eager jax.grad's tracers too
    if committed is not None:
        return committed
    try:
        mesh = resolve_task(spec, spec.name or "task").mesh
    except errors.MultiMeshError:  # a mesh_slice with no MultiMesh, positions beyond devices
        return None
    return NamedSharding(mesh, PartitionSpec())


def _eager_inputs(module: nn.Module, spec: Task, args: Any) -> Any:
    """``args`` with every array moved to where the module computes (replicated there).

    A task function called eagerly runs on its submesh with its inputs moved there; a
    ``Task[Module]`` does the same, so that a pipelined model applied eagerly to
    its placed parameters (stage 0's output meeting stage 1's parameters) computes the
    unplaced model's values instead of failing on incompatible devices.
    """
    target = _eager_target(module, spec)
    if target is None:
        return args
    return jax.tree_util.tree_map(lambda x: move_array(x, target), args)


# --- the Task[Module] class ----------------------------------------------------------------


@contextlib.contextmanager
def _class_name(cls: type, name: str) -> Iterator[None]:
    """Temporarily renames ``cls`` (Flax auto-names submodules after their class)."""
    original = cls.__name__
    cls.__name__ = name
    try:
        yield
    finally:
        cls.__name__ = original


def _make_task_class(model: type[nn.Module], spec: Task) -> type[nn.Module]:
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return call_as_task(self, spec, model.__call__, (args, kwargs))

    def __post_init__(self: nn.Module) -> None:
        # Auto-name like the wrapped module (``Dense_0``, not ``Task[Dense]_0``) so that the
        # parameter tree is the plain model's.
        with _class_name(cls, model.__name__):
            super(cls, self).__post_init__()

    namespace = {
        "__call__": __call__,
        "__post_init__": __post_init__,
        "__module__": model.__module__,
        "__doc__": f"``{model.__name__}`` running as a task (``multimesh_flax.layers.task``).",
        "task_spec": spec,
        "wrapped_module": model,
    }
    cls = type(f"Task[{model.__name__}]", (model,), namespace)
    cls.__qualname__ = cls.__name__
    return cls


def _check_model(model: Any) -> None:
    if not (isinstance(model, type) and issubclass(model, nn.Module)):
        got = (
            f"an instance of {type(model).__name__}"
            if isinstance(model, nn.Module)
            else f"{type(model).__name__}: {model!r}"
        )
        raise errors.TaskTypeError(
            f"Expected a Flax module class (a subclass of flax.linen.Module) such as "
            f"`nn.Dense`, got {got}. Pass the class, not an instance; wrap plain "
            "functions with `multimesh_flax.core.task`."
        )


def task(
    model: type[nn.Module],
    name: str | None = None,
    *,
    task: Task | None = None,
    **kwargs: Any,
) -> type[nn.Module]:
    """Wraps a Flax module class so that each instance runs as a task on its submesh.

    Args:
        model: a ``flax.linen.Module`` subclass (``nn.Dense``, your ``MLPBlock``, ...), or
            an ``flax.nnx.Module`` subclass (see :func:`multimesh_flax.layers._nnx_task.task`).
        name: the task's display name (default: the module instance's name, e.g.
            ``layer_0``, else the module class name).
        task: a ready ``Task``; exclusive with ``kwargs``.
        **kwargs: ``mesh`` (a ``TaskMesh`` or ``jax.sharding.Mesh``), ``devices`` (array or
            list of jax devices) with ``device_axes``, ``logical_axes``, or any ``Task`` field
            (``recompute="full"``: the backward recomputes the module's activations, through
            Flax's lifted ``nn.checkpoint``). Without ``logical_axes`` the mesh axis names are
            the logical names.

    Returns:
        A subclass of ``model`` named ``Task[<Model>]``, constructed with ``model``'s fields.

    Raises:
        TaskTypeError: ``model`` is not a Flax module class.
        InvalidTaskError: ``logical_axes`` without a mesh or device axes, or contradictory
            options.

    Example:
        >>> import numpy as np
        >>> from flax import linen as nn
        >>> from jax.sharding import Mesh
        >>> from multimesh_flax.layers import shard_axes, task
        >>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
        >>> DenseTask = task(nn.Dense, mesh=mesh)
        >>> model = DenseTask(features=16, kernel_init=shard_axes("x", None))
        >>> DenseTask.__name__, isinstance(model, nn.Dense)
        ('Task[Dense]', True)
        >>> params = model.init(jax.random.key(0), jnp.ones((16, 9)))["params"]
        >>> params["kernel"].value.shape
        (9, 16)
    """
    if _nnx_task.is_nnx_class(model):
        return _nnx_task.task(model, name, task=task, **kwargs)
    _check_model(model)
    if task is None:
        check_rules_have_mesh(kwargs)
    return _make_task_class(model, make_task(name, task, kwargs))


def task_spec_of(module: nn.Module | type[nn.Module]) -> Task | None:
    """The ``Task`` of a ``Task[Module]`` class or instance, else ``None``."""
    cls = module if isinstance(module, type) else type(module)
    return getattr(cls, "task_spec", None)
