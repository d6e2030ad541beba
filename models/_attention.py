"""Causal self-attention with grouped-query heads, rotary positions and a Flax KV cache.

`Attention` serves both model families: GPT uses it with biases and no rotary embedding,
Llama without biases and with `apply_rotary` on queries and keys. When ``num_kv_heads <
num_heads`` each key/value head is shared by a group of ``num_heads // num_kv_heads`` query
heads (grouped-query attention). The config's Llama variants switch on more: biases on the
query/key/value projections only (``qkv_bias``, Qwen2), an RMSNorm over each query and key
head before the rotation (``qk_norm``, Qwen3: parameters ``query_norm`` and ``key_norm``),
and Llama 3.1's rescaled rotary frequencies (``rope_scaling``, `rope_frequencies`).

KV cache. Called with ``decode=True``, the module keeps its keys and values in Flax's
``"cache"`` collection: ``cached_key`` and ``cached_value`` of shape ``(batch, cache_len,
num_kv_heads, head_dim)`` and ``cache_index``, the number of positions already written. The
first ``decode=True`` call (inside ``model.init``) only creates the variables, sized by that
call's input; `models.generate.init_cache` does this abstractly and returns zeros. Later calls
write their ``T`` new keys/values at ``cache_index`` and attend to every cached position up to
their own, so a whole prompt can be pre-filled in one call and tokens then added one at a time.
"""

from __future__ import annotations

import einops
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from ._layers import (
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INIT_STD,
    KV_HEADS,
    LENGTH,
    constrain,
    head_rms_norm,
    partitioned,
)
from .configs import ModelConfig, RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """The ``head_dim // 2`` rotary frequencies ``theta ** (-2i / head_dim)``, float32.

    With `scaling`, each frequency is rescaled as Llama 3.1 does (see `RopeScaling`): kept
    for short wavelengths, divided by ``scaling.factor`` for long ones, blended in between.

    Args:
        head_dim: Width of one head (even).
        theta: Base of the frequencies.
        scaling: Llama 3.1's rope scaling, or ``None``.

    Returns:
        A float32 array of shape ``(head_dim // 2,)``.

    Example:
        >>> from models._attention import rope_frequencies
        >>> from models.configs import RopeScaling
        >>> rope_frequencies(4, 100.0).tolist()
        [1.0, 0.10000000149011612]
        >>> scaling = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0,
        ...                       original_max_len=8)
        >>> # Wavelength 2 pi lies between 8 / 2 and 8 / 1: blended with s = 8 / (2 pi) - 1,
        >>> # (1 - s) / 4 + s = 0.4549; wavelength 20 pi is past 8: divided by 4.
        >>> [round(f, 4) for f in rope_frequencies(4, 100.0, scaling).tolist()]
        [0.4549, 0.025]
    """
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return freqs
    return _llama3_scaled(freqs, scaling)


def _llama3_scaled(freqs: jax.Array, scaling: RopeScaling) -> jax.Array:
    context, low, high = scaling.original_max_len, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * jnp.pi / freqs
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = jnp.where(wavelength > context / low, freqs / scaling.factor, blended)
    return jnp.where(wavelength < context / high, freqs, scaled)


def apply_rotary(
    x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
    """Rotates feature pairs of `x` by angles proportional to `positions` (RoPE).

    Feature ``i`` in the first half of the last axis is paired with feature ``i + D/2`` and
    the pair is rotated by ``position * theta ** (-2i / D)`` (those frequencies rescaled by
    `scaling`, see `rope_frequencies`), so the dot product of a rotated query and key depends
    only on their relative position.

    Args:
        x: Queries or keys, shape ``(batch, length, heads, head_dim)`` with even ``head_dim``.
        positions: Integer positions, shape ``(batch, length)``.
        theta: Base of the rotation frequencies.
        scaling: Llama 3.1's rope scaling, or ``None``.

    Returns:
        An array like `x`.
    """
    freqs = rope_frequencies(x.shape[-1], theta, scaling)
    angles = positions[..., None, None].astype(jnp.float32) * freqs  # (B, T, 1, half)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def causal_mask(q_len: int, kv_len: int, q_start: jax.typing.ArrayLike = 0) -> jax.Array:
    """Boolean ``(q_len, kv_len)`` mask: query ``i`` (at ``q_start + i``) sees keys ``<=`` it."""
    q_pos = q_start + jnp.arange(q_len)
    return jnp.arange(kv_len)[None, :] <= q_pos[:, None]


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dropout) -> jax.Array:
    """Softmax attention of ``(B, T, H, D)`` queries over ``(B, S, K, D)`` keys/values."""
    # Query heads in groups of G: head ``k * G + g`` attends with key/value head ``k``.
    q = einops.rearrange(q, "b t (k g) d -> b t k g d", k=k.shape[2])
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = dropout(jax.nn.softmax(logits, axis=-1).astype(v.dtype))
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return einops.rearrange(out, "b t k g d -> b t (k g) d")


