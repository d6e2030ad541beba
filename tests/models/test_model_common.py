"""Properties shared by both families: shapes, causality, stages, logical axes, sharding."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from models import (
    GPTBlock,
    GPTEmbed,
    GPTHead,
    LlamaBlock,
    LlamaEmbed,
    LlamaHead,
    get_config,
    init_cache,
    make_model,
)
from multimesh_flax import errors

PRESETS = ["gpt-tiny", "llama-tiny"]
LOGICAL_NAMES = {"batch", "length", "embed", "mlp", "heads", "kv_heads", "head_dim", "vocab"}
RULES = (
    ("batch", "data"),
    ("length", None),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("vocab", "model"),
)
ATOL = {jnp.float32: 1e-5}


@functools.cache
def _init(name):
    """(model, boxed variables, unboxed params, tokens) for a preset."""
    model = make_model(name)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 259)
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    return model, variables, nn.unbox(variables)["params"], tokens


@functools.cache
def _apply(name):
    model = make_model(name)
    return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))


@functools.cache
def _forward(name):
    _, _, params, tokens = _init(name)
    return _apply(name)(params, tokens)


@pytest.mark.parametrize("name", PRESETS)
def test_forward_shape_and_dtype(name):
    logits = _forward(name)
    assert logits.shape == (4, 16, 264)
    assert logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("name", PRESETS)
def test_top_level_names(name):
    _, variables, _, _ = _init(name)
    head = ["final_norm"] if name.startswith("gpt") else ["final_norm", "lm_head"]
    stem = ["embed", "pos_embed"] if name.startswith("gpt") else ["embed"]
    assert set(variables["params"]) == {"stem", "blocks_0", "blocks_1", "head"}
    assert sorted(variables["params"]["stem"]) == stem
    assert sorted(variables["params"]["head"]) == head


@pytest.mark.parametrize("name", PRESETS)
def test_future_tokens_do_not_change_earlier_logits(name):
    _, _, params, tokens = _init(name)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 259)
    before, after = _forward(name), _apply(name)(params, changed)
    np.testing.assert_allclose(after[:, :10], before[:, :10], atol=ATOL[jnp.float32])
    assert not np.allclose(after[:, 10:], before[:, 10:])


@pytest.mark.parametrize("name", PRESETS)
def test_every_param_has_logical_names(name):
    _, variables, params, _ = _init(name)
    boxes = jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert all(isinstance(box, nn.LogicallyPartitioned) for box in boxes)
    specs = nn.get_partition_spec(variables)["params"]
    flat_specs = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )[0]
    shapes = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    assert len(flat_specs) == len(shapes)
    for path, spec in flat_specs:
        assert len(spec) == shapes[path].ndim, (path, spec)
        assert set(spec) <= LOGICAL_NAMES, (path, spec)


def _run_stages(name, params, tokens):
    """The model run stage by stage, each stage with its own sub-tree of `params`."""
    model = make_model(name)
    gpt = name.startswith("gpt")
    stem, block, head = (
        (GPTEmbed, GPTBlock, GPTHead) if gpt else (LlamaEmbed, LlamaBlock, LlamaHead)
    )
    x = stem(model.config).apply({"params": params["stem"]}, tokens)
    for i in range(model.config.num_layers):
        x = block(model.config).apply({"params": params[f"blocks_{i}"]}, x)
    if gpt:
        table = params["stem"]["embed"]["embedding"]
        return head(model.config).apply({"params": params["head"]}, x, table)
    return head(model.config).apply({"params": params["head"]}, x)


@pytest.mark.parametrize("name", PRESETS)
def test_stages_reproduce_full_model(name):
    _, _, params, tokens = _init(name)
    staged = jax.jit(functools.partial(_run_stages, name))(params, tokens)
    np.testing.assert_allclose(staged, _forward(name), atol=ATOL[jnp.float32])


@pytest.mark.parametrize("name", PRESETS)
def test_sharded_under_logical_rules_matches_single_device(name):
    model, variables, params, tokens = _init(name)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, RULES)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        sharded = jax.device_put(params, shardings["params"])
        logits = jax.jit(lambda p, t: model.apply({"params": p}, t))(sharded, tokens)
    query = sharded["blocks_0"]["attn"]["query"]["kernel"]
    assert query.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert logits.sharding.spec == jax.sharding.PartitionSpec("data", None, "model")
    np.testing.assert_allclose(logits, _forward(name), atol=ATOL[jnp.float32])


@pytest.mark.parametrize("name", PRESETS)
def test_decode_in_chunks_matches_full_forward(name):
    model, _, params, tokens = _init(name)
    cache = init_cache(model, batch_size=4, max_len=16)

    @jax.jit
    def step(cache, chunk, start):
        positions = start + jnp.arange(chunk.shape[1])[None]
        variables = {"params": params, "cache": cache}
        logits, state = model.apply(variables, chunk, positions, decode=True, mutable=["cache"])
        return logits, state["cache"]

    pieces = []
    for start, stop in [(0, 7), *[(t, t + 1) for t in range(7, 16)]]:
        logits, cache = step(cache, tokens[:, start:stop], start)
        pieces.append(logits)
    decoded = jnp.concatenate(pieces, axis=1)
    np.testing.assert_allclose(decoded, _forward(name), atol=1e-4)
    assert int(cache["blocks_0"]["attn"]["cache_index"]) == 16


@pytest.mark.parametrize("name", PRESETS)
def test_sequences_past_max_len_raise_while_tracing(name):
    config = get_config(name, max_len=16)
    model = make_model(config)
    too_long = jax.ShapeDtypeStruct((2, 17), jnp.int32)
    key0 = jax.random.key(0)
    with pytest.raises(errors.SequenceLengthError, match=r"17 tokens.*`max_len` is 16"):
        jax.eval_shape(model.init, key0, too_long)
    with pytest.raises(errors.SequenceLengthError, match="positions up to 17"):
        positions = np.arange(14, 18)  # concrete: closed over, not an eval_shape argument
        jax.eval_shape(lambda key: model.init(key, jnp.zeros((2, 4), jnp.int32), positions), key0)
    fits = jax.eval_shape(model.init, key0, jax.ShapeDtypeStruct((2, 16), jnp.int32))
    assert "params" in fits
