"""The markdown report: a summary against the targets, then every section's rows.

``render(results, seconds, command)`` builds it from the sections' JSON (section name ->
dict); ``python -m benchmarks.report DIR`` re-renders ``DIR/report.md`` from the JSON files
a run left there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import SECTIONS

FILES = {**SECTIONS, "GPU": "gpu"}  # section -> JSON file stem


def _value(r: dict[str, Any]) -> str:
    value = r["value"]
    if isinstance(value, bool):
        text = str(value)
    elif isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    elif isinstance(value, int):
        text = f"{value:,}"
    else:
        text = str(value)
    return f"{text} {r['unit']}".strip()


def _verdict(passed: bool | None) -> str:
    return "" if passed is None else ("pass" if passed else "**MISS**")


def format_row(r: dict[str, Any]) -> str:
    target = f"  (target {r['target']}: {_verdict(r['pass'])})" if r["target"] else ""
    return f"{r['metric']}: {_value(r)}{target}"


def _row(section: str, metric: str, value: Any, target: str = "", passed: Any = None) -> dict:
    return {
        "section": section,
        "metric": metric,
        "value": value,
        "unit": "",
        "target": target,
        "pass": passed,
    }


def _b1(data: dict[str, Any]) -> list[dict]:
    rows = []
    for name, w in data["workloads"].items():
        timed = {k: v for k, v in w["baselines"].items() if "median_ms" in v}
        best = min(timed, key=lambda k: timed[k]["median_ms"])
        gated = [c for c in w["configs"] if c["microbatches"] <= 4]
        worst = max(gated, key=lambda c: c["ratio"])
        met = sum(c["ratio"] <= 1.10 for c in gated)
        ratios = [c["ratio"] for c in gated]
        rows.append(
            _row(
                "B1",
                f"{name}: pipelined step / best jax.jit ({best}, "
                f"{timed[best]['median_ms']:,.0f} ms), m <= 4: range (configs meeting target)",
                f"{min(ratios):.2f} - {max(ratios):.2f} ({met} of {len(gated)})",
                "<= 1.10",
                worst["ratio"] <= 1.10,
            )
        )
        versus = [c for c in gated if "ratio_to_accumulated" in c]
        if versus:
            pipe = [c["ratio_to_accumulated"] for c in versus]
            own = [c["accumulated_to_baseline"] for c in versus]
            rows.append(
                _row(
                    "B1",
                    f"{name}, 1 < m <= 4: pipelined step / jax.jit accumulating the same m "
                    "microbatches; that jax.jit / best jax.jit",
                    f"{min(pipe):.2f} - {max(pipe):.2f}; {min(own):.2f} - {max(own):.2f}",
                )
            )
        rest = [c for c in w["configs"] if c["microbatches"] > 4]
        if rest:
            text = ", ".join(f"S={c['stages']} {c['schedule']} {c['ratio']:.2f}" for c in rest)
            rows.append(_row("B1", f"{name}: m = 8 (no target)", text))
    return rows


def _b2(data: dict[str, Any]) -> list[dict]:
    configs = data["configs"]
    worst_config = max(configs, key=lambda c: c["host_us_per_op"])
    worst = worst_config["host_us_per_op"]
    per_fragment = max(c["host_us_per_fragment"] for c in configs)
    steps = [c["host_us_per_step"] for c in configs]
    calls = [c["host_call_us_per_fragment"] for c in configs]
    return [
        _row(
            "B2",
            "runtime host work per op (fragment or transfer; JAX's calls stubbed), worst "
            f"configuration (S={worst_config['stages']} m={worst_config['microbatches']})",
            f"{worst:.1f} us",
            "<= 30 us",
            worst <= 30,
        ),
        _row(
            "B2",
            "runtime host work per step (stubbed); per fragment, worst; call time per "
            "fragment (JAX's dispatch included)",
            f"{min(steps):.0f} - {max(steps):.0f} us; {per_fragment:.0f} us; "
            f"{min(calls):.0f} - {max(calls):.0f} us",
        ),
    ]


def _b3(data: dict[str, Any]) -> list[dict]:
    rows = []
    for c in data["cold"]:
        label = f"{c['workload']['preset']} S={c['stages']} m={c['microbatches']}"
        rows.append(
            _row(
                "B3",
                f"{label}: state setup + first step / jax.jit's (wall); first call alone "
                "(wall; CPU time; XLA compile time)",
                f"{c['ratio_with_setup']:.2f}; {c['ratio_first_step']:.2f}; "
                f"{c['ratio_first_step_cpu']:.2f}; {c['ratio_xla_compile']:.2f}",
                "<= 1.5",
                c["ratio_with_setup"] <= 1.5,
            )
        )
        if "ratio_first_step_accumulated" in c:
            rows.append(
                _row(
                    "B3",
                    f"{label}: first call / jax.jit accumulating {c['microbatches']} "
                    "microbatches (wall; XLA compile time)",
                    f"{c['ratio_first_step_accumulated']:.2f}; "
                    f"{c['ratio_xla_compile_accumulated']:.2f}",
                )
            )
        rows.append(
            _row(
                "B3",
                f"{label}: executables compiled / fragments",
                f"{c['executables']} / {c['fragments']}",
            )
        )
    rows += [r for r in data["rows"] if "gpt-small" in r["metric"]]
    total = sum(r["compilations"] for r in data["recompiles"].values())
    rows.append(_row("B3", "compilations after step 1 (all programs)", total, "0", total == 0))
    return rows + _b3_sweep(data)


def _b3_sweep(data: dict[str, Any]) -> list[dict]:
    """The sweep's cold ratios in one row, its step ratios, the trace + partition growth, the
    cache runs."""
    points = data.get("sweep", [])
    if not points:
        return []
    met = sum(p["ratio_cold"] <= 1.3 for p in points)
    reps = len(points[0].get("repetitions", [None]))
    how = f"median of {reps} processes per point; " if reps > 1 else ""
    cold = ", ".join(
        f"L={p['layers']} m={p['microbatches']}: {p['ratio_cold']:.2f}" for p in points
    )
    built = ", ".join(
        f"L={p['layers']} m={p['microbatches']}: "
        f"{p.get('trace_partition_median_s', p['ours']['trace_s'] + p['ours']['partition_s']):.2f}"
        for p in points
    )
    rows = [
        _row(
            "B3",
            f"gpt-tiny S=2 1f1b sweep: cold first step (setup + call) / jax.jit+scan's "
            f"({how}{met} of {len(points)} meeting target)",
            cold,
            "<= 1.3",
            met == len(points),
        ),
        _row(
            "B3",
            "gpt-tiny S=2 1f1b sweep: trace + partition seconds" + _medians_note(points),
            built,
        ),
    ]
    rows += [
        r
        for r in data["rows"]
        if r["metric"].startswith(
            ("sweep gpt-tiny S=2 1f1b: step time", "trace + partition", "persistent compilation")
        )
    ]
    return rows


def _medians_note(points: list[dict[str, Any]]) -> str:
    """`` (medians of N processes[ at L=.. m=.., ...])``: which points' trace + partition
    seconds are medians: every point's when the sweep repeats each point in several
    processes; in older results, only the growth row's two ends."""
    medians = [p for p in points if len(p.get("trace_partition_samples", ())) > 1]
    if not medians:
        return ""
    where = ""
    if len(medians) < len(points):
        where = " at " + ", ".join(f"L={p['layers']} m={p['microbatches']}" for p in medians)
    return f" (medians of {len(medians[0]['trace_partition_samples'])} processes{where})"


