"""The front door's ``task``, ``jit`` and ``microbatch``: Flax Linen and NNX module classes
and plain functions alike; ``jit`` also takes NNX graph objects as arguments, and
``microbatch`` functions that close over them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import linen as nn
from flax import nnx

from multimesh_flax import errors
from multimesh_flax.core.declare import _task as _core_task
from multimesh_flax.core.front import _task_function
from multimesh_flax.layers import _nnx_jit, _nnx_task
from multimesh_flax.layers import _task as _flax_task

jit = _nnx_jit.jit
microbatch = _nnx_jit.microbatch


def task(
    fun: Callable[..., Any] | type[nn.Module],
    name: str | None = None,
    *,
    task: _core_task.Task | None = None,
    **kwargs: Any,
) -> Any:
    """Runs ``fun`` as a task: a Flax module class (Linen or NNX) becomes ``Task[Module]``
    (:func:`multimesh_flax.layers.task`), anything else a task function
    (:func:`multimesh_flax.core.task`).

    Example:
        >>> from flax import linen as nn
        >>> import multimesh_flax as mm
        >>> mm.task(nn.Dense, mesh=mm.TaskMesh(devices=[0])).__name__
        'Task[Dense]'
        >>> callable(mm.task(lambda x: x, mesh=mm.TaskMesh(devices=[0])))
        True
    """
    if isinstance(fun, type) and issubclass(fun, nn.Module):
        return _flax_task.task(fun, name, task=task, **kwargs)
    if _nnx_task.is_nnx_class(fun) or isinstance(fun, nnx.Module):
        return _nnx_task.task(fun, name, task=task, **kwargs)
    if isinstance(fun, nn.Module):
        raise errors.TaskTypeError(
            f"Expected a Flax module class such as `nn.Dense` (or a function), got an "
            f"instance of {type(fun).__name__}. Pass the class and construct the wrapped class: "
            f"`task({type(fun).__name__}, ...)(<fields>)`."
        )
    return _task_function.task(fun, name, task=task, **kwargs)
