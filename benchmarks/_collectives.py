r"""The collectives a compiled program runs, read from its HLO text (B0, B7).

:func:`hlo_collectives` counts, in one execution of a compiled XLA program, the collective
instructions (all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all, and
their ``-start`` forms) with their operands and result bytes. An instruction inside a
``while`` body counts once per iteration (XLA's ``known_trip_count``; a loop without one
counts once and is reported in ``"unknown_trip_counts"``), inside any other called
computation once per call. :func:`step_collectives` adds them up over one step of an
``MpmdExecutable`` (each fragment op's executable, as often as the step runs it) and
:func:`compiled_collectives` for one ``jax.stages.Compiled``.

XLA's CPU runtime pays per operand of a tuple all-reduce (B0 measures it), so the operand
count, not only the number of instructions, says what the collectives cost on this host.

Example:
    >>> loop = 'backend_config={"known_trip_count":{"n":"3"}}'
    >>> text = "\n".join([
    ...     "%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {",
    ...     "  %a = f32[4]{0} all-reduce(%x), channel_id=1, to_apply=%add",
    ...     "}",
    ...     "ENTRY %main (x: f32[4]) -> f32[4] {",
    ...     "  %t = (f32[4]{0}, f32[2]{0}) all-reduce(%x, %y), channel_id=2, to_apply=%add",
    ...     "  %w = (s32[], f32[4]) while(%i), condition=%c, body=%body, " + loop,
    ...     "}",
    ... ])
    >>> hlo_collectives(text)["all-reduce"]  # 3 x 1 operand of 16 bytes, 1 x 2 of 24 bytes
    {'ops': 4, 'operands': 5, 'bytes': 72}
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_INSTRUCTION = re.compile(
    r"=\s*(?P<type>.*?)\s+(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\((?P<args>[^)]*)\)"
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(")
_BODY = re.compile(r"\bbody=%(?P<name>[\w.\-]+)")
_CALLEE = re.compile(
    r"\b(?:calls|to_apply|condition|true_computation|false_computation)=%(?P<name>[\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"')
_SHAPE = re.compile(r"\b(?P<dtype>pred|[a-z]+\d+)\[(?P<dims>[\d,]*)\]")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
}  # else 4


def _bytes(type_text: str) -> int:
    total = 0
    for match in _SHAPE.finditer(type_text):
        dims = [int(d) for d in match["dims"].split(",") if d]
        total += _BYTES.get(match["dtype"], 4) * math.prod(dims)
    return total


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and line.rstrip().endswith("{"):
            current = header["name"]
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _calls(line: str) -> Iterator[tuple[str, int | None]]:
    """``(callee, times per execution of line)``; ``None``: a loop of unknown trip count."""
    body = _BODY.search(line)
    if body:
        trips = _TRIPS.search(line)
        yield body["name"], int(trips["n"]) if trips else None
    for callee in _CALLEE.finditer(line):
        yield callee["name"], 1
    branches = _BRANCHES.search(line)
    if branches:
        for name in re.findall(r"%([\w.\-]+)", branches["names"]):
            yield name, 1  # every branch counted: an upper bound


def empty() -> dict[str, dict[str, int]]:
    return {k: {"ops": 0, "operands": 0, "bytes": 0} for k in KINDS}


def hlo_collectives(text: str) -> dict[str, Any]:
    """Per collective kind, ``{"ops", "operands", "bytes"}`` in one execution of the
    program whose HLO text is ``text``; ``"unknown_trip_counts"``: loops counted once."""
    comps, entry = _computations(text)
    times: dict[str, int] = {}
    unknown = 0

    def visit(name: str, factor: int) -> None:
        nonlocal unknown
        if name not in comps:
            return
        times[name] = times.get(name, 0) + factor
        for line in comps[name]:
            for callee, n in _calls(line):
                unknown += n is None
                visit(callee, factor * (1 if n is None else n))

    visit(entry, 1)
    out: dict[str, Any] = empty()
    for name, factor in times.items():
        for line in comps[name]:
            match = _INSTRUCTION.search(line)
            if match is None or match["kind"] not in out:
                continue
            counts = out[match["kind"]]
            counts["ops"] += factor
            counts["operands"] += factor * match["args"].count("%")
            counts["bytes"] += factor * _bytes(match["type"])
    out["unknown_trip_counts"] = unknown
    return out


def add(total: dict[str, Any], part: dict[str, Any], times: int = 1) -> dict[str, Any]:
    """``total`` plus ``times`` x ``part``, kind by kind (in place; returns ``total``)."""
    for kind in KINDS:
        for key in ("ops", "operands", "bytes"):
            total[kind][key] += times * part[kind][key]
    total["unknown_trip_counts"] = total.get("unknown_trip_counts", 0) + part.get(
        "unknown_trip_counts", 0
    )
    return total


def compiled_collectives(compiled: Any) -> dict[str, Any]:
    """:func:`hlo_collectives` of a ``jax.stages.Compiled``."""
    return hlo_collectives(compiled.as_text())


def step_collectives(exe: Any) -> dict[str, Any]:
    """The collectives of one step of an ``MpmdExecutable`` that has run once: every
    fragment op's executable (``exe.state.fns``), once per op. Also ``"fragments_with"``:
    how many of the step's fragment ops run any collective."""
    total: dict[str, Any] = {**empty(), "unknown_trip_counts": 0}
    seen: dict[int, dict[str, Any]] = {}
    with_any = 0
    for index, op in enumerate(exe.ops):
        if op.kind != 0:
            continue
        compiled = exe.state.fns[index]
        if not hasattr(compiled, "as_text"):
            raise RuntimeError(
                f"Expected op {index} ({op.name}) to hold its compiled executable after a "
                f"step, got {type(compiled).__name__}; run the step once before counting."
            )
        key = id(compiled)
        if key not in seen:
            seen[key] = compiled_collectives(compiled)
        part = seen[key]
        with_any += any(part[k]["ops"] for k in KINDS)
        add(total, part)
    total["fragments_with"] = with_any
    total["fragments"] = sum(op.kind == 0 for op in exe.ops)
    return total


def summary(counts: dict[str, Any]) -> str:
    """``"all-reduce 8 (37 operands, 1.2 MiB); collective-permute 2 (2, 0.1 MiB)"``."""
    parts = []
    for kind in KINDS:
        c = counts[kind]
        if c["ops"]:
            parts.append(
                f"{kind} {c['ops']} ({c['operands']} operands, {c['bytes'] / 2**20:.2f} MiB)"
            )
    return "; ".join(parts) or "none"
