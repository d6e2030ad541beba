"""multimesh_flax: Flax-first MPMD model parallelism on stock JAX.

Write an ordinary model, say where each part runs (``task``), annotate arrays with logical
axis names (``with_sharding_constraint``), and compile with ``jit``/``parallelize``: each
task runs on its own submesh, with SPMD sharding inside it.
"""

from multimesh_flax import core as core
from multimesh_flax import errors as errors
from multimesh_flax import layers as layers
from multimesh_flax.core import (
    MultiMesh,
    Schedule,
    ScheduleOp,
    SimulationResult,
    Task,
    TaskMesh,
    Timeline,
    TimelineEvent,
    autoshard,
    context,
    enable_fast_path,
    enable_recomputation,
    ignore_transforms,
    jit,
    logical_to_mesh_spec,
    make_schedule,
    parallelize,
    record_timeline,
    simulate,
    slice_global_mesh,
    task,
    validate_schedule,
    with_sharding_constraint,
)
from multimesh_flax.layers import shard_axes

__all__ = [
    "MultiMesh",
    "Schedule",
    "ScheduleOp",
    "SimulationResult",
    "Task",
    "TaskMesh",
    "Timeline",
    "TimelineEvent",
    "autoshard",
    "context",
    "core",
    "enable_fast_path",
    "enable_recomputation",
    "errors",
    "ignore_transforms",
    "jit",
    "layers",
    "logical_to_mesh_spec",
    "make_schedule",
    "parallelize",
    "record_timeline",
    "shard_axes",
    "simulate",
    "slice_global_mesh",
    "task",
    "validate_schedule",
    "with_sharding_constraint",
]
