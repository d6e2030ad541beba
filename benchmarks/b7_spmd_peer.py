"""B7 the SPMD pipeline peer: ``parallelize_step`` against the pipeline a JAX user writes.

The peer (`benchmarks._spmd_pipeline`) is one ``jax.jit`` step of the same gpt-tiny (4
blocks, batch 32 x 64, AdamW) on the same 8 devices: blocks stacked on a ``stage`` mesh axis,
``shard_map`` + ``lax.ppermute`` rotating activations in GPipe order, stem and head
data-parallel on all 8 devices. For S in {2, 4} and m in {4, 8, 16} (``TINY_GRID``; at m=16
a microbatch of 2 sequences splits over 2 devices only: ours runs data 2 x tensor 2 at 2
stages, ``_common.stage_layout``, and the peer repeats its pipeline on a ``replica`` axis;
``--quick``: S=2, m=4, 1F1B only -- B1's compiled program -- and no cold measurement,
which costs a fresh process per program; the quick suite stays within a minute of extra
time):

* **Step time**: ours (``_common.build_mpmd``, GPipe and 1F1B) and the peer timed round by
  round (``_common.interleaved``); ratios of medians, ours / peer.
* **Cold first step**: building the step and its first call, each program in its own fresh
  process with JAX's persistent compilation cache off, so nothing is warmed by anything;
  wall and CPU seconds, ours / peer.
* **Where the step goes** (``benchmarks._breakdown``): the runtime's own CPU time per step
  and per op (the dispatching thread's CPU time outside JAX's calls, stable from run to
  run) and the thread's CPU time inside them, each submesh's compute and the transfers from
  one recorded step, and the wall time beyond the busiest submesh's compute; for the peer,
  the thread's CPU time in its one call and the rest of its step. And the host's CPU time
  per op with only JAX's C++ work stubbed (``_breakdown.StubbedCpp``: executables and the
  C++ copies return recorded results, all Python -- ours and JAX's around the copies --
  runs): the stable figure for whether a host keeps ahead of its devices (issue 40's
  target: 30 us per op).
* **Collectives per step** (``benchmarks._collectives``): all-reduces, all-gathers,
  reduce-scatters, collective-permutes and all-to-alls with their operands and bytes, read
  from each fragment's compiled HLO and counted as often as the step runs the fragment,
  against the peer's one compiled program (instructions in a loop body once per
  iteration). A data-parallel stage keeps its weight gradients per device over the
  microbatches and all-reduces them once a step, as one array (``core/fragment/
  _stacked_sums``); before session 31 each backward all-reduced them once per microbatch as
  one tuple all-reduce, which XLA's CPU runtime runs operand by operand (B0 prices an
  operand).
* **Peak bytes per device**, state included. Ours: the program walked op by op as the
  runtime runs it (B4's ``walk``: inputs, live values, the runtime's frees) with each
  fragment's XLA temp memory added on its devices while it runs. The peer: XLA's own account
  of its one program, arguments + outputs - donated aliases + temp. Max over devices,
  ours / peer.

**The function path** (``benchmarks._function_path``): the same measurements (step,
breakdown, collectives, peak bytes; cold starts in full runs) for a residual-MLP stack (8
layers of width 256, 1,024 tokens, SGD) written as a new user would -- one ``mm.task`` per
stage, ``jax.value_and_grad(mm.microbatch(loss, ..., schedule=...))`` under ``mm.jit`` --
against its hand-written SPMD peer (weights stacked on ``stage``, ``shard_map`` +
``ppermute``, the loop unrolled), GPipe and 1F1B, at the same S and m (``--quick``: S=2
m=4 1F1B, about 20 s; none in a smoke run, where ``tests/test_b7_function_path.py``
checks it at tiny sizes instead). Its configurations are ``"function_configs"`` in the
JSON.

**Scale** (full runs only): S=8 stages of one device each, 16 blocks (2 a stage), batch
64 x 64, m=32 and m=64 (``SCALE``): steps of a thousand ops and more, so what many ops per
step cost is measured, not guessed. Step time, breakdown, peak bytes and cold start as
above (the cold start from ``SCALE_COLD_REPETITIONS`` fresh processes per program);
``MMFLAX_B7_SCOPE=scale`` measures only these points.

No targets: the section says where the two approaches stand on this host.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax

from benchmarks import _breakdown, _collectives, _common
from benchmarks import _function_path as fp
from benchmarks import _spmd_pipeline as spmd

SECTION = "B7"
ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("gpipe", "1f1b")
COLD_REPETITIONS = 3  # fresh processes per program and configuration (their median)
# Many ops per step: 8 one-device stages of 2 blocks each, a microbatch of one sequence at m=64.
SCALE = _common.Workload("gpt-tiny", batch=64, length=64, overrides=(("num_layers", 16),))
SCALE_GRID = [(8, 32), (8, 64)]
SCALE_COLD_REPETITIONS = 1  # each cold process builds and compiles a program of 1,000+ ops
WORKLOADS = {"tiny": _common.TINY, "scale": SCALE}  # by name, for the cold-start children
TINY_GRID = [(2, 4), (2, 8), (2, 16), (4, 4), (4, 8), (4, 16)]
# The function path (``mm.jit`` + ``mm.microbatch``): its residual-MLP stack, by this name.
FUNCTION = "function"
# ``MMFLAX_B7_SCOPE=targets`` (full runs): only issue 40's target grid -- both paths at
# S in {2, 4}, m in {4, 8, 16} -- no scale points, for a re-measurement after a change to
# the runtime: 25 minutes on a quiet host (session 33), about 55 for a full run. Its cold
# starts are medians of ``COLD_REPETITIONS`` rotated fresh processes too (issue 40's targets
# are medians; one process each read 1.0-1.5x the peer for the same program on this host).
# ``MMFLAX_B7_SCOPE=scale`` (full runs): only the scale points (S=8, m=32 and 64, no function
# path), for a re-measurement of what many ops per step cost; write it to its own ``--out``.
# ``MMFLAX_B7_SCOPE=steps`` (full runs): the target grid's step times alone, both paths (no
# breakdown, collectives, peak bytes or cold starts): where the two stand on another host,
# in minutes (5 on a 16-core host, session 35); write it to its own ``--out``.
SCOPE = os.environ.get("MMFLAX_B7_SCOPE", "")
STEPS_ONLY = SCOPE == "steps"
TARGETS_ONLY, SCALE_ONLY = SCOPE in ("targets", "steps"), SCOPE == "scale"


def grid(quick: bool) -> list[tuple[str, int, int]]:
    """``(workload name, stages, microbatches)`` measured (the scale points in full runs
    only)."""
    if _common.SMOKE:
        return [("tiny", *_common.SMOKE_CONFIG[:2])]
    if quick:
        return [("tiny", 2, 4)]
    tiny = [] if SCALE_ONLY else [("tiny", s, m) for s, m in TINY_GRID]
    return tiny + ([] if TARGETS_ONLY else [("scale", s, m) for s, m in SCALE_GRID])


def function_grid(quick: bool) -> list[tuple[int, int]]:
    """``(stages, microbatches)`` of the function path measured (none in a smoke run: the
    tests check the module on its own, at tiny sizes)."""
    if _common.SMOKE:
        return []
    if quick:
        return [(2, 4)]
    return [] if SCALE_ONLY else list(TINY_GRID)


def step_times(ours: dict[str, Any], peer: Any, rounds: int) -> dict[str, Any]:
    """Median step times (ms) of our schedules and the peer, timed round by round."""
    runners = [*ours.values(), peer]
    with _common.count_compiles() as compiles:
        times = _common.interleaved([r.step for r in runners], rounds)
    medians = [1e3 * _common.median(t) for t in times]
    out: dict[str, Any] = {"peer_median_ms": medians[-1], "compiles_timed_steps": compiles["count"]}
    for schedule, ms in zip(ours, medians[:-1], strict=True):
        out[f"{schedule}_median_ms"] = ms
        out[f"{schedule}_ratio"] = ms / medians[-1]
    return out


def peer_compiled(peer: spmd.PeerRunner) -> Any:
    """The peer's one program, compiled again (``jax.stages.Compiled``: its memory account
    and HLO text)."""
    return peer.jitted.lower(peer.state, peer.batch).compile()


def peer_peak_bytes(compiled: Any) -> dict[str, int]:
    """XLA's memory account of the peer's program (per device: it is one SPMD program)."""
    stats = compiled.memory_analysis()
    arguments, outputs = stats.argument_size_in_bytes, stats.output_size_in_bytes
    aliased, temp = stats.alias_size_in_bytes, stats.temp_size_in_bytes
    return {
        "arguments": arguments,
        "outputs": outputs,
        "aliased": aliased,
        "temp": temp,
        "peak": arguments + outputs - aliased + temp,
    }


def ours_peak_bytes(runner: _common.MpmdRunner) -> dict[str, Any]:
    """B4's op-by-op walk of one step (which it runs, updating the runner's state)."""
    from benchmarks import b4_memory

    tree = jax.tree_util.tree_structure(runner.state)
    leaves = [*jax.tree_util.tree_leaves(runner.state), *jax.tree_util.tree_leaves(runner.batch)]
    walked = b4_memory.walk(runner.executable, leaves)
    runner.state = jax.tree_util.tree_unflatten(tree, walked.pop("outputs")[1:])
    per_device = walked["peak_with_temp_per_device"]
    return {
        "peak": max(per_device.values()),
        "peak_per_device": per_device,
        "peak_without_temp": max(walked["peak_live_bytes_per_device"].values()),
        "max_fragment_temp": walked["max_fragment_temp_bytes"],
    }


def measure(
    stages: int,
    m: int,
    rounds: int,
    schedules: tuple[str, ...] = SCHEDULES,
    workload: str = "tiny",
) -> dict[str, Any]:
    """Step time and peak bytes of ours (each schedule) and the peer at ``(stages, m)``."""
    from benchmarks import b1_step_time

    load = WORKLOADS[workload]
    built = {s: b1_step_time.kept_or_built(load, stages, m, s) for s in schedules}
    ours = {s: runner for s, (runner, _) in built.items()}
    peer = spmd.build_peer(load, stages, m)
    _common.warm(peer)
    result = {"workload": workload, "layers": load.config().num_layers}
    result.update(_compare(stages, m, rounds, ours, peer))
    _common.release(peer, *(r for r, new in built.values() if new))
    return result


def measure_function(
    stages: int,
    m: int,
    rounds: int,
    schedules: tuple[str, ...] = SCHEDULES,
    workload: fp.FnWorkload = fp.FN,
) -> dict[str, Any]:
    """The same for the function path: ``mm.jit`` + ``mm.microbatch`` of the residual-MLP
    stack against its hand-written SPMD peer (``_function_path``)."""
    ours = {s: fp.build_ours(stages, m, s, workload) for s in schedules}
    for runner in ours.values():
        _common.warm(runner)
    peer = fp.build_peer(stages, m, workload)
    _common.warm(peer)
    result = {"workload": FUNCTION, "layers": workload.layers, **workload.describe()}
    result.update(_compare(stages, m, rounds, ours, peer))
    _common.release(peer, *ours.values())
    return result


def _compare(
    stages: int, m: int, rounds: int, ours: dict[str, Any], peer: spmd.PeerRunner
) -> dict[str, Any]:
    """Step times, breakdowns, collectives per step and peak bytes of warmed runners."""
    result = {
        "stages": stages,
        "microbatches": m,
        "schedules": list(ours),
        **step_times(ours, peer, rounds),
    }
    if STEPS_ONLY:
        return result
    result["breakdown"] = {
        schedule: _breakdown.step_breakdown(runner, result[f"{schedule}_median_ms"] / 1e3, rounds)
        for schedule, runner in ours.items()
    }
    result["breakdown"]["peer"] = _breakdown.peer_breakdown(
        peer, result["peer_median_ms"] / 1e3, rounds
    )
    compiled = peer_compiled(peer)
    result["collectives"] = {
        s: _collectives.step_collectives(r.executable) for s, r in ours.items()
    }
    result["collectives"]["peer"] = _collectives.compiled_collectives(compiled)
    result["peer_bytes"] = peer_peak_bytes(compiled)
    for schedule, runner in ours.items():
        mine = ours_peak_bytes(runner)
        result[f"{schedule}_bytes"] = mine
        result[f"{schedule}_peak_ratio"] = mine["peak"] / result["peer_bytes"]["peak"]
    return result


# --- cold first step, one fresh process per program -----------------------------------------


def child(kind: str, stages: int, m: int, workload: str = "tiny") -> dict[str, Any]:
    """Build + first step of one program (``kind``: a schedule or ``"peer"``), cold."""
    jax.config.update("jax_enable_compilation_cache", False)
    wall, cpu = time.perf_counter(), time.process_time()
    with _common.count_compiles() as compiles:
        runner = _build(kind, stages, m, workload)
        runner.step()
    return {
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "compiles": compiles["count"],
        "xla_compile_s": compiles["seconds"],
    }


def _build(kind: str, stages: int, m: int, workload: str) -> _common.Runner:
    """The runner a cold-start child builds: ``kind`` a schedule or ``"peer"``."""
    if workload == FUNCTION:
        if kind == "peer":
            return fp.build_peer(stages, m)
        return fp.build_ours(stages, m, kind)
    load = WORKLOADS[workload]
    if kind == "peer":
        return spmd.build_peer(load, stages, m)
    return _common.build_mpmd(load, stages, m, kind)


def _child_process(kind: str, stages: int, m: int, workload: str) -> dict[str, Any]:
    code = (
        "import json; from benchmarks import configure_devices; configure_devices(); "
        "from benchmarks import b7_spmd_peer as b; "
        f"print('RESULT' + json.dumps(b.child({kind!r}, {stages}, {m}, {workload!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"B7 cold-start child ({kind}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT") :])


def cold(stages: int, m: int, reps: int, workload: str = "tiny") -> dict[str, Any]:
    """Cold build + first step of each program, ``reps`` times each (order rotated)."""
    kinds = [*SCHEDULES, "peer"]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for rep in range(reps):
        for i in range(len(kinds)):
            kind = kinds[(i + rep) % len(kinds)]
            runs[kind].append(_child_process(kind, stages, m, workload))
    out: dict[str, Any] = {"repetitions": runs}
    for kind in kinds:
        for key in ("wall_s", "cpu_s"):
            out[f"{kind}_{key}"] = statistics.median(r[key] for r in runs[kind])
    for schedule in SCHEDULES:
        out[f"{schedule}_ratio"] = out[f"{schedule}_wall_s"] / out["peer_wall_s"]
        out[f"{schedule}_ratio_cpu"] = out[f"{schedule}_cpu_s"] / out["peer_cpu_s"]
    return out


# --- rows -----------------------------------------------------------------------------------


NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def ratios(data: dict[str, Any], key: str, schedules: list[str]) -> tuple[str, str]:
    """``("GPipe / 1F1B", "0.93 / 0.88")``: ``data[f"{schedule}_{key}"]`` per schedule."""
    names = " / ".join(NAMES[s] for s in schedules)
    return names, " / ".join(f"{data[f'{s}_{key}']:.2f}" for s in schedules)


def config_label(c: dict[str, Any]) -> str:
    """``gpt-tiny S=2 m=4``, ``gpt-tiny 16 layers S=8 m=32``, ``residual-MLP (mm.jit) S=2
    m=4``: a configuration's name in the rows."""
    workload = c.get("workload", "tiny")
    name = {"tiny": "gpt-tiny", FUNCTION: f"{fp.FN.name} (mm.jit)"}.get(
        workload, f"gpt-tiny {c['layers']} layers"
    )
    return f"{name} S={c['stages']} m={c['microbatches']}"


