"""Reference models with blocks on submeshes: placement, tied embeddings, training parity
with the single-device model on even and uneven stage splits, and checkpoints that move
between splits."""

from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn

import multimesh_flax as mm
from models import GPT, Llama, cross_entropy_loss, get_config, hf
from models.llama_nnx import LlamaNNX
from models.pipeline import (
    block_stages,
    check_stages,
    get_layers_per_stage,
    make_multimesh,
    stage_of_block,
)
from multimesh_flax import checkpoint, errors

STEPS = 5
GPT2_FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "gpt2"


def _batch(seed=0, batch=8, length=16):
    tokens = jax.random.randint(jax.random.key(seed), (batch, length + 1), 0, 259)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _loss_fn(model_fn, batch):
    return cross_entropy_loss(model_fn(batch["inputs"]), batch["targets"])


def _reference(model, params, batches, optimizer):
    """The unpipelined model on one device under plain ``jax.jit``."""
    params = jax.device_put(jax.tree_util.tree_map(np.asarray, params), jax.devices()[0])
    opt_state = optimizer.init(params)

    def step(p, o, batch):
        loss, grads = jax.value_and_grad(
            lambda p: _loss_fn(lambda x: model.apply({"params": p}, x), batch)
        )(p)
        updates, o = optimizer.update(grads, o, p)
        return loss, optax.apply_updates(p, updates), o

    step = jax.jit(step)
    losses = []
    for batch in batches:
        loss, params, opt_state = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params


def _ids(array):
    return sorted(d.id for d in array.devices())


def _staged(family, config, split):
    """``family`` pipelined over ``split``: a stage count (even) or the blocks per stage."""
    if isinstance(split, int):
        return family(config, stages=split)
    return family(config, layers_per_stage=split)


# Pairwise over (layout, family, schedule) and (even, uneven) split: every run compiles a whole
# pipelined step. An int split is `stages=S`; a tuple is `layers_per_stage`, the uneven ones
# with blocks-free end stages (only the stem or the head) among them. GPT under every
# schedule on 2 even stages is also in test_pipeline_schedules.py.
PAIRWISE = [
    ((2, 2, 2), GPT, "gpipe", 2),
    ((2, 2, 2), Llama, "1f1b", (3, 1)),
    ((4, 2, 1), GPT, "1f1b", 4),
    ((4, 2, 1), Llama, "gpipe", (0, 2, 2, 0)),
    ((4, 2, 1), GPT, "zero-bubble-h2", (1, 2, 1, 0)),
]


def _case_id(layout, family, schedule, split):
    shape = "-".join(map(str, layout))
    kind = "even" if isinstance(split, int) else "uneven" + "".join(map(str, split))
    return f"{shape}-{family.__name__.lower()}-{schedule}-{kind}"