def _b4(data: dict[str, Any]) -> list[dict]:
    configs = data["configs"]
    equal = all(c["params_equal_tabulate"] for c in configs)
    rows = [
        _row(
            "B4",
            f"parameter bytes per device == tabulate ({len(configs)} programs)",
            equal,
            "equal",
            equal,
        )
    ]
    for c in configs:
        if c["name"].startswith("llama-tiny S=2"):
            spread = c["params_plus_opt_state"]["max_over_min"]
            rows.append(
                _row(
                    "B4",
                    "balanced stages (llama-tiny S=2): params + optimizer max/min",
                    f"{spread:.3f}",
                    "<= 1.05",
                    spread <= 1.05,
                )
            )
    gpt = [c for c in configs if c["name"].startswith("gpt")]
    blocks = max(c["blocks_params"]["max_over_min"] for c in gpt)
    whole = sorted({round(c["params_plus_opt_state"]["max_over_min"], 2) for c in gpt})
    rows.append(
        _row(
            "B4",
            "gpt-tiny: blocks max/min; whole model max/min (tied table on stage 0)",
            f"{blocks:.3f}; {', '.join(map(str, whole))}",
            "<= 1.05",
            blocks <= 1.05,
        )
    )
    peaks = {
        c["name"]: max(c["peak_above_inputs_per_device"].values()) / 2**20
        for c in configs
        if c["name"].startswith("gpt")
    }
    rows.append(
        _row(
            "B4",
            "peak live MiB per device above the state, by schedule",
            ", ".join(f"{k.replace('gpt-tiny ', '')}: {v:.1f}" for k, v in peaks.items()),
        )
    )
    return rows