def _collective_text(counts: dict[str, Any]) -> str:
    """``12 all-reduces / 296 operands / 3.1 MiB; 4 other`` (other: the other kinds)."""
    ar = counts["all-reduce"]
    other = sum(counts[k]["ops"] for k in _collectives.KINDS if k != "all-reduce")
    return (
        f"{ar['ops']} all-reduces / {ar['operands']} operands / {ar['bytes'] / 2**20:.1f} MiB; "
        f"{other} other"
    )


def _collective_row(name: str, c: dict[str, Any]) -> dict[str, Any]:
    counts = c["collectives"]
    parts = [f"{NAMES[s]} {_collective_text(counts[s])}" for s in c["schedules"]]
    parts.append(f"peer {_collective_text(counts['peer'])}")
    return _common.row(
        SECTION,
        f"{name}: collectives per step, ours (from each fragment's compiled HLO, times it runs) "
        "/ the SPMD peer's one program (other: gathers, scatters, permutes)",
        " | ".join(parts),
    )


def _rows(c: dict[str, Any]) -> list[dict[str, Any]]:
    label = config_label(c)
    names, steps = ratios(c, "ratio", c["schedules"])
    rows = [
        _common.row(SECTION, f"{label}: SPMD peer step", c["peer_median_ms"], unit="ms"),
        _common.row(SECTION, f"{label}: step / SPMD peer's ({names})", steps),
    ]
    if "breakdown" not in c:  # MMFLAX_B7_SCOPE=steps
        return rows
    _, peaks = ratios(c, "peak_ratio", c["schedules"])
    peer_mib = c["peer_bytes"]["peak"] / 2**20
    rows += [
        _common.row(
            SECTION,
            f"{label}: peak bytes per device / SPMD peer's ({names}; peer {peer_mib:.1f} MiB)",
            peaks,
        ),
    ]
    rows += _breakdown_rows(label, c["breakdown"])
    rows.append(_collective_row(label, c))
    cold_ = c.get("cold")
    if cold_ is None:
        return rows
    reps = len(cold_["repetitions"]["peer"])
    _, wall = ratios(cold_, "ratio", c["schedules"])
    _, cpu = ratios(cold_, "ratio_cpu", c["schedules"])
    return [
        *rows,
        _common.row(
            SECTION,
            f"{label}: cold build + first step / SPMD peer's ({names}; wall, median of "
            f"{reps}; peer {cold_['peer_wall_s']:.1f} s)",
            wall,
        ),
        _common.row(SECTION, f"{label}: the same in CPU time", cpu),
    ]


