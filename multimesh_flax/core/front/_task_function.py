"""``task(fun, ...)``: a function that runs as a task.

Traced by ``jit``/``parallelize``, the function runs inside its task's marker scope with the
task's rules active (``trace/_session.enter_task``); called eagerly (outside every trace) it is
compiled with ``jit`` and runs on its submesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from multimesh_flax import errors
from multimesh_flax.core.declare import _config, _recompute
from multimesh_flax.core.declare._task import Task, make_task
from multimesh_flax.core.front._jit import jit
from multimesh_flax.core.trace._session import (
    contains_tracer,
    current_session,
    enter_task,
    resolve_task,
    warn_foreign_trace,
)


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
    spec = make_task(name, task, kwargs)
    display = spec.name or getattr(fun, "__name__", "task")
    eager_cache: dict[str, Any] = {}

    @functools.wraps(fun)
    def run_task(*args: Any, **kw: Any) -> Any:
        if _config.get_flag("ignore_transforms"):
            return fun(*args, **kw)
        if current_session() is None and not contains_tracer((args, kw)):
            if "jit" not in eager_cache:
                eager_cache["jit"] = jit(run_task)
            return eager_cache["jit"](*args, **kw)
        if current_session() is None:
            warn_foreign_trace(display)
        with enter_task(resolve_task(spec, display)):
            return _recompute.call(fun, args, kw, spec.recompute)

    run_task.task = spec  # type: ignore[attr-defined]
    return run_task
