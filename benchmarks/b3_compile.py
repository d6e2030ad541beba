"""B3 compilation: cold compile time against ``jax.jit``, executables, recompilations.

* **Cold compile.** A batch shape no other section uses, so nothing is cached: the first
  call of the ``parallelize_step`` step (trace, place, fragment, compile every fragment, run)
  over the first call of plain ``jax.jit`` of the same step (trace, compile, run),
  data-parallel over the 8 devices. Wall and process CPU time are both reported (CPU time
  is steadier on a loaded host), and so is the time to build the state (``parallelize_step``
  itself vs the baseline's sharded ``init``). Target: at most 1.5. The first step of
  ``jax.jit`` accumulating the same microbatches in one program (traced once per
  microbatch, like the pipeline) is measured too, as a second reference.
* **Executables vs fragments.** XLA compilations of that first call against the program's
  fragments: identical fragments (the same stage for every microbatch) compile once.
* **Recompilations.** XLA compilations during steps 2..50 (2..20 with ``--quick``): must be 0.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import _common

SECTION = "B3"
ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.5


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - start[0], cpu - start[1]


def cold(
    workload: _common.Workload, stages: int, m: int, schedule: str, jit_first: bool = False
) -> dict[str, Any]:
    """Cold setup and first-step times of the pipelined step and of the ``jax.jit`` one."""
    out: dict[str, Any] = {"batch": workload.batch, "jit_first": bool(jit_first)}
    if jit_first:
        _cold_jit(workload, out)
    start = _clock()
    with _common.count_compiles() as setup_compiles:
        runner = _common.build_mpmd(workload, stages, m, schedule)
    out["mpmd_setup_s"], out["mpmd_setup_cpu_s"] = _since(start)
    start = _clock()
    with _common.count_compiles() as first:
        runner.step()
    out["mpmd_first_s"], out["mpmd_first_cpu_s"] = _since(start)
    exe = runner.executable
    out["fragments"] = _common.fragment_count(exe)
    out["executables"] = first["count"]
    out["mpmd_xla_compile_s"] = first["seconds"]
    out["mpmd_setup_compiles"] = setup_compiles["count"]
    _common.release(runner)
    if not jit_first:
        _cold_jit(workload, out)
    _cold_jit(workload, out, microbatches=m)
    out["ratio_first_step_accumulated"] = out["mpmd_first_s"] / out[f"jit_m{m}_first_s"]
    out["ratio_xla_compile_accumulated"] = (
        out["mpmd_xla_compile_s"] / out[f"jit_m{m}_xla_compile_s"]
    )
    out["ratio_first_step"] = out["mpmd_first_s"] / out["jit_first_s"]
    out["ratio_first_step_cpu"] = out["mpmd_first_cpu_s"] / out["jit_first_cpu_s"]
    out["ratio_xla_compile"] = out["mpmd_xla_compile_s"] / out["jit_xla_compile_s"]
    out["ratio_with_setup"] = (out["mpmd_setup_s"] + out["mpmd_first_s"]) / (
        out["jit_setup_s"] + out["jit_first_s"]
    )
    return out


def _cold_jit(workload: _common.Workload, out: dict[str, Any], microbatches: int = 1) -> None:
    """Cold setup and first step of ``jax.jit`` (keys ``jit_*``), or, for
    ``microbatches > 1``, of ``jax.jit`` accumulating that many microbatches (``jit_m<k>_*``;
    its setup compiles what the plain one's did, so only the first step is kept)."""
    prefix = "jit" if microbatches == 1 else f"jit_m{microbatches}"
    start = _clock()
    with _common.count_compiles() as setup_compiles:
        base = _common.build_jit(workload, "data-parallel 8", microbatches=microbatches)
    if microbatches == 1:
        out["jit_setup_s"], out["jit_setup_cpu_s"] = _since(start)
        out["jit_setup_compiles"] = setup_compiles["count"]
    start = _clock()
    with _common.count_compiles() as first:
        base.step()
    out[f"{prefix}_first_s"], out[f"{prefix}_first_cpu_s"] = _since(start)
    out[f"{prefix}_executables"] = first["count"]
    out[f"{prefix}_xla_compile_s"] = first["seconds"]
    _common.release(base)


def recompiles(runner: _common.MpmdRunner, steps: int) -> dict[str, Any]:
    """XLA compilations during steps 2..``steps`` of an already compiled step."""
    before = runner.executable.compile_count()
    with _common.count_compiles() as compiles:
        for _ in range(steps - 1):
            runner.step()
    return {
        "steps": f"2..{steps}",
        "compilations": compiles["count"],
        "executables_before": before,
        "executables_after": runner.executable.compile_count(),
    }


def _cold_workload(workload: _common.Workload, rep: int) -> _common.Workload:
    """``workload`` at a batch size that nothing else compiles (so nothing is cached)."""
    import dataclasses

    return dataclasses.replace(workload, batch=workload.batch + 16 * (rep + 1))


def cold_in_child(preset: str, stages: int, m: int, schedule: str, reps: int) -> dict[str, Any]:
    """``cold`` ``reps`` times, each in a fresh process (so no cache helps) and with new
    shapes; the two programs' order alternates between repetitions."""
    runs = [_child_process(preset, stages, m, schedule, rep) for rep in range(reps)]
    keys = [k for k in runs[0] if k.startswith("ratio")]
    workload = {w.preset: w for w in (_common.TINY, _common.SMALL)}[preset]
    return {
        "workload": _cold_workload(workload, 0).describe(),
        "stages": stages,
        "microbatches": m,
        "schedule": schedule,
        "repetitions": runs,
        **{k: statistics.median(r[k] for r in runs) for k in keys},
        "fragments": runs[0]["fragments"],
        "executables": runs[0]["executables"],
    }


def _child_process(preset: str, stages: int, m: int, schedule: str, rep: int) -> dict[str, Any]:
    code = (
        "import json; from benchmarks import configure_devices; configure_devices(); "
        "from benchmarks import b3_compile as b; "
        f"print('RESULT' + json.dumps(b.child({preset!r}, {stages}, {m}, {schedule!r}, {rep})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"cold-compile child failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT") :])


def child(preset: str, stages: int, m: int, schedule: str, rep: int) -> dict[str, Any]:
    """One cold measurement (run in a fresh process by ``cold_in_child``)."""
    workload = {w.preset: w for w in (_common.TINY, _common.SMALL)}[preset]
    return cold(_cold_workload(workload, rep), stages, m, schedule, jit_first=rep % 2 == 1)


def run(quick: bool) -> dict[str, Any]:
    colds = [cold_in_child(_common.TINY.preset, 2, 4, "1f1b", 1 if quick else 2)]
    steps = 20 if quick else 50
    from benchmarks import b1_step_time

    runners = list(b1_step_time.KEPT.values())
    if not runners:
        runners = [_common.build_mpmd(_common.TINY, 2, 4, "1f1b")]
        _common.warm(runners[0])
    # The longest run on the most fragmented program; every other kept program gets 5 steps.
    runners.sort(key=lambda r: -_common.fragment_count(r.executable))
    recompile = {runners[0].name: recompiles(runners[0], steps)}
    for r in runners[1:]:
        recompile[r.name] = recompiles(r, 6)
    rows = []
    for c in colds:
        label = f"{c['workload']['preset']} S={c['stages']} m={c['microbatches']} {c['schedule']}"
        rows += [
            _common.row(
                SECTION,
                f"{label}: cold first step / jax.jit (wall, median of {len(c['repetitions'])})",
                round(c["ratio_first_step"], 2),
                target=f"<= {TARGET}",
                passed=c["ratio_first_step"] <= TARGET,
            ),
            _common.row(
                SECTION,
                f"{label}: cold first step / jax.jit (CPU time)",
                round(c["ratio_first_step_cpu"], 2),
            ),
            _common.row(
                SECTION,
                f"{label}: XLA compile seconds / jax.jit's",
                round(c["ratio_xla_compile"], 2),
            ),
            _common.row(
                SECTION,
                f"{label}: cold first step; XLA compile seconds / those of jax.jit accumulating "
                f"the same {c['microbatches']} microbatches",
                f"{c['ratio_first_step_accumulated']:.2f}; "
                f"{c['ratio_xla_compile_accumulated']:.2f}",
            ),
            _common.row(
                SECTION,
                f"{label}: state setup + first step / jax.jit's",
                round(c["ratio_with_setup"], 2),
            ),
            _common.row(
                SECTION,
                f"{label}: executables compiled / fragments",
                f"{c['executables']} / {c['fragments']}",
            ),
        ]
    small = b1_step_time.RESULTS.get("gpt-small")
    if small is not None:  # its first pipelined program compiled with nothing cached
        first = small["configs"][0]
        base = statistics.median(
            r["first_step_s"] for r in small["baselines"].values() if "first_step_s" in r
        )
        ratio = first["first_step_s"] / base
        label = f"gpt-small S={first['stages']} m={first['microbatches']} {first['schedule']}"
        rows.append(
            _common.row(
                SECTION,
                f"{label}: cold first step / jax.jit's (median of the layouts; in B1, 1 sample)",
                round(ratio, 2),
                target=f"<= {TARGET}",
                passed=ratio <= TARGET,
            )
        )
    total = sum(r["compilations"] for r in recompile.values())
    rows.append(
        _common.row(
            SECTION,
            f"compilations after step 1 ({len(recompile)} programs, steps 2..{steps} of the "
            "largest, 2..6 of the rest)",
            total,
            target="0",
            passed=total == 0,
        )
    )
    return {
        "description": __doc__.splitlines()[0],
        "cold": colds,
        "recompiles": recompile,
        "rows": rows,
    }
