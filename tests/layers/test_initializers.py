"""``shard_axes``: logical partitioning metadata on Flax parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from multimesh_flax import errors
from multimesh_flax.layers import shard_axes


def test_default_base_initializer_is_xavier_normal():
    key = jax.random.key(3)
    boxed = shard_axes("embed", "mlp")(key, (8, 32), jnp.float32)
    expected = nn.initializers.xavier_normal()(key, (8, 32), jnp.float32)
    np.testing.assert_array_equal(boxed.value, expected)
    assert boxed.names == ("embed", "mlp")


def test_custom_base_initializer_and_partition_spec():
    dense = nn.Dense(4, kernel_init=shard_axes(None, "mlp", init=nn.initializers.ones))
    variables = dense.init(jax.random.key(0), jnp.ones((2, 3)))
    np.testing.assert_array_equal(variables["params"]["kernel"].value, np.ones((3, 4)))
    specs = nn.get_partition_spec(variables)
    assert specs["params"]["kernel"] == jax.sharding.PartitionSpec(None, "mlp")


def test_seed_tabulate_shows_the_logical_spec():
    dense = nn.Dense(16, kernel_init=shard_axes("x", None))
    table = dense.tabulate(
        jax.random.key(0), jnp.ones((16, 9)), console_kwargs={"force_terminal": False, "width": 120}
    )
    assert "kernel: float32[9,16] P(x, None)" in table
    assert "160 (640 B)" in table


def test_non_string_name_is_rejected():
    with pytest.raises(errors.LogicalRulesError, match="3"):
        shard_axes("embed", 3)
