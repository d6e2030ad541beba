"""The benchmark suite: how well multimesh_flax does what it exists for, against plain
``jax.jit`` with GSPMD, measured in one run and reported as ratios.

Sections (one module each, each writing ``<out>/<section>.json``):

* ``B0`` (``b0_calibration``) -- how many simulated devices of this host run at once, and
  what an all-reduce operand costs;
* ``B1`` (``b1_step_time``) -- pipelined GPT step time / the best ``jax.jit`` layout;
* ``B2`` (``b2_dispatch``) -- the runtime's dispatch overhead per fragment and per step;
* ``B3`` (``b3_compile``) -- cold compile time, executables vs fragments, recompilations;
* ``B4`` (``b4_memory``) -- parameter and optimizer bytes per device (against ``tabulate``),
  temporary memory per fragment, live activations per submesh, per schedule;
* ``B5`` (``b5_transfers``) -- bytes moved between submeshes per step vs the analytic count;
* ``B6`` (``b6_schedules``) -- simulated vs recorded pipeline bubble per schedule;
* ``B7`` (``b7_spmd_peer``) -- step time, cold first step, peak bytes per device and
  collectives per step against the SPMD pipeline a JAX user would write instead
  (``shard_map`` + ``ppermute``), for ``parallelize_step`` and for ``mm.jit`` +
  ``mm.microbatch``;
* ``B8`` (``b8_processes``) -- the same pipelined step in 1 process x 8 devices and 2 processes
  x 4 devices (``jax.distributed``): step time and cold start ratios, bytes across processes
  per step vs the analytic count, one transfer in-process vs cross-process;
* ``B9`` (``b9_planner``) -- the planner's predicted peak bytes, op durations and makespan
  against measured ones on 8 pipelines, and its search time (smoke: the search only);
* ``GPU`` (``gpu``) -- tokens/s and model FLOPs utilisation of gpt-small on a GPU (skipped
  without one).

``main(["--quick", "--out", DIR])`` runs it (``python -m benchmarks`` on the command line) and
writes ``<out>/report.md``, a markdown table of every metric with its target and whether it
was met. ``--quick`` measures the tiny model only, with fewer configurations and steps;
``--smoke`` (the test suite's run) runs every section's code once, with one small pipeline
configuration and a few rounds: its numbers are not measurements.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SMOKE_VAR = "MMFLAX_BENCH_SMOKE"  # set by --smoke; read by _common (and by child processes)
SECTIONS = {
    "B0": "b0_calibration",
    "B1": "b1_step_time",
    "B2": "b2_dispatch",
    "B3": "b3_compile",
    "B4": "b4_memory",
    "B5": "b5_transfers",
    "B6": "b6_schedules",
    "B7": "b7_spmd_peer",
    "B8": "b8_processes",
    "B9": "b9_planner",
}


def configure_devices() -> None:
    """8 simulated CPU devices (unless a GPU run), before any JAX operation."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if os.environ["JAX_PLATFORMS"] == "cpu":
        jax.config.update("jax_num_cpu_devices", 8)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, fewer configs/steps")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every section once at its smallest (implies --quick; numbers are not measurements)",
    )
    parser.add_argument("--out", default=str(RESULTS), help="directory for JSON and report.md")
    parser.add_argument(
        "--sections",
        default=",".join([*SECTIONS, "GPU"]),
        help="comma-separated subset of " + ",".join([*SECTIONS, "GPU"]),
    )
    return parser


def _run_gpu_section(quick: bool, out: Path) -> dict:
    """The GPU section runs in a child process that sees the machine's real devices."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    command = [sys.executable, "-m", "benchmarks.gpu", "--out", str(out / "gpu.json")]
    if quick:
        command.append("--quick")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    path = out / "gpu.json"
    if proc.returncode != 0 or not path.exists():
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"skipped": f"the GPU section failed (exit {proc.returncode})", "log": tail}
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    """Runs the suite; returns 0 (targets missed are reported, not errors)."""
    args = _parser().parse_args(argv)
    wanted = [s.strip().upper() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS and s != "GPU"]
    if unknown:
        print(f"unknown section(s) {unknown}; choose from {[*SECTIONS, 'GPU']}", file=sys.stderr)
        return 2
    if args.smoke:  # before _common is imported: it reads the variable (so do child processes)
        os.environ[SMOKE_VAR] = "1"
        args.quick = True
    configure_devices()
    cache = _smoke_cache() if args.smoke else None
    try:
        return _run_sections(args, wanted)
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)


def _smoke_cache() -> str:
    """A smoke run's own compilation cache: a new temporary directory (removed at the end),
    so that the sections that build the same small programs (B1, B2, B4, B7) load them
    instead of compiling them again (a smoke run's numbers are not measurements). Child
    processes keep their own settings."""
    import multimesh_flax as mm

    directory = tempfile.mkdtemp(prefix="mmflax-bench-smoke-xla-")
    mm.enable_compilation_cache(directory)
    return directory


def _run_sections(args: argparse.Namespace, wanted: list[str]) -> int:
    from benchmarks import _common, report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict[str, dict] = {}
    for name in wanted:
        section_start = time.perf_counter()
        print(f"[{time.perf_counter() - started:7.1f}s] {name} ...", flush=True)
        if name == "GPU":
            data = _run_gpu_section(args.quick, out)
        else:
            data = importlib.import_module(f"benchmarks.{SECTIONS[name]}").run(args.quick)
            data["host"] = _common.host()
            data["quick"] = args.quick
            data["smoke"] = args.smoke
        data["seconds"] = time.perf_counter() - section_start
        results[name] = data
        (out / f"{SECTIONS.get(name, 'gpu')}.json").write_text(
            json.dumps(data, indent=2, default=str) + "\n"
        )
        for r in data.get("rows", []):
            print("   ", report.format_row(r), flush=True)
    total = time.perf_counter() - started
    command = "python -m benchmarks" + report.flag(args.smoke, args.quick)
    (out / "report.md").write_text(report.render(results, total, command))
    print(f"[{total:7.1f}s] wrote {out}/report.md", flush=True)
    return 0
