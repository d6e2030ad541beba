"""GPT specifics: tied embeddings, learned positions, dropout."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import GPT, cross_entropy_loss, get_config


def _init(config, tokens):
    return nn.unbox(jax.jit(GPT(config).init)(jax.random.key(0), tokens))["params"]


def _shapes(config):
    init = jax.eval_shape(GPT(config).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return nn.unbox(init)["params"]


def test_embedding_is_tied_single_copy():
    config = get_config("gpt-tiny")
    params = _shapes(config)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    with_vocab = [jax.tree_util.keystr(path) for path, x in flat if config.vocab_size in x.shape]
    assert with_vocab == ["['stem']['embed']['embedding']"]
    assert params["stem"]["pos_embed"]["embedding"].shape == (config.max_len, config.embed_dim)


def test_head_projects_onto_embedding_matrix():
    # Tokens 0..9 are the only inputs, so rows 10.. of the table are used by the head alone.
    config = get_config("gpt-tiny")
    tokens = jnp.arange(20).reshape(2, 10) % 10
    params = _init(config, tokens)

    def loss(params):
        logits = GPT(config).apply({"params": params}, tokens)
        return cross_entropy_loss(logits, tokens)

    grad = jax.jit(jax.grad(loss))(params)["stem"]["embed"]["embedding"]
    assert float(jnp.abs(grad[10:]).sum()) > 0


def test_dropout_only_when_not_deterministic():
    config = get_config("gpt-tiny", dropout_rate=0.5)
    tokens = jnp.zeros((2, 8), jnp.int32)
    params = _init(config, tokens)
    model = GPT(config)

    @functools.partial(jax.jit, static_argnums=1)
    def apply(seed, deterministic):
        rngs = {"dropout": jax.random.key(seed)}
        return model.apply({"params": params}, tokens, deterministic=deterministic, rngs=rngs)

    np.testing.assert_array_equal(apply(0, True), apply(1, True))
    np.testing.assert_array_equal(apply(0, False), apply(0, False))
    assert not np.allclose(apply(0, False), apply(1, False))
    assert not np.allclose(apply(0, False), apply(0, True))


def test_parameter_count_matches_formula():
    config = get_config("gpt-tiny")
    params = _shapes(config)
    e, m, v, t, layers = config.embed_dim, config.mlp_dim, config.vocab_size, config.max_len, 2
    per_block = 4 * (e * e + e) + (e * m + m) + (m * e + e) + 2 * 2 * e
    expected = v * e + t * e + layers * per_block + 2 * e
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(params)) == expected