@pytest.mark.heavy
@pytest.mark.parametrize(
    "layout, family, schedule, split", PAIRWISE, ids=[_case_id(*case) for case in PAIRWISE]
)
def test_pipelined_training_matches_single_device(layout, family, schedule, split):
    stages, data, model = layout
    config = get_config(f"{family.__name__.lower()}-tiny", num_layers=4)
    multi = make_multimesh(stages, data, model)
    # SGD with momentum is linear in the gradients, so parameters can be compared tightly
    # (Adam's normalisation amplifies float noise in near-zero gradients into ~lr).
    optimizer = optax.sgd(0.05, momentum=0.9)
    batches = [_batch(seed % 2) for seed in range(STEPS)]
    step, state, _ = mm.parallelize_step(
        _staged(family, config, split),
        optimizer,
        multi,
        batches[0],
        loss_fn=_loss_fn,
        microbatches=4,
        schedule=schedule,
    )
    assert step.executable(state, batches[0]).schedule.name == schedule
    per_stage = 8 // stages
    where = block_stages((4 // split,) * split if isinstance(split, int) else split)
    for i in range(4):
        expected = list(range(where[i] * per_stage, (where[i] + 1) * per_stage))
        for leaf in jax.tree_util.tree_leaves(state.params[f"blocks_{i}"]):
            assert _ids(leaf) == expected
    for leaf in jax.tree_util.tree_leaves(state.params["stem"]):
        assert _ids(leaf) == list(range(per_stage))
    for leaf in jax.tree_util.tree_leaves(state.params["head"]):
        assert _ids(leaf) == list(range(8 - per_stage, 8))
    start = jax.tree_util.tree_map(np.asarray, state.params)
    losses = []
    for batch in batches:
        loss, state = step(state, batch)
        losses.append(float(loss))
    ref_losses, ref_params = _reference(family(config), start, batches, optimizer)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        state.params,
        ref_params,
    )
    assert losses[-1] < losses[0]


def test_tied_embedding_has_one_copy_on_the_first_stage():
    config = get_config("gpt-tiny", num_layers=2)
    step, state, _ = mm.parallelize_step(
        GPT(config, stages=2), optax.sgd(0.5), make_multimesh(2, 2, 2), _batch(), loss_fn=_loss_fn
    )
    paths = [
        jax.tree_util.keystr(p)
        for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
        if config.vocab_size in x.shape
    ]
    assert paths == ["['stem']['embed']['embedding']"]
    table = state.params["stem"]["embed"]["embedding"]
    assert _ids(table) == [0, 1, 2, 3]
    _, state = step(state, _batch())
    assert _ids(state.params["stem"]["embed"]["embedding"]) == [0, 1, 2, 3]


def test_stage_assignment_and_errors():
    assert [stage_of_block(i, 8, 4) for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    check_stages(4, 2)
    with pytest.raises(errors.InvalidTaskError, match="divides the 2 blocks"):
        check_stages(2, 4)
    with pytest.raises(errors.MeshShapeError, match="= 8"):
        make_multimesh(2, 2, 1)
    with pytest.raises(errors.InvalidTaskError):
        jax.eval_shape(
            GPT(get_config("gpt-tiny"), stages=3).init, jax.random.key(0), _batch()["inputs"]
        )
    assert get_layers_per_stage(4, stages=2, layers_per_stage=[1, 3]) == (1, 3)  # agreeing
    assert block_stages(get_layers_per_stage(8, layers_per_stage=(1, 3, 3, 1))) == (
        0, 1, 1, 1, 2, 2, 2, 3,
    )  # fmt: skip
    model = Llama(get_config("llama-tiny", num_layers=4), layers_per_stage=[0, 4])
    assert (model.stages, model.layers_per_stage) == (2, (0, 4))
    with pytest.raises(errors.InvalidTaskError, match="neither `stages` nor `layers_per_stage`"):
        hf.load_placed(GPT2_FOLDER, make_multimesh(2, 2, 2))


# `layers_per_stage` for 4 blocks that is not a split of them: the value, then what the
# message must say (what was expected and what was received).
BAD_SPLITS = {
    "wrong_sum": (
        dict(layers_per_stage=(1, 2)),
        ("add up to the model's 4 blocks", "adds up to 3"),
    ),
    "negative": (dict(layers_per_stage=(5, -1)), (">= 0", "(5, -1)")),
    "empty_middle_stage": (
        dict(layers_per_stage=(2, 0, 2)),
        ("between the first and the last", "stage 1 would run nothing", "e.g. (2, 2)"),
    ),
    "not_counts": (dict(layers_per_stage=4), ("sequence of block counts", "got 4", "stages=S")),
    "disagrees_with_stages": (
        dict(stages=4, layers_per_stage=(1, 3)),
        ("`stages`=4", "(2 stages) disagree", "alone"),
    ),
}


@pytest.mark.parametrize("kwargs, messages", BAD_SPLITS.values(), ids=BAD_SPLITS.keys())
def test_bad_layers_per_stage_raise_invalid_task_error(kwargs, messages):
    gpt, llama = get_config("gpt-tiny", num_layers=4), get_config("llama-tiny", num_layers=4)
    builders = [
        lambda: get_layers_per_stage(4, **kwargs),
        lambda: GPT(gpt, **kwargs),
        lambda: Llama(llama, **kwargs),
        lambda: LlamaNNX(llama, **kwargs, rngs=None),
        lambda: hf.load(GPT2_FOLDER, **kwargs),  # 4 layers
    ]
    for build in builders:
        with pytest.raises(errors.InvalidTaskError) as raised:
            build()
        for message in messages:
            assert message in str(raised.value)


def _placed(model, params, multi, abstract=False):
    """``params`` (host arrays) where the pipelined ``model`` keeps them on ``multi``; or,
    with ``abstract``, their shapes with those shardings (a restore target)."""
    with multi:
        placement = mm.layers.get_placement(model, jax.random.key(0), _batch()["inputs"])
    shardings = {tuple(p.path.split("/")): p.sharding for p in placement.params}

    def put(path, x):
        sharding = shardings[tuple(k.key for k in path)]
        if abstract:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.device_put(x, sharding)

    return jax.tree_util.tree_map_with_path(put, params)


def test_checkpoints_move_between_even_and_uneven_splits_bit_exactly(tmp_path):
    config, tokens = get_config("gpt-tiny", num_layers=4), _batch()["inputs"]
    shapes = jax.eval_shape(GPT(config).init, jax.random.key(3), tokens)["params"]
    rng = np.random.default_rng(3)  # random values of the right shapes: no init to compile
    params = jax.tree_util.tree_map(
        lambda x: (0.1 * rng.standard_normal(x.shape)).astype(np.float32), nn.meta.unbox(shapes)
    )
    multi = make_multimesh(2, 2, 2)
    even, uneven = GPT(config, stages=2), GPT(config, layers_per_stage=(1, 3))
    saved = _placed(even, params, multi)
    assert _ids(saved["blocks_1"]["mlp"]["fc"]["kernel"]) == [0, 1, 2, 3]
    checkpoint.save_checkpoint(tmp_path / "even", 1, saved)

    restored = checkpoint.restore_checkpoint(
        tmp_path / "even", _placed(uneven, params, multi, abstract=True)
    )
    assert _ids(restored["blocks_1"]["mlp"]["fc"]["kernel"]) == [4, 5, 6, 7]
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, params)
    with multi:
        logits = {
            name: mm.jit(lambda p, x, model=model: model.apply({"params": p}, x))(p, tokens)
            for name, model, p in (("even", even, saved), ("uneven", uneven, restored))
        }
    np.testing.assert_array_equal(logits["uneven"], logits["even"])

    # ... and back from the uneven split onto another even layout: 4 stages of 2 devices.
    checkpoint.save_checkpoint(tmp_path / "uneven", 1, restored)
    four = _placed(GPT(config, stages=4), params, make_multimesh(4, 2, 1), abstract=True)
    back = checkpoint.restore_checkpoint(tmp_path / "uneven", four)
    assert _ids(back["blocks_1"]["mlp"]["fc"]["kernel"]) == [2, 3]
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
