"""Checkpoints of training states whose leaves live on different submeshes (orbax-checkpoint).

An MPMD training state is an ordinary pytree (for example a
``flax.training.train_state.TrainState``) whose arrays each sit on their own submesh. Orbax
saves every array through its own sharding and stores it as one full logical array, so a
checkpoint does not depend on the layout it was written from: restoring takes a *target*
tree whose leaves (arrays, or ``jax.ShapeDtypeStruct`` with a ``sharding``) say where each
array goes, which may be the saved layout, more or fewer pipeline stages, another
data × tensor split, or a single device.

``Checkpointer`` wraps ``orbax.checkpoint.CheckpointManager``: one step directory per
``save``, holding the state, a JSON metadata dict (model config, layout, ...) and a checksum
per leaf. ``save_checkpoint``, ``restore_checkpoint``, ``restore_metadata``, ``latest_step``
and ``unfinished_saves`` are one-call shortcuts.

When things break. Orbax writes a step into a temporary directory and renames it when
complete, so a save that dies midway leaves earlier checkpoints intact and is never listed;
``unfinished_saves`` lists such leftovers and ``Checkpointer(directory)`` removes them with
one warning (a read-only open changes nothing). A save that cannot be written (read-only
folder, full disk) raises ``CheckpointSaveError`` naming the step, the directory and the OS
reason: from ``save`` itself, or for a background save from ``wait_until_finished``,
``close``, the ``with`` block or the next ``save``; at interpreter exit it is logged once and
the process exits with status 1 (``multimesh_flax._checkpoint_saves``: the exit never waits
on orbax's threads of a failed step). Ctrl-C while the last save finishes at exit abandons
it (status 130, its temporary directory stays and is ignored). A restore whose bytes changed
on disk fails the leaf's checksum, and a truncated or missing file or an unreadable metadata
file raises ``CheckpointCorruptError`` naming the leaf or file and the other saved steps.
Checksums are saved and verified in single-process jobs only
(``multimesh_flax._checkpoint_checksums``).

Multi-process jobs (``jax.distributed``). Every process calls ``save`` and ``restore`` with
the same tree (a collective). Each process writes only the shards on its own devices and
reads only those its own devices need: a leaf of another process's pipeline stage is neither
copied to this host on save nor read on restore (it comes back as an empty global array of
the target's sharding, as the multi-controller runtime returns it). Orbax 0.12.8 refuses
both ends of this for arrays that are not SPMD over all processes; the handler that gets it
there, and why, is in ``multimesh_flax.distributed._orbax``. The files are those a single
process writes: a checkpoint written by 2 processes restores in 1 onto any layout, and the
reverse. In such a job ``restore`` needs a ``target`` (the shardings say which shards each
process reads). In one process, ``restore()`` without a target places arrays as saved where
the saving devices exist here; an array saved on devices this process does not have (the
ids of another job's processes) goes to the default device.

Example:
  >>> import tempfile
  >>> from multimesh_flax import checkpoint
  >>> tmp = tempfile.TemporaryDirectory()
  >>> state = {"w": jnp.arange(4.0), "step": 3}
  >>> checkpoint.save_checkpoint(tmp.name, 3, state, metadata={"lr": 0.1})
  >>> checkpoint.latest_step(tmp.name)
  3
  >>> one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  >>> target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=one_device), "step": 0}
  >>> checkpoint.restore_checkpoint(tmp.name, target)
  {'step': 3, 'w': Array([0., 1., 2., 3.], dtype=float32)}
  >>> checkpoint.restore_metadata(tmp.name)
  {'lr': 0.1}
  >>> tmp.cleanup()
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from multimesh_flax import _checkpoint_checksums as _checksums
from multimesh_flax import _checkpoint_saves as _saves
from multimesh_flax import errors
from multimesh_flax.distributed import _orbax, collective_call

__all__ = [
    "Checkpointer",
    "latest_step",
    "restore_checkpoint",
    "restore_metadata",
    "save_checkpoint",
    "unfinished_saves",
]

logger = logging.getLogger(__name__)

_STATE = "state"
_METADATA = "metadata"
_CHECKSUMS = "checksums"


def _own_buffers(tree: Any) -> Any:
    """Copies restored arrays into buffers that XLA owns.

    On CPU a restored array may alias host memory that the reader allocated; a training step
    that *donates* it (``parallelize_step`` donates the state) must not free memory it does
    not own, so every restored array is copied once into fresh device buffers.
    """
    copied = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)
    return jax.block_until_ready(copied)


class Checkpointer:
    """Saves and restores numbered checkpoints of a pytree state in one directory.

    Args:
      directory: where the step directories live; created unless ``read_only``.
      max_to_keep: keep only this many newest checkpoints (``None`` keeps all).
      async_save: if true, ``save`` returns once the arrays are copied to host and writes
        in the background; ``wait_until_finished`` (or ``close``, or leaving a ``with``
        block) waits for it and raises ``CheckpointSaveError`` if it failed. A save still
        in flight when the interpreter exits is finished then, so
        ``Checkpointer(d).save(step, state)`` as a script's last line is kept; if it fails
        there, one error is logged and the process exits with status 1.
      read_only: open an existing directory for restoring only: nothing is created,
        written or cleaned up, and ``save`` raises. Otherwise the temporary folders of
        interrupted saves (``unfinished_saves``) are removed, with one warning.

    Raises:
      CheckpointArgumentError: ``directory`` is a file, or ``max_to_keep`` is not positive.
      CheckpointNotFoundError: ``read_only`` and ``directory`` does not exist.
      CheckpointSaveError: ``directory`` cannot be created.

    Example:
      >>> import tempfile
      >>> from multimesh_flax.checkpoint import Checkpointer
      >>> tmp = tempfile.TemporaryDirectory()
      >>> with Checkpointer(tmp.name, max_to_keep=2) as ckpt:
      ...     for step in (1, 2, 3):
      ...         ckpt.save(step, {"w": jnp.full(2, float(step))}, metadata={"step": step})
      ...     ckpt.wait_until_finished()
      ...     print(ckpt.all_steps(), ckpt.metadata())
      ...     print(ckpt.restore(target={"w": jnp.zeros(2)}))
      [2, 3] {'step': 3}
      {'w': Array([3., 3.], dtype=float32)}
      >>> tmp.cleanup()
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        async_save: bool = True,
        read_only: bool = False,
    ) -> None:
        collective_call("Checkpointer()")  # every process opens it (a no-op in one process)
        local = "://" not in os.fspath(directory)  # orbax needs absolute local paths
        self.directory = epath.Path(os.path.abspath(directory) if local else directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise errors.CheckpointArgumentError(
                f"Expected `directory` to be a directory, but '{self.directory}' is a file. "
                "Pass a directory path (it is created if missing)."
            )
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise errors.CheckpointArgumentError(
                f"Expected `max_to_keep` to be a positive integer or None (keep all), got "
                f"{max_to_keep!r}. Pass e.g. `max_to_keep=3`, or None."
            )
        if read_only and not self.directory.is_dir():
            raise errors.CheckpointNotFoundError(
                f"Expected a checkpoint directory, but `directory`='{self.directory}' does "
                "not exist. Pass the directory given to `save`."
            )
        self.read_only = read_only
        self._async = async_save
        self._multiprocess = jax.process_count() > 1
        if not read_only:
            self._clean_up_unfinished_saves()
        # Orbax's own read_only mode logs warnings on every open; these options write nothing.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            create=not read_only,
            save_root_metadata=not read_only,
            # One process removes interrupted saves itself, above; several leave it to orbax.
            cleanup_tmp_directories=self._multiprocess and not read_only,
            enable_async_checkpointing=async_save,
        )
        # One process: orbax's standard handler. Several: each writes and reads its own shards.
        state = _orbax.state_handler() if self._multiprocess else ocp.StandardCheckpointHandler()
        handlers = {
            _STATE: state,
            _METADATA: ocp.JsonCheckpointHandler(),
            _CHECKSUMS: ocp.JsonCheckpointHandler(),
        }
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=handlers
            )
        except OSError as e:  # e.g. the directory cannot be created
            raise _saves.save_error(None, str(self.directory), e) from e

    def _clean_up_unfinished_saves(self) -> None:
        """Removes the temporary folders of interrupted saves, with one warning."""
        leftovers = unfinished_saves(self.directory)
        if not leftovers or jax.process_index() != 0:
            return
        logger.warning(
            "Ignoring %d unfinished checkpoint save(s) in '%s' (interrupted before they were "
            "finalized; earlier steps are intact): %s",
            len(leftovers),
            self.directory,
            ", ".join(p.name for p in leftovers),
        )
        if self._multiprocess:
            return  # orbax removes them, in step with the other processes
        for path in leftovers:
            try:
                epath.Path(path).rmtree()
            except OSError as e:  # a read-only folder: they stay, and stay ignored
                logger.debug("Could not remove %s: %s", path, e)

    def save(self, step: int, state: Any, metadata: Mapping[str, Any] | None = None) -> None:
        """Saves ``state`` and JSON ``metadata`` as checkpoint ``step``.

        Every array is written through its own sharding, so leaves may live on different
        submeshes. With ``async_save`` this returns once the arrays are copied to host. In a
        multi-process job every process calls it and writes the shards of its own devices.

        Args:
          step: a non-negative integer greater than every saved step.
          state: any pytree of ``jax.Array``, numpy arrays and Python scalars.
          metadata: a JSON-serializable dict (model config, layout, ...); ``None`` saves ``{}``.

        Raises:
          CheckpointStepError: ``step`` is not an integer greater than the latest saved step.
          CheckpointMetadataError: ``metadata`` is not a JSON-serializable dict.
          CheckpointReadOnlyError: this checkpointer was opened with ``read_only=True``.
          CheckpointArgumentError: ``state`` is ``None``, holds no leaves, or has a leaf that
            is not an array or a Python number; in a multi-process job, also a PRNG key
            array held by one process.
          CheckpointSaveError: the step cannot be written (read-only folder, disk full);
            with ``async_save``, also an earlier background save that failed.
        """
        collective_call("Checkpointer.save")  # a process that skips it is named at once
        if self.read_only:
            raise errors.CheckpointReadOnlyError(
                f"Cannot save step {step}: '{self.directory}' was opened with `read_only=True`. "
                "Open it with `Checkpointer(directory)` to save."
            )
        _saves.wait(self._manager)  # a failed earlier save is reported before a new one
        step = self._check_new_step(step)
        _check_state(state)
        metadata = _check_metadata(metadata)
        items = {_METADATA: ocp.args.JsonSave(metadata)}
        if self._multiprocess:  # see "Multi-process jobs" in the module docstring
            _orbax.check_savable(state)
            items[_STATE] = ocp.args.PyTreeSave(state)
        else:
            items[_STATE] = ocp.args.StandardSave(state)
            items[_CHECKSUMS] = ocp.args.JsonSave(_checksums.checksums(state))
        _saves.track(self._manager, step, str(self.directory))
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(**items))
        except Exception as e:  # the folder is read-only, the disk is full, ...
            raise _saves.failed(self._manager, step, str(self.directory), e) from e
        _saves.started(self._manager, in_background=saved and self._async)
        if not saved:
            raise errors.CheckpointStepError(
                f"orbax declined to save step {step} in '{self.directory}' (its save policy "
                "skipped it). Save under a larger step."
            )
        logger.info("Saving checkpoint step %d to %s", step, self.directory)

    def restore(self, step: int | None = None, target: Any = None) -> Any:
        """Restores the state saved as ``step`` (default: the latest) onto ``target``'s layout.

        Args:
          step: which checkpoint; ``None`` means the latest finalized one.
          target: a pytree with the saved structure whose leaves are ``jax.Array`` (their
            ``sharding`` is used, their values are not), ``jax.ShapeDtypeStruct`` with a
            ``sharding`` (without one, orbax places it on the default device), numpy arrays
            or Python scalars. The result has ``target``'s tree type. ``None`` returns the
            raw tree (dicts and lists) placed as saved, or on the default device where the
            saving devices are missing. In a multi-process job, a leaf placed on no device
            of this process is not read: it comes back as an empty global array.

        Raises:
          CheckpointNotFoundError: no checkpoint, or none for ``step``.
          CheckpointMismatchError: ``target``'s paths, shapes or dtypes differ from the saved.
          CheckpointArgumentError: ``target`` is ``None`` in a multi-process job.
          CheckpointCorruptError: a leaf's bytes changed on disk (its checksum, checked in
            single-process jobs), or a file of the step is truncated or missing.
        """
        collective_call("Checkpointer.restore")
        step = self._resolve_step(step)
        if target is not None:
            target = jax.tree.map(_as_abstract, target)
            saved = self._read(step, None)[_STATE]
            _check_target(saved.tree, target, f"step {step} in '{self.directory}'")
        if self._multiprocess:
            return self._restore_own_shards(step, target)
        # Arrays saved on devices missing here (another job's) go to the default device.
        fallback = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        read = ocp.args.StandardRestore(target, fallback_sharding=fallback)
        restored = _own_buffers(self._read(step, {_STATE: read})[_STATE])
        self._verify(step, restored)
        return restored

    def _restore_own_shards(self, step: int, target: Any) -> Any:
        """Each process reads the shards of its own devices; other leaves come back empty."""
        if target is None:
            raise errors.CheckpointArgumentError(
                f"Expected a `target` to restore step {step} in this {jax.process_count()}-"
                "process job, got None (each process reads only its own devices' shards, "
                "so it needs their shardings). Pass the state `init_params`/"
                "`parallelize_step` returned, or `jax.ShapeDtypeStruct`s with shardings."
            )
        restored = self._read(step, {_STATE: _orbax.restore_args(target)})[_STATE]
        return _orbax.fill_absent(_own_buffers(restored), target)

    def _read(self, step: int, items: dict[str, Any] | None) -> Any:
        """Orbax's restore of ``items`` (``None``: the items' metadata) of ``step``; a file
        that cannot be read raises ``CheckpointCorruptError``."""
        # Before the read, not once it failed: an abandoned read may report between orbax
        # closing its loop and this frame's ``except`` (seen once in a fresh-clone suite).
        _saves.drop_abandoned_orbax_work()
        try:
            if items is None:
                return self._manager.item_metadata(step)
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except BaseException as e:
            damage = None if isinstance(e, errors.MultiMeshError) else _damage(e)
            if damage is None:
                raise
        # Not chained: the orbax error holds the reads of the other leaves, which would
        # complain when collected later; the message keeps the first line of its reason.
        gc.collect()
        raise self._corrupt(step, damage)

    def _corrupt(self, step: int, what: str) -> errors.CheckpointCorruptError:
        others = [s for s in self.all_steps() if s != step]
        instead = (
            f"Restore another saved step ({others}: `restore(step=...)`), or copy"
            if others
            else "No other step is saved here: copy"
        )
        return errors.CheckpointCorruptError(
            f"Checkpoint step {step} in '{self.directory / str(step)}' is damaged: {what}. "
            f"{instead} the checkpoint again from a good source."
        )

    def _verify(self, step: int, restored: Any) -> None:
        """Compares ``restored`` with the checksums saved with ``step`` (if it has them)."""
        if not (self.directory / str(step) / _CHECKSUMS).exists():
            return  # saved by a multi-process job, or before checksums were saved
        expected = self._read(step, {_CHECKSUMS: ocp.args.JsonRestore()})[_CHECKSUMS]
        bad = _checksums.mismatches(expected, restored)
        if bad:
            raise self._corrupt(
                step,
                f"{len(bad)} leaf(s) differ from the checksum saved with them, first "
                f"`{bad[0]}` (its bytes changed on disk after the save)",
            )

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """Returns the JSON metadata saved with ``step`` (default: the latest).

        Raises:
          CheckpointNotFoundError: no checkpoint, or none for ``step``.
          CheckpointCorruptError: the metadata file is missing or not JSON.
        """
        step = self._resolve_step(step)
        file = self.directory / str(step) / _METADATA / _METADATA
        try:
            args = ocp.args.Composite(**{_METADATA: ocp.args.JsonRestore()})
            metadata = self._manager.restore(step, args=args)[_METADATA]
        except Exception as e:
            damage = _damage(e)
            if damage is None:
                raise
            raise self._corrupt(step, f"the metadata file '{file}' is unreadable: {damage}") from e
        if not isinstance(metadata, dict):
            raise self._corrupt(step, f"the metadata file '{file}' holds no JSON dict")
        return metadata

    def latest_step(self) -> int | None:
        """The newest finalized step, or ``None`` when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All finalized steps, oldest first; interrupted saves are not listed."""
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until a background save has been written and finalized.

        Raises:
          CheckpointSaveError: the background save failed (read-only folder, disk full, ...);
            the message names the step, the directory and the reason.
        """
        _saves.wait(self._manager)

    def close(self) -> None:
        """Waits for pending saves and releases the manager.

        Raises:
          CheckpointSaveError: the background save failed; the manager is released anyway.
        """
        _saves.wait(self._manager, close=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            return  # no wait on Ctrl-C: at exit, a save in flight gets a few seconds
        self.close()

    def _check_new_step(self, step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise errors.CheckpointStepError(
                f"Expected `step` to be a non-negative integer, got {step!r}. Save under the "
                "training step (0, 1, ...)."
            )
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            raise errors.CheckpointStepError(
                f"Expected `step` greater than the latest saved step {latest} in "
                f"'{self.directory}', got {step}. Save under a larger step, or into a "
                "fresh directory."
            )
        return int(step)

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise errors.CheckpointNotFoundError(
                f"Expected a finalized checkpoint in '{self.directory}', found none "
                "(interrupted saves do not count). Check the directory, or start from scratch."
            )
        if step is None:
            return steps[-1]
        if step not in steps:
            raise errors.CheckpointNotFoundError(
                f"Expected `step` to be one of the saved steps {steps} in '{self.directory}', "
                f"got {step!r}. Pass one of them, or None for the latest."
            )
        return int(step)


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    state: Any,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Saves ``state`` and ``metadata`` as ``step`` in ``directory`` and waits until written.

    See ``Checkpointer.save``.
    """
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.save(step, state, metadata)


