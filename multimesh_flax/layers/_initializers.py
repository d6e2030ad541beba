"""Parameter initializers that carry logical partitioning metadata.

``shard_axes("embed", "mlp")`` is an initializer whose parameters are boxed with logical axis
names (Flax's ``LogicallyPartitioned``), so that ``parallelize`` and ``model.tabulate`` know
how each parameter is laid out: Flax's table shows it as ``P(embed, mlp)``. Used as an NNX
``kernel_init`` (called while an ``nnx.Module`` is constructed, outside every Linen module)
it is ``nnx.with_partitioning``: the variable gets the names as its ``out_sharding``
metadata.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.linen import module as _linen_module
from flax.nnx import pytreelib as _nnx_pytree

from multimesh_flax import errors

Initializer = Callable[..., Any]


def shard_axes(*names: str | None, init: Initializer | None = None) -> Initializer:
    """An initializer whose parameters carry the logical axis ``names``.

    Args:
        *names: one logical axis name (or ``None``, replicated) per parameter dimension.
        init: the base initializer; default Xavier normal.

    Returns:
        A Flax initializer ``(key, shape, dtype)``: NNX variable metadata
        (``out_sharding=names``) while an NNX module is constructed, else a Linen
        ``LogicallyPartitioned`` box.

    Raises:
        LogicalRulesError: a name that is neither a string nor ``None``.

    Example:
        >>> from flax import linen as nn
        >>> from multimesh_flax.layers import shard_axes
        >>> dense = nn.Dense(16, kernel_init=shard_axes("x", None))
        >>> params = dense.init(jax.random.key(0), jnp.ones((4, 9)))["params"]
        >>> params["kernel"].names, params["kernel"].value.shape
        (('x', None), (9, 16))
        >>> from flax import nnx
        >>> with nnx.use_eager_sharding(False):  # or construct it through mm.task
        ...     layer = nnx.Linear(9, 16, kernel_init=shard_axes("x", None), rngs=nnx.Rngs(0))
        >>> layer.kernel.get_metadata()["out_sharding"]
        ('x', None)
    """
    bad = [n for n in names if n is not None and not isinstance(n, str)]
    if bad:
        raise errors.LogicalRulesError(
            f"Expected logical axis names as strings or None, got {bad[0]!r} in "
            f"shard_axes{names!r}. Example: shard_axes('embed', 'mlp')."
        )
    base = nn.initializers.xavier_normal() if init is None else init
    linen_init = nn.with_logical_partitioning(base, tuple(names))
    nnx_init = nnx.with_partitioning(base, tuple(names))

    def initializer(key: Any, shape: Any, dtype: Any = jnp.float32) -> Any:
        _check_rank(names, shape)
        if _constructing_nnx_module() and not _inside_linen_module():
            return nnx_init(key, shape, dtype)
        return linen_init(key, shape, dtype)

    return initializer


def _check_rank(names: tuple[str | None, ...], shape: Any) -> None:
    """Refuses more logical names than the parameter has dimensions, naming the module."""
    if len(names) <= len(shape):
        return
    stack = _linen_module._context.module_stack
    module = stack[-1] if stack and stack[-1] is not None else None
    where = f" of module `{'/'.join(module.path) or type(module).__name__}`" if module else ""
    raise errors.PartitionSpecError(
        f"shard_axes{names!r} names {len(names)} dimensions, but the parameter{where} has "
        f"shape {tuple(shape)} ({len(shape)} dimensions). Give one name (or None) per "
        f"dimension, e.g. shard_axes{names[: len(shape)]!r}."
    )


def _inside_linen_module() -> bool:
    """Whether a Linen module is being initialised or applied here (Linen keeps a stack of
    the modules whose methods are running; ``None`` at the bottom)."""
    stack = _linen_module._context.module_stack
    return bool(stack) and stack[-1] is not None


_NNX_CONSTRUCT = _nnx_pytree._graph_node_meta_call.__code__


def _constructing_nnx_module() -> bool:
    """Whether an ``nnx.Module`` (any NNX graph object) is being constructed up the stack.

    NNX keeps no record of this, so the frames are searched for NNX's construction hook;
    initializers run once per parameter, so the cost does not matter.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _NNX_CONSTRUCT:
            return True
        frame = frame.f_back
    return False