def _breakdown_rows(label: str, parts: dict[str, Any]) -> list[dict[str, Any]]:
    """Per schedule: the host's dispatch per op, and the step split into host dispatch,
    the busiest submesh's compute, transfers and the rest; the peer's dispatch."""
    rows = []
    for schedule, b in parts.items():
        if schedule == "peer":
            continue
        ms = {k: 1e3 * v for k, v in b.items() if isinstance(v, float)}
        rows += [
            _common.row(
                SECTION,
                f"{label} {NAMES[schedule]}: CPU time outside JAX's calls per op ({b['ops']} "
                "ops; the runtime, tree work and buffer frees: B2 subtracts a hand replay's)",
                round(b["runtime_per_op_us"], 1),
                unit="us",
            ),
            _common.row(
                SECTION,
                f"{label} {NAMES[schedule]}: host CPU per op with only JAX's C++ work stubbed "
                "(the runtime's Python and JAX's; B2's stable method, C++ calls left out)",
                round(b["python_host_per_op_us"], 1),
                unit="us",
            ),
            _common.row(
                SECTION,
                f"{label} {NAMES[schedule]}: step {ms['step_s']:.1f} ms; CPU outside / inside "
                "JAX's calls; busiest submesh's compute / transfers / beyond it; all "
                "submeshes' compute (each op recorded alone; XLA's CPU client runs programs "
                "of several devices one at a time, B0) (ms)",
                f"{ms['runtime_cpu_s']:.1f} / {ms['inside_jax_calls_cpu_s']:.1f}; "
                f"{ms['busiest_compute_s']:.1f} / {ms['transfers_s']:.1f} / "
                f"{ms['beyond_busiest_s']:.1f}; {ms['all_compute_s']:.1f}",
            ),
        ]
    peer = parts["peer"]
    rows.append(
        _common.row(
            SECTION,
            f"{label}: SPMD peer step {1e3 * peer['step_s']:.1f} ms = CPU in its one call / "
            "the rest (ms)",
            f"{1e3 * peer['call_cpu_s']:.1f} / {1e3 * peer['rest_s']:.1f}",
        )
    )
    return rows