def restore_checkpoint(
    directory: str | os.PathLike[str], target: Any = None, step: int | None = None
) -> Any:
    """Restores ``step`` (default: the latest) from ``directory`` onto ``target``'s layout.

    See ``Checkpointer.restore``.
    """
    with Checkpointer(directory, read_only=True) as ckpt:
        return ckpt.restore(step, target)


def restore_metadata(directory: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """Returns the JSON metadata saved with ``step`` (default: the latest) in ``directory``."""
    with Checkpointer(directory, read_only=True) as ckpt:
        return ckpt.metadata(step)


def unfinished_saves(directory: str | os.PathLike[str]) -> list[Path]:
    """The temporary folders of saves in ``directory`` that were never finalized.

    Orbax writes a step into ``<step>.orbax-checkpoint-tmp...`` and renames it when the save
    is complete; a save killed midway leaves that folder. Restores ignore it, and opening
    the directory with ``Checkpointer(directory)`` removes it (with one warning). A
    directory whose entries are all unfinished saves holds no usable checkpoint.

    Args:
      directory: a checkpoint directory; a missing one has none.

    Returns:
      The leftover folders, sorted by name (empty when there are none).

    Example:
      >>> import tempfile
      >>> from multimesh_flax import checkpoint
      >>> tmp = tempfile.TemporaryDirectory()
      >>> os.mkdir(os.path.join(tmp.name, "7.orbax-checkpoint-tmp"))
      >>> [p.name for p in checkpoint.unfinished_saves(tmp.name)]
      ['7.orbax-checkpoint-tmp']
      >>> checkpoint.latest_step(tmp.name) is None
      True
      >>> tmp.cleanup()
    """
    path = epath.Path(directory)
    if not path.is_dir():
        return []
    suffix = ocp.path.atomicity_types.TMP_DIR_SUFFIX
    return sorted((Path(os.fspath(p)) for p in path.iterdir() if suffix in p.name), key=str)


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest finalized step in ``directory``, or ``None`` (also for a missing directory).

    Interrupted saves (orbax's temporary directories) are ignored.
    """
    if not epath.Path(directory).is_dir():
        return None
    steps = ocp.utils.checkpoint_steps(directory)
    return max(steps) if steps else None


_SAVABLE = (jax.Array, np.ndarray, np.generic, bool, int, float)


def _check_state(state: Any) -> None:
    """Refuses, before orbax writes anything, a state it would fail on midway."""
    leaves = jax.tree_util.tree_leaves_with_path(state)
    if not leaves:
        raise errors.CheckpointArgumentError(
            f"Expected `state` to hold at least one array, got {state!r}. Pass the training "
            "state (a pytree of arrays)."
        )
    for path, leaf in leaves:
        if not isinstance(leaf, _SAVABLE):
            raise errors.CheckpointArgumentError(
                f"Cannot save leaf {jax.tree_util.keystr(path)} of `state`: "
                f"{type(leaf).__name__} {leaf!r}. Checkpoints hold arrays and Python numbers; "
                "put strings and other settings into `metadata`."
            )


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, Mapping):
        raise errors.CheckpointMetadataError(
            f"Expected `metadata` to be a dict, got {type(metadata).__name__}."
        )
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as e:
        raise errors.CheckpointMetadataError(
            f"Expected `metadata` to be JSON-serializable, but {e}. Convert arrays with "
            "`.tolist()` and dataclasses with `dataclasses.asdict`."
        ) from e


def _as_abstract(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


def _describe(leaf: Any) -> str:
    if isinstance(leaf, (bool, int, float, complex)):
        return f"Python {type(leaf).__name__}"
    if leaf is None or not hasattr(leaf, "shape"):
        return "missing"
    return f"shape {tuple(leaf.shape)} {np.dtype(leaf.dtype).name}"


def _leaf_mismatch(saved: Any, target: Any) -> bool:
    if saved is None or target is None:
        return True
    if isinstance(target, (bool, int, float, complex)):
        return tuple(getattr(saved, "shape", ())) != ()
    if not hasattr(saved, "shape") or not hasattr(target, "shape"):
        return False
    same_dtype = np.dtype(saved.dtype) == np.dtype(target.dtype)
    return tuple(saved.shape) != tuple(target.shape) or not same_dtype


def _check_target(saved_tree: Any, target: Any, where: str) -> None:
    saved = ocp.tree.to_flat_dict(saved_tree)
    received = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(target, keep_empty_nodes=True))
    paths = list(saved) + [p for p in received if p not in saved]
    bad = [p for p in paths if _leaf_mismatch(saved.get(p), received.get(p))]
    if bad:
        path = bad[0]
        raise errors.CheckpointMismatchError(
            f"`target` does not match checkpoint {where} at "
            f"{len(bad)} path(s); first at `{'.'.join(map(str, path))}`: expected "
            f"{_describe(saved.get(path))} (as saved), received "
            f"{_describe(received.get(path))}. Build `target` from the same model and "
            "optimizer config as the saved state (see `Checkpointer.metadata`)."
        )


# Tensorstore and orbax report unreadable files as status text in ValueError/RuntimeError.
_DAMAGE_WORDS = ("OUT_OF_RANGE", "DATA_LOSS", "NOT_FOUND", "Truncated", "Zstd", "corrupt")
_KEY = re.compile(
    r'Error reading "([^"]+?)(?:/[0-9.]+)?" in OCDBT database at local file "([^"]+)"'
)


def _damage(error: BaseException) -> str | None:
    """What ``error`` (from orbax's restore, or one it chains) says is damaged, if anything."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
            return f"a JSON file is not valid JSON ({_first_line(e)})"
        text = str(e)
        if isinstance(e, OSError) or any(w in text for w in _DAMAGE_WORDS):
            key = _KEY.search(text)
            if key:
                return (
                    f"the data of leaf `{key.group(1)}` under '{key.group(2)}' cannot be read, "
                    f"a file there is truncated, missing or changed ({_first_line(e)})"
                )
            return f"a file cannot be read ({_first_line(e)})"
        todo += [e.__cause__, e.__context__]
    return None


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= limit else line[:limit] + "..."
