"""Presets, `get_config`, `ModelConfig` validation and `make_model`."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import GPT, PRESETS, Family, Llama, ModelConfig, get_config, make_model
from multimesh_flax import errors


def test_presets():
    assert set(PRESETS) == {"gpt-tiny", "gpt-small", "llama-tiny", "llama-1b"}
    assert get_config("gpt-tiny").family is Family.GPT
    assert get_config("llama-tiny").num_kv_heads < get_config("llama-tiny").num_heads
    small = get_config("gpt-small")
    assert (small.num_layers, small.embed_dim, small.num_heads) == (12, 768, 12)
    assert small.vocab_size == 50_304 and small.vocab_size % 64 == 0


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="gpt-tiny, gpt-small, llama-tiny, llama-1b"):
        get_config("gpt-medium")


def test_overrides_rederive_dependent_fields():
    config = get_config("gpt-tiny", num_heads=8)
    assert (config.num_kv_heads, config.head_dim) == (8, 8)
    assert get_config("llama-tiny", num_heads=8).num_kv_heads == 2
    with pytest.raises(errors.ModelConfigError, match="num_experts"):
        get_config("gpt-tiny", num_experts=4)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"embed_dim": 66}, "embed_dim"),
        ({"num_layers": 0}, "num_layers"),
        ({"dropout_rate": 1.0}, "dropout_rate"),
        ({"family": "bert"}, "family"),
    ],
)
def test_invalid_configs(changes, match):
    args = dict(family="llama", vocab_size=8, num_layers=1, embed_dim=64, num_heads=4)
    args |= dict(mlp_dim=8, max_len=8)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**(args | changes))


def test_family_accepts_string_and_config_is_frozen():
    config = get_config("gpt-tiny", family="llama")
    assert config.family is Family.LLAMA
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "low", "high"), [("gpt-small", 124e6, 125e6), ("llama-1b", 1.0e9, 1.2e9)]
)
def test_large_preset_sizes(name, low, high):
    model = make_model(name)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    count = sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes)["params"]))
    assert low < count < high


def test_make_model():
    assert isinstance(make_model("gpt-tiny"), GPT)
    assert isinstance(make_model(get_config("llama-tiny")), Llama)
    with pytest.raises(TypeError, match="config"):
        make_model(3)  # type: ignore[arg-type]