def _b5(data: dict[str, Any]) -> list[dict]:
    text = ", ".join(
        f"S={c['stages']} m={c['microbatches']} {c['schedule']}: {c['ratio']:.2f}"
        for c in data["configs"]
    )
    hidden = sum(c["hidden_bytes"] for c in data["configs"])
    return [
        _row("B5", "bytes moved between submeshes / analytic count", text),
        _row("B5", "bytes moved outside the program between steps", hidden, "0", hidden == 0),
    ]


def _b6(data: dict[str, Any]) -> list[dict]:
    text = "; ".join(
        f"{s['pipeline']} {s['schedule']}: {s['predicted_unit_costs']:.2f} / "
        f"{s['predicted_measured_costs']:.2f} / {s['recorded']:.2f}"
        for s in data["schedules"]
    )
    rows = [_row("B6", "bubble: simulated (unit costs / measured costs) / recorded", text)]
    entries = data.get("table2", [])
    if entries:
        names = ("1f1b", "zero-bubble-h1", "zero-bubble-h2")
        exact = sum(
            all(abs(e[n]["simulated"] - e[n]["formula"]) < 1e-9 for n in names) for e in entries
        )
        rows.append(
            _row(
                "B6",
                "1F1B, ZB-H1, ZB-H2: simulated overlapped-step bubble = Zero Bubble Table 2 "
                "formula (setups)",
                f"{exact} / {len(entries)}",
                "all",
                exact == len(entries),
            )
        )
    paper = data.get("table5", [])
    if paper:
        met = sum(bool(e["met"]) for e in paper)
        rows.append(
            _row(
                "B6",
                "Zero Bubble Table 5 from its Table 9 inputs: 1F1B, ZB-H1, ZB-H2 equal at 4 "
                "decimals, ZB-1p/ZB-2p no worse within p/2p M_B (setups)",
                f"{met} / {len(paper)}",
                "all",
                met == len(paper),
            )
        )
    return rows


def _b7(data: dict[str, Any]) -> list[dict]:
    rows = _b7_configs(data["configs"], "")
    if data.get("function_configs"):
        rows += _b7_configs(data["function_configs"], "function path (mm.jit + mm.microbatch): ")
    return rows


def _b7_configs(configs: list[dict[str, Any]], prefix: str) -> list[dict]:
    names = {"gpipe": "GPipe", "1f1b": "1F1B"}
    schedules = configs[0]["schedules"]
    label = " / ".join(names[s] for s in schedules)

    def by_config(key: str, cold: bool = False) -> str:
        parts = []
        for c in configs:
            source = c["cold"] if cold else c
            text = " / ".join(f"{source[f'{s}_{key}']:.2f}" for s in schedules)
            layers = f" ({c['layers']} layers)" if c.get("workload", "tiny") == "scale" else ""
            parts.append(f"S={c['stages']} m={c['microbatches']}{layers}: {text}")
        return "; ".join(parts)

    rows = [_row("B7", f"{prefix}step / SPMD peer's step ({label})", by_config("ratio"))]
    if not all(f"{s}_peak_ratio" in c for c in configs for s in schedules):
        return rows  # MMFLAX_B7_SCOPE=steps: step times alone
    rows.append(
        _row(
            "B7", f"{prefix}peak bytes per device / SPMD peer's ({label})", by_config("peak_ratio")
        )
    )
    if all("cold" in c for c in configs):
        counts = sorted({len(c["cold"]["repetitions"]["peer"]) for c in configs})
        reps = counts[-1]
        fewer = f"; {counts[0]} for the 16-layer points" if len(counts) > 1 else ""
        rows.append(
            _row(
                "B7",
                f"{prefix}cold build + first step / SPMD peer's ({label}, wall, "
                + (f"medians of {reps} processes{fewer})" if reps > 1 else "single samples)"),
                by_config("ratio", cold=True),
            )
        )
    return rows


