"""Hugging Face checkpoints: our logits against transformers', placement, export, round trips.

The references are the logits that `transformers` itself computed on the fixture checkpoints
(``tests/fixtures/make_hf_fixtures.py``): GPT-2 with a tied head, Llama with grouped-query
heads, a non-default ``rope_theta`` and an untied head saved as a sharded checkpoint, a
tied Llama stored in bfloat16, and the Llama-family variants (Llama 3.1 rope scaling, Qwen2
untied and tied, Qwen3, Mistral; their own features are tested in ``test_hf_families.py``).
"""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import safetensors
import safetensors.numpy

import multimesh_flax as mm
from models import cross_entropy_loss, hf, make_model
from models.pipeline import make_multimesh
from multimesh_flax import errors

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NAMES = ["gpt2", "llama", "llama-tied", "llama3", "qwen2", "qwen2-tied", "qwen3", "mistral"]
LAYOUTS = {1: (1, 2, 4), 2: (2, 2, 2), 4: (4, 2, 1)}  # stages -> (stages, data, model)
TOL = 1e-4


def _reference(name):
    ref = np.load(FIXTURES / f"{name}.logits.npz")
    return ref["tokens"], ref["logits"]


def _keys_and_shapes(folder):
    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safetensors.safe_open(str(file), framework="np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                out[key] = tuple(f.get_slice(key).get_shape())
    return out


def _staged(config, stages):
    return type(make_model(config))(config, stages=stages)


def _flat(params):
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_leaves_with_path(params)
    }


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_unpipelined(name):
    tokens, expected = _reference(name)
    config, params = hf.load(FIXTURES / name, dtype=np.float32)
    logits = jax.jit(make_model(config).apply)({"params": params}, tokens)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=TOL, rtol=TOL)


# Every family sharded on one stage, then pipelined over 2 or 4 stages (alternately: the
# stage split is the same code for every family, the families' layers are not).
PIPELINED = [(n, 1) for n in NAMES] + [(n, 2 if i % 2 else 4) for i, n in enumerate(NAMES)]


@pytest.mark.parametrize("name, stages", PIPELINED)
def test_logits_match_transformers_pipelined(name, stages):
    tokens, expected = _reference(name)
    multi = make_multimesh(*LAYOUTS[stages])
    config, params = hf.load_placed(FIXTURES / name, multi, stages=stages, dtype=np.float32)
    model = _staged(config, stages)
    with multi:
        logits = mm.jit(lambda p, x: model.apply({"params": p}, x))(params, tokens)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=TOL, rtol=TOL)


def _ids(array):
    return sorted(d.id for d in array.devices())


def test_load_placed_puts_every_tensor_on_its_stage_sharded():
    multi = make_multimesh(2, 2, 2)
    config, params = hf.load_placed(FIXTURES / "llama", multi, stages=2)
    for leaf in jax.tree_util.tree_leaves(params["stem"]) + jax.tree_util.tree_leaves(
        [params["blocks_0"], params["blocks_1"]]
    ):
        assert _ids(leaf) == [0, 1, 2, 3]
    for leaf in jax.tree_util.tree_leaves([params["blocks_2"], params["blocks_3"], params["head"]]):
        assert _ids(leaf) == [4, 5, 6, 7]
    table = params["stem"]["embed"]["embedding"]
    assert table.sharding.shard_shape(table.shape) == (config.vocab_size // 2, config.embed_dim)


@pytest.mark.heavy
def test_fine_tuning_a_loaded_checkpoint_pipelined_starts_from_its_loss():
    """The first pipelined training step's loss is the loss of transformers' logits."""
    tokens, expected = _reference("llama")
    tokens, expected = np.tile(tokens, (2, 1)), np.tile(expected, (2, 1, 1))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    multi = make_multimesh(2, 2, 2)
    config, placed = hf.load_placed(FIXTURES / "llama", multi, stages=2)

    def loss_fn(model_fn, b):
        return cross_entropy_loss(model_fn(b["inputs"]), b["targets"])

    step, state, _ = mm.parallelize_step(
        _staged(config, 2), optax.sgd(0.1), multi, batch, loss_fn=loss_fn, microbatches=2
    )
    jax.tree_util.tree_map(lambda a, b: assert_same_place(a, b), state.params, placed)
    state = state.replace(params=placed)
    loss, state = step(state, batch)
    want = cross_entropy_loss(expected[:, :-1], batch["targets"])
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    second, _ = step(state, batch)
    assert float(second) < float(loss)


def assert_same_place(a, b):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


@pytest.mark.parametrize("name", NAMES)
def test_export_has_the_reference_keys_and_shapes_and_round_trips_bit_exact(name, tmp_path):
    config, params = hf.load(FIXTURES / name)
    out = hf.save(tmp_path / name, config, params)
    assert _keys_and_shapes(out) == _keys_and_shapes(FIXTURES / name)
    again_config, again = hf.load(out)
    assert again_config == config
    first, second = _flat(params), _flat(again)
    assert first.keys() == second.keys()
    for key in first:
        assert first[key].dtype == second[key].dtype, key
        assert np.array_equal(first[key], second[key]), key
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in [out, *out.iterdir()])  # not private
    saved = json.loads((out / "config.json").read_text())
    reference = json.loads((FIXTURES / name / "config.json").read_text())
    assert saved["architectures"] == reference["architectures"]
    assert saved["tie_word_embeddings"] == reference["tie_word_embeddings"]


