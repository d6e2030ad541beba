"""Where a pipelined step's wall time goes: host dispatch, device compute per submesh,
transfers, and what is left (waiting).

* **Host dispatch** is the CPU time of the dispatching thread during a step
  (``time.thread_time``). XLA runs every program on its own threads, so this thread's CPU
  time is the host's own work between ops: argument checks, the op loop, JAX's dispatch of
  each program. Unlike wall time it does not grow when another process takes the cores, so it
  reproduces from run to run (the median of ``rounds`` steps); divided by the op count it is
  the runtime's cost per op.
* **Compute per submesh** and **transfers** come from one step recorded with
  ``mm.record_timeline()``, which waits for each op before the next: an op's duration is its
  own work, with no other op overlapping it (plus its dispatch and the wait, so these are
  upper bounds).
* **Beyond the busiest submesh**: the step's wall time minus the compute of the submesh with
  the most. A perfectly overlapped pipeline would get it down to the transfers on the
  critical path; the rest is bubble, host time on the critical path and waiting.

Example:
    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda x: x @ x)
    >>> x = jnp.ones((64, 64))
    >>> cpu = host_cpu_seconds(lambda: f(x).block_until_ready(), rounds=3)
    >>> 0 < cpu < 1
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks import _common


def host_cpu_seconds(step: Callable[[], Any], rounds: int) -> float:
    """The median CPU time of this thread across ``rounds`` calls of ``step``."""
    samples = []
    for _ in range(rounds):
        start = time.thread_time()
        step()
        samples.append(time.thread_time() - start)
    return _common.median(samples)


def recorded_seconds(runner: _common.MpmdRunner) -> dict[str, Any]:
    """Compute seconds per submesh and transfer seconds of one recorded step."""
    import multimesh_flax as mm

    with mm.record_timeline() as timeline:
        runner.step()
    compute: dict[str, float] = {}
    transfers = 0.0
    for event in timeline.events:
        if event.kind == "transfer":
            transfers += event.end - event.start
        else:
            place = ",".join(map(str, event.place))
            compute[place] = compute.get(place, 0.0) + event.end - event.start
    return {"compute_per_submesh_s": compute, "transfers_s": transfers}


def step_breakdown(runner: _common.MpmdRunner, step_s: float, rounds: int) -> dict[str, Any]:
    """The account of one pipelined step whose median wall time is ``step_s``."""
    ops = len(runner.executable.ops)
    host = host_cpu_seconds(runner.step, rounds)
    recorded = recorded_seconds(runner)
    busiest = max(recorded["compute_per_submesh_s"].values())
    return {
        "step_s": step_s,
        "ops": ops,
        "host_dispatch_s": host,
        "host_per_op_us": 1e6 * host / ops,
        **recorded,
        "busiest_compute_s": busiest,
        "beyond_busiest_s": step_s - busiest,
    }


def peer_breakdown(peer: Any, step_s: float, rounds: int) -> dict[str, Any]:
    """The SPMD peer's step as far as it splits: one program, so host dispatch and the rest
    (its compute, collectives and waiting, which XLA runs as one)."""
    host = host_cpu_seconds(peer.step, rounds)
    return {"step_s": step_s, "ops": 1, "host_dispatch_s": host, "device_s": step_s - host}
