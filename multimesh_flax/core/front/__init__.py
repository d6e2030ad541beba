"""Stage 6, front doors: ``jit`` (``_jit``: build and call, cached per signature; the build
is the driver ``_build``, which lists every pass in the order it runs), ``parallelize``
(``_parallelize``: shardings for initialisers and steps; ``_initializer``: initialisers that
create each leaf in its sharding) and ``task(fun)`` (``_task_function``, an adapter of
``_task_call``, the one task call of every kind).

The Flax layer imports the names below from this package, never its modules.
"""

from multimesh_flax.core.front._build import PASSES as PASSES
from multimesh_flax.core.front._build import build_program as build_program
from multimesh_flax.core.front._build import collector_paused as collector_paused
from multimesh_flax.core.front._build import partition_program as partition_program
from multimesh_flax.core.front._initializer import sharded_initializer as sharded_initializer
from multimesh_flax.core.front._jit import MpmdJit as MpmdJit
from multimesh_flax.core.front._jit import jit as jit
from multimesh_flax.core.front._parallelize import derive_shardings as derive_shardings
from multimesh_flax.core.front._parallelize import parallelize as parallelize
from multimesh_flax.core.front._parallelize import shape_structs as shape_structs
from multimesh_flax.core.front._task_call import EagerRunner as EagerRunner
from multimesh_flax.core.front._task_call import TaskCall as TaskCall
from multimesh_flax.core.front._task_call import call_on_submesh as call_on_submesh
from multimesh_flax.core.front._task_call import call_task as call_task
from multimesh_flax.core.front._task_call import committed_place as committed_place
from multimesh_flax.core.front._task_call import eager_mesh as eager_mesh
from multimesh_flax.core.front._task_call import move_array as move_array
from multimesh_flax.core.front._task_call import run_as as run_as
from multimesh_flax.core.front._task_function import task as task