def test_gpt2_checkpoint_with_the_original_key_names_and_mask_buffers(tmp_path):
    """The published GPT-2 weights predate the ``transformer.`` prefix and hold masks."""
    import safetensors.numpy

    folder = tmp_path / "legacy"
    folder.mkdir()
    shutil.copy(FIXTURES / "gpt2" / "config.json", folder)
    tensors = safetensors.numpy.load_file(str(FIXTURES / "gpt2" / "model.safetensors"))
    legacy = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    legacy["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    safetensors.numpy.save_file(legacy, str(folder / "model.safetensors"))
    tokens, expected = _reference("gpt2")
    config, params = hf.load(folder)
    logits = make_model(config).apply({"params": params}, tokens)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=TOL, rtol=TOL)


def test_bf16_loads_as_stored_or_cast():
    config, params = hf.load(FIXTURES / "llama-tied")
    assert np.dtype(config.param_dtype).name == "bfloat16"
    assert {x.dtype.name for x in jax.tree_util.tree_leaves(params)} == {"bfloat16"}
    config, params = hf.load(FIXTURES / "llama-tied", dtype=np.float32)
    assert {x.dtype.name for x in jax.tree_util.tree_leaves(params)} == {"float32"}


def test_sharded_export_writes_an_index_and_loads_back(tmp_path):
    config, params = hf.load(FIXTURES / "gpt2")
    out = hf.save(tmp_path / "sharded", config, params, max_shard_size=60_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_keys_and_shapes(FIXTURES / "gpt2"))
    assert all(p.stat().st_size <= 60_000 + 4_096 for p in out.glob("*.safetensors"))
    _, again = hf.load(out)
    for key, value in _flat(params).items():
        assert np.array_equal(value, _flat(again)[key]), key


def test_fine_tuned_tied_llama_is_exported_untied(tmp_path):
    config, params = hf.load(FIXTURES / "llama-tied", dtype=np.float32)
    params["head"]["lm_head"]["kernel"] = params["head"]["lm_head"]["kernel"] + 1.0
    out = hf.save(tmp_path / "untied", config, params)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in _keys_and_shapes(out)
    _, again = hf.load(out)
    assert np.array_equal(again["head"]["lm_head"]["kernel"], params["head"]["lm_head"]["kernel"])


