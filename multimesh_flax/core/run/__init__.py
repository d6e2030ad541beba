"""Stage 5, compile and dispatch: one cached program per distinct fragment (``_compile``,
keyed by ``trace._structure``), compiled once and relocated to other submeshes
(``_relocate``), a flat op list (``_ops``: immutable records, and the state a call learns)
dispatched in schedule order (``_dispatch``), and recorded timelines (``_timeline_plot``).

The op list is re-exported here: it is what ``multimesh_flax.distributed`` reads to dispatch
the same program in each process of a multi-process job.
"""

from multimesh_flax.core.run._ops import DispatchState as DispatchState
from multimesh_flax.core.run._ops import Op as Op
from multimesh_flax.core.run._ops import OpKind as OpKind
from multimesh_flax.core.run._ops import OpProgram as OpProgram
from multimesh_flax.core.run._ops import OpUnit as OpUnit
from multimesh_flax.core.run._ops import PutOp as PutOp
from multimesh_flax.core.run._ops import RunOp as RunOp
