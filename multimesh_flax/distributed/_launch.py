"""Local launcher: N processes on this machine, each with K CPU devices, one coordinator.

``launch`` is for development and tests: it picks a free loopback port for the coordinator of
``jax.distributed``, starts ``n`` copies of a command with the environment that
:func:`multimesh_flax.distributed.initialize` reads (``MMFLAX_COORDINATOR``,
``MMFLAX_NUM_PROCESSES``, ``MMFLAX_PROCESS_ID``, ``MMFLAX_DEVICES_PER_PROCESS``), streams every
line they print prefixed with ``[rank]``, and returns when all have exited.

It never hangs: when one process fails, the others get ``failure_grace`` seconds to notice
(their own error, e.g. the lost-process error of the distributed runtime, is the useful
message) and are then killed by process id; past ``timeout`` every process still running is
killed by process id. On a cluster nothing here is used: the scheduler starts the processes
and ``initialize`` falls back to ``jax.distributed.initialize()``'s own detection.

Ending the launcher ends the job. Each process runs in its own process group (so a terminal's
Ctrl-C reaches the launcher alone, not a rank in the middle of a collective), and is killed
with its whole group: on SIGTERM or SIGINT to the launcher (the handlers, installed while
``launch`` runs in the main thread, terminate every group, wait ``_TERM_WAIT`` seconds, kill
what is left and re-deliver the signal to the previous handler), and, on Linux, when the
launcher dies by any means, SIGKILL included (``PR_SET_PDEATHSIG``, requested by a small
Python shim that then executes the command in the same process). Before, a rank orphaned by
a SIGTERM to the launcher ran on for about 12 s, until its heartbeats to the dead coordinator
ran out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

from multimesh_flax import errors

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "MMFLAX_COORDINATOR"
ENV_NUM_PROCESSES = "MMFLAX_NUM_PROCESSES"
ENV_PROCESS_ID = "MMFLAX_PROCESS_ID"
ENV_DEVICES = "MMFLAX_DEVICES_PER_PROCESS"
TIMED_OUT = 124  # exit status of a process killed at the launch timeout (as `timeout(1)`)
_KILL_WAIT = 5.0  # seconds to wait for a killed process to be reaped
# Seconds between SIGTERM and SIGKILL when the launcher itself is stopped: long enough for
# `mmflax train` to finish its step and save (it handles SIGTERM so), short enough for a job.
_TERM_WAIT = 10.0
_PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a child gets when its parent dies


@dataclasses.dataclass
class LaunchResult:
    """What :func:`launch` observed.

    ``returncode`` is 0 when every process exited with 0, else the first non-zero status
    (``TIMED_OUT`` when the launch timed out). ``returncodes`` and ``outputs`` are per rank
    (``outputs``: every line the process printed, stdout and stderr together).
    """

    returncode: int
    returncodes: list[int]
    outputs: list[list[str]]
    timed_out: bool = False

    def output(self, rank: int) -> str:
        """Everything process ``rank`` printed, as one string."""
        return "".join(self.outputs[rank])


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` cannot be bound because something already holds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def busy_port_message(host: str, port: int, where: str) -> str:
    """What to say about a coordinator port another program holds (``where``: who chose it)."""
    return (
        f"Expected a free TCP port for the jax.distributed coordinator, got {host}:{port} "
        f"({where}), which another program already listens on (a job still running, or one "
        f"that has not exited yet). Pick another port, or find the holder with "
        f"`ss -ltnp 'sport = :{port}'` (or `lsof -i :{port}`) and stop it."
    )


def _check(n: int, command: Sequence[str], devices_per_process: int) -> list[str]:
    if not isinstance(n, int) or n < 1:
        raise errors.LaunchArgumentError(
            f"Expected `n` as a positive number of processes, got {n!r}. Pass e.g. `n=2`."
        )
    if not isinstance(devices_per_process, int) or devices_per_process < 1:
        raise errors.LaunchArgumentError(
            f"Expected `devices_per_process` as a positive int, got {devices_per_process!r}."
        )
    if isinstance(command, str) or not command:
        raise errors.LaunchArgumentError(
            f"Expected `command` as a non-empty list of arguments, got {command!r}. Pass "
            "e.g. `[sys.executable, 'train.py']`."
        )
    return [str(c) for c in command]


def _child_env(
    rank: int, n: int, port: int, devices: int, extra: Mapping[str, str] | None
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.update(
        {
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(n),
            ENV_PROCESS_ID: str(rank),
            ENV_DEVICES: str(devices),
            "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _pump(rank: int, stream: IO[str], sink: list[str], out: IO[str] | None, lock: Any) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if out is not None:
            with lock:
                out.write(f"[{rank}] {line}")
                out.flush()
    stream.close()


def _signal_group(p: subprocess.Popen[str], sig: int) -> None:
    """Sends ``sig`` to ``p``'s process group (its own: ``launch`` starts it in one)."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:  # the group is gone: the process exited and was reaped
        pass
    except PermissionError:  # pragma: no cover - a group reused by another user's process
        p.send_signal(sig)


