"""Reference models with blocks on submeshes: placement, tied embeddings, and training
parity with the single-device model."""

import jax
import numpy as np
import optax
import pytest

import multimesh_flax as mm
from models import GPT, Llama, cross_entropy_loss, get_config
from models.pipeline import check_stages, make_multimesh, stage_of_block
from multimesh_flax import errors

STEPS = 5


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


# Every pair of (layout, family), (layout, schedule) and (family, schedule) values once: a
# pairwise cover of the 2 x 2 x 2 grid (each run compiles a whole pipelined step; GPT under
# every schedule on 2 stages is also in test_pipeline_schedules.py).
PAIRWISE = [
    ((2, 2, 2), GPT, "gpipe"),
    ((2, 2, 2), Llama, "1f1b"),
    ((4, 2, 1), GPT, "1f1b"),
    ((4, 2, 1), Llama, "gpipe"),
]


@pytest.mark.parametrize(
    "layout, family, schedule",
    PAIRWISE,
    ids=[f"{s}-{d}-{m}-{f.__name__.lower()}-{sch}" for (s, d, m), f, sch in PAIRWISE],
)
def test_pipelined_training_matches_single_device(layout, family, schedule):
    stages, data, model = layout
    config = get_config(f"{family.__name__.lower()}-tiny", num_layers=4)
    multi = make_multimesh(stages, data, model)
    # SGD with momentum is linear in the gradients, so parameters can be compared tightly
    # (Adam's normalisation amplifies float noise in near-zero gradients into ~lr).
    optimizer = optax.sgd(0.05, momentum=0.9)
    batches = [_batch(seed % 2) for seed in range(STEPS)]
    step, state, _ = mm.parallelize_step(
        family(config, stages=stages),
        optimizer,
        multi,
        batches[0],
        loss_fn=_loss_fn,
        microbatches=4,
        schedule=schedule,
    )
    assert step.executable(state, batches[0]).schedule.name == schedule
    per_stage = 8 // stages
    for i in range(4):
        stage = stage_of_block(i, 4, stages)
        expected = list(range(stage * per_stage, (stage + 1) * per_stage))
        for leaf in jax.tree_util.tree_leaves(state.params[f"blocks_{i}"]):
            assert _ids(leaf) == expected
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
