"""multimesh_flax: Flax-first MPMD model parallelism on stock JAX.

Write an ordinary model, say where each part runs (``task``), annotate arrays with logical
axis names (``with_sharding_constraint``), and compile with ``jit``/``parallelize``: each
task runs on its own submesh, with SPMD sharding inside it.
"""

from multimesh_flax import checkpoint as checkpoint
from multimesh_flax import core as core
from multimesh_flax import errors as errors
from multimesh_flax import layers as layers
from multimesh_flax import planner as planner
from multimesh_flax._compilation_cache import enable_compilation_cache
from multimesh_flax._front import jit, microbatch, task
from multimesh_flax.core import (
    Context,
    MultiMesh,
    PipelineOptions,
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
    logical_to_mesh_spec,
    make_schedule,
    measured_costs,
    parallelize,
    plot_timeline,
    record_timeline,
    recorded_bubble,
    register_task,
    simulate,
    slice_global_mesh,
    validate_schedule,
    with_sharding_constraint,
)
from multimesh_flax.layers import parallelize_step, shard_axes, tabulate
from multimesh_flax.planner import (
    DeviceSpec,
    Plan,
    Plans,
    Prediction,
    UnitProfile,
    measure_transfer,
    plan,
    predict,
    profile_units,
)

__all__ = [
    "Context",
    "DeviceSpec",
    "MultiMesh",
    "PipelineOptions",
    "Plan",
    "Plans",
    "Prediction",
    "Schedule",
    "ScheduleOp",
    "SimulationResult",
    "Task",
    "TaskMesh",
    "Timeline",
    "TimelineEvent",
    "UnitProfile",
    "autoshard",
    "checkpoint",
    "context",
    "core",
    "enable_compilation_cache",
    "enable_fast_path",
    "enable_recomputation",
    "errors",
    "ignore_transforms",
    "jit",
    "layers",
    "logical_to_mesh_spec",
    "make_schedule",
    "measure_transfer",
    "measured_costs",
    "microbatch",
    "parallelize",
    "parallelize_step",
    "plan",
    "planner",
    "plot_timeline",
    "predict",
    "profile_units",
    "record_timeline",
    "recorded_bubble",
    "register_task",
    "shard_axes",
    "simulate",
    "slice_global_mesh",
    "tabulate",
    "task",
    "validate_schedule",
    "with_sharding_constraint",
]
