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
    does not divide the model's layers, a ``--layers-per-stage`` that does not add up to
    them, leaves a middle stage empty or disagrees with ``--stages``, ``--stages`` x
    ``--data`` x ``--tensor`` different from the device count, a batch that
    ``--microbatches`` x ``--data`` does not divide, a ``--tensor`` size that does not
    divide the heads or widths, a ``--devices`` count after JAX already started with
    another, a ``--resume`` that changes the model or data of the saved run, a fresh
    ``--out`` that already holds a run, an ``--eval-fraction`` outside (0, 1) or without a
    ``--dataset`` to hold out from, a ``--grad-accum`` below 1, a negative ``--clip-norm``,
    a ``--min-lr-ratio`` outside [0, 1], a ``--lr-schedule cosine`` whose ``--warmup``
    leaves no step to decay over, or ``--check-reference`` with a bfloat16 ``--precision``.
    The message names the option, the value received and the values that would work.
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


class DataFileError(MultiMeshError, ValueError):
    """A ``--dataset`` file of ``mmflax train`` cannot be read as documents of text.

    The path does not exist, names a file of another type, or a folder with no ``.txt``,
    ``.jsonl`` or ``.parquet`` file; or a file cannot be opened, is empty, holds bytes that
    are not UTF-8 text (a binary file), or (JSONL, Parquet) lacks the ``--text-field``. The
    message names the file (and the line), what was expected and what was found. Fix or
    remove the file, or pass the right ``--text-field``. Raised before anything is compiled,
    and nothing is left behind in the run folder.
    """


class DataSizeError(MultiMeshError, ValueError):
    """The ``--dataset`` of ``mmflax train`` holds too few tokens for the run's settings.

    Training needs at least one batch of ``--batch-size`` windows of ``--seq-len`` + 1
    tokens after the ``--eval-fraction`` is held out, and the held-out part at least one
    window. The message gives the token and window counts found and the counts needed; add
    text, or lower ``--batch-size``, ``--seq-len`` or ``--eval-fraction``.
    """
