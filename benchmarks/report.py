"""The markdown report: one table of every section's rows (metric, value, target, met?)."""

from __future__ import annotations

from typing import Any


def _value(r: dict[str, Any]) -> str:
    value = r["value"]
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    elif isinstance(value, int) and not isinstance(value, bool):
        text = f"{value:,}"
    else:
        text = str(value)
    return f"{text} {r['unit']}".strip()


def _verdict(passed: bool | None) -> str:
    return "" if passed is None else ("pass" if passed else "**MISS**")


def format_row(r: dict[str, Any]) -> str:
    target = f"  (target {r['target']}: {_verdict(r['pass'])})" if r["target"] else ""
    return f"{r['metric']}: {_value(r)}{target}"


def render(results: dict[str, dict[str, Any]], seconds: float, command: str) -> str:
    """The report for ``results`` (section name -> section JSON)."""
    lines = [
        "# Benchmark report",
        "",
        f"`{command}` -- {seconds / 60:.1f} minutes.",
        "",
    ]
    host = next((d["host"] for d in results.values() if "host" in d), None)
    if host:
        lines += [
            f"jax {host['jax']}, backend `{host['backend']}`, {host['devices']} devices, "
            f"{host['host_cpus']} host CPUs (load average at the end "
            f"{', '.join(f'{x:.1f}' for x in host['load_average'])}).",
            "",
        ]
    lines += ["| section | metric | value | target | met |", "|---|---|---|---|---|"]
    for name, data in results.items():
        if "skipped" in data:
            lines.append(f"| {name} | skipped: {data['skipped']} | | | |")
        for r in data.get("rows", []):
            lines.append(
                f"| {r['section']} | {r['metric']} | {_value(r)} | {r['target']} | "
                f"{_verdict(r['pass'])} |"
            )
    missed = [
        f"{r['section']} {r['metric']}"
        for d in results.values()
        for r in d.get("rows", [])
        if r["pass"] is False
    ]
    lines += ["", f"Targets missed: {len(missed)}."]
    lines += [f"- {m}" for m in missed]
    return "\n".join(lines) + "\n"
