"""B2 dispatch overhead: what the MPMD runtime adds per fragment and per step.

A GPT so small that compute is negligible (4 blocks of width 32, batch 8, length 8), so a
step's wall time is dispatch. Per configuration, three things are timed alternately:

* ``call`` -- the ``parallelize_step`` step function, as a user calls it;
* ``replay`` -- the same jitted fragments and ``device_put`` transfers called by hand in the
  same order with no bookkeeping (JAX's own cost for the same work);
* ``jit`` -- plain ``jax.jit`` of the same step, data parallel over the 8 devices.

Each call and replay is also timed up to the moment it returns, before waiting for its
results: that *host time* is dispatch alone (JAX runs the programs asynchronously), free of
the compute noise in whole-step times.
``runtime_us_per_fragment = (host time of call - host time of replay) / fragments`` is the
runtime's own cost (signature lookup, argument checks, slot bookkeeping, frees); target at
most 50 us. ``per step`` numbers are the same differences for a whole step.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import _common

SECTION = "B2"
TARGET_US = 50.0
WORKLOAD = _common.Workload(
    "gpt-tiny",
    batch=8,
    length=8,
    overrides=(("num_layers", 4), ("embed_dim", 32), ("mlp_dim", 64), ("dtype", jnp.float32)),
)


class _Alternating:
    """One state passed around between the step function and a hand replay of its ops, so
    the two can be timed round by round on the same state (the step donates its state)."""

    def __init__(self, runner: _common.MpmdRunner) -> None:
        self.runner = runner
        self.exe = runner.executable
        self.tree = jax.tree_util.tree_structure(runner.state)
        self.batch_leaves = jax.tree_util.tree_leaves(runner.batch)
        self.host: dict[str, list[float]] = {"call": [], "replay": []}

    def call(self) -> None:
        start = time.perf_counter()
        loss, state = self.runner.step_fn(self.runner.state, self.runner.batch)
        self.host["call"].append(time.perf_counter() - start)
        jax.block_until_ready((loss, state))
        self.runner.state = state

    def replay(self) -> None:
        start = time.perf_counter()
        leaves = [*jax.tree_util.tree_leaves(self.runner.state), *self.batch_leaves]
        outs = _common.replay(self.exe, leaves)
        self.host["replay"].append(time.perf_counter() - start)
        jax.block_until_ready(outs)
        self.runner.state = jax.tree_util.tree_unflatten(self.tree, outs[1:])


def measure(stages: int, m: int, schedule: str, rounds: int, base: Any) -> dict[str, Any]:
    runner = _common.build_mpmd(WORKLOAD, stages, m, schedule)
    _common.warm(runner, 3)
    exe = runner.executable
    both = _Alternating(runner)
    calls, replays, jits = _common.interleaved([both.call, both.replay, base.step], rounds)
    fragments = _common.fragment_count(exe)
    call, rep, jit = (_common.median(t) for t in (calls, replays, jits))
    host_call, host_rep = (_common.median(both.host[k]) for k in ("call", "replay"))
    _common.release(runner)
    return {
        "stages": stages,
        "microbatches": m,
        "schedule": schedule,
        "fragments": fragments,
        "transfers": _common.transfer_count(exe),
        "call_us": 1e6 * call,
        "replay_us": 1e6 * rep,
        "jit_us": 1e6 * jit,
        "call_us_per_fragment": 1e6 * call / fragments,
        "replay_us_per_fragment": 1e6 * rep / fragments,
        "host_call_us": 1e6 * host_call,
        "host_call_us_per_fragment": 1e6 * host_call / fragments,
        "host_replay_us": 1e6 * host_rep,
        "runtime_us_per_step": 1e6 * (host_call - host_rep),
        "runtime_us_per_fragment": 1e6 * (host_call - host_rep) / fragments,
        "whole_step_difference_us": 1e6 * (call - rep),
        "extra_us_per_step_vs_jit": 1e6 * (call - jit),
    }


def run(quick: bool) -> dict[str, Any]:
    rounds = 30 if quick else 100
    configs = (
        [(2, 1, "gpipe"), (2, 4, "1f1b")]
        if quick
        else [
            (2, 1, "gpipe"),
            (2, 4, "1f1b"),
            (4, 4, "1f1b"),
            (4, 8, "gpipe"),
        ]
    )
    base = _common.build_jit(WORKLOAD, "data-parallel 8")
    _common.warm(base, 3)
    results = [measure(s, m, sched, rounds, base) for s, m, sched in configs]
    rows = []
    for r in results:
        label = (
            f"S={r['stages']} m={r['microbatches']} {r['schedule']} ({r['fragments']} fragments)"
        )
        rows.append(
            _common.row(
                SECTION,
                f"{label}: runtime overhead per fragment",
                round(r["runtime_us_per_fragment"], 1),
                target=f"<= {TARGET_US:.0f} us",
                passed=r["runtime_us_per_fragment"] <= TARGET_US,
                unit="us",
            )
        )
        rows.append(
            _common.row(
                SECTION,
                f"{label}: runtime overhead per step",
                round(r["runtime_us_per_step"]),
                unit="us",
            )
        )
        rows.append(
            _common.row(
                SECTION,
                f"{label}: host time to dispatch a fragment (JAX's dispatch included)",
                round(r["host_call_us_per_fragment"]),
                unit="us",
            )
        )
        rows.append(
            _common.row(
                SECTION,
                f"{label}: step vs jax.jit of the same step",
                round(r["extra_us_per_step_vs_jit"]),
                unit="us more",
            )
        )
    _common.release(base)
    return {
        "description": __doc__.splitlines()[0],
        "workload": WORKLOAD.describe(),
        "rounds": rounds,
        "configs": results,
        "rows": rows,
    }
