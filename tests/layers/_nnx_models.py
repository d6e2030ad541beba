"""Small NNX models for the NNX tests: a residual MLP block, staged on a
``("stage", "data", "model")`` MultiMesh, and its plain single-device twin."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import multimesh_flax as mm

RULES = [("mlp", "model"), ("embed", None), ("batch", "data")]
TOL = dict(rtol=2e-5, atol=2e-6)


def partitioned(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Block(nnx.Module):
    def __init__(self, d, *, rngs):
        self.up = nnx.Linear(d, 4 * d, kernel_init=partitioned("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(4 * d, d, kernel_init=partitioned("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Net(nnx.Module):
    """``stages`` blocks; ``wrap=True`` puts block ``s`` on stage ``s`` of the MultiMesh."""

    def __init__(self, d, *, rngs, stages=2, wrap=True):
        def make(s):
            return mm.task(Block, mesh_slice={"stage": s}, logical_axes=RULES) if wrap else Block

        self.blocks = nnx.List([make(s)(d, rngs=rngs) for s in range(stages)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def multi_mesh(stages=2):
    return mm.MultiMesh(
        axis_sizes=(stages, 2, 8 // (2 * stages)), axis_names=("stage", "data", "model")
    )


def plain_net(d=16, seed=0, stages=2):
    with nnx.use_eager_sharding(False):
        return Net(d, rngs=nnx.Rngs(seed), stages=stages, wrap=False)


def batch(n=8, d=16):
    return jax.random.normal(jax.random.key(1), (n, d)), jax.random.normal(
        jax.random.key(2), (n, d)
    )


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def device_ids(array):
    return sorted(d.id for d in array.devices())


def assert_states_close(a, b, tol=TOL):
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol),
        nnx.state(a, nnx.Param).to_pure_dict(),
        nnx.state(b, nnx.Param).to_pure_dict(),
    )
