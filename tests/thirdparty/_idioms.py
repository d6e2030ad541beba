"""Small models written in the idioms of code we did not write, and the shared checks.

Each model is plain Flax (nothing from ``multimesh_flax`` inside its layers): the tests place
it from outside and compare the pipelined run with the same computation on one device.

* ``ExplicitBlock`` (NNX) and ``ExplicitDense`` (Linen): sharding in types, as JAX's explicit
  sharding tutorials write it -- ``jax.sharding.reshard``, ``jax.typeof(x).sharding``,
  ``out_sharding=`` on an einsum, variables carrying ``out_sharding`` metadata.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm

TOL = dict(rtol=2e-5, atol=2e-6)
EXPLICIT = (AxisType.Explicit,) * 3
AXES = ("stage", "data", "model")
D = 8


def explicit_multi_mesh(stages):
    """A ``MultiMesh`` over a ``jax.make_mesh`` mesh (Explicit axes, its default)."""
    mesh = jax.make_mesh((stages, 2, 4 // stages), AXES, axis_types=EXPLICIT)
    return mm.MultiMesh(global_mesh=mesh)


def one_device_mesh():
    """The same axes on one device: the reference runs here under ``jax.set_mesh``."""
    return jax.make_mesh((1, 1, 1), AXES, axis_types=EXPLICIT, devices=jax.devices()[:1])


def batch(n=8, d=D):
    keys = jax.random.split(jax.random.key(1))
    return jax.random.normal(keys[0], (n, d)), jax.random.normal(keys[1], (n, d))


# --- NNX, explicit sharding ----------------------------------------------------------------


def _sharded(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class ExplicitBlock(nnx.Module):
    def __init__(self, d, *, rngs):
        self.up = nnx.Linear(d, 2 * d, kernel_init=_sharded(None, "model"), rngs=rngs)
        self.down = nnx.Linear(2 * d, d, kernel_init=_sharded("model", None), rngs=rngs)

    def __call__(self, x):
        x = jax.sharding.reshard(x, P("data", None))
        h = jnp.einsum("bd,dh->bh", x, self.up.kernel[...], out_sharding=P("data", "model"))
        h = jax.nn.gelu(h + self.up.bias[...])
        y = self.down(h, out_sharding=P("data", None))
        return jax.sharding.reshard(x + y, jax.typeof(x).sharding)


class ExplicitNet(nnx.Module):
    def __init__(self, d, stages, *, rngs, wrap=True):
        def make(s):
            return mm.task(ExplicitBlock, mesh_slice={"stage": s}) if wrap else ExplicitBlock

        self.blocks = nnx.List([make(s)(d, rngs=rngs) for s in range(stages)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def nnx_train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(nnx_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def nnx_microbatched_step(model, optimizer, batch):
    step = mm.microbatch(
        lambda b: nnx.value_and_grad(nnx_loss)(model, b), 0, 2, schedule="1f1b", reduce="mean"
    )
    loss, grads = step(batch)
    optimizer.update(model, grads)
    return loss


def nnx_params(model):
    return nnx.state(model, nnx.Param).to_pure_dict()


# --- Linen, explicit sharding --------------------------------------------------------------


class ExplicitDense(nn.Module):
    """A residual MLP block that shards its kernels by ``reshard`` where it reads them
    (Linen's ``Partitioned`` boxes constrain, which Explicit axes turn into asserts)."""

    @nn.compact
    def __call__(self, x):
        x = jax.sharding.reshard(x, P("data", None))
        d = x.shape[-1]
        up = self.param("up", nn.initializers.lecun_normal(), (d, 2 * d))
        down = self.param("down", nn.initializers.lecun_normal(), (2 * d, d))
        up = jax.sharding.reshard(up, P(None, "model"))
        h = jax.nn.gelu(jnp.einsum("bd,dh->bh", x, up, out_sharding=P("data", "model")))
        down = jax.sharding.reshard(down, P("model", None))
        y = jnp.einsum("bh,hd->bd", h, down, out_sharding=P("data", None))
        return jax.sharding.reshard(x + y, jax.typeof(x).sharding)


class ExplicitLinenNet(nn.Module):
    stages: int
    wrap: bool = True

    @nn.compact
    def __call__(self, x, y):
        for s in range(self.stages):
            block = mm.task(ExplicitDense, mesh_slice={"stage": s}) if self.wrap else ExplicitDense
            x = block(name=f"block_{s}")(x)
        return jnp.mean((x - y) ** 2)


def assert_trees_close(a, b, tol=TOL):
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol), a, b
    )


def sgd():
    return optax.sgd(0.1)
