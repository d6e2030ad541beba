"""Ending a 2-process job in order is not a lost process.

The watchdog (``multimesh_flax.distributed._watchdog``) ends a process whose job lost another
one. Its poll (the coordination service's live-process query) is a rendezvous of the
processes' watchdogs, so once one process stops polling the other's poll waits until the job
shuts down. Neither an explicit ``jax.distributed.shutdown()`` nor the shutdown at interpreter
exit may then be reported as a lost process, and the poll must not be left running into the
interpreter's finalization (it aborted the process there: "terminate called after throwing an
instance of ''"). Each job staggers its processes, so that one process shuts down or exits
while the other is still working.
"""

from __future__ import annotations

import sys

import pytest

from multimesh_flax.distributed import launch

# Process 1 works 1.5 s longer than process 0, then both end; after an explicit shutdown each
# lives on for 1 s (10 watchdog polls), long enough for a spurious lost-process report.
JOB = """
import sys, time
from multimesh_flax.distributed import initialize
initialize(heartbeat_timeout=3)
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
rank = jax.process_index()
seen = multihost_utils.process_allgather(jnp.float32(rank))  # a collective over both
time.sleep(1.5 * rank)
if sys.argv[1] == "explicit":
    jax.distributed.shutdown()
    assert not jax.distributed.is_initialized()
    time.sleep(1.0)
print("finished", seen.tolist(), flush=True)
"""


@pytest.mark.parametrize("ending", ["explicit", "at_exit"])
def test_an_orderly_shutdown_is_not_a_lost_process(ending):
    result = launch(
        2,
        [sys.executable, "-c", JOB, ending],
        devices_per_process=2,
        timeout=90,
        failure_grace=15,
        stream=None,
    )
    outputs = result.output(0) + result.output(1)
    assert result.returncodes == [0, 0], outputs[-3000:]
    assert "ProcessLostError" not in outputs and not result.timed_out
    for rank in range(2):
        assert "finished [0.0, 1.0]" in result.output(rank)
