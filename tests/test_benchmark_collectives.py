"""``benchmarks._collectives`` counts what XLA compiled: the collectives of real programs."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _collectives


def _mesh():
    return Mesh(np.array(jax.devices()[:4]), ("data",), axis_types=(AxisType.Auto,))


def test_sums_over_a_sharded_axis_are_one_tuple_all_reduce():
    mesh = _mesh()
    x = jax.device_put(jnp.ones((4, 12)), NamedSharding(mesh, P("data")))
    fn = jax.jit(
        lambda x: [x[:, 3 * i : 3 * i + 3].sum(0) for i in range(4)],
        out_shardings=NamedSharding(mesh, P()),
    )
    counts = _collectives.compiled_collectives(fn.lower(x).compile())
    assert counts["all-reduce"] == {"ops": 1, "operands": 4, "bytes": 4 * 3 * 4}
    assert counts["collective-permute"]["ops"] == 0


def test_a_collective_in_a_loop_counts_once_per_iteration():
    mesh = _mesh()

    def body(x):
        def tick(_, y):
            return jax.lax.ppermute(y, "data", [(i, (i + 1) % 4) for i in range(4)]) * 2

        return jax.lax.fori_loop(0, 5, tick, x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("data")))
    counts = _collectives.compiled_collectives(fn.lower(x).compile())
    assert counts["collective-permute"]["ops"] == 5
    assert counts["unknown_trip_counts"] == 0
