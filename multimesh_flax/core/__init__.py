"""Pure-JAX machinery: meshes, tasks, logical sharding, contexts, ``jit``/``parallelize``,
pipeline schedules and their simulator."""

from multimesh_flax.core.declare._config import autoshard as autoshard
from multimesh_flax.core.declare._config import context as context
from multimesh_flax.core.declare._config import enable_fast_path as enable_fast_path
from multimesh_flax.core.declare._config import enable_recomputation as enable_recomputation
from multimesh_flax.core.declare._config import get_flag as get_flag
from multimesh_flax.core.declare._config import ignore_transforms as ignore_transforms
from multimesh_flax.core.declare._devices import TaskMesh as TaskMesh
from multimesh_flax.core.declare._devices import get_device_list as get_device_list
from multimesh_flax.core.declare._multimesh import MultiMesh as MultiMesh
from multimesh_flax.core.declare._multimesh import get_multi_mesh as get_multi_mesh
from multimesh_flax.core.declare._multimesh import slice_global_mesh as slice_global_mesh
from multimesh_flax.core.declare._registry import Context as Context
from multimesh_flax.core.declare._registry import register_task as register_task
from multimesh_flax.core.declare._rules import logical_to_mesh_spec as logical_to_mesh_spec
from multimesh_flax.core.declare._schedules import Schedule as Schedule
from multimesh_flax.core.declare._schedules import ScheduleOp as ScheduleOp
from multimesh_flax.core.declare._schedules import make_schedule as make_schedule
from multimesh_flax.core.declare._schedules import validate_schedule as validate_schedule
from multimesh_flax.core.declare._task import Task as Task
from multimesh_flax.core.front._jit import MpmdJit as MpmdJit
from multimesh_flax.core.front._jit import jit as jit
from multimesh_flax.core.front._parallelize import parallelize as parallelize
from multimesh_flax.core.front._task_function import task as task
from multimesh_flax.core.plan._simulator import SimulationResult as SimulationResult
from multimesh_flax.core.plan._simulator import simulate as simulate
from multimesh_flax.core.run._dispatch import Timeline as Timeline
from multimesh_flax.core.run._dispatch import TimelineEvent as TimelineEvent
from multimesh_flax.core.run._dispatch import record_timeline as record_timeline
from multimesh_flax.core.run._timeline_plot import measured_costs as measured_costs
from multimesh_flax.core.run._timeline_plot import plot_timeline as plot_timeline
from multimesh_flax.core.run._timeline_plot import recorded_bubble as recorded_bubble
from multimesh_flax.core.trace._constraints import (
    with_sharding_constraint as with_sharding_constraint,
)
from multimesh_flax.core.trace._microbatch import microbatch as microbatch
