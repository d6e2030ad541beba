"""Stage 5, compile and dispatch: one cached program per distinct fragment (``_compile``,
keyed by ``trace._structure``), compiled once and relocated to other submeshes
(``_relocate``), a flat op list (``_ops``: immutable records, and the state a call learns)
dispatched in schedule order (``_dispatch``), compiled ahead of the first call where asked
(``_ahead``), and recorded timelines (``_timeline_plot``).

The op list (``_ops``) is what ``multimesh_flax.distributed`` reads to dispatch the same
program in each process of a multi-process job; it hands back a ``ProcessHandOff``, which the
build passes to ``compile_program``. Nothing here imports ``multimesh_flax.distributed``.
"""

from multimesh_flax.core.run._ahead import CompileAhead as CompileAhead
from multimesh_flax.core.run._ahead import compile_ahead as compile_ahead
from multimesh_flax.core.run._compile import FragmentProgram as FragmentProgram
from multimesh_flax.core.run._compile import compile_fragment as compile_fragment
from multimesh_flax.core.run._dispatch import MpmdExecutable as MpmdExecutable
from multimesh_flax.core.run._dispatch import Timeline as Timeline
from multimesh_flax.core.run._dispatch import TimelineEvent as TimelineEvent
from multimesh_flax.core.run._dispatch import compile_program as compile_program
from multimesh_flax.core.run._dispatch import record_timeline as record_timeline
from multimesh_flax.core.run._explicit import jaxpr_as_auto_fun as jaxpr_as_auto_fun
from multimesh_flax.core.run._ops import DispatchState as DispatchState
from multimesh_flax.core.run._ops import Move as Move
from multimesh_flax.core.run._ops import Op as Op
from multimesh_flax.core.run._ops import OpKind as OpKind
from multimesh_flax.core.run._ops import OpProgram as OpProgram
from multimesh_flax.core.run._ops import OpUnit as OpUnit
from multimesh_flax.core.run._ops import ProcessHandOff as ProcessHandOff
from multimesh_flax.core.run._ops import PutOp as PutOp
from multimesh_flax.core.run._ops import RunOp as RunOp
from multimesh_flax.core.run._timeline_plot import measured_costs as measured_costs
from multimesh_flax.core.run._timeline_plot import plot_timeline as plot_timeline
from multimesh_flax.core.run._timeline_plot import recorded_bubble as recorded_bubble
from multimesh_flax.core.run._timeline_plot import replay_timeline as replay_timeline
