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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from multimesh_flax import errors

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "MMFLAX_COORDINATOR"
ENV_NUM_PROCESSES = "MMFLAX_NUM_PROCESSES"
ENV_PROCESS_ID = "MMFLAX_PROCESS_ID"
ENV_DEVICES = "MMFLAX_DEVICES_PER_PROCESS"
TIMED_OUT = 124  # exit status of a process killed at the launch timeout (as `timeout(1)`)
_KILL_WAIT = 5.0  # seconds to wait for a killed process to be reaped


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


def _kill(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Kills every process still running, by process id, and reaps it (bounded)."""
    for p in procs:
        if p.poll() is None:
            logger.info("killing process %d", p.pid)
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=_KILL_WAIT)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill the kernel ignored
            logger.warning("process %d did not exit after SIGKILL", p.pid)


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

    Returns:
        A :class:`LaunchResult`; ``returncode`` is non-zero if any process failed.

    Raises:
        LaunchArgumentError: ``n``, ``devices_per_process`` or ``command`` is malformed.

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
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    outputs: list[list[str]] = [[] for _ in range(n)]
    lock = threading.Lock()
    pumps = []
    try:
        for rank in range(n):
            proc = subprocess.Popen(
                argv,
                env=_child_env(rank, n, port, devices_per_process, env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                bufsize=1,
            )
            procs.append(proc)
            pump = threading.Thread(
                target=_pump, args=(rank, proc.stdout, outputs[rank], stream, lock), daemon=True
            )
            pump.start()
            pumps.append(pump)
        timed_out = _watch(procs, timeout, failure_grace)
    finally:
        _kill(procs)
    for pump in pumps:
        pump.join(timeout=_KILL_WAIT)
    codes = [TIMED_OUT if timed_out and p.returncode < 0 else p.returncode for p in procs]
    first = next((c for c in codes if c != 0), 0)
    return LaunchResult(TIMED_OUT if timed_out else first, codes, outputs, timed_out)
