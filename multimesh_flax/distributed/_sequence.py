"""Checking that every process of a job runs the same collective calls, in the same order.

A multi-process job is one program run by every process: each step, checkpoint save or
restore and ``host_values`` is a collective that every process must enter. When one does not
(an extra step in one process, a save under ``if jax.process_index() == 0``, a process that
raised), the others wait in a collective that never completes; what they reported before was
either nothing for minutes or a false "lost process" (a finished process was aborted by the
shutdown barrier while the one still stepping reported it as dead).

Each such call is *entered* here with a label (:func:`enter`, :func:`collective_call`): a
counter and a window of the last labels, in memory (no exchange on a step's path; a save,
restore or ``host_values`` also publishes it at once, as it may block holding the GIL). A daemon
thread publishes this process's record to the coordinator's key-value store every ``POLL_S``
seconds, when it changed, and reads everyone's records. At shutdown (the hook of
``_watchdog``) a process publishes an exit record: how many calls it made, its last one, and
whether it is exiting with an uncaught exception. A process then knows, within ``POLL_S``:

* that another process ran a different call under the same number (labels differ);
* that it started call ``n + 1`` after another process finished after ``n`` calls (an extra
  step here, or a call the other never made);
* and within ``POLL_S + PEER_GRACE_S``, that another process failed (its exit record says
  so) at or before the call this one is in, so that this one may be waiting for it.

On such a finding the process publishes an error record, logs a ``CallSequenceError`` (or the
other process's failure) naming both processes and the call, and ends with ``EXIT_SEQUENCE``
(``EXIT_PEER_FAILED``); a process that reads another's error record ends with it. Process 0
hosts the store, so it waits (at most ``LINGER_S``) for the others to have read the records
before it ends.

DESIGN. A process that ends here leaves without jax's shutdown barrier (``os._exit``), and a
barrier missing a process aborts the processes waiting in it (jaxlib's fatal "Shutdown barrier
has failed", exit -6). Two rules keep a failing process's own exit status and error:

* another process's failure ends this one only after ``PEER_GRACE_S``, and never once this
  one's main program has raised (``sys.last_value``) or ended (the interpreter is exiting;
  jax's exit handler runs the shutdown after the handlers registered later). When every
  process raises the same error (per-process input seeds), one finds the other's exit record
  while itself still unwinding; it reaches its own shutdown and exits with its own error, not
  as a bystander (CI, session 44: one process ended 75 this way, the other -6);
* a failing process enters the barrier only once every other process has an exit record (it
  is shutting down too); if one ended here instead (an error record), or the store is gone, or
  none answers within ``FAILED_WAIT_S``, it leaves at once with the status Python gives an
  uncaught exception (1; killed by SIGINT for ``KeyboardInterrupt``). Exit handlers
  registered before ``import jax`` (whose handler runs the shutdown) do not run then.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from multimesh_flax import errors

logger = logging.getLogger(__name__)

POLL_S = 0.2
WINDOW = 32  # labels of the latest calls each process publishes (to compare by number)
LINGER_S = 3.0  # how long process 0 waits for the others to read its error or exit record
EXIT_WAIT_S = 10.0  # how long a finished process waits for the others' exit records
PEER_GRACE_S = 2.0  # how long a process may take to fail too before a peer's failure ends it
FAILED_WAIT_S = EXIT_WAIT_S  # how long a failing process waits for the others' exit records
EXIT_SEQUENCE = 76  # exit status after a CallSequenceError
EXIT_PEER_FAILED = 75  # as the watchdog's EXIT_LOST: the job failed because of another process
_KEY = "mmflax/calls"


class _Calls:
    """This process's collective calls and the thread that compares them with the others'."""

    def __init__(self, client: Any, rank: int, count: int) -> None:
        self.client, self.rank, self.count = client, rank, count
        self.n = 0
        self.recent: collections.deque[tuple[int, str]] = collections.deque(maxlen=WINDOW)
        self.published = -1
        self.failures_seen: dict[int, float] = {}  # rank -> when its failure was first read
        self.lock = threading.Lock()  # publish_run runs in the thread and in collective_call
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mmflax-sequence", daemon=True)

    def label(self, number: int) -> str:
        return next((label for k, label in self.recent if k == number), "a collective call")

    # --- the records ---

    def publish(self, kind: str, value: dict[str, Any]) -> None:
        self.client.key_value_set(
            f"{_KEY}/{kind}/{self.rank}", json.dumps(value), allow_overwrite=True
        )

    def publish_run(self) -> None:
        with self.lock:
            n = self.n
            if n != self.published:
                self.publish("run", {"n": n, "recent": list(self.recent)})
                self.published = n

    def records(self) -> dict[str, dict[int, Any]]:
        """``{"run"|"exit"|"error": {rank: record}}`` of the other processes."""
        out: dict[str, dict[int, Any]] = {"run": {}, "exit": {}, "error": {}}
        for key, value in self.client.key_value_dir_get(f"{_KEY}/"):
            kind, rank = key.rsplit("/", 2)[-2:]
            if kind in out and int(rank) != self.rank:
                out[kind][int(rank)] = json.loads(value)
        return out

    # --- the comparisons ---

    def differs(self, other: int, theirs: dict[str, Any]) -> str | None:
        """A different label under the same call number, in the windows both published."""
        mine = dict(self.recent)
        for k, label in theirs["recent"]:
            if k in mine and mine[k] != label:
                return (
                    f"Process {self.rank} ran {mine[k]} as its collective call {k}, process "
                    f"{other} ran {label}. Every process must run the same collective calls "
                    "(steps, checkpoint save/restore, host_values) in the same order."
                )
        return None

    def overran(self, other: int, theirs: dict[str, Any], n: int) -> str | None:
        """This process (``n`` calls) started a call after ``other`` finished (its exit)."""
        if n <= theirs["n"]:
            return None
        call = theirs["n"] + 1
        return (
            f"Process {self.rank} ran {self.label(call)} (collective call {call}) after "
            f"process {other} finished after {theirs['n']} calls (its last: "
            f"{theirs.get('last') or 'none'}). Every process must run the same sequence of "
            "calls: the same number of steps, and save/restore/host_values in every process, "
            "not under `if jax.process_index() == ...`."
        )

    def check(self, records: dict[str, dict[int, Any]], exiting: bool) -> None:
        """Ends this process on a finding (see the module docstring)."""
        for other, message in sorted(records["error"].items()):
            status = message.get("status", EXIT_SEQUENCE)
            self.end(f"(found by process {other}) {message['message']}", status=status)
        for other, theirs in sorted(records["run"].items()):
            found = self.differs(other, theirs)
            if found is None and exiting:
                found = self._outran(other, theirs)
            if found is not None:
                self.end(found)
        for other, theirs in sorted(records["exit"].items()):
            found = self.differs(other, {"recent": theirs.get("recent", [])})
            if found is None and theirs.get("failed"):
                if not exiting and self._waited_for(other, theirs):
                    self.end(self._peer_failed(other, theirs), status=EXIT_PEER_FAILED)
                continue
            found = found or self.overran(other, theirs, self.n)
            if found is None and exiting and theirs["n"] > self.n:
                found = self._outran(other, theirs)
            if found is not None:
                self.end(found)

    def _waited_for(self, other: int, theirs: dict[str, Any]) -> bool:
        """``other`` failed at (or before) this process's call, ``PEER_GRACE_S`` or more ago,
        and this process's main program has neither raised nor ended (so it may be waiting
        for ``other``)."""
        if self.n < theirs["n"] or _exiting():
            return False
        first = self.failures_seen.setdefault(other, time.monotonic())
        return time.monotonic() - first >= PEER_GRACE_S

    def _peer_failed(self, other: int, theirs: dict[str, Any]) -> str:
        return (
            f"Process {other} failed ({theirs['failed']}) after its collective call "
            f"{theirs['n']} ({theirs.get('last') or 'none'}); process {self.rank}, at its call "
            f"{self.n} ({self.label(self.n)}), stops instead of waiting for it. See that "
            "process's output for its error."
        )

    def _outran(self, other: int, theirs: dict[str, Any]) -> str | None:
        """``other`` started a call after this (exiting) process stopped."""
        if theirs["n"] <= self.n:
            return None
        call = self.n + 1
        label = dict(theirs.get("recent", [])).get(call, "a collective call")
        return (
            f"Process {other} ran {label} (collective call {call}) after process {self.rank} "
            f"finished after {self.n} calls (its last: {self.label(self.n) if self.n else 'none'})"
            ". Every process must run the same sequence of calls: the same number of steps, "
            "and save/restore/host_values in every process, not under "
            "`if jax.process_index() == ...`."
        )

    # --- ending ---

    def end(self, message: str, *, status: int = EXIT_SEQUENCE) -> None:
        """Logs ``message``, lets the others read it, and ends this process."""
        with contextlib.suppress(Exception):
            self.publish("error", {"message": message, "status": status})
        cls = errors.CallSequenceError if status == EXIT_SEQUENCE else errors.ProcessLostError
        logger.critical("%s: %s", cls.__name__, message)
        self._leave(status)

    def _leave(self, status: int) -> None:
        """Ends this process now, without jax's shutdown barrier (process 0 lingers first).

        A negative ``status`` is a signal this process ends by, as Python ends on an uncaught
        ``KeyboardInterrupt`` (SIGINT).
        """
        if self.rank == 0:
            self._linger()
        _flush()
        if status < 0:
            signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
        os._exit(status if status >= 0 else 128 - status)

    def _linger(self) -> None:
        """Process 0 hosts the store: waits until the others have an exit or error record."""
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            try:
                records = self.records()
            except Exception:
                return
            done = set(records["exit"]) | set(records["error"])
            if done >= set(range(1, self.count)):
                time.sleep(POLL_S)  # their last read of our records
                return
            time.sleep(POLL_S / 2)

    # --- the thread ---

    def _run(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                self.publish_run()
                records = self.records()
            except Exception:  # the store is gone (process 0 ended): the watchdog reports it
                return
            if not self.stop.is_set():
                self.check(records, exiting=False)

    def exit(self, wait_s: float) -> None:
        """At shutdown: publishes the exit record and waits (at most ``wait_s``) for the
        others' exit records, ending the process on a finding. A process exiting with an
        uncaught exception goes on as ``_end_failed`` says."""
        uncaught = _uncaught()
        failed = None if uncaught is None else _describe(uncaught)
        last = self.label(self.n) if self.n else None
        record = {"n": self.n, "last": last, "recent": list(self.recent), "failed": failed}
        try:
            self.publish("exit", record)
        except Exception:  # the store is gone: process 0 ended, so no barrier can complete
            if uncaught is not None:
                self._leave(_uncaught_status(uncaught))
            return
        if uncaught is not None:
            self._end_failed(uncaught)
            return
        deadline = time.monotonic() + wait_s
        while True:
            try:
                records = self.records()
            except Exception:
                return
            self.check(records, exiting=True)
            if set(records["exit"]) >= set(range(self.count)) - {self.rank}:
                return
            if time.monotonic() > deadline:
                return
            time.sleep(POLL_S / 2)

    def _end_failed(self, uncaught: BaseException) -> None:
        """A failing process: returns (to the shutdown barrier) once every other process has
        an exit record; leaves without the barrier if one ended here, the store is gone, or
        ``FAILED_WAIT_S`` passed (see the module docstring)."""
        others = set(range(self.count)) - {self.rank}
        deadline = time.monotonic() + FAILED_WAIT_S
        while time.monotonic() < deadline:
            try:
                records = self.records()
            except Exception:  # process 0 ended: no barrier to wait in
                break
            if records["error"]:
                break
            if set(records["exit"]) >= others:
                return
            time.sleep(POLL_S / 2)
        self._leave(_uncaught_status(uncaught))


def _uncaught() -> BaseException | None:
    """The exception this process is exiting with (``None``: a normal exit)."""
    value = getattr(sys, "last_value", None)
    if value is None or isinstance(value, SystemExit):
        return None
    return value


def _exiting() -> bool:
    """This process's main program raised (its traceback is printed) or ended."""
    return _uncaught() is not None or not threading.main_thread().is_alive()


