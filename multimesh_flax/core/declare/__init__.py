"""Stage 1, declarations: what the user says before anything is traced.

Meshes and devices (``_devices``, ``_multimesh``), tasks (``_task``), name-based registration
and contexts (``_registry``), logical rules (``_rules``), pipeline schedules (``_schedules``)
and options (``_pipeline_options``), recomputation policies (``_recompute``), flags and
``context`` (``_config``), placement warnings (``_warnings``) and the one thread-local
(``_thread``). Nothing here imports a
later stage; later stages import these names from this package, never its modules.
"""

from multimesh_flax.core.declare._config import autoshard as autoshard
from multimesh_flax.core.declare._config import context as context
from multimesh_flax.core.declare._config import enable_fast_path as enable_fast_path
from multimesh_flax.core.declare._config import enable_recomputation as enable_recomputation
from multimesh_flax.core.declare._config import get_flag as get_flag
from multimesh_flax.core.declare._config import ignore_transforms as ignore_transforms
from multimesh_flax.core.declare._costs import CostFn as CostFn
from multimesh_flax.core.declare._costs import make_cost_fn as make_cost_fn
from multimesh_flax.core.declare._devices import DeviceListScope as DeviceListScope
from multimesh_flax.core.declare._devices import Place as Place
from multimesh_flax.core.declare._devices import TaskMesh as TaskMesh
from multimesh_flax.core.declare._devices import as_device_array as as_device_array
from multimesh_flax.core.declare._devices import check_unique as check_unique
from multimesh_flax.core.declare._devices import get_device_list as get_device_list
from multimesh_flax.core.declare._devices import make_auto_mesh as make_auto_mesh
from multimesh_flax.core.declare._devices import no_ambient_mesh as no_ambient_mesh
from multimesh_flax.core.declare._devices import place_of as place_of
from multimesh_flax.core.declare._devices import use_device_list as use_device_list
from multimesh_flax.core.declare._multimesh import MultiMesh as MultiMesh
from multimesh_flax.core.declare._multimesh import get_multi_mesh as get_multi_mesh
from multimesh_flax.core.declare._multimesh import slice_global_mesh as slice_global_mesh
from multimesh_flax.core.declare._pipeline_options import PipelineOptions as PipelineOptions
from multimesh_flax.core.declare._pipeline_options import pipeline_options as pipeline_options
from multimesh_flax.core.declare._recompute import Recompute as Recompute
from multimesh_flax.core.declare._recompute import RecomputeTransform as RecomputeTransform
from multimesh_flax.core.declare._recompute import call_recomputed as call_recomputed
from multimesh_flax.core.declare._recompute import effective as effective
from multimesh_flax.core.declare._recompute import jax_transform as jax_transform
from multimesh_flax.core.declare._recompute import linen_transform as linen_transform
from multimesh_flax.core.declare._recompute import make_recompute as make_recompute
from multimesh_flax.core.declare._recompute import nnx_transform as nnx_transform
from multimesh_flax.core.declare._recompute import step_policy as step_policy
from multimesh_flax.core.declare._registry import Context as Context
from multimesh_flax.core.declare._registry import Match as Match
from multimesh_flax.core.declare._registry import Registration as Registration
from multimesh_flax.core.declare._registry import active_contexts as active_contexts
from multimesh_flax.core.declare._registry import find_match as find_match
from multimesh_flax.core.declare._registry import has_registrations as has_registrations
from multimesh_flax.core.declare._registry import inactive_contexts as inactive_contexts
from multimesh_flax.core.declare._registry import register_task as register_task
from multimesh_flax.core.declare._registry import (
    registrations_fingerprint as registrations_fingerprint,
)
from multimesh_flax.core.declare._rules import Rule as Rule
from multimesh_flax.core.declare._rules import check_specs as check_specs
from multimesh_flax.core.declare._rules import entry_names as entry_names
from multimesh_flax.core.declare._rules import is_spec as is_spec
from multimesh_flax.core.declare._rules import logical_to_mesh_spec as logical_to_mesh_spec
from multimesh_flax.core.declare._schedule_ops import Phase as Phase
from multimesh_flax.core.declare._schedule_ops import ScheduleOp as ScheduleOp
from multimesh_flax.core.declare._schedule_ops import op_deps as op_deps
from multimesh_flax.core.declare._schedules import SCHEDULE_NAMES as SCHEDULE_NAMES
from multimesh_flax.core.declare._schedules import Schedule as Schedule
from multimesh_flax.core.declare._schedules import make_schedule as make_schedule
from multimesh_flax.core.declare._schedules import stage_rows as stage_rows
from multimesh_flax.core.declare._schedules import validate_schedule as validate_schedule
from multimesh_flax.core.declare._schedules import validated_order as validated_order
from multimesh_flax.core.declare._sentinel import Sentinel as Sentinel
from multimesh_flax.core.declare._task import Task as Task
from multimesh_flax.core.declare._task import check_rules_have_mesh as check_rules_have_mesh
from multimesh_flax.core.declare._task import make_task as make_task
from multimesh_flax.core.declare._thread import STATE as STATE
from multimesh_flax.core.declare._warnings import closest_names as closest_names
from multimesh_flax.core.declare._warnings import forget_warnings as forget_warnings
from multimesh_flax.core.declare._warnings import warn_placement as warn_placement
