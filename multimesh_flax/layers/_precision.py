"""The precision recipe of ``parallelize_step``: which dtype stores the state and which
computes the step.

``parallelize_step(..., precision=...)`` takes a :class:`Precision` (or its string value):

* ``"fp32"`` (default): nothing is cast; the step is the program it always was.
* ``"bf16"``, mixed precision: parameters and optimizer state stay float32. At the step's
  entry every float32 parameter and float batch leaf is cast to bfloat16
  (:func:`to_compute`), so the forward, the backward, the activations kept between them and
  the values sent between stages are bfloat16. Each (micro)batch's gradients are cast back
  to the parameters' float32 (:func:`like`) before they are averaged and applied, so
  accumulation and the update are float32. The loss is returned as float32.
* ``"pure-bf16"``: parameters and optimizer state are *stored* in bfloat16.
  ``parallelize_step`` casts the freshly initialised parameters before it builds the
  optimizer state (so Adam's moments are bfloat16 too); the step casts float batch leaves
  to bfloat16 and returns the loss as float32.

The casts are ordinary equations of the step: each parameter's cast reads the parameter
where it lives, so it runs on the stage that owns it, and what leaves that stage is
bfloat16. Integer leaves (token ids), PRNG keys and non-parameter collections (batch
statistics) are never cast. A module that fixes its own compute dtype
(``nn.Dense(dtype=jnp.float32)``, a config ``dtype``) still computes in that dtype.
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp

from multimesh_flax import errors


class Precision(enum.Enum):
    """Which dtype stores parameters and optimizer state, and which computes the step.

    Attributes:
        FP32: float32 everywhere (no casts).
        BF16: float32 state, bfloat16 forward and backward, float32 gradients and update.
        PURE_BF16: bfloat16 state, forward, backward and update.

    Example:
        >>> from multimesh_flax.layers import Precision
        >>> Precision("pure-bf16") is Precision.PURE_BF16
        True
    """

    FP32 = "fp32"
    BF16 = "bf16"
    PURE_BF16 = "pure-bf16"


def normalize(precision: Any) -> Precision:
    """``precision`` as a :class:`Precision` (``None``: ``FP32``).

    Raises:
        ParallelizeArgumentError: anything else.
    """
    if precision is None:
        return Precision.FP32
    if isinstance(precision, Precision):
        return precision
    try:
        return Precision(precision)
    except ValueError:
        raise errors.ParallelizeArgumentError(
            f"Expected `precision` to be 'fp32', 'bf16' or 'pure-bf16' (or a "
            f"`mm.layers.Precision`), got {type(precision).__name__}: {precision!r}. Pass "
            "precision='bf16' for bfloat16 compute with float32 parameters and optimizer state."
        ) from None


def _is_wide_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return (
        dtype is not None
        and jnp.issubdtype(dtype, jnp.floating)
        and jnp.dtype(dtype).itemsize > jnp.dtype(jnp.bfloat16).itemsize
    )


def to_compute(tree: Any) -> Any:
    """``tree`` with every float leaf wider than bfloat16 cast to bfloat16.

    Example:
        >>> out = to_compute({"w": jnp.ones(2), "ids": jnp.arange(2)})
        >>> str(out["w"].dtype), str(out["ids"].dtype)
        ('bfloat16', 'int32')
    """
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16) if _is_wide_float(x) else x, tree
    )


def like(tree: Any, reference: Any) -> Any:
    """``tree`` with each leaf cast to the dtype of ``reference``'s leaf (same structure)."""
    return jax.tree_util.tree_map(lambda x, r: x.astype(r.dtype), tree, reference)


def stored(precision: Precision, params: Any) -> Any:
    """The parameters as the state stores them: bfloat16 for ``PURE_BF16``, else as given."""
    return to_compute(params) if precision is Precision.PURE_BF16 else params
