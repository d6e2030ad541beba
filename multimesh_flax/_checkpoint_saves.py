"""Background checkpoint saves: failures are reported once, and the process never hangs.

``Checkpointer.save`` with ``async_save=True`` hands the writing to orbax's background
threads. This module keeps the bookkeeping that turns what can go wrong there into one clear
``CheckpointSaveError`` and a process that exits:

* ``track`` records a save in flight (its manager, step and directory), keeping the manager
  alive until the save is waited for: ``Checkpointer(d).save(step, state)`` as a script's
  last line drops the ``Checkpointer`` at once.
* ``wait`` waits for a manager's save; an orbax failure becomes ``CheckpointSaveError``
  (``save_error`` words it: the step, the directory, the OS reason and what to do).
* Orbax's threads of a failed save may wait up to 300 s for signals that the failed step
  never sends (a commit thread waits for the temporary directory that could not be made);
  they are not daemon threads, so the interpreter would wait for them at exit.
  ``release_waiting_threads`` cancels them and sends them the signals (one process only).
* ``finish_at_exit`` runs before Python joins threads at interpreter exit: it waits for
  every save still in flight; a failure is logged once and the process exits with status 1
  (``os._exit``, since a threading exit hook cannot set the status otherwise, and orbax's
  threads of the failed step may never end); Ctrl-C while it runs abandons the saves in
  flight (their temporary directories stay, later runs ignore them) and exits with status 130.
* ``_QuietOrbaxFailures`` drops orbax's own tracebacks of a failed save (it logs the same
  exception three times, and asyncio logs its gathered futures as "exception was never
  retrieved" when they are collected) while a ``Checkpointer`` save is in flight or after one
  failed; the error raised here chains the original exception, so nothing is lost.
* ``drop_abandoned_orbax_work`` keeps orbax's work abandoned by a failed save or restore
  from printing "Exception ignored" tracebacks whenever the collector reaches it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import logging
import os
import signal
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any

import orbax.checkpoint as ocp

from multimesh_flax import errors

logger = logging.getLogger("multimesh_flax.checkpoint")

# How long, at exit, orbax threads left by a failed or abandoned save may take to end.
_EXIT_GRACE_S = 5.0


@dataclasses.dataclass
class PendingSave:
    """A background save in flight: what to wait for and what to name when it fails."""

    manager: ocp.CheckpointManager
    step: int
    directory: str
    operation_id: str | None


# Saves in flight, by id of their manager; an entry leaves when the save is waited for.
_PENDING: dict[int, PendingSave] = {}
_LOCK = threading.Lock()
_FAILED = threading.Event()  # a save of this process failed or was abandoned


def track(manager: ocp.CheckpointManager, step: int, directory: str) -> None:
    """Records a save that ``manager`` starts now (call ``started`` once it runs)."""
    drop_abandoned_orbax_work()
    with _LOCK:
        _PENDING[id(manager)] = PendingSave(manager, step, directory, None)


def started(manager: ocp.CheckpointManager, in_background: bool) -> None:
    """Notes the orbax operation of the save just started, or forgets a finished one."""
    with _LOCK:
        save = _PENDING.get(id(manager))
        if save is not None and in_background:
            save.operation_id = _operation_id()
        elif save is not None:
            del _PENDING[id(manager)]


def pending(manager: ocp.CheckpointManager) -> PendingSave | None:
    """The save in flight of ``manager``, if any."""
    with _LOCK:
        return _PENDING.get(id(manager))


def wait(manager: ocp.CheckpointManager, *, close: bool = False) -> None:
    """Waits for ``manager``'s save (and closes it); a failure raises ``CheckpointSaveError``.

    Raises:
      CheckpointSaveError: the background save failed; the step is not saved.
    """
    save = pending(manager)
    try:
        manager.close() if close else manager.wait_until_finished()
    except Exception as e:
        if save is None:
            raise
        error = failed(manager, save.step, save.directory, e, save.operation_id)
        if close:
            _close_quietly(manager)
        raise error from e
    with _LOCK:
        _PENDING.pop(id(manager), None)


def failed(
    manager: ocp.CheckpointManager,
    step: int,
    directory: str,
    error: BaseException,
    operation_id: str | None = None,
) -> errors.CheckpointSaveError:
    """Forgets ``manager``'s failed save, releases its threads, and words the error."""
    with _LOCK:
        _PENDING.pop(id(manager), None)
    _FAILED.set()
    release_waiting_threads(operation_id or _operation_id())
    return save_error(step, directory, error)


