"""Stopping a process whose job lost another process.

A collective whose peer died never completes (measured on CPU/gloo: the surviving process sat
in the collective until the coordination service noticed the missing heartbeats). The
coordination service declares a process dead after ``heartbeat_timeout`` seconds without a
heartbeat; a daemon thread started by :func:`~multimesh_flax.distributed.initialize` asks it
for the live processes every ``POLL_S`` seconds and, once one is missing, logs a
``ProcessLostError`` naming it and ends this process with status ``EXIT_LOST``. The bound on
noticing is therefore ``heartbeat_timeout + POLL_S`` (plus the time the service takes to
answer). The watchdog stops when the interpreter exits, before jax shuts the job down.
jaxlib's own error polling may end the process first with its fatal message ("Task 1
heartbeat timeout"); both name the lost process.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

from multimesh_flax import errors

logger = logging.getLogger(__name__)

POLL_S = 0.1
EXIT_LOST = 75  # EX_TEMPFAIL: the job failed because of another process


def _lost(client: Any, count: int) -> list[int]:
    try:
        live = client.get_live_nodes(list(range(count)))
    except Exception:  # the coordinator (process 0) itself is gone
        return [0]
    return sorted(set(range(count)) - set(live))


def _watch(client: Any, rank: int, count: int, heartbeat_timeout: int) -> None:
    while not _EXITING.is_set():
        lost = _lost(client, count)
        if lost and not _EXITING.is_set():
            names = ", ".join(f"process {p}" for p in lost)
            error = errors.ProcessLostError(
                f"Lost {names} of this {count}-process job (no heartbeat for "
                f"{heartbeat_timeout} s: it died or was killed). Process {rank} stops instead "
                "of waiting for collectives that cannot finish. See that process's output for "
                "its own error."
            )
            logger.critical("%s: %s", type(error).__name__, error)
            os._exit(EXIT_LOST)
        time.sleep(POLL_S)


_STARTED: dict[str, int] = {}  # "heartbeat_timeout" once the watchdog runs
# Set when the interpreter exits: jax's own exit handler then shuts the job down (the
# coordinator of process 0 goes away), which is not a lost process.
_EXITING = threading.Event()


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
    """Starts the daemon thread that ends this process when another one is lost."""
    thread = threading.Thread(
        target=_watch,
        args=(client, rank, count, heartbeat_timeout),
        name="mmflax-watchdog",
        daemon=True,
    )
    # atexit runs handlers last-registered first: this one before jax's shutdown.
    atexit.register(_EXITING.set)
    thread.start()
    _STARTED["heartbeat_timeout"] = heartbeat_timeout
    return thread
