"""The non-finite check of ``parallelize_step``: steps whose loss or gradients blow up.

``parallelize_step(..., nonfinite=...)`` takes a :class:`NonFinite` (or its string value):

* inside the traced step, :func:`guard` computes the global gradient norm
  (``optax.tree.norm``), ``ok = isfinite(loss) & isfinite(norm)``, and keeps each leaf of
  the new state only where ``ok``: ``where(ok, new, old)``, placed with the leaf (only
  scalars move between submeshes). A skipped step returns the state it was given,
  ``step`` included (as ``optax.apply_if_finite`` leaves its inner state alone);
* on the host, :func:`check` reads ``ok`` after the step (one scalar) and, for
  ``NonFinite.RAISE``, raises ``NonFiniteError`` with the unchanged state attached (the
  state passed in was donated).

Both modes run the same program; the step function keeps the last :class:`StepCheck` for
callers that report the loss or the gradient norm.
"""

from __future__ import annotations

import enum
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from multimesh_flax import errors
from multimesh_flax.distributed import host_values


class NonFinite(enum.Enum):
    """What a training step does when its loss or gradient norm is NaN or inf.

    In both cases the update is not applied: the step returns the state it was given.

    Attributes:
        RAISE: the step function raises ``NonFiniteError`` (the unchanged state is its
            ``state`` attribute).
        SKIP: the step function returns ``(loss, unchanged state)`` and training goes on.

    Example:
        >>> from multimesh_flax.layers import NonFinite
        >>> NonFinite("skip") is NonFinite.SKIP
        True
    """

    RAISE = "raise"
    SKIP = "skip"


class StepCheck(NamedTuple):
    """What the last step of a step function built with ``nonfinite`` checked.

    Device scalars: reading one (``float``/``bool``) waits for that step.

    Attributes:
        loss: the step's loss.
        grad_norm: the global norm of the step's gradients (``optax.tree.norm``).
        applied: whether both were finite, so the update was applied.
    """

    loss: jax.Array
    grad_norm: jax.Array
    applied: jax.Array


def normalize(nonfinite: Any) -> NonFinite | None:
    """``nonfinite`` as a :class:`NonFinite` (``None`` stays ``None``: no check)."""
    if nonfinite is None or isinstance(nonfinite, NonFinite):
        return nonfinite
    try:
        return NonFinite(nonfinite)
    except (ValueError, TypeError):
        raise errors.ParallelizeArgumentError(
            f"Expected `nonfinite` to be None, 'raise' or 'skip' (or a `NonFinite`), got "
            f"{type(nonfinite).__name__}: {nonfinite!r}. Pass `nonfinite='raise'` to stop at "
            "a NaN/inf loss or gradient, `nonfinite='skip'` to drop such steps."
        ) from None


def guard(loss: jax.Array, grads: Any, new: Any, old: Any) -> tuple[Any, StepCheck]:
    """``(where(ok, new, old) leaf by leaf, StepCheck)``, ``ok``: loss and gradient norm
    finite.

    Traced outside every task: the MPMD partitioner places each leaf's sum of squares in
    the fragment that produced its gradient and each ``where`` as glue on the submesh that
    holds the leaf, so only scalars move (the norm's partial sums and ``ok``).
    """
    norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(norm)
    kept = jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), new, old)
    return kept, StepCheck(loss, norm, ok)


def _what(loss: float, norm: float) -> str:
    bad = [
        f"{name} {value}"
        for name, value in (("loss", loss), ("gradient norm", norm))
        if not math.isfinite(value)
    ]
    return " and ".join(bad)


def check(mode: NonFinite, state: Any, result: StepCheck) -> None:
    """Raises ``NonFiniteError`` for ``NonFinite.RAISE`` when the step was not applied."""
    if mode is not NonFinite.RAISE:
        return
    applied, loss, norm = host_values((result.applied, result.loss, result.grad_norm))
    if bool(applied):  # read in every process: a multi-process job raises everywhere
        return
    loss, norm = float(loss), float(norm)
    step = int(state.step)
    raise errors.NonFiniteError(
        f"Non-finite {_what(loss, norm)} in the training step at `state.step`={step}; the "
        "update was not applied. The state passed in was donated: continue from "
        "`error.state` (unchanged). Lower the learning rate (or clip gradients with "
        "`optax.clip_by_global_norm`), check the batch for NaN/inf or out-of-range values, "
        "or build the step with `nonfinite='skip'` to drop such steps.",
        state=state,
        step=step,
        loss=loss,
        grad_norm=norm,
    )
