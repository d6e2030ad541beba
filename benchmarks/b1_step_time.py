"""B1 step time: pipelined GPT training steps against the best plain ``jax.jit`` layout.

For each workload (``gpt-tiny`` with 4 blocks; ``gpt-small`` at a reduced batch and sequence
length) the ``jax.jit`` baselines of ``_common.LAYOUTS`` (two of them in a smoke run) are
timed together, round by round, and the fastest is *the* baseline. Then every pipelined
configuration -- 2 and 4 stages, ``m`` microbatches, GPipe and 1F1B (identical for
``m = 1``, run once) -- is timed alternating step by step with that baseline; the reported
ratio is the median step time of the pipeline over the baseline's median over the same
rounds. Target: at most 1.10 for
``m <= 4``. Compilations during the timed steps are counted too (they must be 0).

For ``gpt-tiny`` every ``m > 1`` configuration is also timed against ``jax.jit`` in the best
layout accumulating the same ``m`` microbatches in one program: that separates what
microbatching itself costs on this host (smaller matrix products, a gradient reduction per
microbatch) from what the pipeline adds.
"""

from __future__ import annotations

from typing import Any

from benchmarks import _common

SECTION = "B1"
TARGET = 1.10

# Runners of the tiny workload, kept for the later sections (they reuse the compiled steps),
# and each workload's results (B3 reads gpt-small's cold first steps from them).
KEPT: dict[str, _common.MpmdRunner] = {}
RESULTS: dict[str, dict[str, Any]] = {}


def kept_or_built(
    workload: _common.Workload, stages: int, m: int, schedule: str
) -> tuple[_common.MpmdRunner, bool]:
    """B1's compiled runner for this configuration, or a new warmed one; the flag says
    whether it is new (then the caller releases it)."""
    runner = KEPT.get(_common.mpmd_name(workload, stages, m, schedule))
    if runner is not None:
        return runner, False
    runner = _common.build_mpmd(workload, stages, m, schedule)
    _common.warm(runner)
    return runner, True


def grid(workload: _common.Workload, quick: bool) -> list[tuple[int, int, str]]:
    """``(stages, microbatches, schedule)`` configurations measured for ``workload``."""
    if _common.SMOKE:
        return [_common.SMOKE_CONFIG]
    if quick:  # the test suite's run: 2 stages with 1 and with 4 microbatches
        return [(2, 1, "gpipe"), (2, 4, "1f1b")]
    if workload.preset == "gpt-small":  # a minute of compilation each on this host
        return [(2, 1, "gpipe"), (2, 4, "1f1b"), (4, 4, "1f1b"), (4, 8, "1f1b")]
    out = []
    for stages in (2, 4):
        for m in (1, 2, 4, 8):
            for schedule in ("gpipe", "1f1b"):
                if m > 1 or schedule == "gpipe":
                    out.append((stages, m, schedule))
    return out


def rounds_for(workload: _common.Workload, quick: bool) -> int:
    if workload.preset == "gpt-small":
        return 3
    if _common.SMOKE:
        return 2
    return 5 if quick else 15


def baselines(workload: _common.Workload, rounds: int) -> tuple[dict[str, Any], Any]:
    """Times the three ``jax.jit`` layouts together; returns results and the fastest."""
    runners, layouts = [], []
    results: dict[str, Any] = {}
    for layout in _common.compared_layouts():
        problem = _common.layout_problem(workload, layout)
        if problem is not None:
            results[layout] = {"skipped": problem}
            continue
        with _common.count_compiles() as compiles:
            runner = _common.build_jit(workload, layout)
            first = _common.warm(runner)
        runners.append(runner)
        layouts.append(layout)
        results[layout] = {"first_step_s": first, "compiles": compiles["count"]}
    times = _common.interleaved([r.step for r in runners], rounds)
    for layout, t in zip(layouts, times, strict=True):
        results[layout]["median_ms"] = 1e3 * _common.median(t)
    best = min(range(len(runners)), key=lambda i: _common.median(times[i]))
    for i, runner in enumerate(runners):
        if i != best:
            _common.release(runner)
    return results, runners[best]


def accumulated_baselines(
    workload: _common.Workload, base: Any, quick: bool
) -> dict[int, _common.JitRunner]:
    """Per ``m > 1`` of the grid, ``jax.jit`` in the best layout accumulating ``m``
    microbatches in one program (gpt-tiny only: a gpt-small compile costs a minute)."""
    if workload.preset != "gpt-tiny":
        return {}
    ms = sorted({m for _, m, _ in grid(workload, quick) if m > 1})
    runners = {m: _common.build_jit(workload, base.layout, microbatches=m) for m in ms}
    for runner in runners.values():
        _common.warm(runner)
    return runners


