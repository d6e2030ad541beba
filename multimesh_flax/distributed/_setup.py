"""Joining a ``jax.distributed`` job: under the local launcher, or under a cluster scheduler.

:func:`initialize` is the first call of a multi-process script. Under
:func:`~multimesh_flax.distributed.launch` (or ``mmflax launch``) it reads the launcher's
environment, gives this process its CPU devices (``jax_num_cpu_devices``), selects the gloo CPU
collectives (cross-process collectives on CPU need them) and connects to the coordinator. Without
that environment it calls ``jax.distributed.initialize()`` with no address, which detects
SLURM, Open MPI and TPU pods by itself (GPUs then use NCCL).

The heartbeat timeout bounds how long the job survives a lost process: the coordination
service declares a process dead after ``heartbeat_timeout`` seconds without a heartbeat and
every other process is then stopped with an error naming it (see ``docs/errors.md``).
"""

from __future__ import annotations

import logging
import os

import jax

from multimesh_flax import errors
from multimesh_flax.distributed import _exchange, _launch, _sequence, _watchdog

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT = 10  # seconds; jax's own default (100 s) is for real clusters
SHUTDOWN_TIMEOUT = 10  # seconds a launched process waits for the others when it exits


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise errors.DistributedSetupError(
            f"Expected the environment variable {name} as a non-negative int, got {raw!r}. "
            "Start the script with `mmflax launch` or `multimesh_flax.distributed.launch`."
        )
    return value


def launched() -> bool:
    """Whether this process was started by the local launcher."""
    return _launch.ENV_PROCESS_ID in os.environ


def initialize(*, heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT) -> None:
    """Connects this process to its job: call it before any JAX operation.

    Under the local launcher, sets this process's CPU device count and gloo collectives and
    connects to the launcher's coordinator; otherwise calls ``jax.distributed.initialize()``,
    which detects the cluster (SLURM, Open MPI, TPU). Calling it twice is harmless.

    Args:
        heartbeat_timeout: seconds without a heartbeat after which a process counts as lost
            and the others stop (the bound of the lost-process error).

    Raises:
        DistributedSetupError: the launcher's environment is malformed.
    """
    if jax.distributed.is_initialized():
        return
    if not launched():
        logger.info("no launcher environment: jax.distributed.initialize() detects the cluster")
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout)
    else:
        _join_launched(heartbeat_timeout)
    if jax.process_count() > 1:
        _watchdog.start(
            _exchange.client(), jax.process_index(), jax.process_count(), heartbeat_timeout
        )
        _sequence.start(_exchange.client(), jax.process_index(), jax.process_count())


def _join_launched(heartbeat_timeout: int) -> None:
    rank = _env_int(_launch.ENV_PROCESS_ID)
    count = _env_int(_launch.ENV_NUM_PROCESSES)
    devices = _env_int(_launch.ENV_DEVICES)
    address = os.environ[_launch.ENV_COORDINATOR]
    if rank == 0:  # the process that starts the coordinator's server
        _check_coordinator_port(address)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=count,
        process_id=rank,
        heartbeat_timeout_seconds=heartbeat_timeout,
        initialization_timeout=60,
        # A process that fails waits at exit for the others to reach the shutdown barrier;
        # bounded, so that the others' watchdogs soon see it gone.
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT,
    )
    logger.info("process %d of %d joined with %d CPU devices", rank, count, devices)


def _check_coordinator_port(address: str) -> None:
    """Raises ``CoordinatorPortError`` if the coordinator's port is taken (process 0 only).

    jaxlib reports a taken port as "Failed to start RPC server" (or crashed, 1 run in 3 on
    the 2-core host), and the other processes waited ``initialization_timeout`` for it.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise errors.DistributedSetupError(
            f"Expected {_launch.ENV_COORDINATOR} as HOST:PORT, got {address!r}."
        ) from None
    for bind_host in dict.fromkeys([host, "0.0.0.0"]):
        try:
            taken = _launch.port_in_use(bind_host, number)
        except OSError:  # not an address of this machine: jax reports what it finds
            continue
        if taken:
            raise errors.CoordinatorPortError(
                _launch.busy_port_message(host, number, f"{_launch.ENV_COORDINATOR} of process 0")
            )
