"""Stopping a process whose job lost another process.

A collective whose peer died never completes (measured on CPU/gloo: the surviving process sat
in the collective until the coordination service noticed the missing heartbeats). The
coordination service declares a process dead after ``heartbeat_timeout`` seconds without a
heartbeat; a daemon thread started by :func:`~multimesh_flax.distributed.initialize` asks it
for the live processes every ``POLL_S`` seconds and, once one is missing, logs a
``ProcessLostError`` naming it and ends this process with status ``EXIT_LOST``. The bound on
noticing is therefore ``heartbeat_timeout + POLL_S`` (plus the time the service takes to
answer). jaxlib's own error polling may end the process first with its fatal message ("Task 1
heartbeat timeout"); both name the lost process.

DESIGN. The live-process query is a rendezvous: it returns once every live process in it has
asked too (``jax.experimental.multihost_utils.live_devices`` documents the same barrier). So
when one process stops polling, the other's poll waits inside jaxlib until the first process
leaves the job. Two consequences, both handled by hooking jax's shutdown (the one
``jax.distributed.shutdown()`` and jax's exit handler both call):

* an orderly shutdown, explicit or at exit, is not a lost process: the hook stops the watchdog
  *before* the shutdown, whose barrier no process passes until all have entered it, so no
  process can see another leave before its own watchdog has stopped;
* no poll may still be waiting in jaxlib when the interpreter finalizes: a thread that comes
  back from C++ then is ended by Python with a forced unwind that aborts the process
  ("terminate called after throwing an instance of ''", B8's exit -6 in 3 of 6 runs). The hook
  waits for the watchdog's thread *after* the shutdown, which is what releases its last poll.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from multimesh_flax import errors
from multimesh_flax.distributed import _sequence

logger = logging.getLogger(__name__)

POLL_S = 0.1
EXIT_LOST = 75  # EX_TEMPFAIL: the job failed because of another process


def _lost(client: Any, count: int) -> list[int]:
    try:
        live = client.get_live_nodes(list(range(count)))
    except Exception:  # the coordinator (process 0) itself is gone
        return [0]
    return sorted(set(range(count)) - set(live))


def _watch(client: Any, rank: int, count: int, heartbeat_timeout: int, stop: Any) -> None:
    while not stop.is_set():
        lost = _lost(client, count)
        if lost and not stop.is_set():
            names = ", ".join(f"process {p}" for p in lost)
            error = errors.ProcessLostError(
                f"Lost {names} of this {count}-process job (no heartbeat for "
                f"{heartbeat_timeout} s: it died or was killed). Process {rank} stops instead "
                "of waiting for collectives that cannot finish. See that process's output for "
                "its own error."
            )
            logger.critical("%s: %s", type(error).__name__, error)
            os._exit(EXIT_LOST)
        stop.wait(POLL_S)


JOIN_S = 10.0  # seconds the shutdown waits for the watchdog's last poll to come back
_STARTED: dict[str, Any] = {}  # "heartbeat_timeout", "stop" and "thread" of the running one


def _stop() -> threading.Thread | None:
    """Stops the watchdog from reporting; returns its thread (``None``: none runs)."""
    stop, thread = _STARTED.pop("stop", None), _STARTED.pop("thread", None)
    if stop is not None:
        stop.set()
    return thread


def _join(thread: threading.Thread | None) -> None:
    if thread is None or thread is threading.current_thread():
        return
    thread.join(JOIN_S)
    if thread.is_alive():
        logger.warning(
            "the watchdog's last poll did not return within %.0f s of the shutdown; the "
            "process may abort when the interpreter exits",
            JOIN_S,
        )


def _hook_shutdown() -> None:
    """Makes jax's shutdown stop the watchdog before it and wait for its thread after it."""
    from jax._src import distributed  # jax.distributed.shutdown() and jax's exit handler
    # both call global_state.shutdown(); there is no public shutdown callback in jax 0.10

    state = distributed.global_state
    if getattr(state.shutdown, "_mmflax_watchdog", False):
        return
    original = state.shutdown

    def shutdown() -> None:
        thread = _stop()
        try:
            _sequence.at_shutdown()  # may end the process: another ran calls this one did not
            original()
        finally:
            _join(thread)

    shutdown._mmflax_watchdog = True  # type: ignore[attr-defined]
    state.shutdown = shutdown


def await_loss() -> None:
    """After a failed collective: waits (bounded) for the watchdog to report a lost process.

    A collective whose peer died fails with gloo's "Connection closed by peer"; the watchdog
    then names the process within the heartbeat timeout. Returns if nothing was lost by then
    (the caller re-raises the original error).
    """
    timeout = _STARTED.get("heartbeat_timeout")
    if timeout is not None:
        time.sleep(timeout + 2.0)


def start(client: Any, rank: int, count: int, heartbeat_timeout: int) -> threading.Thread:
    """Starts the daemon thread that ends this process when another one is lost.

    It runs until jax shuts the job down (``jax.distributed.shutdown()`` or interpreter exit).
    """
    _join(_stop())  # a watchdog of an earlier job in this process
    _hook_shutdown()
    stop = threading.Event()
    thread = threading.Thread(
        target=_watch,
        args=(client, rank, count, heartbeat_timeout, stop),
        name="mmflax-watchdog",
        daemon=True,
    )
    _STARTED.update(heartbeat_timeout=heartbeat_timeout, stop=stop, thread=thread)
    thread.start()
    return thread