def save_error(
    step: int | None, directory: str, error: BaseException
) -> errors.CheckpointSaveError:
    """``CheckpointSaveError`` naming the step, directory and OS reason of ``error``."""
    code, reason = _os_reason(error)
    if code == errno.ENOSPC:
        advice = (
            "The disk is full: free space there, or save into another folder (e.g. "
            "`Checkpointer(other_directory)`)."
        )
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        advice = "The folder is not writable: make it writable, or save into another folder."
    else:
        advice = "Check that the folder is writable and has free space, or save elsewhere."
    if step is None:
        return errors.CheckpointSaveError(
            f"Could not open checkpoint directory '{directory}' for saving: {reason}. {advice}"
        )
    steps = _finalized_steps(directory)
    return errors.CheckpointSaveError(
        f"Could not save checkpoint step {step} in '{directory}': {reason}. {advice} "
        f"Step {step} is not saved; the finalized steps there are {steps}."
    )


def _os_reason(error: BaseException) -> tuple[int | None, str]:
    """The errno and a one-line reason of ``error`` or of the exceptions it chains."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno, str(e)
        text = str(e)
        for code, words in _STATUS_WORDS:
            if any(w in text for w in words):
                return code, f"{os.strerror(code)} ({_first_line(text)})"
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None, f"{type(error).__name__}: {_first_line(str(error))}"


# Tensorstore reports OS failures as status text, not as OSError.
_STATUS_WORDS = (
    (errno.ENOSPC, ("No space left on device", "RESOURCE_EXHAUSTED")),
    (errno.EROFS, ("Read-only file system",)),
    (errno.EACCES, ("Permission denied",)),
)


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _finalized_steps(directory: str) -> list[int]:
    try:
        return sorted(ocp.utils.checkpoint_steps(directory))
    except Exception:  # the listing is a courtesy; the save error is what matters
        return []


def _operation_id() -> str | None:
    """Orbax's id of the save just started (its threads carry it), if this orbax has one."""
    try:
        from orbax.checkpoint._src.futures import synchronization

        return synchronization.OperationIdGenerator.get_current_operation_id()
    except (ImportError, AttributeError):
        return None


def release_waiting_threads(operation_id: str | None) -> None:
    """Cancels orbax's threads of a failed save that wait for signals it will never send."""
    if operation_id is None:
        return
    try:
        from orbax.checkpoint._src.futures import future, signaling_client
        from orbax.checkpoint._src.multihost import multihost

        if multihost.is_jax_distributed_client_initialized():
            return  # signals are shared between processes there; exit handles stragglers
        client = signaling_client.get_signaling_client()
        for thread in threading.enumerate():
            if not isinstance(thread, future._SignalingThread) or not thread.is_alive():
                continue
            if thread._operation_id != operation_id:
                continue
            thread.cancel()
            for signal in thread._receive_signals:
                key = future.AwaitableSignalsContract.get_unique_awaitable_singal_key(
                    signal, operation_id
                )
                client.key_value_set(key, future._SIGNAL_ACTION_SUCCESS, allow_overwrite=True)
    except Exception:  # orbax internals moved: the exit hook still ends the process
        logger.debug("Could not release orbax threads of a failed save", exc_info=True)


def _close_quietly(manager: ocp.CheckpointManager) -> None:
    try:
        manager.close()  # the failure was raised once; the rest of close still runs
    except Exception:
        logger.debug("Closing a checkpoint manager after a failed save", exc_info=True)


def _orbax_threads() -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.is_alive() and not t.daemon and type(t).__module__.startswith("orbax.")
    ]


