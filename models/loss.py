"""Next-token prediction loss: softmax cross entropy against integer targets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

__all__ = ["cross_entropy_loss"]


def cross_entropy_loss(
    logits: jax.Array,
    targets: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """Mean cross entropy of `logits` against integer `targets`, computed in float32.

    Args:
        logits: Unnormalised scores, shape ``(..., vocab)`` (e.g. ``(batch, length, vocab)``).
        targets: Integer ids, shape ``logits.shape[:-1]``.
        mask: Optional weights of shape ``logits.shape[:-1]`` (e.g. 0 for padding); the
            result is then the weighted mean over tokens (0 if every weight is 0).

    Returns:
        A float32 scalar: the mean over all (unmasked) tokens.

    Raises:
        ValueError: If the shapes of `targets` or `mask` do not match ``logits.shape[:-1]``.

    Example:
        >>> import jax.numpy as jnp
        >>> from models import cross_entropy_loss
        >>> logits = jnp.zeros((2, 3, 4))  # uniform over 4 ids: loss log(4)
        >>> float(cross_entropy_loss(logits, jnp.zeros((2, 3), jnp.int32)))  # doctest: +ELLIPSIS
        1.386...
    """
    targets = jnp.asarray(targets)
    _check_shape("targets", targets.shape, logits.shape[:-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return losses.mean()
    mask = jnp.asarray(mask, jnp.float32)
    _check_shape("mask", mask.shape, logits.shape[:-1])
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _check_shape(name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if got != expected:
        raise ValueError(
            f"`{name}` must have shape {expected} (the logits' shape without the vocab axis), "
            f"got {got}."
        )
