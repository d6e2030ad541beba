"""Pure-JAX machinery: meshes, tasks, logical sharding, contexts, ``jit``/``parallelize``,
pipeline schedules and their simulator.

The public names below come from the stage packages (``declare``, ``trace``, ``plan``,
``run``, ``front``), each of which re-exports what the stages after it use.
"""

from multimesh_flax.core.declare import Context as Context
from multimesh_flax.core.declare import MultiMesh as MultiMesh
from multimesh_flax.core.declare import PipelineOptions as PipelineOptions
from multimesh_flax.core.declare import Schedule as Schedule
from multimesh_flax.core.declare import ScheduleOp as ScheduleOp
from multimesh_flax.core.declare import Task as Task
from multimesh_flax.core.declare import TaskMesh as TaskMesh
from multimesh_flax.core.declare import autoshard as autoshard
from multimesh_flax.core.declare import context as context
from multimesh_flax.core.declare import enable_fast_path as enable_fast_path
from multimesh_flax.core.declare import enable_recomputation as enable_recomputation
from multimesh_flax.core.declare import get_device_list as get_device_list
from multimesh_flax.core.declare import get_flag as get_flag
from multimesh_flax.core.declare import get_multi_mesh as get_multi_mesh
from multimesh_flax.core.declare import ignore_transforms as ignore_transforms
from multimesh_flax.core.declare import logical_to_mesh_spec as logical_to_mesh_spec
from multimesh_flax.core.declare import make_schedule as make_schedule
from multimesh_flax.core.declare import register_task as register_task
from multimesh_flax.core.declare import slice_global_mesh as slice_global_mesh
from multimesh_flax.core.declare import validate_schedule as validate_schedule
from multimesh_flax.core.front import MpmdJit as MpmdJit
from multimesh_flax.core.front import jit as jit
from multimesh_flax.core.front import parallelize as parallelize
from multimesh_flax.core.front import task as task
from multimesh_flax.core.plan import SimulationResult as SimulationResult
from multimesh_flax.core.plan import simulate as simulate
from multimesh_flax.core.run import Timeline as Timeline
from multimesh_flax.core.run import TimelineEvent as TimelineEvent
from multimesh_flax.core.run import measured_costs as measured_costs
from multimesh_flax.core.run import plot_timeline as plot_timeline
from multimesh_flax.core.run import record_timeline as record_timeline
from multimesh_flax.core.run import recorded_bubble as recorded_bubble
from multimesh_flax.core.trace import microbatch as microbatch
from multimesh_flax.core.trace import with_sharding_constraint as with_sharding_constraint