def _b0(data: dict[str, Any]) -> list[dict]:
    rows = [
        _row(
            "B0",
            "devices' worth of work the host runs at once (8 programs on 8 devices)",
            f"{data['concurrency']['8']:.2f}",
        )
    ]
    submeshes = data.get("submeshes")
    if submeshes:
        k = max(submeshes["concurrency"], key=int)
        rows.append(
            _row(
                "B0",
                f"the same for {k} programs on {k} submeshes of "
                f"{submeshes['devices_per_program']} devices (XLA's CPU client runs them one "
                "at a time)",
                f"{submeshes['concurrency'][k]:.2f}",
            )
        )
    allreduce = data.get("allreduce")
    for floats, size in (allreduce or {}).get("floats_per_device", {}).items():
        ms = size["median_ms"]
        n = max(int(key.split()[1]) for key in ms)
        rows.append(
            _row(
                "B0",
                f"all-reduce over {allreduce['devices']} devices of {4 * int(floats) / 2**20:.2f} "
                f"MiB per device in {n} pieces: one tuple all-reduce / concatenated first (ms); "
                "cost per operand",
                f"{ms[f'tuple {n}']:.2f} / {ms[f'concatenated {n}']:.2f}; "
                f"{size['per_operand_us']:.0f} us",
            )
        )
    return rows


def summary_rows(results: dict[str, dict[str, Any]]) -> list[dict]:
    """One row per target (and the headline numbers without one)."""
    makers = {
        "B0": _b0,
        "B1": _b1,
        "B2": _b2,
        "B3": _b3,
        "B4": _b4,
        "B5": _b5,
        "B6": _b6,
        "B7": _b7,
    }
    rows = []
    for name, data in results.items():
        if name in makers and "rows" in data:
            rows += makers[name](data)
        elif "skipped" in data:
            rows.append(_row(name, "skipped", data["skipped"]))
        else:
            rows += data.get("rows", [])
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| section | metric | value | target | met |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['section']} | {r['metric']} | {_value(r)} | {r['target']} | "
            f"{_verdict(r['pass'])} |"
        )
    return lines


def _cpu(host: dict[str, Any]) -> str:
    """`` of <the CPU>`` where the run recorded it (since session 43)."""
    return f" of {host['cpu']}" if "cpu" in host else ""


def render(results: dict[str, dict[str, Any]], seconds: float, command: str) -> str:
    """The report for ``results`` (section name -> section JSON)."""
    lines = ["# Benchmark report", "", f"`{command}` -- {seconds / 60:.1f} minutes.", ""]
    if "--smoke" in command:
        lines += ["A smoke run: every section's code ran once; the numbers are not measurements."]
        lines += [""]
    host = next((d["host"] for d in results.values() if "host" in d), None)
    if host:
        lines += [
            f"jax {host['jax']}, backend `{host['backend']}`, {host['devices']} devices, "
            f"{host['host_cpus']} host CPUs{_cpu(host)} (load average at the end "
            f"{', '.join(f'{x:.1f}' for x in host['load_average'])}).",
            "",
        ]
    lines += ["## Summary", "", *table(summary_rows(results)), "", "## Every measurement", ""]
    rows = [r for d in results.values() for r in d.get("rows", [])]
    rows += [_row(name, "skipped", d["skipped"]) for name, d in results.items() if "skipped" in d]
    lines += table(rows)
    missed = [f"{r['section']} {r['metric']}" for r in rows if r["pass"] is False]
    lines += ["", f"Targets missed: {len(missed)} of {sum(r['pass'] is not None for r in rows)}."]
    lines += [f"- {m}" for m in missed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.report DIR``: re-renders ``DIR/report.md`` from its JSON."""
    out = Path((argv or sys.argv[1:] or [str(Path(__file__).parent / "results")])[0])
    results = {}
    for name, stem in FILES.items():
        path = out / f"{stem}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
    quick = any(d.get("quick") for d in results.values())
    smoke = any(d.get("smoke") for d in results.values())
    seconds = sum(d.get("seconds", 0.0) for d in results.values())
    command = "python -m benchmarks" + flag(smoke, quick)
    (out / "report.md").write_text(render(results, seconds, command))
    return 0


def flag(smoke: bool, quick: bool) -> str:
    """The command-line flag of a run's size, as the report quotes its command."""
    return " --smoke" if smoke else " --quick" if quick else ""


if __name__ == "__main__":
    sys.exit(main())
