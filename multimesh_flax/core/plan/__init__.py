"""Stage 3, plan: pipeline units, accumulation order and the simulated schedule.

``_plan.plan_program`` is the stage's pass: ``_pipeline`` groups task equations into units
(stage, microbatch, phase) and builds each region's schedule; ``_accumulate`` re-associates
sums over microbatches into that order; ``_simulator`` simulates a schedule (also a public
tool). Later stages import the names below from this package, never its modules.
"""

from multimesh_flax.core.plan._accumulate import behind_barrier as behind_barrier
from multimesh_flax.core.plan._accumulate import bundle_sums as bundle_sums
from multimesh_flax.core.plan._accumulate import is_bundle as is_bundle
from multimesh_flax.core.plan._accumulate import reassociate_sums as reassociate_sums
from multimesh_flax.core.plan._pipeline import SPLIT_NAMES as SPLIT_NAMES
from multimesh_flax.core.plan._pipeline import PipelinePlan as PipelinePlan
from multimesh_flax.core.plan._pipeline import Unit as Unit
from multimesh_flax.core.plan._pipeline import analyze as analyze
from multimesh_flax.core.plan._pipeline import dispatch_order as dispatch_order
from multimesh_flax.core.plan._pipeline import equation_order as equation_order
from multimesh_flax.core.plan._pipeline import microbatch_of as microbatch_of
from multimesh_flax.core.plan._pipeline import stage_name as stage_name
from multimesh_flax.core.plan._plan import plan_program as plan_program
from multimesh_flax.core.plan._simulator import SimulationResult as SimulationResult
from multimesh_flax.core.plan._simulator import fused_backwards as fused_backwards
from multimesh_flax.core.plan._simulator import simulate as simulate
