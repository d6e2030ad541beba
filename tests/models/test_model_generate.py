"""`generate`: cached decoding agrees with recomputation; sampling honours its options."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from models import generate, make_model

PRESETS = ["gpt-tiny", "llama-tiny"]


@functools.cache
def _init(name):
    model = make_model(name)
    prompt = jax.random.randint(jax.random.key(3), (2, 5), 0, 259)
    variables = jax.jit(model.init)(jax.random.key(0), prompt)
    return model, variables, prompt


@pytest.mark.parametrize("name", PRESETS)
def test_greedy_cached_matches_uncached(name):
    model, variables, prompt = _init(name)
    params = nn.unbox(variables)["params"]
    cached = generate(model, params, prompt, 12)
    uncached = generate(model, params, prompt, 12, use_cache=False)
    assert cached.shape == (2, 17) and cached.dtype == jnp.int32
    np.testing.assert_array_equal(cached[:, :5], prompt)
    np.testing.assert_array_equal(cached, uncached)


@pytest.mark.parametrize("name", PRESETS)
def test_greedy_picks_argmax_of_full_forward(name):
    model, variables, prompt = _init(name)
    out = generate(model, variables["params"], prompt, 12)  # Boxed params work too.
    logits = jax.jit(model.apply)(variables, out)
    np.testing.assert_array_equal(out[:, 5:], jnp.argmax(logits[:, 4:-1], axis=-1))


def test_sampling_is_seeded_and_top_k_restricts_choices():
    model, variables, prompt = _init("gpt-tiny")
    params = nn.unbox(variables)["params"]
    sample = functools.partial(generate, model, params, prompt, 12, temperature=1.0)
    a, b = sample(rng=jax.random.key(0)), sample(rng=jax.random.key(0))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, sample(rng=jax.random.key(1)))
    top3 = sample(rng=jax.random.key(2), top_k=3)
    logits = jax.jit(model.apply)({"params": params}, top3)[:, 4:-1]
    ranks = jnp.sum(logits > jnp.take_along_axis(logits, top3[:, 5:, None], -1), axis=-1)
    assert int(ranks.max()) < 3
    np.testing.assert_array_equal(
        sample(rng=jax.random.key(3), top_k=1), generate(model, params, prompt, 12)
    )


def test_sampling_cached_matches_uncached_for_same_key():
    model, variables, prompt = _init("llama-tiny")
    params = nn.unbox(variables)["params"]
    kwargs = dict(rng=jax.random.key(4), temperature=0.7, top_k=20)
    np.testing.assert_array_equal(
        generate(model, params, prompt, 12, **kwargs),
        generate(model, params, prompt, 12, use_cache=False, **kwargs),
    )


def test_sharded_params_generate_the_same_tokens():
    model, variables, prompt = _init("llama-tiny")
    params = nn.unbox(variables)["params"]
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    by_heads = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
    sharded = jax.tree.map(
        lambda x: jax.device_put(x, by_heads if x.ndim == 3 else replicated), params
    )
    np.testing.assert_array_equal(
        generate(model, sharded, prompt, 12), generate(model, params, prompt, 12)
    )


def test_zero_new_tokens_returns_prompt():
    model, variables, prompt = _init("gpt-tiny")
    np.testing.assert_array_equal(generate(model, variables["params"], prompt, 0), prompt)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prompt=jnp.zeros((5,), jnp.int32)), "prompt"),
        (dict(prompt=jnp.zeros((1, 5))), "integer"),
        (dict(max_new_tokens=200), "max_len"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=1.0), "rng"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=0), "top_k"),
    ],
)
def test_invalid_arguments(kwargs, match):
    model, variables, prompt = _init("gpt-tiny")
    args = dict(prompt=prompt, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(model, variables["params"], **args)