def measure_config(
    workload: _common.Workload,
    stages: int,
    m: int,
    schedule: str,
    base: Any,
    rounds: int,
    accumulated: Any = None,
) -> tuple[dict[str, Any], _common.MpmdRunner]:
    with _common.count_compiles() as cold:
        runner = _common.build_mpmd(workload, stages, m, schedule)
        first = _common.warm(runner)
    exe = runner.executable
    programs = [runner.step, base.step] + ([accumulated.step] if accumulated else [])
    with _common.count_compiles() as steady:
        mpmd_t, base_t, *acc_t = _common.interleaved(programs, rounds)
    data, model = _common.stage_layout(workload, stages, m)
    result = {
        "stages": stages,
        "microbatches": m,
        "schedule": schedule,
        "stage_mesh": {"data": data, "model": model},
        "median_ms": 1e3 * _common.median(mpmd_t),
        "baseline_median_ms": 1e3 * _common.median(base_t),
        "ratio": _common.median(mpmd_t) / _common.median(base_t),
        "first_step_s": first,
        "compiles_first_step": cold["count"],
        "compiles_timed_steps": steady["count"],
        "fragments": _common.fragment_count(exe),
        "transfers": _common.transfer_count(exe),
        "executables": exe.compile_count(),
    }
    if acc_t:
        result["accumulated_median_ms"] = 1e3 * _common.median(acc_t[0])
        result["ratio_to_accumulated"] = _common.median(mpmd_t) / _common.median(acc_t[0])
        result["accumulated_to_baseline"] = _common.median(acc_t[0]) / _common.median(base_t)
    return result, runner


def run_workload(workload: _common.Workload, quick: bool, keep: bool) -> dict[str, Any]:
    rounds = rounds_for(workload, quick)
    base_results, base = baselines(workload, rounds)
    accumulated = accumulated_baselines(workload, base, quick)
    configs = []
    for stages, m, schedule in grid(workload, quick):
        result, runner = measure_config(
            workload, stages, m, schedule, base, rounds, accumulated.get(m)
        )
        configs.append(result)
        if keep:
            KEPT[runner.name] = runner
        else:
            _common.release(runner)
    _common.release(base, *accumulated.values())
    return {
        "workload": workload.describe(),
        "rounds": rounds,
        "baselines": base_results,
        "best_baseline": base.name,
        "configs": configs,
    }


def _rows(name: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for layout, r in data["baselines"].items():
        if "skipped" in r:
            rows.append(_common.row(SECTION, f"{name}: jax.jit {layout}", f"n/a ({r['skipped']})"))
            continue
        rows.append(_common.row(SECTION, f"{name}: jax.jit {layout}", r["median_ms"], unit="ms"))
    for c in data["configs"]:
        gated = c["microbatches"] <= 4
        label = f"{name} S={c['stages']} m={c['microbatches']} {c['schedule']}"
        rows.append(
            _common.row(
                SECTION,
                f"{label}: step / best jit",
                round(c["ratio"], 3),
                target=f"<= {TARGET}" if gated else "",
                passed=(c["ratio"] <= TARGET) if gated else None,
            )
        )
        if "ratio_to_accumulated" in c:
            rows.append(
                _common.row(
                    SECTION,
                    f"{label}: step / jax.jit accumulating the same {c['microbatches']} "
                    "microbatches",
                    round(c["ratio_to_accumulated"], 3),
                )
            )
            rows.append(
                _common.row(
                    SECTION,
                    f"{label}: that jax.jit / best jit (microbatching's own cost)",
                    round(c["accumulated_to_baseline"], 3),
                )
            )
    return rows


def run(quick: bool) -> dict[str, Any]:
    workloads = [_common.TINY] if quick else [_common.TINY, _common.SMALL]
    out: dict[str, Any] = {"description": __doc__.splitlines()[0], "workloads": {}}
    rows = []
    for workload in workloads:
        data = run_workload(workload, quick, keep=workload is _common.TINY)
        out["workloads"][workload.name] = data
        RESULTS[workload.name] = data
        rows.extend(_rows(workload.name, data))
    out["rows"] = rows
    return out
