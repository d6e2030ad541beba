"""The Llama-family checkpoints beyond Llama: rope scaling, Qwen2, Qwen3, Mistral.

Logits on 1, 2 and 4 stages and export round trips of every fixture are in ``test_hf.py``
(its ``NAMES``); here are what each variant adds: both spellings of the rope settings, a
fixture whose rope scaling really changes the logits, the Mistral window refused past its
length, refusals that name the field, the NNX Llama on the same checkpoints, and presets that
stay as they were. References are transformers' logits
(``tests/fixtures/make_hf_fixtures.py``).
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import generate, get_config, hf, init_cache, make_model
from models.configs import RopeScaling
from models.llama_nnx import LlamaNNX, load_linen_params
from multimesh_flax import errors

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
TOL = 1e-4


def _reference(name):
    ref = np.load(FIXTURES / f"{name}.logits.npz")
    return ref["tokens"], ref["logits"]


@pytest.fixture(scope="module")
def loaded():
    """``{name: (config, float32 params)}`` of the family fixtures, read once."""
    names = ["llama3", "qwen2", "qwen3", "mistral"]
    return {name: hf.load(FIXTURES / name, dtype=np.float32) for name in names}


def _logits(config, params, tokens):
    return np.asarray(jax.jit(make_model(config).apply)({"params": params}, tokens))


def _copy(name, tmp_path):
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _rewrite(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


# --- what each fixture is -------------------------------------------------------------------


def test_each_fixture_loads_into_its_variant(loaded):
    llama3, qwen2, qwen3, mistral = (loaded[n][0] for n in ["llama3", "qwen2", "qwen3", "mistral"])
    assert llama3.rope_scaling == RopeScaling(4.0, 0.25, 1.0, original_max_len=8)
    assert (qwen2.qkv_bias, qwen2.qk_norm) == (True, False)
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim) == (True, False, 16)
    assert qwen3.head_dim != qwen3.embed_dim // qwen3.num_heads
    assert (mistral.sliding_window, mistral.num_kv_heads) == (16, 1)
    bias = loaded["qwen2"][1]["blocks_0"]["attn"]["key"]["bias"]
    assert bias.shape == (2, 8) and not np.allclose(bias, 0)
    assert "bias" not in loaded["qwen2"][1]["blocks_0"]["attn"]["out"]
    norm = loaded["qwen3"][1]["blocks_3"]["attn"]["query_norm"]["scale"]
    assert norm.shape == (16,) and not np.allclose(norm, 1)


def test_the_llama3_fixture_needs_its_rope_scaling(loaded):
    """Without the scaling the logits are far off, so the match in test_hf is no accident."""
    tokens, expected = _reference("llama3")
    assert tokens.shape[1] > loaded["llama3"][0].rope_scaling.original_max_len
    config, params = loaded["llama3"]
    unscaled = _logits(dataclasses.replace(config, rope_scaling=None), params, tokens)
    assert np.abs(unscaled - expected).max() > 1e-2


# --- rope settings: both spellings, the refused kinds ---------------------------------------


def _v4_spelling(config):
    """The rope settings as transformers v4 wrote them: top-level theta, ``rope_scaling``."""
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")  # the oldest configs say "type"
    config["rope_scaling"] = rope


def test_rope_scaling_and_rope_parameters_spellings_give_the_same_model(loaded, tmp_path):
    folder = _copy("llama3", tmp_path)
    assert "rope_scaling" not in json.loads((folder / "config.json").read_text())
    _rewrite(folder, _v4_spelling)
    config, params = hf.load(folder, dtype=np.float32)
    assert config == loaded["llama3"][0]
    tokens, expected = _reference("llama3")
    np.testing.assert_allclose(_logits(config, params, tokens), expected, atol=TOL, rtol=TOL)


def test_export_writes_both_rope_spellings(loaded, tmp_path):
    out = hf.save(tmp_path / "out", *loaded["llama3"])
    saved = json.loads((out / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == saved["rope_scaling"]["rope_type"] == "llama3"
    assert saved["rope_parameters"]["rope_theta"] == saved["rope_theta"] == 200.0
    assert saved["rope_scaling"]["original_max_position_embeddings"] == 8


BAD_ROPE = {
    "linear": ({"rope_type": "linear", "factor": 2.0}, "`rope_parameters.rope_type`='linear'"),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic'"),
    "yarn": ({"rope_type": "yarn", "factor": 4.0}, "'yarn'; the reference Llama implements"),
    "partial": ({"partial_rotary_factor": 0.5}, "`partial_rotary_factor`=0.5"),
    "per-layer": ({"full_attention": {"rope_type": "default"}}, "per layer type"),
}


@pytest.mark.parametrize("rope, match", BAD_ROPE.values(), ids=BAD_ROPE.keys())
def test_unsupported_rope_settings_name_the_field(rope, match, tmp_path):
    folder = _copy("qwen2", tmp_path)
    _rewrite(folder, lambda c: c.update(rope_parameters={"rope_theta": 1e4, **rope}))
    with pytest.raises(errors.UnsupportedArchitectureError, match=match):
        hf.load_config(folder)


def test_llama3_rope_without_its_factors_or_with_two_disagreeing_spellings(tmp_path):
    folder = _copy("llama3", tmp_path)
    _rewrite(folder, lambda c: c["rope_parameters"].pop("low_freq_factor"))
    with pytest.raises(errors.PretrainedConfigError, match=r"`rope_parameters.low_freq_factor`"):
        hf.load_config(folder)
    _rewrite(folder, lambda c: c["rope_parameters"].update(low_freq_factor=0.25))
    _rewrite(folder, lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(errors.PretrainedConfigError, match="disagree"):
        hf.load_config(folder)


# --- Mistral's window -----------------------------------------------------------------------


def test_a_sequence_longer_than_the_sliding_window_is_refused(loaded):
    config, params = loaded["mistral"]
    model = make_model(config)
    tokens = jnp.zeros((1, 17), jnp.int32)
    message = r"17 tokens.*`sliding_window` is 16.*at most 16 tokens"
    with pytest.raises(errors.SequenceLengthError, match=message):
        model.apply({"params": params}, tokens)
    with pytest.raises(errors.SequenceLengthError, match=message):
        init_cache(model, batch_size=1, max_len=17)  # a KV cache past the window
    with pytest.raises(errors.SequenceLengthError, match=message):
        generate(model, params, tokens[:, :8], max_new_tokens=9)
    with nnx.use_eager_sharding(False):
        nnx_model = LlamaNNX(config, rngs=nnx.Rngs(0))
    with pytest.raises(errors.SequenceLengthError, match=message):
        nnx_model(tokens)


@pytest.mark.parametrize(("window", "expected"), [(None, None), (64, 64), ("absent", 4096)])
def test_mistral_window_null_long_or_absent(window, expected, loaded, tmp_path):
    folder = _copy("mistral", tmp_path)
    if window == "absent":
        _rewrite(folder, lambda c: c.pop("sliding_window"))  # MistralConfig's default
    else:
        _rewrite(folder, lambda c: c.update(sliding_window=window))
    config = hf.load_config(folder, dtype=np.float32)
    assert config.sliding_window == expected
    tokens, want = _reference("mistral")
    np.testing.assert_allclose(
        _logits(config, loaded["mistral"][1], tokens), want, atol=TOL, rtol=TOL
    )


def test_qwen_sliding_window_layers_are_refused(tmp_path):
    folder = _copy("qwen3", tmp_path)
    _rewrite(folder, lambda c: c.update(use_sliding_window=True))
    with pytest.raises(errors.UnsupportedArchitectureError, match="`use_sliding_window`=True"):
        hf.load_config(folder)
    _rewrite(
        folder, lambda c: c.update(use_sliding_window=False, layer_types=["sliding_attention"])
    )
    with pytest.raises(errors.UnsupportedArchitectureError, match="`layer_types`"):
        hf.load_config(folder)


# --- refused architectures name what they lack ----------------------------------------------

GEMMA = {
    "architectures": ["GemmaForCausalLM"],
    "model_type": "gemma",
    "hidden_act": "gelu",
    "hidden_activation": "gelu_pytorch_tanh",
    "head_dim": 256,
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "num_hidden_layers": 18,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": 256000,
}


def test_a_refused_architecture_names_its_unsupported_fields(tmp_path):
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GEMMA))
    with pytest.raises(errors.UnsupportedArchitectureError) as info:
        hf.load(folder)
    message = str(info.value)
    for fragment in ["GemmaForCausalLM", "`hidden_activation`='gelu_pytorch_tanh'", "SwiGLU"]:
        assert fragment in message
    assert "sqrt(`hidden_size`)" in message and "1 + weight" in message
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(errors.UnsupportedArchitectureError, match=r"no `vocab_size`, `hidden"):
        hf.load(folder)


def test_llama_features_in_gpt_or_in_no_exportable_architecture_are_refused(loaded, tmp_path):
    with pytest.raises(errors.ModelConfigError, match="`qk_norm`=True is a Llama-family"):
        get_config("gpt-tiny", qk_norm=True)
    config, params = loaded["qwen3"]
    both = dataclasses.replace(config, qkv_bias=True)
    with pytest.raises(errors.UnsupportedArchitectureError, match="`qkv_bias` and `qk_norm`"):
        hf.save(tmp_path / "out", both, params)  # refused before the parameter check
    assert list(tmp_path.iterdir()) == []


# --- the NNX Llama, and presets unchanged ---------------------------------------------------


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_nnx_llama_matches_transformers(name, loaded):
    config, params = loaded[name]
    with nnx.use_eager_sharding(False):
        model = LlamaNNX(config, rngs=nnx.Rngs(0))
    load_linen_params(model, params)
    tokens, expected = _reference(name)
    logits = nnx.jit(lambda m, x: m(x))(model, tokens)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=TOL, rtol=TOL)


def test_presets_have_no_new_parameters():
    config = get_config("llama-tiny")
    assert (config.rope_scaling, config.qkv_bias, config.qk_norm, config.sliding_window) == (
        None,
        False,
        False,
        None,
    )
    tokens = jnp.zeros((1, 4), jnp.int32)
    shapes = jax.eval_shape(make_model(config).init, jax.random.key(0), tokens)
    attn = shapes["params"]["blocks_0"]["attn"]
    assert {k: sorted(v) for k, v in attn.items()} == {
        n: ["kernel"] for n in ("query", "key", "value", "out")
    }
