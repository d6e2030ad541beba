"""Errors that only the ``mmflax`` command line raises.

They subclass `multimesh_flax.errors.MultiMeshError` like the library's errors, so a handler
for that base class catches them too; ``mmflax`` prints them as ``mmflax: <message>`` and
exits with status 2. The library's own errors (a missing checkpoint, a bad pretrained folder)
reach the command line unchanged from `multimesh_flax.errors`.
"""

from __future__ import annotations

from multimesh_flax.errors import MultiMeshError


class RunOptionError(MultiMeshError, ValueError):
    """An ``mmflax`` option contradicts the model, the devices or the run folder.

    Raised before anything is compiled: an unknown model preset, a ``--stages`` count that
    does not divide the model's layers, ``--stages`` x ``--data`` x ``--tensor`` different
    from the device count, a batch that ``--microbatches`` x ``--data`` does not divide, a
    ``--tensor`` size that does not divide the heads or widths, a ``--devices`` count after
    JAX already started with another, a ``--resume`` that changes the model or data of the
    saved run, or a fresh ``--out`` that already holds a run. The message names the option,
    the value received and the values that would work.
    """


class RunFolderBusyError(MultiMeshError, ValueError):
    """Another ``mmflax train`` process is writing the same run folder (``--out``).

    Two runs in one folder overwrite each other's checkpoints and metadata, so the second
    stops before it traces anything. The message names the process holding the folder's
    lock. Wait for it, stop it, or pass another ``--out``; the lock disappears with its
    process, however that process ends.
    """


class NonFiniteTrainingError(MultiMeshError, ValueError):
    """``mmflax train`` met a non-finite loss or gradient norm and stopped.

    The step named in the message produced the first NaN or infinity; its update was not
    applied and no non-finite state was saved, so the run's checkpoint holds the last finite
    state saved before it. Lower ``--lr`` (or raise ``--warmup``) in a new run, check the
    data, or pass ``--on-nonfinite skip`` to skip such steps and go on.
    """
