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


# --- BatchNorm, Dropout and parameters no task owns ---------------------------------------


class NormBlock(nn.Module):
    """Dense, BatchNorm (``batch_stats``), Dropout: a ResNet-style block in Linen."""

    train: bool = True
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, name="dense_with_a_rather_long_name")(x)
        x = nn.BatchNorm(use_running_average=not self.train, momentum=0.5)(x)
        return nn.relu(nn.Dropout(self.dropout, deterministic=not self.train)(x))


class NormNet(nn.Module):
    """Two ``NormBlock`` stages between layers no task owns (a stem and a head)."""

    train: bool = True
    dropout: float = 0.0
    wrap: bool = True

    @nn.compact
    def __call__(self, x, y):
        x = nn.Dense(D, name="stem")(x)
        for s in range(2):
            block = mm.task(NormBlock, mesh_slice={"stage": s}) if self.wrap else NormBlock
            x = block(self.train, self.dropout, name=f"stage_{s}_residual_block")(x)
        return jnp.mean((nn.Dense(D, name="head")(x) - y) ** 2)


def auto_multi_mesh():
    return mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=AXES)


class NnxNormBlock(nnx.Module):
    def __init__(self, d, *, rngs):
        self.linear = nnx.Linear(d, d, rngs=rngs)
        self.norm = nnx.BatchNorm(d, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.drop(self.norm(self.linear(x))))


class TiedNet(nnx.Module):
    """An embedding no task owns, tied: read first (lookup) and last (logits)."""

    def __init__(self, vocab, d, *, rngs, wrap=True):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)

        def make(s):
            block = mm.task(nnx.Linear, mesh_slice={"stage": s}) if wrap else nnx.Linear
            return block(d, d, rngs=rngs)

        self.blocks = nnx.List([make(s) for s in range(2)])

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = jax.nn.relu(block(x))
        return self.embed.attend(x)


def tied_loss(model, ids):
    return optax.softmax_cross_entropy_with_integer_labels(model(ids), ids).mean()


def tied_step(model, optimizer, ids):
    loss, grads = nnx.value_and_grad(tied_loss)(model, ids)
    optimizer.update(model, grads)
    return loss


def live_placement(tree):
    """``{path: (device ids, spec)}`` of the arrays in a tree of parameters."""
    from multimesh_flax.core.fragment import canonical_spec

    flat = jax.tree_util.tree_leaves_with_path(tree)
    out = {}
    for path, leaf in flat:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        spec = getattr(leaf.sharding, "spec", None)
        ids = tuple(sorted(d.id for d in leaf.devices()))
        out["/".join(keys)] = (ids, None if spec is None else canonical_spec(spec))
    return out


def table_placement(placement):
    """``{path: (device ids, spec)}`` as ``mm.tabulate``'s table says."""
    from multimesh_flax.core.fragment import canonical_spec

    return {p.path: (tuple(p.device_ids), canonical_spec(p.mesh_spec)) for p in placement.params}


# --- a model whose own code instantiates the blocks (placed by class) ----------------------


class PlainBlock(nnx.Module):
    def __init__(self, d, *, rngs):
        self.proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.gelu(self.proj(x))


class PlainNet(nnx.Module):
    """Creates its ``PlainBlock``\\ s itself, under ``transformer_blocks/layers/<i>``."""

    def __init__(self, d, layers, *, rngs):
        self.transformer_blocks = nnx.Dict(
            layers=nnx.List([PlainBlock(d, rngs=rngs) for _ in range(layers)])
        )

    def __call__(self, x):
        for block in self.transformer_blocks["layers"]:
            x = block(x)
        return x


# --- Linen logical axes, NNX logical partitioning, scan over layers -----------------------

LOGICAL_RULES = (("batch", "data"), ("embed", None), ("mlp", "model"))


class LogicalMlp(nn.Module):
    """flax examples' idiom: logical names on parameters and activations."""

    @nn.compact
    def __call__(self, x):
        x = nn.with_logical_constraint(x, ("batch", "embed"))
        init = nn.initializers.lecun_normal()
        up = nn.Dense(2 * D, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))
        down = nn.Dense(D, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))
        h = nn.with_logical_constraint(nn.gelu(up(x)), ("batch", "mlp"))
        return x + down(h)


class LogicalNet(nn.Module):
    wrap: bool = True

    @nn.compact
    def __call__(self, x, y):
        for s in range(2):
            task = mm.task(LogicalMlp, mesh_slice={"stage": s}, logical_axes=LOGICAL_RULES)
            x = (task if self.wrap else LogicalMlp)(name=f"mlp_{s}")(x)
        return jnp.mean((x - y) ** 2)


class NnxLogicalBlock(nnx.Module):
    """NNX's idiom: ``nnx.with_partitioning`` logical names, mapped by the task's rules."""

    def __init__(self, d, *, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(d, 2 * d, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             rngs=rngs)  # fmt: skip
        self.down = nnx.Linear(2 * d, d,
                               kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                               rngs=rngs)  # fmt: skip

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class NnxLogicalNet(nnx.Module):
    def __init__(self, d, *, rngs, wrap=True):
        def make(s):
            if not wrap:
                return NnxLogicalBlock
            return mm.task(NnxLogicalBlock, mesh_slice={"stage": s}, logical_axes=LOGICAL_RULES)

        self.blocks = nnx.List([make(s)(d, rngs=rngs) for s in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.gelu(nn.Dense(D)(x)), None


class ScanNet(nn.Module):
    """A stem on stage 0, then four layers under ``nn.scan`` on stage 1 (``per_layer``: the
    scanned layer itself a task, which a scan cannot hold)."""

    wrap: bool = True
    per_layer: bool = False

    @nn.compact
    def __call__(self, x, y):
        stem = mm.task(nn.Dense, mesh_slice={"stage": 0}) if self.wrap else nn.Dense
        x = stem(D, name="stem")(x)
        layer = mm.task(ScanLayer, mesh_slice={"stage": 1}) if self.per_layer else ScanLayer
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        if self.wrap and not self.per_layer:
            stack = mm.task(stack, mesh_slice={"stage": 1})
        x, _ = stack(name="layers")(x, None)
        return jnp.mean((x - y) ** 2)


def linen_reference(model, data, steps=2, lr=0.1):
    """Plain ``jax.jit`` SGD on one device, from ``parallelize_step``'s initial parameters."""
    x, y = data
    params = nn.unbox(model.init(jax.random.split(jax.random.key(0))[0], x, y))["params"]
    grad = jax.jit(jax.value_and_grad(lambda p: model.apply({"params": p}, x, y)))
    losses = []
    with mm.ignore_transforms():
        for _ in range(steps):
            loss, grads = grad(params)
            params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
            losses.append(float(loss))
    return losses, params


def train_linen(model, data, steps=2, **kwargs):
    step, state, _ = mm.parallelize_step(model, sgd(), global_batch=data, **kwargs)
    losses = []
    for _ in range(steps):
        loss, state = step(state, data)
        losses.append(float(loss))
    return losses, state
