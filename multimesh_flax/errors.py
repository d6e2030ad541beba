"""User-facing error classes of multimesh_flax.

Every mistake a user can make with the public API raises one of these classes. Each one
subclasses ``ValueError`` or ``TypeError`` (so generic handlers keep working) and its message
says what was expected, what was received, and what to do instead.

The classes are named ``<Problem>Error`` and grouped by the part of the toolkit that raises
them. Tests assert the class, so a class, once published, keeps its meaning.
"""

from __future__ import annotations


class MultiMeshError(Exception):
    """Base class of every error raised for a user mistake."""


# --- meshes ---------------------------------------------------------------------------------


class MeshShapeError(MultiMeshError, ValueError):
    """Mesh axis names, sizes and devices disagree.

    Raised when the number of devices is not the product of the axis sizes, or when the
    number of axis names differs from the number of axis sizes. Fix the sizes so their
    product equals the device count, or pass exactly as many names as sizes.
    """


class DuplicateDeviceError(MultiMeshError, ValueError):
    """A device (or device position) appears more than once in one mesh.

    A mesh is a grid of *distinct* devices. List each device once.
    """


class UnknownMeshAxisError(MultiMeshError, ValueError):
    """An axis name that the mesh does not have was used (in ``slice`` or ``mesh_slice``).

    Use one of the mesh's ``axis_names``.
    """


class MeshIndexError(MultiMeshError, ValueError):
    """An index or device position lies outside what the mesh or device list holds.

    Raised for ``MultiMesh.slice(stage=5)`` on a 2-stage mesh, or a ``TaskMesh`` position
    beyond the executable's device list. Use an index in ``[0, size)``.
    """


class NoMultiMeshError(MultiMeshError, ValueError):
    """Something needs the current ``MultiMesh`` but none is active.

    ``Task(mesh_slice=...)`` and ``slice_global_mesh`` resolve against the innermost
    ``with multi_mesh:`` block. Open one, or give the task an explicit ``mesh``.
    """


# --- tasks ----------------------------------------------------------------------------------


class InvalidTaskError(MultiMeshError, ValueError):
    """A ``Task`` was given contradictory or incomplete arguments.

    For example both ``mesh`` and ``mesh_slice``, or ``logical_axes`` with no mesh to map
    them onto.
    """


class TaskTypeError(MultiMeshError, TypeError):
    """An argument that must be a ``Task``, ``TaskMesh`` or mesh has another type."""


class TaskInControlFlowError(MultiMeshError, ValueError):
    """A task boundary sits inside ``lax.scan``, ``lax.cond``, ``lax.while_loop`` and the like.

    A loop or conditional runs as one unit on one submesh, so a task cannot start inside
    it. Move the task call outside the loop (unroll it in Python), or make the whole loop
    one task.
    """


# --- logical sharding -----------------------------------------------------------------------


class LogicalRulesError(MultiMeshError, ValueError):
    """Logical axis rules are malformed or name a mesh axis that does not exist.

    Rules are a sequence of ``(logical_name, mesh_axis)`` pairs, where ``mesh_axis`` is
    one of the task mesh's ``axis_names`` (or ``None`` to replicate).
    """


class PartitionSpecError(MultiMeshError, ValueError):
    """A ``PartitionSpec`` does not fit the array it is applied to.

    The spec has more entries than the array has dimensions. Give at most ``ndim`` entries.
    """


class UnevenShardingError(MultiMeshError, ValueError):
    """A dimension does not divide evenly over the mesh axes a rule maps it to.

    Pad the dimension to a multiple of the shard count (for example a byte vocabulary of
    259 to 264), or map its logical name to a smaller mesh axis.
    """


# --- transformations ------------------------------------------------------------------------


class ParallelizeArgumentError(MultiMeshError, ValueError):
    """``parallelize`` or ``jit`` was given arguments it cannot use.

    For example both ``get_input_batch`` and ``initial_batch``, or ``devices`` of the
    wrong kind.
    """


class StaticArgumentError(MultiMeshError, TypeError):
    """A static argument is not hashable, or an index in ``static_argnums`` is invalid."""


# --- pipeline schedules ---------------------------------------------------------------------


class InvalidScheduleError(MultiMeshError, ValueError):
    """A pipeline schedule cannot run as given, or cannot be built from the given arguments.

    Raised for an unknown schedule name, a stage count that the submeshes do not divide, an
    op that appears twice, is missing, or sits on a row (submesh) its stage does not belong
    to, an order that deadlocks (a row waits for an op that another row only runs after
    something that waits in turn), and simulation costs that are negative or name an unknown
    phase. The message names the offending op as ``<phase><stage>.<microbatch>`` (``B1.3``)
    and says how to fix it; most often, reorder the row so every op comes after the ops it
    depends on.
    """
