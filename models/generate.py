"""Autoregressive generation with a KV cache, and a cache-free reference.

The cache is Flax's ``"cache"`` variable collection, filled by the attention layers when a
model is called with ``decode=True`` (see `models._attention`). `init_cache` returns a zeroed
cache for a batch size and length; its tree mirrors the parameters
(``cache["blocks_i"]["attn"]`` holds ``cached_key``, ``cached_value`` and ``cache_index``),
so it can be placed next to the blocks it belongs to.

`generate` pre-fills the cache with the whole prompt in one call, then feeds one token per
step inside a `jax.lax.scan`. With ``use_cache=False`` it instead re-runs the model on the
whole (fixed-size, zero-padded) sequence at every step; causal masking makes the padding
invisible, so both paths compute the same logits and greedy decoding agrees.

Nothing here places arrays on devices: `params` may be host arrays, committed to one device or
sharded; the jitted computation follows them.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["generate", "init_cache"]


def init_cache(model: nn.Module, batch_size: int, max_len: int) -> dict:
    """Returns a zeroed KV cache for `model`, for `batch_size` sequences of `max_len` tokens.

    The shapes come from `jax.eval_shape` of ``model.init(..., decode=True)``, so no
    parameters are materialised.

    Args:
        model: A `models.GPT` or `models.Llama` (any module taking ``decode=True``).
        batch_size: Number of sequences.
        max_len: Positions the cache can hold (prompt plus generated tokens).

    Returns:
        The ``"cache"`` collection: a nested dict of arrays.

    Example:
        >>> from models import init_cache, make_model
        >>> cache = init_cache(make_model("llama-tiny"), batch_size=2, max_len=16)
        >>> cache["blocks_0"]["attn"]["cached_key"].shape  # (batch, length, kv_heads, head_dim)
        (2, 16, 2, 16)
    """
    tokens = jax.ShapeDtypeStruct((batch_size, max_len), jnp.int32)
    init = functools.partial(model.init, decode=True)
    shapes = jax.eval_shape(lambda t: init(jax.random.key(0), t)["cache"], tokens)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def generate(
    model: nn.Module,
    params,
    prompt: jax.typing.ArrayLike,
    max_new_tokens: int,
    *,
    rng: jax.Array | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    use_cache: bool = True,
) -> jax.Array:
    """Extends `prompt` by `max_new_tokens` tokens, greedily or by sampling.

    Args:
        model: A `models.GPT` or `models.Llama`.
        params: The model's ``"params"`` collection (boxed or unboxed, on any devices).
        prompt: Token ids, shape ``(batch, prompt_len)``, all prompts the same length.
        max_new_tokens: Number of tokens to append.
        rng: PRNG key for sampling; required when ``temperature > 0``.
        temperature: 0 picks the most likely token (greedy); above 0 samples from
            ``softmax(logits / temperature)``.
        top_k: When sampling, keep only the `top_k` most likely tokens. Ignored when greedy.
        use_cache: Decode with the KV cache (the default) or recompute the whole sequence
            each step (slow; a reference for tests).

    The decoding loop is jitted with `model`, `max_new_tokens`, `temperature` and `top_k` as
    static arguments: each new combination compiles once.

    Returns:
        int32 array ``(batch, prompt_len + max_new_tokens)``: the prompt, then the new tokens.

    Raises:
        ValueError: For a prompt that is not 2-D, a total length above ``model.config.max_len``,
            a negative `max_new_tokens` or `temperature`, a bad `top_k`, or sampling
            without `rng`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from models import generate, make_model
        >>> model = make_model("gpt-tiny")
        >>> prompt = jnp.array([[256, 72, 105]], jnp.int32)
        >>> params = model.init(jax.random.key(0), prompt)["params"]
        >>> generate(model, params, prompt, 5).shape
        (1, 8)
        >>> out = generate(model, params, prompt, 5, rng=jax.random.key(1), temperature=0.8,
        ...                top_k=10)
        >>> bool((out[:, :3] == prompt).all())
        True
    """
    prompt = jnp.asarray(prompt)
    _check_args(model, prompt, max_new_tokens, rng, temperature, top_k)
    if max_new_tokens == 0:
        return prompt.astype(jnp.int32)
    rng = jax.random.key(0) if rng is None else rng
    worker = _generate_cached if use_cache else _generate_uncached
    return worker(model, params, prompt.astype(jnp.int32), rng, max_new_tokens, temperature, top_k)


def _check_args(model, prompt, max_new_tokens, rng, temperature, top_k) -> None:
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(
            f"`prompt` must be an integer array of shape (batch, prompt_len), got "
            f"{prompt.dtype} with shape {prompt.shape}; add a batch axis with prompt[None]."
        )
    if max_new_tokens < 0:
        raise ValueError(f"`max_new_tokens` must be >= 0, got {max_new_tokens}.")
    config = getattr(model, "config", None)
    total = prompt.shape[1] + max_new_tokens
    if config is not None and total > config.max_len:
        raise ValueError(
            f"prompt length {prompt.shape[1]} plus `max_new_tokens` {max_new_tokens} is "
            f"{total}, above the model's `max_len` {config.max_len}; shorten either."
        )
    if temperature < 0:
        raise ValueError(f"`temperature` must be >= 0 (0 is greedy), got {temperature}.")
    if temperature > 0 and rng is None:
        raise ValueError("Sampling (`temperature` > 0) needs a PRNG key: pass `rng`.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"`top_k` must be a positive int or None, got {top_k}.")


def _sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None):
    """Next token ids ``(batch,)`` from last-position `logits` ``(batch, vocab)``."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


_STATIC = ("model", "max_new_tokens", "temperature", "top_k")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate_cached(model, params, prompt, rng, max_new_tokens, temperature, top_k):
    batch, prompt_len = prompt.shape
    keys = jax.random.split(rng, max_new_tokens)
    cache = init_cache(model, batch, prompt_len + max_new_tokens)

    def run(tokens, positions, cache):
        variables = {"params": params, "cache": cache}
        logits, state = model.apply(variables, tokens, positions, decode=True, mutable=["cache"])
        return logits[:, -1], state["cache"]

    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompt.shape)
    logits, cache = run(prompt, positions, cache)
    first = _sample(logits, keys[0], temperature, top_k)

    def step(carry, key):
        token, position, cache = carry
        logits, cache = run(token[:, None], jnp.full((batch, 1), position), cache)
        token = _sample(logits, key, temperature, top_k)
        return (token, position + 1, cache), token

    carry = (first, jnp.int32(prompt_len), cache)
    _, rest = lax.scan(step, carry, keys[1:])
    return jnp.concatenate([prompt, first[:, None], rest.T], axis=1)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate_uncached(model, params, prompt, rng, max_new_tokens, temperature, top_k):
    batch, prompt_len = prompt.shape
    keys = jax.random.split(rng, max_new_tokens)
    tokens = jnp.zeros((batch, prompt_len + max_new_tokens), jnp.int32)
    tokens = lax.dynamic_update_slice(tokens, prompt, (0, 0))

    def step(i, tokens):
        logits = model.apply({"params": params}, tokens)
        last = lax.dynamic_index_in_dim(logits, prompt_len + i - 1, axis=1, keepdims=False)
        token = _sample(last, keys[i], temperature, top_k)
        return lax.dynamic_update_slice(tokens, token[:, None], (0, prompt_len + i))

    return lax.fori_loop(0, max_new_tokens, step, tokens)