class _Projection(nn.Module):
    """An einsum with a ``kernel`` of `shape`, plus a ``bias`` over its last `out_ndim` axes.

    Written out instead of using `nn.DenseGeneral`, whose initializer creates a flat 2-D
    kernel first: under a mesh with logical axis rules, unboxing that flat kernel applies the
    3-D logical constraint to a 2-D array and fails.
    """

    config: ModelConfig
    shape: tuple[int, int, int]
    names: tuple[str, str, str]
    equation: str
    out_ndim: int
    use_bias: bool
    std: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        init = partitioned(nn.initializers.normal(self.std), self.names)
        kernel = self.param("kernel", init, self.shape, cfg.param_dtype)
        y = jnp.einsum(self.equation, x.astype(cfg.dtype), kernel.astype(cfg.dtype))
        if not self.use_bias:
            return y
        bias_init = partitioned(nn.initializers.zeros_init(), self.names[-self.out_ndim :])
        bias = self.param("bias", bias_init, self.shape[-self.out_ndim :], cfg.param_dtype)
        return y + bias.astype(cfg.dtype)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention.

    Parameters: ``query`` (kernel ``(embed, heads, head_dim)``), ``key`` and ``value``
    (``(embed, kv_heads, head_dim)``), ``out`` (``(heads, head_dim, embed)``), each with a
    bias of its output axes when `use_bias` (``query``, ``key`` and ``value`` also when
    ``config.qkv_bias``); with ``config.qk_norm`` also ``query_norm`` and ``key_norm``
    (RMSNorm scales of shape ``(head_dim,)``).

    Attributes:
        config: Model hyperparameters (heads, widths, dtypes, dropout, rotary base and
            scaling, ``qkv_bias``, ``qk_norm``).
        use_bias: Whether the four projections have biases (GPT) or not (Llama).
        use_rope: Whether to rotate queries and keys by position (Llama).
        out_std: Init scale of the ``out`` projection.
    """

    config: ModelConfig
    use_bias: bool = True
    use_rope: bool = False
    out_std: float = INIT_STD

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        *,
        deterministic: bool = True,
        decode: bool = False,
    ) -> jax.Array:
        """Attends `x` (``(batch, length, embed)``) to itself; returns the same shape."""
        cfg = self.config
        assert cfg.num_kv_heads is not None and cfg.head_dim is not None
        q = self._project(x, cfg.num_heads, HEADS, "query")
        k = self._project(x, cfg.num_kv_heads, KV_HEADS, "key")
        v = self._project(x, cfg.num_kv_heads, KV_HEADS, "value")
        if cfg.qk_norm:
            q = head_rms_norm(cfg, name="query_norm")(q)
            k = head_rms_norm(cfg, name="key_norm")(k)
        if self.use_rope:
            q = apply_rotary(q, positions, cfg.rope_theta, cfg.rope_scaling)
            k = apply_rotary(k, positions, cfg.rope_theta, cfg.rope_scaling)
        q_start = 0
        if decode:
            k, v, q_start = self._update_cache(k, v)
        mask = causal_mask(q.shape[1], k.shape[1], q_start)
        dropout = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)
        out = constrain(_attend(q, k, v, mask, dropout), (BATCH, LENGTH, HEADS, HEAD_DIM))
        return constrain(self._output(out), HIDDEN)

    def _project(self, x: jax.Array, num_heads: int, heads_axis: str, name: str) -> jax.Array:
        cfg = self.config
        assert cfg.head_dim is not None
        shape = (cfg.embed_dim, num_heads, cfg.head_dim)
        names = (EMBED, heads_axis, HEAD_DIM)
        bias = self.use_bias or cfg.qkv_bias
        y = _Projection(cfg, shape, names, "bte,ehd->bthd", 2, bias, INIT_STD, name=name)(x)
        return constrain(y, (BATCH, LENGTH, heads_axis, HEAD_DIM))

    def _output(self, out: jax.Array) -> jax.Array:
        cfg = self.config
        assert cfg.head_dim is not None
        shape = (cfg.num_heads, cfg.head_dim, cfg.embed_dim)
        names = (HEADS, HEAD_DIM, EMBED)
        return _Projection(
            cfg, shape, names, "bthd,hde->bte", 1, self.use_bias, self.out_std, name="out"
        )(out)

    def _update_cache(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Writes `k`, `v` into the cache; returns all cached keys/values and the write offset."""
        ready = self.has_variable("cache", "cached_key")
        cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
        start = index.value
        if not ready:  # Creating the cache (model.init): plain causal attention over `x`.
            return k, v, start
        kv_axes = (BATCH, LENGTH, KV_HEADS, HEAD_DIM)
        offset = (0, start, 0, 0)
        cached_k.value = constrain(lax.dynamic_update_slice(cached_k.value, k, offset), kv_axes)
        cached_v.value = constrain(lax.dynamic_update_slice(cached_v.value, v, offset), kv_axes)
        index.value = start + k.shape[1]
        return cached_k.value, cached_v.value, start
