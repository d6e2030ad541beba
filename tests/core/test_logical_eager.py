"""``with_sharding_constraint`` called eagerly with no task, mesh or transform: the identity
(as ``flax.linen.with_logical_constraint`` is without a mesh), for functions, Linen and NNX."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm


def test_eager_function_returns_its_input_unchanged():
    x = jnp.arange(6.0).reshape(3, 2)  # 3 rows: no mesh could shard them evenly anyway
    out = mm.with_sharding_constraint(x, P("batch", "embed"))
    assert out is x


def test_eager_linen_model_gives_the_unconstrained_values():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = mm.with_sharding_constraint(x, P("batch", None))
            return nn.Dense(3)(x)

    x = jnp.ones((5, 4))
    params = Net().init(jax.random.key(0), x)
    out = Net().apply(params, x)
    with mm.ignore_transforms():
        ref = Net().apply(params, x)
    np.testing.assert_array_equal(out, ref)


def test_eager_nnx_model_gives_the_unconstrained_values():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return self.dense(mm.with_sharding_constraint(x, P("batch", None)))

    model = Net(nnx.Rngs(0))
    x = jnp.ones((5, 4))
    with mm.ignore_transforms():
        ref = model(x)
    np.testing.assert_array_equal(model(x), ref)


def test_with_a_mesh_set_it_is_jax_constraint():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda a: mm.with_sharding_constraint(a, P("x")))(jnp.ones(8))
    assert out.sharding.spec == P("x")
    named = NamedSharding(mesh, P("x"))
    out = jax.jit(lambda a: mm.with_sharding_constraint(a, named))(jnp.ones(8))
    assert out.sharding.is_equivalent_to(named, 1)
