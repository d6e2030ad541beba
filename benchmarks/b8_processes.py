"""B8 processes: the same pipelined step in 1 process x 8 devices and 2 processes x 4 devices.

The gpt-tiny step of B5 (2 stages, 1F1B, 4 microbatches) runs here on 8 devices, then as a
2-process ``jax.distributed`` job (``multimesh_flax.distributed.launch``, 4 CPU devices each,
gloo collectives), one stage per process. Reported:

* step time ratio (median of the timed steps, 2x4 / 1x8) and cold start ratio (building the
  step and running it once);
* bytes moved across processes per step (``ProcessDispatch.cross_process_bytes``: what the
  collective wires carry, a replicated destination counted once per device) against B5's
  analytic count of what crosses the stage boundary (activations, cotangents, tied table and
  its gradient);
* the latency of one transfer of a stage-boundary activation: ``jax.device_put`` between two
  4-device submeshes in one process, against the cross-process wire (a ``ppermute``).

``python -m benchmarks.b8_processes --child OUT --steps N`` is one process of the job. The
smoke run (the test suite's) leaves the 2-process job out: it is a minute of compiling in two
more processes, and ``tests/distributed`` launches and checks such jobs; its JSON says so. Its
one-process step is ``_common.SMOKE_CONFIG`` (2 microbatches), whose fragments B1 compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common

SECTION = "B8"
# The smoke run measures one process on the configuration every smoke section uses (B1 has
# compiled it into the smoke run's cache), not a fourth program of its own.
STAGES, MICROBATCHES, SCHEDULE = _common.SMOKE_CONFIG if _common.SMOKE else (2, 4, "1f1b")
TRANSFERS = 20  # repetitions of the single-transfer latency
SMOKE_SKIP = "not run in smoke mode (tests/distributed launches 2-process jobs)"


def _boundary_meshes() -> tuple[Any, Any]:
    import jax
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices()[:8], dtype=object).reshape(2, 4, 1)
    auto = (AxisType.Auto, AxisType.Auto)
    return tuple(Mesh(devices[s], ("data", "model"), axis_types=auto) for s in range(2))


def _boundary_aval(workload: _common.Workload) -> Any:
    import jax

    cfg = workload.config()
    shape = (workload.batch // MICROBATCHES, workload.length, cfg.embed_dim)
    return jax.ShapeDtypeStruct(shape, cfg.dtype)


def _transfer_latency(move: Any) -> float:
    """Median seconds of ``move()`` (which waits for its result), after one warm-up call."""
    move()
    return _common.median([_common.timed(move) for _ in range(TRANSFERS)])


def _local_latency(workload: _common.Workload) -> float:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    src, dst = (NamedSharding(m, PartitionSpec("data")) for m in _boundary_meshes())
    aval = _boundary_aval(workload)
    x = jax.device_put(np.ones(aval.shape, aval.dtype), src)
    return _transfer_latency(lambda: jax.block_until_ready(jax.device_put(x, dst)))


def _cross_latency(workload: _common.Workload) -> float:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from multimesh_flax.distributed import _wire

    src, dst = (NamedSharding(m, PartitionSpec("data")) for m in _boundary_meshes())
    aval = _boundary_aval(workload)
    x = jax.device_put(np.ones(aval.shape, aval.dtype), src)
    held = x if jax.process_index() == 0 else None

    def move() -> None:
        y = _wire.transfer(held, src, dst, aval)
        jax.block_until_ready(y if y is not None else x)

    return _transfer_latency(move)


def _measure_step(workload: _common.Workload, steps: int) -> dict[str, Any]:
    """Cold start (build + first step) and the median of ``steps`` timed steps."""
    import jax

    began = time.perf_counter()
    runner = _common.build_mpmd(workload, STAGES, MICROBATCHES, SCHEDULE)
    runner.batch = jax.tree.map(np.asarray, runner.batch)  # host data: any process places it
    runner.step()
    cold = time.perf_counter() - began
    times = [_common.timed(runner.step) for _ in range(steps)]
    exe = runner.executable
    processes = getattr(exe, "processes", None)
    result = {
        "cold_s": cold,
        "step_s": _common.median(times),
        "step_times_s": times,
        "transfer_bytes": exe.transfer_bytes(),
        "cross_process_bytes": processes.cross_process_bytes() if processes else 0,
    }
    _common.release(runner)
    return result


def _child(out: str, steps: int) -> None:
    from multimesh_flax.distributed import initialize

    initialize()
    import jax

    result = _measure_step(_common.TINY, steps)
    result["transfer_latency_s"] = _cross_latency(_common.TINY)
    if jax.process_index() == 0:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")


def _two_processes(steps: int) -> dict[str, Any]:
    from multimesh_flax.distributed import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b8.json"
        command = [sys.executable, "-m", "benchmarks.b8_processes", "--child", str(out)]
        result = launch(2, [*command, "--steps", str(steps)], timeout=900, stream=None)
        if result.returncode != 0 or not out.exists():
            tail = result.output(0)[-2000:] + result.output(1)[-2000:]
            return {"failed": f"exit {result.returncode}", "log": tail}
        return json.loads(out.read_text())


def run(quick: bool) -> dict[str, Any]:
    from benchmarks import b5_transfers

    steps = 2 if _common.SMOKE else 3 if quick else 10
    workload = _common.TINY
    one = _measure_step(workload, steps)
    one["transfer_latency_s"] = _local_latency(workload)
    two = {"skipped": SMOKE_SKIP} if _common.SMOKE else _two_processes(steps)
    analytic = b5_transfers.analytic(workload, STAGES)["total"]
    data: dict[str, Any] = {"one_process": one, "two_processes": two, "analytic_bytes": analytic}
    if "failed" in two or "skipped" in two:
        outcome = two.get("failed") or two["skipped"]
        data["rows"] = [_common.row(SECTION, "2 processes x 4 devices", outcome)]
        return data
    label = f"gpt-tiny S={STAGES} m={MICROBATCHES} {SCHEDULE}"
    data["rows"] = [
        _common.row(
            SECTION,
            f"{label}: step time, 2 processes x 4 / 1 x 8 "
            f"({two['step_s'] * 1e3:.1f} / {one['step_s'] * 1e3:.1f} ms)",
            round(two["step_s"] / one["step_s"], 2),
        ),
        _common.row(
            SECTION,
            f"{label}: cold start (build + first step), 2 x 4 / 1 x 8 "
            f"({two['cold_s']:.1f} / {one['cold_s']:.1f} s)",
            round(two["cold_s"] / one["cold_s"], 2),
        ),
        _common.row(
            SECTION,
            f"{label}: bytes across processes per step / analytic "
            f"({two['cross_process_bytes']:,} / {analytic:,})",
            round(two["cross_process_bytes"] / analytic, 3),
        ),
        _common.row(
            SECTION,
            "one stage-boundary activation transfer: cross-process wire / in-process "
            f"device_put ({two['transfer_latency_s'] * 1e6:,.0f} / "
            f"{one['transfer_latency_s'] * 1e6:,.0f} us)",
            round(two["transfer_latency_s"] / one["transfer_latency_s"], 1),
        ),
    ]
    return data


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.b8_processes")
    parser.add_argument("--child", required=True, help="JSON file process 0 writes")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    _child(args.child, args.steps)