def _kill(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Kills every process still running with its process group, and reaps it (bounded)."""
    for p in procs:
        if p.poll() is None:
            logger.info("killing process %d", p.pid)
            _signal_group(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=_KILL_WAIT)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill the kernel ignored
            logger.warning("process %d did not exit after SIGKILL", p.pid)


def _terminate(procs: Sequence[subprocess.Popen[str]]) -> None:
    """SIGTERM to every process group still running, then SIGKILL after ``_TERM_WAIT`` s."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + _TERM_WAIT
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    _kill(procs)


class _Stopped(BaseException):
    """The launcher got SIGTERM or SIGINT while its processes ran (``signum``: which)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Turns SIGTERM/SIGINT/SIGHUP into ``_Stopped`` while the body runs (main thread only:
    elsewhere Python cannot install handlers, and the parent-death signal still applies)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _redeliver(signum: int) -> None:
    """Hands ``signum`` to the handler that was there before ``launch``, synchronously.

    ``signal.raise_signal`` alone leaves a Python handler pending until the interpreter next
    checks for signals; under load the launcher's script could end first, and a stopped
    launcher exited 0 (once in a loaded suite run). A Python handler (``KeyboardInterrupt``
    for SIGINT) is called here; the default action (termination) and ``SIG_IGN`` go through
    the OS.
    """
    handler = signal.getsignal(signum)
    if callable(handler):
        handler(signum, None)
    else:
        signal.raise_signal(signum)


# Run in the child before the command: asks for SIGKILL when the launcher dies, gives up if it
# already has, then becomes the command (exec keeps the request). A ``preexec_fn`` would do
# the same, but makes subprocess fork a process that runs JAX's threads (a RuntimeWarning).
_SHIM = (
    "import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(1, 9); "
    "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])"
)


def _die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that the child gets SIGKILL when the launcher dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-S", "-c", _SHIM, str(os.getpid()), *argv]


def _watch(
    procs: Sequence[subprocess.Popen[str]], timeout: float | None, failure_grace: float
) -> bool:
    """Waits for every process; returns whether the launch timed out."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > failure_grace:
            _kill(procs)
            return False
        if deadline is not None and now > deadline:
            _kill(procs)
            return True
        time.sleep(0.05)
    return False


def launch(
    n: int,
    command: Sequence[str],
    *,
    devices_per_process: int = 4,
    timeout: float | None = None,
    failure_grace: float = 30.0,
    env: Mapping[str, str] | None = None,
    stream: IO[str] | None | str = "stdout",
    port: int | None = None,
) -> LaunchResult:
    """Runs ``command`` in ``n`` local processes that form one ``jax.distributed`` job.

    Args:
        n: number of processes.
        command: the program and its arguments (each process runs the same one; it calls
            :func:`multimesh_flax.distributed.initialize` before any JAX operation).
        devices_per_process: CPU devices each process simulates.
        timeout: seconds after which every process still running is killed (``None``: none).
        failure_grace: seconds the others may keep running after one process failed (to
            report the failure themselves) before they are killed.
        env: extra environment variables for every process.
        stream: where the ``[rank]``-prefixed output goes: ``"stdout"`` (``sys.stdout`` at
            the time of the call), a text stream, or ``None`` (only collected).
        port: the coordinator's loopback port (``None``: a free one).

    Returns:
        A :class:`LaunchResult`; ``returncode`` is non-zero if any process failed.

    Raises:
        LaunchArgumentError: ``n``, ``devices_per_process``, ``command`` or ``port`` is
            malformed.
        CoordinatorPortError: ``port`` is already in use.

    A SIGTERM, SIGINT or SIGHUP to the launcher while the processes run ends them all (see the
    module docstring) and is then delivered to the handler that was installed before.

    Example:
        >>> import sys
        >>> from multimesh_flax.distributed import launch
        >>> code = "import os; print(os.environ['MMFLAX_PROCESS_ID'])"
        >>> result = launch(2, [sys.executable, "-c", code], stream=None, timeout=60)
        >>> result.returncode, [out[0].strip() for out in result.outputs]
        (0, ['0', '1'])
    """
    argv = _check(n, command, devices_per_process)
    if stream == "stdout":
        stream = sys.stdout
    port = _check_port(port)
    procs: list[subprocess.Popen[str]] = []
    outputs: list[list[str]] = [[] for _ in range(n)]
    pumps: list[threading.Thread] = []
    stopped, timed_out = None, False
    try:
        try:
            with _stopped_by_signals():
                timed_out = _start_and_watch(
                    _die_with_parent(argv),
                    n,
                    port,
                    devices_per_process,
                    env,
                    stream,
                    timeout,
                    failure_grace,
                    procs,
                    outputs,
                    pumps,
                )
        except _Stopped as e:  # the old handlers are back: a second Ctrl-C interrupts this
            stopped = e.signum
            logger.warning("launcher got signal %d: stopping its %d processes", stopped, n)
            _terminate(procs)
    finally:
        _kill(procs)
    for pump in pumps:
        pump.join(timeout=_KILL_WAIT)
    if stopped is not None:
        _redeliver(stopped)
    codes = [TIMED_OUT if timed_out and p.returncode < 0 else p.returncode for p in procs]
    first = next((c for c in codes if c != 0), 0)
    return LaunchResult(TIMED_OUT if timed_out else first, codes, outputs, timed_out)


def _check_port(port: int | None) -> int:
    if port is None:
        return free_port()
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise errors.LaunchArgumentError(
            f"Expected `port` as a TCP port number (1-65535) or None, got {port!r}."
        )
    if port_in_use("127.0.0.1", port):
        raise errors.CoordinatorPortError(
            busy_port_message("127.0.0.1", port, "the `port` passed to launch")
        )
    return port


def _start_and_watch(
    argv: list[str],
    n: int,
    port: int,
    devices: int,
    env: Mapping[str, str] | None,
    stream: IO[str] | None,
    timeout: float | None,
    failure_grace: float,
    procs: list[subprocess.Popen[str]],
    outputs: list[list[str]],
    pumps: list[threading.Thread],
) -> bool:
    """Starts the ``n`` processes (appending to ``procs`` and ``pumps`` as it goes, so that the
    caller can kill what started) and waits for them; returns whether the launch timed out."""
    lock = threading.Lock()
    for rank in range(n):
        proc = subprocess.Popen(
            argv,
            env=_child_env(rank, n, port, devices, env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: see the module docstring
        )
        procs.append(proc)
        pump = threading.Thread(
            target=_pump, args=(rank, proc.stdout, outputs[rank], stream, lock), daemon=True
        )
        pump.start()
        pumps.append(pump)
    return _watch(procs, timeout, failure_grace)