def _describe(value: BaseException) -> str:
    """``"RuntimeError: message"`` (at most 300 characters), or the bare type's name."""
    text = str(value)
    return f"{type(value).__name__}: {text}"[:300] if text else type(value).__name__


def _uncaught_status(value: BaseException) -> int:
    """The exit status Python gives an uncaught ``value``: 1, or ``-SIGINT`` (killed by the
    signal) for a ``KeyboardInterrupt``."""
    return -signal.SIGINT if isinstance(value, KeyboardInterrupt) else 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        for handler in logging.getLogger().handlers:
            handler.flush()


_STATE: dict[str, _Calls] = {}


def start(client: Any, rank: int, count: int) -> None:
    """Starts checking this process's collective calls against the others' (one job)."""
    stop()
    calls = _Calls(client, rank, count)
    _STATE["calls"] = calls
    calls.thread.start()


def stop() -> _Calls | None:
    """Stops the thread (waits for its last poll, which does not block); returns the state."""
    calls = _STATE.pop("calls", None)
    if calls is not None:
        calls.stop.set()
        if calls.thread is not threading.current_thread():
            calls.thread.join(POLL_S * 10 + 5.0)
    return calls


def at_shutdown(wait_s: float = EXIT_WAIT_S) -> None:
    """Called by the shutdown hook before jax's shutdown barrier (see the module docstring)."""
    calls = stop()
    if calls is not None:
        calls.exit(wait_s)


