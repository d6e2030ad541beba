"""``task(fun, ...)``: a function that runs as a task.

The adapter of a function to the one task call (``front/_task_call``): the body is the
function, the recomputation checkpoint is ``jax.checkpoint``, and called eagerly it runs op
by op on the task's submesh. Everything else -- placement, rules,
recomputation, the foreign-trace warning, errors -- is ``_task_call.call_task``'s, the same for
Linen and NNX modules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from multimesh_flax import errors
from multimesh_flax.core.declare import Task, make_task
from multimesh_flax.core.front import _task_call


def task(
    fun: Callable[..., Any], name: str | None = None, *, task: Task | None = None, **kwargs: Any
) -> Callable[..., Any]:
    """Wraps ``fun`` so that it (forward and backward) runs on the task's submesh.

    Inside ``jit``/``parallelize`` the task becomes its own units of the MPMD program. Called
    eagerly, it runs op by op on the task's submesh: inputs move there (replicated) and the
    result comes back uncommitted on the submesh's first device (as a ``jnp`` result: JAX
    moves it to wherever it is used next). Under ``ignore_transforms`` it is ``fun`` itself.

    Args:
        fun: the function to run as a task.
        name: display name (default: ``fun.__name__``).
        task: a ready ``Task``; exclusive with ``kwargs``.
        **kwargs: ``Task`` fields (``mesh``, ``logical_axes``, ``mesh_slice``,
            ``recompute``, ...), or
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

        With ``recompute`` the backward recomputes the task's activations instead of
        keeping them (same values):

        >>> h = mm.task(lambda x: jnp.sin(jnp.sin(x)), mesh=mm.TaskMesh(devices=[0]),
        ...             recompute="full")
        >>> round(float(mm.jit(jax.grad(lambda x: h(x).sum()))(jnp.ones(2))[0]), 4)
        0.36
    """
    if not callable(fun):
        raise errors.TaskTypeError(
            f"Expected `fun` to be a function to run as a task, got {type(fun).__name__}: "
            f"{fun!r}. Pass the function itself."
        )
    declared = make_task(name, task, kwargs)
    spec = dataclasses.replace(declared, name=declared.name or getattr(fun, "__name__", "task"))

    @functools.wraps(fun)
    def run_task(*args: Any, **kw: Any) -> Any:
        return _task_call.call_task(task_call, args, kw)

    task_call = _task_call.TaskCall(
        spec=spec, body=fun, eager=_task_call.eager_on_submesh(spec, fun)
    )
    run_task.task = declared  # type: ignore[attr-defined]
    return run_task
