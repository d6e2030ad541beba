"""Pipeline schedules on the MPMD runtime: predicted vs recorded bubble, dispatch cost per op.

A 4-submesh pipeline (one CPU device each) of 8 MLP blocks, ``value_and_grad`` of a
mean-squared error, microbatched into ``m`` microbatches with each schedule:

* ``gpipe``, ``1f1b``, ``zero-bubble-h1``, ``zero-bubble-h2``, ``zero-bubble-auto``: 4 stages
  of 2 blocks;
* ``interleaved-1f1b``: 8 stages of 1 block, 2 per submesh (``interleave=2``);
* ``zero-bubble-v``: 8 stages of 1 block on a V (stage ``s`` and ``7 - s`` on device ``s``).

Reported per schedule (JSON on stdout and in ``benchmarks/results/schedules.json``):

* ``predicted_bubble_unit_costs`` -- ``simulate(schedule)`` with F = B = W = 1;
* ``predicted_bubble_measured_costs`` -- ``simulate`` with the recorded median duration per
  phase and per transfer (``measured_costs``); ``predicted_bubble_overlapped``: the same
  with steps overlapping (``steady_bubble_fraction``), and ``peak_activation_sets`` per
  submesh;
* ``recorded_bubble`` -- ``recorded_bubble`` of the recorded step: the recorded per-op
  durations replayed in the runtime's dispatch order with real data dependencies (the
  recording itself runs ops one at a time; this host has 2 cores, so the 4 submeshes cannot
  really overlap). Median over ``--calls`` recorded steps;
* ``ops``, ``runs``: ops (fragment runs + transfers) and fragment runs per step;
* ``dispatch_us_per_op`` -- on a model so small that compute is negligible, the wall time of
  a step divided by its ops (JAX's own dispatch included), and ``runtime_us_per_op``: that
  minus replaying the same jitted fragments and transfers by hand, i.e. what our runtime adds.

Run: ``.venv/bin/python benchmarks/bench_schedules.py [--m 8] [--width 512] [--calls 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402

import multimesh_flax as mm  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import replay  # noqa: E402
from multimesh_flax.core.declare import SCHEDULE_NAMES  # noqa: E402

SUBMESHES = 4
BLOCKS = 8
SCHEDULES = [name for name in SCHEDULE_NAMES if name != "custom"]
TWO_PER_SUBMESH = ("interleaved-1f1b", "zero-bubble-v")


def block(params: dict, x: jax.Array) -> jax.Array:
    """A residual MLP block."""
    return x + jax.nn.gelu(x @ params["w1"]) @ params["w2"]


def make_loss(schedule: str):
    """The loss over 8 blocks, cut into stages for ``schedule``; stage s on the device the
    schedule gives it (``s % 4``, or on a V)."""
    per_stage = 1 if schedule in TWO_PER_SUBMESH else BLOCKS // SUBMESHES
    stages = BLOCKS // per_stage
    rows = mm.core.declare.stage_rows(schedule, stages, SUBMESHES)

    def stage_fn(params, x):
        for p in params:
            x = block(p, x)
        return x

    tasks = [
        mm.task(stage_fn, name=f"stage{s}", mesh=mm.TaskMesh(devices=[rows[s]]))
        for s in range(stages)
    ]

    def loss(params, batch):
        x, y = batch
        for s, t in enumerate(tasks):
            x = t(params[s * per_stage : (s + 1) * per_stage], x)
        return jnp.mean((x - y) ** 2)

    return loss


def make_inputs(width: int, batch: int):
    keys = jax.random.split(jax.random.key(0), BLOCKS + 2)
    params = [
        {
            "w1": jax.random.normal(k, (width, 2 * width)) / jnp.sqrt(width),
            "w2": jax.random.normal(jax.random.fold_in(k, 1), (2 * width, width))
            / jnp.sqrt(2 * width),
        }
        for k in keys[:BLOCKS]
    ]
    data = (
        jax.random.normal(keys[-2], (batch, width)),
        jax.random.normal(keys[-1], (batch, width)),
    )
    return params, data


def make_step(schedule: str, m: int, batch: int):
    options = {"interleave": 2} if schedule == "interleaved-1f1b" else {}
    mb_loss = mm.microbatch(
        make_loss(schedule), 0, batch // m, argnum=1, schedule=schedule, reduce="mean", **options
    )
    return mm.jit(jax.value_and_grad(mb_loss))


def _placed(step, params, data):
    exe = step.executable(params, data)
    leaves, tree = jax.tree.flatten((params, data))
    return jax.tree.unflatten(tree, jax.device_put(leaves, exe.input_shardings))


def bubbles(schedule: str, m: int, width: int, batch: int, calls: int) -> dict:
    params, data = make_inputs(width, batch)
    step = make_step(schedule, m, batch)
    jax.block_until_ready(step(params, data))
    params, data = _placed(step, params, data)
    jax.block_until_ready(step(params, data))
    exe = step.executable(params, data)
    with mm.record_timeline() as timeline:
        for _ in range(calls):
            jax.block_until_ready(step(params, data))
    recorded = [mm.recorded_bubble(timeline, call=c) for c in range(calls)]
    costs = [mm.measured_costs(timeline, call=c) for c in range(calls)]
    median_costs = {k: statistics.median(c[k] for c in costs) for k in costs[0]}
    schedule_data = exe.schedule
    predicted = mm.simulate(schedule_data, costs=median_costs)
    return {
        "stages": schedule_data.num_stages,
        "submeshes": schedule_data.num_submeshes,
        "predicted_bubble_unit_costs": mm.simulate(schedule_data).bubble_fraction,
        "predicted_bubble_measured_costs": predicted.bubble_fraction,
        "predicted_bubble_overlapped": predicted.steady_bubble_fraction,
        "peak_activation_sets": list(predicted.peak_in_flight),
        "recorded_bubble": statistics.median(recorded),
        "recorded_bubble_per_call": recorded,
        "measured_costs_ms": {k: 1e3 * v for k, v in median_costs.items()},
        "ops": len(exe.ops),
        "runs": sum(op.kind == 0 for op in exe.ops),
        "step_ms": 1e3 * _median_call(lambda: step(params, data), 2 * calls),
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _median_call(fn, steps: int) -> float:
    return statistics.median(_timed(fn) for _ in range(steps))


def dispatch_overhead(schedule: str, m: int, steps: int) -> dict:
    """Per-op cost of a step whose compute is negligible (width 8, 2 rows per microbatch)."""
    params, data = make_inputs(8, 2 * m)
    step = make_step(schedule, m, 2 * m)
    jax.block_until_ready(step(params, data))
    params, data = _placed(step, params, data)
    exe = step.executable(params, data)
    leaves = jax.tree.leaves((params, data))
    calls, hand = [], []
    for _ in range(steps):  # alternate, so load changes on the host hit both alike
        calls.append(_timed(lambda: step(params, data)))
        hand.append(_timed(lambda: replay(exe, leaves)))
    t_call, t_hand = statistics.median(calls), statistics.median(hand)
    ops = len(exe.ops)
    return {
        "ops": ops,
        "dispatch_us_per_op": 1e6 * t_call / ops,
        "jax_only_us_per_op": 1e6 * t_hand / ops,
        "runtime_us_per_op": 1e6 * (t_call - t_hand) / ops,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "schedules.json"))
    args = parser.parse_args()
    result = {
        "jax": jax.__version__,
        "host_cpus": os.cpu_count(),
        "m": args.m,
        "width": args.width,
        "batch": args.batch,
        "blocks": BLOCKS,
        "submeshes": SUBMESHES,
        "schedules": {
            name: bubbles(name, args.m, args.width, args.batch, args.calls) for name in SCHEDULES
        },
        "dispatch": {name: dispatch_overhead(name, args.m, args.steps) for name in SCHEDULES},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