def enter(label: str, *, publish: bool = False) -> None:
    """Counts a collective call of this process (``label``: the same in every process).

    Costs an append under the GIL (a step); with ``publish`` also one write to the store now,
    for calls that may block holding the GIL, so that the thread could not publish them
    (measured: a checkpoint save waiting for a process that never saved). Nothing when no
    multi-process job is running.
    """
    calls = _STATE.get("calls")
    if calls is not None:
        calls.n += 1
        calls.recent.append((calls.n, label))
        if publish:
            with contextlib.suppress(Exception):  # the store is gone: the watchdog reports it
                calls.publish_run()


class collective_call:  # noqa: N801 - used like a function, as contextlib's helpers
    """Counts a collective call that every process of the job must make.

    Call it first thing in the collective (``collective_call("Checkpointer.save")``), or wrap
    the call's body (``with collective_call(...):``). If a process makes it and another does
    not (it finished, or made another call there), both end within a fraction of a second
    with a ``CallSequenceError`` naming the processes and ``label``, instead of waiting in the
    collective. Outside a multi-process job it does nothing.

    Args:
        label: what the call is, the same string in every process (``"Checkpointer.save"``).

    Example:
        >>> from multimesh_flax.distributed import collective_call
        >>> with collective_call("Checkpointer.save"):
        ...     pass
    """

    def __init__(self, label: str) -> None:
        enter(label, publish=True)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
