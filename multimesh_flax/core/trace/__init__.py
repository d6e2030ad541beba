"""Stage 2, trace and colour: capture the program once and label every equation by task.

Two passes (``_trace``): ``capture_program`` runs ``jax.make_jaxpr`` inside a trace session
(``_session``: what one trace learns) and inlines nested calls; ``colour_program`` colours
each equation with its task and phase (``_colour``, also for name-registered tasks) and keeps
each microbatch's copy of a body traced once as a few call equations (``_blocks``). The
result, a ``TracedProgram``, holds one ``Equation`` record per equation (``_program``).
While tracing, ``_constraints`` resolves logical sharding constraints and ``_microbatch``
hands JAX each microbatch loop as one ``scan``, which the inliner unrolls per microbatch
(``_loops``). ``_structure`` compares jaxprs and equations
by structure (the fragment cache's keys, identical microbatch copies).

Later stages and the Flax layer import the names below from this package, never its modules.
"""

from multimesh_flax.core.trace._blocks import as_block as as_block
from multimesh_flax.core.trace._blocks import block_body as block_body
from multimesh_flax.core.trace._blocks import is_block as is_block
from multimesh_flax.core.trace._blocks import is_sum as is_sum
from multimesh_flax.core.trace._blocks import reaches_other_owner as reaches_other_owner
from multimesh_flax.core.trace._blocks import reading_renamed as reading_renamed
from multimesh_flax.core.trace._blocks import with_producers as with_producers
from multimesh_flax.core.trace._colour import abstract_mesh as abstract_mesh
from multimesh_flax.core.trace._colour import flax_rules as flax_rules
from multimesh_flax.core.trace._colour import module_names as module_names
from multimesh_flax.core.trace._colour import registry_state as registry_state
from multimesh_flax.core.trace._colour import task_for as task_for
from multimesh_flax.core.trace._constraints import concrete_constraint as concrete_constraint
from multimesh_flax.core.trace._constraints import constrain_to_task as constrain_to_task
from multimesh_flax.core.trace._constraints import leave_explicit_axes as leave_explicit_axes
from multimesh_flax.core.trace._constraints import (
    with_sharding_constraint as with_sharding_constraint,
)
from multimesh_flax.core.trace._jaxprs import make_jaxpr_object as make_jaxpr_object
from multimesh_flax.core.trace._microbatch import microbatch as microbatch
from multimesh_flax.core.trace._program import Equation as Equation
from multimesh_flax.core.trace._program import TracedProgram as TracedProgram
from multimesh_flax.core.trace._program import each_distinct as each_distinct
from multimesh_flax.core.trace._session import MICROBATCH_RE as MICROBATCH_RE
from multimesh_flax.core.trace._session import Label as Label
from multimesh_flax.core.trace._session import MicrobatchCall as MicrobatchCall
from multimesh_flax.core.trace._session import ResolvedTask as ResolvedTask
from multimesh_flax.core.trace._session import TraceSession as TraceSession
from multimesh_flax.core.trace._session import contains_tracer as contains_tracer
from multimesh_flax.core.trace._session import current_session as current_session
from multimesh_flax.core.trace._session import current_task as current_task
from multimesh_flax.core.trace._session import enter_task as enter_task
from multimesh_flax.core.trace._session import is_shape_only as is_shape_only
from multimesh_flax.core.trace._session import resolve_task as resolve_task
from multimesh_flax.core.trace._session import shape_only_trace as shape_only_trace
from multimesh_flax.core.trace._session import trace_session as trace_session
from multimesh_flax.core.trace._session import warn_foreign_trace as warn_foreign_trace
from multimesh_flax.core.trace._structure import BoundedCache as BoundedCache
from multimesh_flax.core.trace._structure import equation_key as equation_key
from multimesh_flax.core.trace._structure import equation_readers as equation_readers
from multimesh_flax.core.trace._structure import structural_key as structural_key
from multimesh_flax.core.trace._trace import CapturedProgram as CapturedProgram
from multimesh_flax.core.trace._trace import capture_program as capture_program
from multimesh_flax.core.trace._trace import colour_program as colour_program
from multimesh_flax.core.trace._trace import trace_program as trace_program
