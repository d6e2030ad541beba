"""``python -m benchmarks --smoke`` runs every section end to end and writes every result file.

Speed is never asserted here (the CI host's load is unknown); only that each section ran
and wrote the keys the report and the README rely on.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

# One worker runs these tests (dev.py's --dist loadgroup): they share the smoke run.
pytestmark = pytest.mark.xdist_group("test_benchmarks")

ROOT = Path(__file__).resolve().parents[1]
SECTION_FILES = {
    "b0_calibration": ["concurrency", "effective_parallel_devices", "submeshes"],
    "b1_step_time": ["workloads"],
    "b2_dispatch": ["configs", "ambient_mesh_us"],
    "b3_compile": ["cold", "recompiles"],
    "b4_memory": ["configs"],
    "b5_transfers": ["configs"],
    "b6_schedules": ["schedules"],
    "b7_spmd_peer": ["configs"],
    "b8_processes": ["one_process", "two_processes", "analytic_bytes"],
    "b9_planner": ["search", "configs"],
}


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # The suite's XLA flags (LLVM level 0 and the older fusion emitter: the smoke run is
    # mostly compilation; with LLVM level 0 alone its total was 196 s against 268 s with XLA's
    # defaults, its few steps slower). Not the suite's
    # compilation cache: a smoke run keeps one of its own (``benchmarks._smoke_cache``).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MMFLAX_COMPILATION_CACHE": "off"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("name", sorted(SECTION_FILES))
def test_smoke_mode_writes_each_section(smoke_results, name):
    data = json.loads((smoke_results / f"{name}.json").read_text())
    for key in [*SECTION_FILES[name], "rows", "seconds", "host", "quick", "smoke"]:
        assert key in data, key
    assert data["quick"] is True and data["smoke"] is True
    assert data["host"]["devices"] == 8
    for row in data["rows"]:
        assert set(row) == {"section", "metric", "value", "unit", "target", "pass"}


def test_smoke_step_time_compares_against_the_smoke_jit_layouts(smoke_results):
    data = json.loads((smoke_results / "b1_step_time.json").read_text())
    tiny = data["workloads"]["gpt-tiny"]
    from benchmarks import _common

    assert set(tiny["baselines"]) == set(_common.SMOKE_LAYOUTS)  # a full run: every LAYOUTS
    assert "median_ms" in tiny["baselines"]["data-parallel 8"]
    for config in tiny["configs"]:
        assert config["ratio"] > 0
        assert config["compiles_timed_steps"] == 0
        if config["microbatches"] > 1:
            assert config["ratio_to_accumulated"] > 0
            assert config["accumulated_to_baseline"] > 0


def test_smoke_cold_compile_has_both_references(smoke_results):
    data = json.loads((smoke_results / "b3_compile.json").read_text())
    for cold in data["cold"]:
        assert cold["ratio_first_step"] > 0
        assert cold["ratio_first_step_accumulated"] > 0


def test_sweep_point_takes_medians_over_its_processes():
    from benchmarks import b3_compile

    def run(cold, step, traced, first):
        ours = {"cold_s": cold, "trace_s": traced, "partition_s": 0.5}
        return {
            "scan_first": first,
            "ratio_cold": cold / 10,
            "ratio_step": step,
            "ours": ours,
            "jit_scan": {"cold_s": 10.0},
        }

    point = b3_compile.median_point(
        [run(14.0, 1.0, 1.0, False), run(11.0, 0.7, 3.0, True), run(12.0, 0.9, 2.0, False)]
    )
    assert point["ratio_cold"] == 1.2 and point["ours"]["cold_s"] == 12.0  # the median run
    assert point["ratio_step"] == 0.9
    assert point["trace_partition_samples"] == [1.5, 3.5, 2.5]
    assert point["trace_partition_median_s"] == 2.5
    assert [r["scan_first"] for r in point["repetitions"]] == [False, True, False]


def test_report_renders_a_b7_run_of_step_times_alone():
    # MMFLAX_B7_SCOPE=steps: no peak bytes, breakdown, collectives or cold starts.
    from benchmarks import report

    config = {"stages": 2, "microbatches": 4, "schedules": ["gpipe", "1f1b"]}
    config |= {"gpipe_ratio": 1.16, "1f1b_ratio": 1.07, "peer_median_ms": 37.7}
    rows = report._b7({"configs": [config], "function_configs": [dict(config, workload="fn")]})
    assert [r["value"] for r in rows] == ["S=2 m=4: 1.16 / 1.07"] * 2
    assert "function path" in rows[1]["metric"]
    # A full run's configuration adds its peak bytes (and cold starts, when measured).
    full = config | {"gpipe_peak_ratio": 0.85, "1f1b_peak_ratio": 0.5}
    rows = report._b7({"configs": [full]})
    assert [r["value"] for r in rows] == ["S=2 m=4: 1.16 / 1.07", "S=2 m=4: 0.85 / 0.50"]


def test_planner_pipeline_takes_median_errors_over_its_passes():
    from benchmarks import b9_planner

    def measured(peak, op, makespan, op_errors):
        return {
            "worst_peak_error": peak,
            "median_abs_op_error": op,
            "makespan_error": makespan,
            "op_errors": op_errors,
            "predicted_step_s": 1.0 + makespan,
        }

    row = b9_planner.combined(
        [
            measured(0.03, 0.10, -0.16, {"0F": 0.1, "0B": -0.3}),
            measured(0.05, 0.20, 0.13, {"0F": 0.3}),
            measured(0.04, 0.30, -0.01, {"0F": 0.2, "0B": -0.1}),
        ]
    )
    assert row["makespan_error"] == -0.01 and row["predicted_step_s"] == 0.99  # the median pass
    assert row["worst_peak_error"] == 0.04 and row["median_abs_op_error"] == 0.20
    assert row["op_errors"] == {"0F": 0.2, "0B": -0.2}  # each op over the passes that ran it
    assert [p["makespan_error"] for p in row["passes"]] == [-0.16, 0.13, -0.01]


def test_host_work_keeps_each_functions_fastest_block():
    """A slow stretch (here: the first two blocks, 20 ms of CPU a call) does not count once a
    fast block has been seen; with the span already over, ``min_blocks`` blocks each run."""
    import time

    from benchmarks import _breakdown

    calls = {"slow then fast": 0, "steady": 0}

    def slow_then_fast():
        calls["slow then fast"] += 1
        if calls["slow then fast"] <= 4:  # blocks 1 and 2 of 2 calls each
            end = time.thread_time() + 0.02  # CPU time: a sleep would not count
            while time.thread_time() < end:
                pass

    def steady():
        calls["steady"] += 1

    means = _breakdown.fastest_block_means(
        {"slow then fast": slow_then_fast, "steady": steady}, calls=2, span=0.0, min_blocks=4
    )
    assert means["slow then fast"] < 0.005  # blocks 3 and 4 (fast), not 1 and 2 (20 ms)
    assert calls == {"slow then fast": 8, "steady": 8}  # 4 blocks of 2 calls each


def test_accumulating_baseline_computes_the_plain_step():
    # The microbatch-accumulating jax.jit baseline must train exactly like the plain one
    # (mean loss, mean gradients), or ratios against it would compare different work. Adam
    # turns the rounding of a differently ordered sum into up to ~1e-5 of a 1e-3 update.
    # B2's small GPT with 2 blocks (the sum runs over every parameter's gradient alike, at any
    # depth; 4 blocks took twice the compilation).
    import dataclasses

    import numpy as np

    from benchmarks import _common, b2_dispatch

    overrides = {**dict(b2_dispatch.WORKLOAD.overrides), "num_layers": 2}
    workload = dataclasses.replace(b2_dispatch.WORKLOAD, overrides=tuple(overrides.items()))
    plain = _common.build_jit(workload, "data 4 x tensor 2")
    accumulated = _common.build_jit(workload, "data 4 x tensor 2", microbatches=2)
    for runner in (plain, accumulated):
        runner.step()
    np.testing.assert_allclose(accumulated.loss, plain.loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(accumulated.state), jax.tree.leaves(plain.state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_smoke_memory_matches_tabulate(smoke_results):
    data = json.loads((smoke_results / "b4_memory.json").read_text())
    assert all(c["params_equal_tabulate"] for c in data["configs"])


def test_smoke_gpu_section_skips_cleanly_without_a_gpu(smoke_results):
    data = json.loads((smoke_results / "gpu.json").read_text())
    if "skipped" in data:
        assert data["rows"] == []
    else:
        assert "ratio" in data


def test_smoke_report_has_a_row_per_metric(smoke_results):
    report = (smoke_results / "report.md").read_text()
    assert "`python -m benchmarks --smoke`" in report and "not measurements" in report
    assert "## Summary" in report
    assert "| section | metric | value | target | met |" in report
    for section in ("B0", "B1", "B2", "B3", "B4", "B5", "B6"):
        assert f"| {section} |" in report
    assert "Targets missed:" in report
