"""Partitioned building blocks shared by the GPT and Llama models.

Every parameter made here carries logical axis names, attached with Flax's own
`nn.with_logical_partitioning` on its initializer, and `constrain` wraps
`nn.with_logical_constraint` for activations. Outside a `nn.logical_axis_rules` context both
are inert, so the models run unchanged on one device; with rules and a mesh they shard.

The logical axis names, as module constants:

* `BATCH`, `LENGTH`: the batch and sequence dimensions of activations (`LENGTH` also names the
  rows of GPT's learned position table).
* `EMBED`: the residual-stream width. `MLP`: the feed-forward hidden width.
* `HEADS`, `KV_HEADS`, `HEAD_DIM`: query heads, key/value heads and the width of one head.
* `VOCAB`: rows of the token embedding, columns of the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from multimesh_flax import errors

from .configs import ModelConfig

BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
VOCAB = "vocab"

HIDDEN = (BATCH, LENGTH, EMBED)
"""Logical axes of the residual stream, shape ``(batch, length, embed_dim)``."""

INIT_STD = 0.02
"""Standard deviation of the normal initializer used for weights (GPT-2's choice)."""


def partitioned(init: Callable, names: Sequence[str]) -> Callable:
    """`init` with the logical axis `names` attached to the parameters it creates."""
    return nn.with_logical_partitioning(init, tuple(names))


def constrain(x: jax.Array, names: Sequence[str]) -> jax.Array:
    """Constrains activation `x` to the logical axes `names` (a no-op without rules)."""
    return nn.with_logical_constraint(x, tuple(names))  # pyright: ignore[reportPrivateImportUsage]


def residual_std(config: ModelConfig) -> float:
    """Init scale of projections that write into the residual stream (GPT-2's 1/sqrt(2L))."""
    return INIT_STD / (2 * config.num_layers) ** 0.5


def dense(
    config: ModelConfig,
    features: int,
    names: tuple[str, str],
    *,
    use_bias: bool,
    std: float = INIT_STD,
    **kwargs,
) -> nn.Dense:
    """A `nn.Dense` whose kernel is named `names` and whose bias is named ``names[1:]``."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=partitioned(nn.initializers.normal(std), names),
        bias_init=partitioned(nn.initializers.zeros_init(), names[1:]),
        **kwargs,
    )


def token_embedding(config: ModelConfig, **kwargs) -> nn.Embed:
    """The token table, shape ``(vocab_size, embed_dim)``, named ``("vocab", "embed")``."""
    return nn.Embed(
        config.vocab_size,
        config.embed_dim,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        embedding_init=partitioned(nn.initializers.normal(INIT_STD), (VOCAB, EMBED)),
        **kwargs,
    )


def layer_norm(config: ModelConfig, **kwargs) -> nn.LayerNorm:
    """A LayerNorm over the embedding axis with named scale and bias."""
    return nn.LayerNorm(
        epsilon=config.norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=partitioned(nn.initializers.ones_init(), (EMBED,)),
        bias_init=partitioned(nn.initializers.zeros_init(), (EMBED,)),
        **kwargs,
    )


def rms_norm(config: ModelConfig, **kwargs) -> nn.RMSNorm:
    """An RMSNorm over the embedding axis with a named scale."""
    return nn.RMSNorm(
        epsilon=config.norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=partitioned(nn.initializers.ones_init(), (EMBED,)),
        **kwargs,
    )


def head_rms_norm(config: ModelConfig, **kwargs) -> nn.RMSNorm:
    """An RMSNorm over the last axis of ``(..., head_dim)`` queries or keys, scale named."""
    return nn.RMSNorm(
        epsilon=config.norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=partitioned(nn.initializers.ones_init(), (HEAD_DIM,)),
        **kwargs,
    )


def default_positions(shape: Sequence[int], positions: jax.typing.ArrayLike | None) -> jax.Array:
    """Positions of a ``(batch, length, ...)`` input: `positions`, else ``0 .. length-1``."""
    batch, length = shape[0], shape[1]
    if positions is None:
        return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    positions = jnp.asarray(positions)
    if positions.shape not in ((batch, length), (1, length), (length,)):
        raise ValueError(
            f"`positions` must have shape ({batch}, {length}) to match the input, "
            f"got {positions.shape}."
        )
    return jnp.broadcast_to(positions.astype(jnp.int32), (batch, length))


def _concrete_max(positions: jax.typing.ArrayLike) -> int | None:
    """The largest of concrete `positions`; ``None`` for traced or empty ones."""
    try:
        values = np.asarray(positions)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    return int(values.max()) if values.size else None


def check_length(
    config: ModelConfig, shape: Sequence[int], positions: jax.typing.ArrayLike | None
) -> None:
    """Raises `SequenceLengthError` for positions at or past ``config.max_len``.

    Checked while tracing: without `positions`, the static length of a ``(batch, length,
    ...)`` input (positions ``0 .. length-1``); with concrete `positions`, their largest
    value. Traced positions (a KV-cache decoding step inside ``jit``) are not checked here:
    `models.generate` checks prompt plus new tokens against ``max_len`` before decoding.

    With a ``config.sliding_window``, a static length above the window is refused too (the
    models attend to every earlier position, which equals the windowed attention only up to
    the window's length). A KV cache is created by a call with its full length, so a cache
    longer than the window is refused when it is made.
    """
    length = shape[1]
    _check_window(config, length)
    if positions is None:
        last, got = length - 1, f"a sequence of {length} tokens (positions 0..{length - 1})"
    else:
        last = _concrete_max(positions)
        got = f"positions up to {last}"
    if last is None or last < config.max_len:
        return
    family = config.family.value
    raise errors.SequenceLengthError(
        f"The {family} model got {got}, but its config's `max_len` is {config.max_len}: "
        f"positions must stay below {config.max_len}. Use sequences of at most "
        f"{config.max_len} tokens (a shorter `seq_len`), or a config with a larger "
        f"`max_len` (e.g. `get_config(name, max_len={_at_least(last + 1)})`)."
    )


def _check_window(config: ModelConfig, length: int) -> None:
    window = config.sliding_window
    if window is None or length <= window:
        return
    family = config.family.value
    raise errors.SequenceLengthError(
        f"The {family} model got a sequence of {length} tokens, but its config's "
        f"`sliding_window` is {window}: each token may attend only to the {window} latest "
        "positions, and the reference attention, which sees every earlier position, computes "
        f"the same only for sequences of at most {window} tokens. Use sequences of at most "
        f"{window} tokens (a shorter `seq_len`, or a shorter prompt plus new tokens)."
    )


def _at_least(n: int) -> int:
    """The smallest power of two >= `n` (a suggested `max_len`)."""
    return 1 << (n - 1).bit_length()
