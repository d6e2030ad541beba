"""Llama specifics: grouped-query attention, rotary positions, no biases, untied head."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import Llama, get_config, init_cache
from models._attention import apply_rotary


def _init(config, tokens):
    return nn.unbox(jax.jit(Llama(config).init)(jax.random.key(0), tokens))["params"]


def _shapes(config):
    init = jax.eval_shape(Llama(config).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return nn.unbox(init)["params"]


def test_grouped_query_shapes():
    config = get_config("llama-tiny")
    assert config.num_kv_heads < config.num_heads
    attn = _shapes(config)["blocks_0"]["attn"]
    e, h, k, d = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
    assert attn["query"]["kernel"].shape == (e, h, d)
    assert attn["key"]["kernel"].shape == (e, k, d)
    assert attn["value"]["kernel"].shape == (e, k, d)
    assert attn["out"]["kernel"].shape == (h, d, e)
    cache = init_cache(Llama(config), batch_size=3, max_len=10)
    assert cache["blocks_1"]["attn"]["cached_value"].shape == (3, 10, k, d)


def test_grouped_query_equals_multi_head_with_repeated_kv():
    # Reference: plain multi-head attention whose key/value heads are copies, head j of
    # query group j // group_size.
    gqa = get_config("llama-tiny")
    mha = get_config("llama-tiny", num_kv_heads=gqa.num_heads)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 259)
    params = _init(gqa, tokens)
    group = gqa.num_heads // gqa.num_kv_heads

    def repeat_kv(path, x):
        names = [getattr(p, "key", None) for p in path]
        return jnp.repeat(x, group, axis=1) if names[-2] in ("key", "value") else x

    mha_params = jax.tree_util.tree_map_with_path(repeat_kv, params)
    expected = jax.jit(Llama(mha).apply)({"params": mha_params}, tokens)
    actual = jax.jit(Llama(gqa).apply)({"params": params}, tokens)
    np.testing.assert_allclose(actual, expected, atol=1e-5)


def test_no_biases_and_untied_head():
    config = get_config("llama-tiny")
    params = _shapes(config)
    names = {
        getattr(p, "key", None)
        for path, _ in jax.tree_util.tree_leaves_with_path(params)
        for p in path
    }
    assert "bias" not in names
    assert params["head"]["lm_head"]["kernel"].shape == (config.embed_dim, config.vocab_size)
    assert params["stem"]["embed"]["embedding"].shape == (config.vocab_size, config.embed_dim)


@pytest.mark.parametrize("shift", [0, 3, 50])
def test_rotary_scores_depend_only_on_relative_position(shift):
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 16))
    positions = jnp.array([[5]]), jnp.array([[2]])

    def score(offset):
        rq = apply_rotary(q, positions[0] + offset, 10_000.0)
        rk = apply_rotary(k, positions[1] + offset, 10_000.0)
        return jnp.sum(rq * rk)

    np.testing.assert_allclose(score(shift), score(0), rtol=1e-5)
    np.testing.assert_allclose(apply_rotary(q, jnp.zeros((1, 1), jnp.int32), 1e4), q)
