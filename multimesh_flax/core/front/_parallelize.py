"""``parallelize``: derive input shardings from a function and build sharded initializers.

``parallelize(fun, init_params=..., get_input_batch=...)`` traces ``fun(params, batch)`` on
abstract inputs, derives where every parameter and batch leaf must live (the first logical
constraint applied to it, resolved by its task's rules, else replicated on the submesh of
its first consumer), and returns:

* ``sharded_fun`` -- ``jit(fun)``, an MPMD program when tasks sit on different submeshes;
* ``sharded_init_params`` / ``sharded_get_input_batch`` -- the user's initializers compiled
  so every array arrives in its sharding (``_initializer``: never as a full copy on one
  device first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from multimesh_flax import errors
from multimesh_flax.core.declare import as_device_array
from multimesh_flax.core.fragment import input_sharding
from multimesh_flax.core.front import _jit
from multimesh_flax.core.front._build import collector_paused, partition_program
from multimesh_flax.core.front._initializer import sharded_initializer
from multimesh_flax.core.trace import shape_only_trace, trace_program


def derive_shardings(fun: Callable[..., Any], args: tuple[Any, ...], devices: Any) -> list[Any]:
    """Where each leaf of ``args`` should arrive for ``fun``: traced and placed, not compiled
    and not kept (``tabulate``); a compiled function reads them from its own program with
    ``MpmdJit.input_shardings``."""
    with collector_paused():
        traced = trace_program(fun, args, devices)
        part = partition_program(traced, devices)
    shardings = [input_sharding(part, v) for v in traced.jaxpr.invars]
    fallback = jax.sharding.NamedSharding(
        part.place_meshes[part.default_place], jax.sharding.PartitionSpec()
    )
    return [fallback if s is None else s for s in shardings]


def shape_structs(tree: Any) -> Any:
    """``tree`` with every leaf replaced by its ``jax.ShapeDtypeStruct`` (shape and dtype)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _check_args(fun: Any, init_params: Any, get_input_batch: Any, initial_batch: Any) -> None:
    if not callable(fun):
        raise errors.ParallelizeArgumentError(
            f"Expected `fun` to be a function `fun(params, batch)`, got {type(fun).__name__}: "
            f"{fun!r}. Pass the function itself."
        )
    if get_input_batch is not None and initial_batch is not None:
        raise errors.ParallelizeArgumentError(
            "Expected either `get_input_batch` or `initial_batch`, got both. Pass one."
        )
    for name, value in (("init_params", init_params), ("get_input_batch", get_input_batch)):
        if value is not None and not callable(value):
            raise errors.ParallelizeArgumentError(
                f"Expected `{name}` to be a function taking no arguments, got "
                f"{type(value).__name__}: {value!r}. Wrap a value in a function: "
                f"`{name}=lambda: value`."
            )


def parallelize(
    fun: Callable[..., Any],
    *,
    init_params: Callable[[], Any] | None = None,
    get_input_batch: Callable[[], Any] | None = None,
    initial_batch: Any = None,
    devices: Sequence[jax.Device] | np.ndarray | None = None,
) -> tuple[Any, ...]:
    """Compiles ``fun(params, batch)`` into a sharded (possibly MPMD) function.

    Args:
        fun: ``fun(params, batch)``; ``params`` is omitted when ``init_params`` is ``None``,
            ``batch`` when neither ``get_input_batch`` nor ``initial_batch`` is given.
        init_params: a function of no arguments returning the (unsharded) parameters.
        get_input_batch: a function of no arguments returning an example batch.
        initial_batch: an example batch (arrays), instead of ``get_input_batch``.
        devices: the device list to parallelize over, as jax devices or integer positions in
            ``jax.devices()`` (default: all devices).

    Returns:
        ``(sharded_fun, sharded_init_params, sharded_get_input_batch)`` when
        ``get_input_batch`` is given, else ``(sharded_fun, sharded_init_params)``. The
        fragments of ``sharded_fun`` start compiling in a thread right away
        (``MpmdJit.compile_ahead``; ``sharded_fun.ahead``), while the caller initializes.

    Raises:
        ParallelizeArgumentError: both ``get_input_batch`` and ``initial_batch``, or ``fun``
            or an initializer that is not callable.

    Example:
        >>> import multimesh_flax as mm
        >>> mesh = mm.TaskMesh(devices=range(8), axis_names=("x",))
        >>> def f(w, x):
        ...     x = mm.with_sharding_constraint(x, P("batch", None))
        ...     return x @ mm.with_sharding_constraint(w, P(None, "model"))
        >>> f = mm.task(f, mesh=mesh, logical_axes=[("batch", "x"), ("model", "x")])
        >>> sh_f, init_w, get_x = mm.parallelize(
        ...     f, init_params=lambda: jnp.ones((4, 8)), get_input_batch=lambda: jnp.ones((8, 4)))
        >>> init_w().sharding.spec, get_x().sharding.spec
        (P(None, 'x'), P('x',))
        >>> float(sh_f(init_w(), get_x()).sum())
        256.0
    """
    _check_args(fun, init_params, get_input_batch, initial_batch)
    devices = None if devices is None else as_device_array(devices, "devices")
    has_batch = get_input_batch is not None or initial_batch is not None
    with shape_only_trace():
        params_shape = jax.eval_shape(init_params) if init_params is not None else None
    batch_shape = None
    if get_input_batch is not None:
        with shape_only_trace():
            batch_shape = jax.eval_shape(get_input_batch)
    elif initial_batch is not None:
        batch_shape = shape_structs(initial_batch)
    args = tuple(
        a for a, used in ((params_shape, init_params is not None), (batch_shape, has_batch)) if used
    )
    sharded_fun = _jit.jit(fun, devices=devices)
    # Builds the program the first call runs (one trace, one partition), then reads from it
    # where the arguments must live.
    (shardings, _) = sharded_fun.input_shardings(*args)
    # Its fragments compile in a thread meanwhile (``compile_ahead``): while the caller
    # initializes the parameters and the batch. Dropping ``sharded_fun`` ends that.
    example = args if initial_batch is None else (*args[:-1], initial_batch)  # batch last
    ahead = sharded_fun.compile_ahead(*example)
    parts = iter(shardings)
    sharded_init = None
    if init_params is not None:
        sharded_init = _widening(sharded_initializer(init_params, next(parts)), ahead)
    elif ahead is not None:
        ahead.widen()
    if get_input_batch is not None:
        return sharded_fun, sharded_init, sharded_initializer(get_input_batch, next(parts))
    return sharded_fun, sharded_init


def _widening(init: Callable[[], Any], ahead: Any) -> Callable[[], Any]:
    """``init``, letting ``ahead`` (a ``CompileAhead``, or ``None``) compile at full width once
    ``init`` has compiled and run."""

    def initialized() -> Any:
        params = init()
        if ahead is not None:
            ahead.widen()
        return params

    return initialized
