"""B6 schedules: the simulator's predicted bubble against recorded timelines, per schedule.

Two pipelines, each step recorded with ``record_timeline`` (which runs ops one at a time,
so durations are real; ``recorded_bubble`` replays them overlapped in dispatch order with
the real data dependencies -- this host cannot run the submeshes at once, see B0):

* the MLP pipeline of ``bench_schedules.py`` (8 residual blocks on 4 single-device
  submeshes) under GPipe, 1F1B, interleaved 1F1B and zero-bubble H2;
* the tiny GPT on 4 stages (``parallelize_step``) under GPipe and 1F1B.

Per schedule: ``simulate(schedule)`` with unit costs, ``simulate`` with the recorded median
cost per phase (``measured_costs``), and the recorded bubble (median over calls).
"""

from __future__ import annotations

import statistics
from typing import Any

import multimesh_flax as mm
from benchmarks import _common, bench_schedules

SECTION = "B6"


def _record(step: Any, calls: int) -> dict[str, Any]:
    """Records ``calls`` blocked calls of ``step()``; returns bubbles and costs."""
    with mm.record_timeline() as timeline:
        for _ in range(calls):
            step()
    recorded = [mm.recorded_bubble(timeline, call=c) for c in range(calls)]
    costs = [mm.measured_costs(timeline, call=c) for c in range(calls)]
    median_costs = {k: statistics.median(c[k] for c in costs) for k in costs[0]}
    return {
        "recorded": statistics.median(recorded),
        "recorded_per_call": recorded,
        "costs": median_costs,
    }


def gpt(stages: int, m: int, schedule: str, calls: int) -> dict[str, Any]:
    from benchmarks import b1_step_time

    runner, owned = b1_step_time.kept_or_built(_common.TINY, stages, m, schedule)
    recorded = _record(runner.step, calls)
    sched = runner.executable.schedule
    result = {
        "pipeline": "gpt-tiny",
        "schedule": schedule,
        "stages": sched.num_stages,
        "submeshes": sched.num_submeshes,
        "microbatches": m,
        "predicted_unit_costs": mm.simulate(sched).bubble_fraction,
        "predicted_measured_costs": mm.simulate(sched, costs=recorded["costs"]).bubble_fraction,
        "recorded": recorded["recorded"],
        "recorded_per_call": recorded["recorded_per_call"],
        "measured_costs_ms": {k: 1e3 * v for k, v in recorded["costs"].items()},
    }
    if owned:
        _common.release(runner)
    return result


def mlp(schedule: str, m: int, calls: int) -> dict[str, Any]:
    r = bench_schedules.bubbles(schedule, m, width=256, batch=128, calls=calls)
    return {
        "pipeline": "mlp",
        "schedule": schedule,
        "stages": r["stages"],
        "submeshes": r["submeshes"],
        "microbatches": m,
        "predicted_unit_costs": r["predicted_bubble_unit_costs"],
        "predicted_measured_costs": r["predicted_bubble_measured_costs"],
        "recorded": r["recorded_bubble"],
        "recorded_per_call": r["recorded_bubble_per_call"],
        "measured_costs_ms": r["measured_costs_ms"],
    }


def run(quick: bool) -> dict[str, Any]:
    calls = 3 if quick else 5
    m = 4 if quick else 8
    schedules = ["1f1b"] if quick else bench_schedules.SCHEDULES
    results = [mlp(s, m, calls) for s in schedules]
    gpt_configs = [(4, 4, "1f1b")] if quick else [(4, 8, "gpipe"), (4, 8, "1f1b")]
    if _common.SMOKE:
        calls, gpt_configs = 2, [_common.SMOKE_CONFIG]
    results += [gpt(s, mb, sched, calls) for s, mb, sched in gpt_configs]
    rows = []
    for r in results:
        label = (
            f"{r['pipeline']} {r['schedule']} ({r['stages']} stages on {r['submeshes']} "
            f"submeshes, m={r['microbatches']})"
        )
        rows.append(
            _common.row(
                SECTION,
                f"{label}: bubble simulated (unit / measured costs) vs recorded",
                f"{r['predicted_unit_costs']:.3f} / {r['predicted_measured_costs']:.3f} vs "
                f"{r['recorded']:.3f}",
            )
        )
    return {"description": __doc__.splitlines()[0], "schedules": results, "rows": rows}
