"""Explicit sharding (sharding in types) inside tasks: models written with
``jax.sharding.reshard``, ``jax.typeof(x).sharding`` and ``out_sharding=``, pipelined over
2 and 4 stages of a ``MultiMesh`` with Explicit axes, against the same model on one device
under ``jax.set_mesh``; and an ambient ``jax.set_mesh`` around ``mm.jit``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType

import multimesh_flax as mm
from tests.thirdparty._idioms import (
    TOL,
    D,
    ExplicitLinenNet,
    ExplicitNet,
    assert_trees_close,
    batch,
    explicit_multi_mesh,
    nnx_microbatched_step,
    nnx_params,
    nnx_train_step,
    one_device_mesh,
    sgd,
)

STEPS = 2


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_readme_first_program_under_set_mesh(axis_type):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
        f = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[0]))
        g = mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[1]))
        out = mm.jit(lambda x: g(f(x)))(jnp.arange(3.0))
    np.testing.assert_allclose(np.asarray(out), [1.0, 3.0, 5.0])
    assert {d.id for d in out.devices()} == {1}


def _nnx_reference(step, stages, data):
    with jax.set_mesh(one_device_mesh()):
        model = ExplicitNet(D, stages, rngs=nnx.Rngs(0), wrap=False)
        optimizer = nnx.Optimizer(model, sgd(), wrt=nnx.Param)
        with mm.ignore_transforms():
            jitted = nnx.jit(step)
            losses = [float(jitted(model, optimizer, data)) for _ in range(STEPS)]
    return losses, nnx_params(model)


@pytest.mark.parametrize(
    ("stages", "step"),
    [(2, nnx_microbatched_step), (4, nnx_train_step)],
    ids=["2-stages-1f1b", "4-stages"],
)
def test_nnx_explicit_sharding_pipelined_matches_one_device(stages, step):
    data = batch()
    with explicit_multi_mesh(stages):
        model = ExplicitNet(D, stages, rngs=nnx.Rngs(0))
        table = mm.tabulate(model, data[0], console_kwargs={"width": 200})
        optimizer = nnx.Optimizer(model, sgd(), wrt=nnx.Param)
        jitted = mm.jit(step)
        losses = [float(jitted(model, optimizer, data)) for _ in range(STEPS)]
    ref_losses, ref_params = _nnx_reference(step, stages, data)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(nnx_params(model), ref_params)
    last = model.blocks[stages - 1].up.kernel.get_value()
    assert {d.id for d in last.devices()} == set(range(8 - 8 // stages, 8))
    assert f"blocks/{stages - 1}/up/kernel" in table
    model_axis = (None, "model") if stages == 2 else ()  # 4 stages: "model" has size 1
    assert last.sharding.spec == jax.sharding.PartitionSpec(*model_axis)


def _linen_reference(data, stages):
    x, y = data
    model = ExplicitLinenNet(stages=stages, wrap=False)
    with jax.set_mesh(one_device_mesh()):
        params_key = jax.random.split(jax.random.key(0))[0]
        params = nn.unbox(model.init(params_key, x, y))["params"]
        losses = []
        for _ in range(STEPS):
            loss, grads = jax.jit(jax.value_and_grad(lambda p: model.apply({"params": p}, x, y)))(
                params
            )
            params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
            losses.append(float(loss))
    return losses, params


@pytest.mark.parametrize(
    ("stages", "pipeline"),
    [(2, dict(microbatches=2, schedule="1f1b")), (4, {})],
    ids=["2-stages-1f1b", "4-stages"],
)
def test_linen_explicit_sharding_pipelined_matches_one_device(stages, pipeline):
    data = batch()
    with explicit_multi_mesh(stages):
        step, state, _ = mm.parallelize_step(
            ExplicitLinenNet(stages=stages),
            sgd(),
            global_batch=data,
            rng=jax.random.key(0),
            **pipeline,
        )
        losses = []
        for _ in range(STEPS):
            loss, state = step(state, data)
            losses.append(float(loss))
        # called eagerly, each task runs under jax.set_mesh of its submesh
        eager = ExplicitLinenNet(stages=stages).apply({"params": state.params}, *data)
    ref_losses, ref_params = _linen_reference(data, stages)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(nn.unbox(state.params), ref_params)
    with jax.set_mesh(one_device_mesh()):
        after = ExplicitLinenNet(stages=stages, wrap=False).apply({"params": ref_params}, *data)
    np.testing.assert_allclose(float(eager), float(after), **TOL)
    kernel = nn.unbox(state.params)[f"block_{stages - 1}"]["up"]
    assert {d.id for d in kernel.devices()} == set(range(8 - 8 // stages, 8))


def test_variables_with_out_sharding_no_task_owns_build_inside_a_multimesh():
    """NNX would shard them at birth on an ambient mesh; inside ``with multi:`` they are
    made unsharded and placed by ``mm.jit``."""
    init = nnx.with_partitioning(nnx.initializers.normal(), (None, "model"))
    ids = jnp.arange(8) % 16
    with explicit_multi_mesh(2):
        embed = nnx.Embed(16, D, embedding_init=init, rngs=nnx.Rngs(0))
        got = mm.jit(lambda e, i: e(i))(embed, ids)
    with nnx.use_eager_sharding(False):
        plain = nnx.Embed(16, D, embedding_init=init, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain(ids)), **TOL)