def test_vocab_padding_keeps_logits_and_is_cut_off_on_export(tmp_path):
    tokens, expected = _reference("llama")
    config, params = hf.load(FIXTURES / "llama", vocab_multiple=384)
    assert config.vocab_size == 384
    logits = np.asarray(make_model(config).apply({"params": params}, tokens))
    np.testing.assert_allclose(logits[..., :320], expected, atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(logits[..., 320:], 0.0)
    out = hf.save(tmp_path / "trimmed", config, params, vocab_size=320)
    assert _keys_and_shapes(out) == _keys_and_shapes(FIXTURES / "llama")


def test_vocab_that_does_not_split_over_the_model_axis(tmp_path):
    config, params = hf.load(FIXTURES / "llama")
    odd = hf.save(tmp_path / "odd", config, params, vocab_size=319)
    multi = make_multimesh(2, 2, 2)
    with pytest.raises(errors.VocabularySplitError, match="vocab_multiple=2"):
        hf.load_placed(odd, multi, stages=2)
    padded, placed = hf.load_placed(odd, multi, stages=2, vocab_multiple=2)
    assert padded.vocab_size == 320
    tokens, expected = _reference("llama")
    tokens = np.minimum(tokens, 318)
    reference = make_model(config).apply({"params": params}, tokens)
    with multi:
        model = _staged(padded, 2)
        logits = mm.jit(lambda p, x: model.apply({"params": p}, x))(placed, tokens)
    np.testing.assert_allclose(
        np.asarray(logits)[..., :319], np.asarray(reference)[..., :319], atol=TOL, rtol=TOL
    )


# --- bad input: typed errors naming the file/key and the fix -----------------------------


def _copy(name, tmp_path):
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_folder_without_config(tmp_path):
    folder = _copy("gpt2", tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(errors.PretrainedConfigError, match="config.json"):
        hf.load(folder)
    with pytest.raises(errors.PretrainedConfigError, match="not a directory"):
        hf.load(tmp_path / "nowhere")


def test_unsupported_architecture_and_features(tmp_path):
    folder = _copy("llama", tmp_path)
    _edit_config(folder, architectures=["MixtralForCausalLM"], num_local_experts=8)
    with pytest.raises(
        errors.UnsupportedArchitectureError, match=r"MixtralForCausalLM.*`num_local_experts`=8"
    ):
        hf.load(folder)
    _edit_config(folder, architectures=["LlamaForCausalLM"], attention_bias=True)
    with pytest.raises(errors.UnsupportedArchitectureError, match="attention_bias"):
        hf.load(folder)
    _edit_config(folder, attention_bias=False, rope_parameters={"rope_type": "yarn"})
    with pytest.raises(errors.UnsupportedArchitectureError, match="'yarn'"):
        hf.load(folder)


def test_missing_extra_and_misshaped_tensors(tmp_path):
    folder = _copy("gpt2", tmp_path)
    _edit_config(folder, n_layer=5)
    with pytest.raises(
        errors.PretrainedTensorError, match=r"'transformer.h.4.ln_1.weight'.*missing"
    ):
        hf.load(folder)
    _edit_config(folder, n_layer=2)
    with pytest.raises(errors.PretrainedTensorError, match=r"'transformer.h.2.*not part of"):
        hf.load(folder)
    _edit_config(folder, n_layer=4, n_positions=32)
    with pytest.raises(errors.PretrainedTensorError, match=r"wpe.weight.*\(64, 32\).*\(32, 32\)"):
        hf.load(folder)


def test_truncated_and_missing_shard_files(tmp_path):
    folder = _copy("llama", tmp_path)
    shard = folder / "model-00003-of-00006.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(errors.PretrainedTensorError, match="model-00003-of-00006.*truncated"):
        hf.load(folder)
    shard.unlink()
    with pytest.raises(errors.PretrainedTensorError, match="model-00003-of-00006.*not in"):
        hf.load(folder)


def _break_tensor(folder, key, change):
    """Rewrites `folder`'s model.safetensors with ``change(array)`` in place of tensor `key`."""
    path = folder / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    tensors[key] = change(tensors[key])
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})


def _three_inf(array):
    return np.where(np.arange(array.size).reshape(array.shape) < 3, np.inf, array)


def test_non_finite_and_integer_tensors(tmp_path):
    folder = _copy("gpt2", tmp_path)
    key = "transformer.h.1.mlp.c_fc.weight"
    _break_tensor(folder, key, _three_inf)
    with pytest.raises(
        errors.PretrainedTensorError, match=rf"'{key}'.*model.safetensors.*holds 3 non-finite"
    ):
        hf.load(folder)
    _break_tensor(folder, key, lambda a: np.ones(a.shape, np.int32))
    with pytest.raises(errors.PretrainedTensorError, match=rf"'{key}'.*has dtype I32"):
        hf.load(folder)


def test_stages_that_do_not_divide_the_layers():
    with pytest.raises(errors.InvalidTaskError, match="divides the 4 blocks"):
        hf.load(FIXTURES / "gpt2", stages=3)


def test_failed_save_writes_nothing(tmp_path):
    config, params = hf.load(FIXTURES / "gpt2")
    del params["blocks_3"]
    with pytest.raises(errors.PretrainedTensorError, match="blocks_3"):
        hf.save(tmp_path / "out", config, params)
    assert list(tmp_path.iterdir()) == []
    config, params = hf.load(FIXTURES / "gpt2")
    hf.save(tmp_path / "out", config, params)
    before = _keys_and_shapes(tmp_path / "out")
    with pytest.raises(errors.PretrainedConfigError, match="overwrite=True"):
        hf.save(tmp_path / "out", config, params)
    assert _keys_and_shapes(tmp_path / "out") == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_public_names():
    assert sorted(hf.__all__) == ["HFTokenizer", "load", "load_config", "load_placed", "save"]


# --- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_round_trips_text_with_the_byte_tokenizer_interface():
    tok = hf.HFTokenizer.from_folder(FIXTURES / "gpt2")
    text = "Shall I compare thee to a summer's day?\nThou art more lovely"
    ids = tok.encode(text, eos=True)
    assert ids.dtype == np.int32 and ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(ids) < len(text)  # BPE merges make fewer ids than bytes
    assert tok.decode(ids) == text
    assert tok.vocab_size == 320 and tok.pad_id == tok.eos_id
    with pytest.raises(ValueError, match=r"\[0, 320\)"):
        tok.decode([320])
    with pytest.raises(errors.PretrainedConfigError, match="tokenizer.json"):
        hf.HFTokenizer.from_folder(FIXTURES / "llama")
