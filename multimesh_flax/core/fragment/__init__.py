"""Stage 4, place and fragment: every equation gets a submesh (``_place``), then runs of
same-submesh equations become fragments, put in dispatch order and fused where that is
free (``_partition``, with ``_sink`` moving glue to its readers and ``_fuse`` fusing);
``_inputs`` says in which sharding each program input arrives.

Its passes, in order: ``place_program``, ``cut_fragments``, ``arrange_fragments``,
``fuse_fragments``; ``make_partition`` records the result. Later stages import the names
below from this package, never its modules.
"""

from multimesh_flax.core.fragment._inputs import canonical_sharding as canonical_sharding
from multimesh_flax.core.fragment._inputs import canonical_spec as canonical_spec
from multimesh_flax.core.fragment._inputs import first_constraint as first_constraint
from multimesh_flax.core.fragment._inputs import input_sharding as input_sharding
from multimesh_flax.core.fragment._jaxpr import constraints_making as constraints_making
from multimesh_flax.core.fragment._jaxpr import fragment_jaxpr as fragment_jaxpr
from multimesh_flax.core.fragment._partition import Fragment as Fragment
from multimesh_flax.core.fragment._partition import Partition as Partition
from multimesh_flax.core.fragment._partition import arrange_fragments as arrange_fragments
from multimesh_flax.core.fragment._partition import cut_fragments as cut_fragments
from multimesh_flax.core.fragment._partition import fuse_fragments as fuse_fragments
from multimesh_flax.core.fragment._partition import make_partition as make_partition
from multimesh_flax.core.fragment._place import PlacedProgram as PlacedProgram
from multimesh_flax.core.fragment._place import aval_nbytes as aval_nbytes
from multimesh_flax.core.fragment._place import nbytes as nbytes
from multimesh_flax.core.fragment._place import place_program as place_program
