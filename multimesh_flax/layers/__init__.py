"""The Flax-native layer: ``Task[Module]`` wrappers (Linen and NNX), logical-partitioning
initializers (``shard_axes``), ``parallelize_step``, placement-aware ``tabulate``, and ``jit``
taking NNX graph objects."""

from multimesh_flax.core.trace import with_sharding_constraint as with_sharding_constraint
from multimesh_flax.layers._initializers import shard_axes as shard_axes
from multimesh_flax.layers._nnx_jit import jit as jit
from multimesh_flax.layers._nonfinite import NonFinite as NonFinite
from multimesh_flax.layers._nonfinite import StepCheck as StepCheck
from multimesh_flax.layers._placement_report import Placement as Placement
from multimesh_flax.layers._precision import Precision as Precision
from multimesh_flax.layers._step import ParallelStep as ParallelStep
from multimesh_flax.layers._step import TrainState as TrainState
from multimesh_flax.layers._step import parallelize_step as parallelize_step
from multimesh_flax.layers._tabulate import get_placement as get_placement
from multimesh_flax.layers._tabulate import tabulate as tabulate
from multimesh_flax.layers._task import task as task