def _exit_now(status: int) -> None:
    """Flushes logs and standard streams, then ends the process with ``status``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def finish_at_exit() -> None:
    """Waits for every save in flight at interpreter exit; never lets the exit hang."""
    try:
        _finish_at_exit()
    except KeyboardInterrupt:  # Ctrl-C anywhere in the hook, not only while it waits
        _abandon_pending()
    except BaseException:  # noqa: BLE001 - an exit hook that fails must still end the process
        logger.exception("Finishing checkpoint saves at exit failed")
        _exit_now(1)


def _finish_at_exit() -> None:
    with _LOCK:
        saves = list(_PENDING.values())
    # Exiting on Ctrl-C: a save gets a few seconds to finish, then it is abandoned.
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    failed = False
    for save in saves:
        error = None
        try:
            error = _wait_interruptibly(save, _EXIT_GRACE_S if interrupted else None)
        except KeyboardInterrupt:
            _abandon(save)
        if isinstance(error, errors.CheckpointSaveError):
            failed = True
            logger.error("%s The process exits with status 1.", error)
            logger.debug("Cause of the failed save", exc_info=error.__cause__)
        elif error is not None:
            logger.error(
                "Finishing checkpoint step %d in '%s' at exit failed: %r",
                save.step,
                save.directory,
                error,
            )
    if failed:
        _join_orbax_threads(_EXIT_GRACE_S)
        _exit_now(1)
    if _FAILED.is_set() and not _join_orbax_threads(_EXIT_GRACE_S):
        logger.error("Orbax threads of a failed checkpoint save did not end; exiting with 1.")
        _exit_now(1)


def _wait_interruptibly(save: PendingSave, limit: float | None) -> BaseException | None:
    """Waits for ``save`` in a helper thread, so Ctrl-C (or ``limit``) can cut it short."""
    outcome: list[BaseException] = []

    def finish() -> None:
        try:
            wait(save.manager, close=True)
        except BaseException as e:  # handed to the waiting thread
            outcome.append(e)

    helper = threading.Thread(target=finish, name="mmflax-finish-save", daemon=True)
    helper.start()
    end = None if limit is None else time.monotonic() + limit
    while helper.is_alive():
        helper.join(0.1)
        if end is not None and time.monotonic() > end:
            raise KeyboardInterrupt
    return outcome[0] if outcome else None


def _abandon(save: PendingSave) -> None:
    """Ends the process, leaving ``save`` unfinalized (Ctrl-C while it was finishing)."""
    _ignore_further_interrupts()
    _log_abandoned(save)
    _exit_now(130)


def _abandon_pending() -> None:
    """Ends the process with status 130, leaving every save in flight unfinalized."""
    _ignore_further_interrupts()
    with _LOCK:
        saves = list(_PENDING.values())
    for save in saves:
        _log_abandoned(save)
    _exit_now(130)


def _log_abandoned(save: PendingSave) -> None:
    logger.error(
        "Interrupted while finishing checkpoint step %d in '%s' at exit: it is left "
        "unfinalized (a temporary folder that later runs ignore); earlier steps are intact.",
        save.step,
        save.directory,
    )


def _ignore_further_interrupts() -> None:
    """A second Ctrl-C must not cut the exit short: the process is ending already."""
    with contextlib.suppress(ValueError):  # only the main thread may set handlers
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _join_orbax_threads(timeout: float) -> bool:
    """Gives orbax's remaining threads ``timeout`` seconds in all; whether they all ended."""
    end = time.monotonic() + timeout
    for thread in _orbax_threads():  # the base join: orbax's own raises the thread's error
        threading.Thread.join(thread, max(0.0, end - time.monotonic()))
    return not _orbax_threads()


_ORBAX = f"{os.sep}orbax{os.sep}"


def _through_orbax(tb: TracebackType | None) -> bool:
    """Whether a traceback passes through orbax's code (frames only: no source is read)."""
    return any(_ORBAX in frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb))


class _QuietOrbaxFailures(logging.Filter):
    """Drops orbax's tracebacks of a failed save while a ``Checkpointer`` save is pending or
    after one failed: orbax's own (absl's logger), and asyncio's "exception was never
    retrieved" for orbax's gathered futures, logged whenever the collector reaches them (in 1
    of 6 runs of ``test_failed_saves_raise_one_clear_error_and_the_process_exits``'s child).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.exc_info:
            return True
        if not (_PENDING or _FAILED.is_set()):
            return True
        return not (_ORBAX in (record.pathname or "") or _through_orbax(record.exc_info[2]))


def _is_abandoned_orbax_work(unraisable: Any) -> bool:
    """An orbax coroutine closed by the collector, or a completion posted to orbax's closed
    event loop (``RuntimeError: Event loop is closed`` raised inside asyncio)."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None:
        return _ORBAX in code.co_filename
    error = getattr(unraisable, "exc_value", None)
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}asyncio{os.sep}" in frames[-1].filename


def drop_abandoned_orbax_work() -> None:
    """Keeps orbax's work abandoned by a failed restore or save from printing tracebacks.

    Orbax runs a restore or a save on an event loop that it closes without cancelling what
    is still pending, so when one leaf's read or write fails the others stay suspended;
    they are closed whenever the garbage collector reaches them, which may be long after,
    once tensorstore lets go of them. Each then reports an exception that says nothing (the
    failure itself is raised to the caller); a read or write that completes after the loop
    closed reports "Event loop is closed" (seen once each in fresh-clone suites, sessions
    43 and 44). From the first restore or save on, those two reports are dropped
    (`_is_abandoned_orbax_work`); every other report goes to the hook installed before.
    """
    if getattr(sys.unraisablehook, "_drops_orbax_work", False):
        return
    report = sys.unraisablehook

    def drop_orbax_work(unraisable: Any) -> None:
        if not _is_abandoned_orbax_work(unraisable):
            report(unraisable)

    drop_orbax_work._drops_orbax_work = True  # type: ignore[attr-defined]
    sys.unraisablehook = drop_orbax_work


def _register() -> None:
    # Orbax submits work to thread pools that Python shuts down before ``atexit`` handlers
    # run; ``threading._register_atexit`` hooks run before that, and before threads are joined.
    register: Any = getattr(threading, "_register_atexit", atexit.register)
    register(finish_at_exit)
    quiet = _QuietOrbaxFailures()
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(quiet)


_register()
