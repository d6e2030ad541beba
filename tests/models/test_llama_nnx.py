"""The NNX Llama port: Linen's variable names, a Linen checkpoint gives the same logits (also
pipelined over an uneven split), and pipelined training (2 stages, 1F1B, 4 microbatches)
matches the single-device NNX run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import multimesh_flax as mm
from models import Llama, cross_entropy_loss, get_config
from models.llama_nnx import LlamaNNX, load_linen_params
from models.pipeline import make_multimesh
from multimesh_flax import errors

STEPS = 5
CONFIG = get_config("llama-tiny", num_layers=4)


def _batch(seed=0, batch=8, length=16):
    tokens = jax.random.randint(jax.random.key(seed), (batch, length + 1), 0, 259)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _linen_params():
    return nn.meta.unbox(Llama(CONFIG).init(jax.random.key(1), _batch()["inputs"])["params"])


def _plain_model(params):
    with nnx.use_eager_sharding(False):
        model = LlamaNNX(CONFIG, rngs=nnx.Rngs(0))
    load_linen_params(model, params)
    return model


def _loss(model, batch):
    return cross_entropy_loss(model(batch["inputs"]), batch["targets"])


def _ids(array):
    return sorted(d.id for d in array.devices())


def test_variable_paths_and_shapes_are_the_linen_parameter_tree():
    params = _linen_params()
    model = _plain_model(params)
    shapes = jax.tree_util.tree_map(np.shape, nnx.state(model, nnx.Param).to_pure_dict())
    assert shapes == jax.tree_util.tree_map(np.shape, params)


def test_linen_checkpoint_gives_the_same_logits_plain_and_pipelined_unevenly():
    params = _linen_params()
    tokens = _batch()["inputs"]
    expected = Llama(CONFIG).apply({"params": params}, tokens)
    np.testing.assert_allclose(_plain_model(params)(tokens), expected, rtol=1e-5, atol=1e-5)
    # An uneven split (the even one trains below): one block with the stem, three with the head.
    with make_multimesh(2, 2, 2):
        staged = LlamaNNX(CONFIG, layers_per_stage=(1, 3), rngs=nnx.Rngs(0))
        load_linen_params(staged, params)
        assert _ids(staged.blocks_0.mlp.up.kernel.get_value()) == [0, 1, 2, 3]
        assert _ids(staged.blocks_1.mlp.up.kernel.get_value()) == [4, 5, 6, 7]
        logits = mm.jit(lambda m, x: m(x))(staged, tokens)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def _pipelined_step(model, optimizer, batch):
    def grad_fn(b):
        return nnx.value_and_grad(_loss)(model, b)

    step = mm.microbatch(grad_fn, 0, 2, schedule="1f1b", reduce="mean", trace_once=False)
    loss, grads = step(batch)
    optimizer.update(model, grads)
    return loss


def _plain_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


@pytest.mark.heavy
def test_pipelined_training_matches_single_device():
    params = _linen_params()
    batches = [_batch(seed % 2) for seed in range(STEPS)]
    # SGD with momentum, as the Linen parity tests (tests/models/test_pipeline.py)
    tx = optax.sgd(0.05, momentum=0.9)
    with make_multimesh(2, 2, 2):
        model = LlamaNNX(CONFIG, stages=2, rngs=nnx.Rngs(0))
        load_linen_params(model, params)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = mm.jit(_pipelined_step)
        losses = [float(step(model, optimizer, b)) for b in batches]
        assert "schedule '1f1b': 2 stages" in step.describe(model, optimizer, batches[0])
    reference = _plain_model(params)
    ref_optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)
    with mm.ignore_transforms():
        jitted = nnx.jit(_plain_step)
        ref_losses = [float(jitted(reference, ref_optimizer, b)) for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        nnx.state(model, nnx.Param).to_pure_dict(),
        nnx.state(reference, nnx.Param).to_pure_dict(),
    )
    assert losses[-1] < losses[0]
    for name, devices in (
        ("stem", [0, 1, 2, 3]),
        ("blocks_1", [0, 1, 2, 3]),
        ("blocks_2", [4, 5, 6, 7]),
        ("head", [4, 5, 6, 7]),
    ):
        for leaf in jax.tree_util.tree_leaves(nnx.state(getattr(model, name), nnx.Param)):
            assert _ids(leaf) == devices


def test_sequences_past_max_len_raise():
    with nnx.use_eager_sharding(False):
        model = LlamaNNX(get_config("llama-tiny", num_layers=1, max_len=8), rngs=nnx.Rngs(0))
    with pytest.raises(errors.SequenceLengthError, match=r"9 tokens.*`max_len` is 8"):
        nnx.eval_shape(lambda m: m(jnp.zeros((1, 9), jnp.int32)), model)
    assert nnx.eval_shape(lambda m: m(jnp.zeros((1, 8), jnp.int32)), model).shape == (1, 8, 264)