def run(quick: bool) -> dict[str, Any]:
    rounds, schedules = (5, ("1f1b",)) if quick else (15, SCHEDULES)
    if _common.SMOKE:
        rounds = 2
    configs, rows = [], []
    for workload, stages, m in grid(quick):
        result = measure(stages, m, rounds, schedules, workload)
        if not quick and not STEPS_ONLY:
            reps = COLD_REPETITIONS if workload == "tiny" else SCALE_COLD_REPETITIONS
            result["cold"] = cold(stages, m, reps, workload)
        configs.append(result)
        rows += _rows(result)
    function_configs = []
    for stages, m in function_grid(quick):
        result = measure_function(stages, m, rounds, schedules)
        if not quick and not STEPS_ONLY:
            result["cold"] = cold(stages, m, COLD_REPETITIONS, FUNCTION)
        function_configs.append(result)
        rows += _rows(result)
    return {
        "description": __doc__.splitlines()[0],
        "workload": _common.TINY.describe(),
        "scale_workload": SCALE.describe(),
        "function_workload": fp.FN.describe(),
        "rounds": rounds,
        "scope": SCOPE if SCOPE in ("targets", "scale", "steps") and not quick else "all",
        "configs": configs,
        "function_configs": function_configs,
        "rows": rows,
    }
