"""Where a pipelined step's wall time goes: host dispatch, device compute per submesh,
transfers, and what is left (waiting).

* **Runtime overhead** is the CPU time of the dispatching thread during a step
  (``time.thread_time``) outside JAX's calls of the step's programs and transfers
  (:class:`JaxClock`): argument checks, the op loop, slots and frees -- what our runtime
  adds to calling the same programs by hand. CPU time, not wall time: it does not grow when
  another process holds the core, so it reproduces from run to run (the median of ``rounds``
  steps). Inside the calls the thread's time is JAX's dispatch and, for programs XLA on CPU
  deems cheap, the program itself, which then runs before the call returns; that is
  reported as "inside JAX calls".
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

import jax

from benchmarks import _common


class JaxClock:
    """Adds up this thread's CPU time inside an executable's fragment calls and
    ``jax.device_put`` while active (``with clock:``)."""

    def __init__(self, exe: Any) -> None:
        self.exe = exe
        self.inside = 0.0
        self._saved: list[tuple[int, Any]] = []

    def _timed(self, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside += time.thread_time() - start

        return wrapped

    def __enter__(self) -> JaxClock:
        self.inside = 0.0
        fns = self.exe.state.fns  # what each RUN op calls (see core/run/_ops.py)
        self._saved = [(i, fns[i]) for i, op in enumerate(self.exe.ops) if op.kind == 0]
        for i, fn in self._saved:
            fns[i] = self._timed(fn)
        self._device_put = jax.device_put
        jax.device_put = self._timed(self._device_put)
        return self

    def __exit__(self, *_: Any) -> None:
        jax.device_put = self._device_put
        for i, fn in self._saved:
            self.exe.state.fns[i] = fn


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


def runtime_cpu_seconds(runner: _common.MpmdRunner, rounds: int) -> tuple[float, float]:
    """Medians over ``rounds`` steps of this thread's CPU time outside and inside JAX's calls
    of the step's programs and transfers."""
    outside, inside = [], []
    with JaxClock(runner.executable) as clock:
        for _ in range(rounds):
            clock.inside, start = 0.0, time.thread_time()
            runner.step()
            outside.append(time.thread_time() - start - clock.inside)
            inside.append(clock.inside)
    return _common.median(outside), _common.median(inside)


def step_breakdown(runner: _common.MpmdRunner, step_s: float, rounds: int) -> dict[str, Any]:
    """The account of one pipelined step whose median wall time is ``step_s``."""
    ops = len(runner.executable.ops)
    runtime, inside = runtime_cpu_seconds(runner, rounds)
    recorded = recorded_seconds(runner)
    busiest = max(recorded["compute_per_submesh_s"].values())
    return {
        "step_s": step_s,
        "ops": ops,
        "runtime_cpu_s": runtime,
        "runtime_per_op_us": 1e6 * runtime / ops,
        "inside_jax_calls_cpu_s": inside,
        **recorded,
        "busiest_compute_s": busiest,
        "beyond_busiest_s": step_s - busiest,
    }


def peer_breakdown(peer: Any, step_s: float, rounds: int) -> dict[str, Any]:
    """The SPMD peer's step as far as it splits: one program, so the thread's CPU time in its
    call (dispatch, and the program if XLA runs it inline) and the rest of the step (its
    compute on XLA's threads, collectives and waiting)."""
    cpu = host_cpu_seconds(peer.step, rounds)
    return {"step_s": step_s, "ops": 1, "call_cpu_s": cpu, "rest_s": step_s - cpu}
