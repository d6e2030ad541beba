"""Small models in the idioms of code we did not write, each pipelined over 2 stages against
the same model on one device: Linen logical axes (flax's examples), NNX
``nnx.with_partitioning``, and scan over layers (``nn.scan``: the scanned stack placed as one
task; placing each scanned layer is refused with ``TaskInControlFlowError``)."""

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import multimesh_flax as mm
from multimesh_flax import errors
from tests.thirdparty._idioms import (
    TOL,
    D,
    LogicalNet,
    NnxLogicalNet,
    ScanNet,
    assert_trees_close,
    auto_multi_mesh,
    batch,
    linen_reference,
    nnx_params,
    nnx_train_step,
    train_linen,
)


@pytest.mark.parametrize(
    ("model", "kwargs", "stage_1"),
    [(LogicalNet, dict(microbatches=2, schedule="1f1b"), "mlp_1"), (ScanNet, {}, "layers")],
    ids=["linen-logical-axes-1f1b", "nn.scan-stack-as-one-task"],
)
def test_linen_idiom_pipelined_matches_one_device(model, kwargs, stage_1):
    data = batch()
    with auto_multi_mesh():
        losses, state = train_linen(model(), data, rng=jax.random.key(0), **kwargs)
    ref_losses, ref_params = linen_reference(model(wrap=False), data)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(nn.unbox(state.params), ref_params)
    last = jax.tree.leaves(nn.unbox(state.params)[stage_1])[0]
    assert {d.id for d in last.devices()} == {4, 5, 6, 7}


def test_scan_refuses_a_task_per_scanned_layer():
    with auto_multi_mesh(), pytest.raises(errors.TaskInControlFlowError, match="inside `scan`"):
        mm.parallelize_step(ScanNet(per_layer=True), optax.sgd(0.1), global_batch=batch())


def test_nnx_with_partitioning_pipelined_matches_one_device():
    data = batch()
    with auto_multi_mesh():
        model = NnxLogicalNet(D, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = mm.jit(nnx_train_step)
        losses = [float(step(model, optimizer, data)) for _ in range(2)]
    kernel = model.blocks[1].up.kernel.get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert {d.id for d in kernel.devices()} == {4, 5, 6, 7}
    with nnx.use_eager_sharding(False):
        reference = NnxLogicalNet(D, rngs=nnx.Rngs(0), wrap=False)
    ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    with mm.ignore_transforms():
        ref_losses = [float(nnx.jit(nnx_train_step)(reference, ref_optimizer, data))
                      for _ in range(2)]  # fmt: skip
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(nnx_params(model), nnx_params(reference))
