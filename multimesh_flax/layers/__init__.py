"""The Flax-native layer: logical-partitioning initializers (``shard_axes``) and, built on
the core, the ``Task[Module]`` wrappers, ``parallelize_step`` and placement-aware
``tabulate``."""

from multimesh_flax.core._logical import with_sharding_constraint as with_sharding_constraint
from multimesh_flax.layers._initializers import shard_axes as shard_axes
