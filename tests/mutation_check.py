"""Mutation spot-check: plant one-line bugs in a copy of the repository, see which tests catch them.

Each mutation replaces one stable source snippet of a core function (placement, fragmenting,
gradient accumulation order, schedule order, logical rule resolution, dropout key folding,
checkpoint target checking, simulator formulas, ...) and runs the test files that should
notice. A mutation is *caught* when those tests fail. The table of results is kept in
``tests/MUTATIONS.md``; every mutation there must be caught.

The shared working tree is never touched: the script exports ``HEAD`` (or, with
``--worktree``, copies the working tree) into a temporary folder, checks first that the
selected tests pass there unmutated (the baseline), then applies one mutation at a time,
runs its tests with ``-x`` under a timeout and restores the file. When a snippet is no
longer found (the code moved on), the row says so: update the snippet here.

Not collected by pytest (the name does not start with ``test_``); run it by hand, it costs
minutes of CPU::

    .venv/bin/python tests/mutation_check.py            # all mutations, markdown table
    .venv/bin/python tests/mutation_check.py --list     # names and whether snippets exist
    .venv/bin/python tests/mutation_check.py --only key-fold-step sim-bubble
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One planted bug: in ``path``, ``old`` (must occur exactly once) becomes ``new``."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, ``-k`` expressions
    what: str


SIM = ("tests/core/test_simulator.py",)
SCHED = ("tests/core/test_schedules.py", "tests/core/test_simulator.py")
PARITY = ("tests/core/test_pipeline_parity.py",)

MUTATIONS = (
    Mutation(
        "sim-bubble",
        "multimesh_flax/core/plan/_simulator.py",
        "return 1.0 - sum(busy) / (len(busy) * span) if span > 0 else 0.0",
        "return 1.0 - sum(busy) / (len(busy) * span + 1) if span > 0 else 0.0",
        SIM,
        "simulator: idle fraction 1 - busy / (rows * span + 1)",
    ),
    Mutation(
        "sim-transfer",
        "multimesh_flax/core/plan/_simulator.py",
        'start = max(start, end[dep] + (cost(dep.stage, "transfer") if crossing else 0.0))',
        "start = max(start, end[dep])",
        SIM,
        "simulator: transfers between rows cost nothing",
    ),
    Mutation(
        "sim-unsplit-backward",
        "multimesh_flax/core/plan/_simulator.py",
        'return cost(op.stage, "B") + cost(op.stage, "W")',
        'return cost(op.stage, "B")',
        SIM,
        "simulator: an unsplit backward costs B only (W forgotten)",
    ),
    Mutation(
        "sched-1f1b-warmup",
        "multimesh_flax/core/declare/_schedules.py",
        "warmup = min(rows - r - 1, m)",
        "warmup = min(rows - r, m)",
        SCHED,
        "schedule order: 1F1B warms up one forward too many",
    ),
    Mutation(
        "sched-interleaved-warmup",
        "multimesh_flax/core/declare/_schedules.py",
        "warmup = min(2 * (rows - r - 1) + (chunks - 1) * rows, total)",
        "warmup = min(2 * (rows - r - 1) + chunks * rows, total)",
        SCHED,
        "schedule order: interleaved 1F1B warms up a row too many",
    ),
    Mutation(
        "logical-axis-once",
        "multimesh_flax/core/declare/_rules.py",
        "if name not in names or any(a in used for a in axes):",
        "if name not in names:",
        ("tests/core/test_logical.py",),
        "logical rules: a mesh axis may shard two dimensions of one array",
    ),
    Mutation(
        "logical-oversharding",
        "multimesh_flax/core/declare/_rules.py",
        "if count > shape[d]:",
        "if count > 2 * shape[d]:",
        ("tests/core/test_logical.py",),
        "logical rules: a rule is kept although it shards a dimension into more parts than it has",
    ),
    Mutation(
        "key-fold-step",
        "multimesh_flax/layers/_step.py",
        "return jax.random.fold_in(self.dropout_key, step)",
        "return jax.random.fold_in(self.dropout_key, 0)",
        ("tests/layers/test_dropout_keys.py",),
        "dropout keys: every step uses step 0's key (same masks every step)",
    ),
    Mutation(
        "key-fold-microbatch",
        "multimesh_flax/layers/_step.py",
        "return step_key if microbatch is None else jax.random.fold_in(step_key, microbatch)",
        "return step_key",
        ("tests/layers/test_dropout_keys.py",),
        "dropout keys: every microbatch of a step shares the step's key",
    ),
    Mutation(
        "microbatch-chunk",
        "multimesh_flax/core/trace/_microbatch.py",
        "return jax.lax.slice_in_dim(leaf, k * size, (k + 1) * size, axis=axis)",
        "return jax.lax.slice_in_dim(leaf, 0, size, axis=axis)",
        ("tests/core/test_microbatch.py",),
        "microbatching: every microbatch is the first chunk",
    ),
    Mutation(
        "microbatch-mean",
        "multimesh_flax/core/trace/_microbatch.py",
        "total = jax.tree_util.tree_map(lambda x: _divided(x, m), total)",
        "total = jax.tree_util.tree_map(lambda x: x, total)",
        ("tests/core/test_microbatch.py",),
        "microbatching: reduce='mean' returns the sum",
    ),
    Mutation(
        "placement-innermost-task",
        "multimesh_flax/layers/_placement.py",
        "if param_path[:n] == module_path and (best is None or n > len(best[0])):",
        "if param_path[:n] == module_path and (best is None or n < len(best[0])):",
        ("tests/layers/test_flax_task.py", "tests/layers/test_tabulate.py"),
        "placement: a parameter belongs to its outermost task, not its innermost",
    ),
    Mutation(
        "placement-mirror",
        "multimesh_flax/layers/_placement.py",
        "if hit is not None and hit[0] == tuple(np.shape(leaf)):",
        "if hit is not None and hit[0] != tuple(np.shape(leaf)):",
        ("tests/layers/test_step.py", "-k", "optimizer_state"),
        "placement: optimizer state no longer sits with its parameter",
    ),
    Mutation(
        "checkpoint-dtype",
        "multimesh_flax/checkpoint.py",
        "same_dtype = np.dtype(saved.dtype) == np.dtype(target.dtype)",
        "same_dtype = True",
        ("tests/test_checkpoint.py", "-k", "mismatch or rejected"),
        "checkpoint target check: a dtype mismatch passes",
    ),
    Mutation(
        "dispatch-schedule-order",
        "multimesh_flax/core/plan/_pipeline.py",
        "return keys.get(unit, (-math.inf,)) if unit is not None else (-math.inf,), index",
        "return (-math.inf,), index",
        PARITY,
        "schedule order: fragments dispatch in program order, ignoring the schedule",
    ),
    Mutation(
        "fragment-microbatch-index",
        "multimesh_flax/core/plan/_pipeline.py",
        "found = [(int(m.group(1)), int(m.group(2))) for m in MICROBATCH_RE.finditer(stack)]",
        "found = [(int(m.group(1)), 0) for m in MICROBATCH_RE.finditer(stack)]",
        PARITY,
        "fragmenting: every equation is attributed to microbatch 0",
    ),
    Mutation(
        "accumulate-order",
        "multimesh_flax/core/plan/_accumulate.py",
        "return _chain(template, sorted(leaves, key=key), out)",
        "return _chain(template, leaves, out)",
        ("tests/core/test_pipeline_parity.py", "-k", "gradient", "tests/core/test_accumulate.py"),
        "accumulation order: gradient sums on one submesh keep program order, not ready order",
    ),
    Mutation(
        "blocks-abstract-constraints",
        "multimesh_flax/core/run/_compile.py",
        "    if is_block(eqn):\n        return _abstract_block(eqn)\n",
        "",
        ("tests/core/test_blocks.py",),
        "blocks: constraints inside a block keep their concrete mesh (stages share no program)",
    ),
    Mutation(
        "blocks-first-constraint",
        "multimesh_flax/core/fragment/_inputs.py",
        "            if is_block(eqn):",
        "            if False:",
        ("tests/core/test_blocks.py",),
        "blocks: an input's first constraint inside a block is not seen (it arrives replicated)",
    ),
    Mutation(
        "blocks-output-sums",
        "multimesh_flax/core/trace/_blocks.py",
        "    single = _output_sums(eqns, template.outvars)",
        "    single: set[int] = set()",
        ("tests/core/test_accumulate.py",),
        "blocks: a tied gradient's in-microbatch sum is hidden in a block (no per-submesh sums)",
    ),
    Mutation(
        "blocks-backward-split",
        "multimesh_flax/core/trace/_blocks.py",
        "    activation = _activation_gradient(body) if split else set()",
        "    activation: set[int] = set()",
        ("tests/core/test_blocks.py",),
        "blocks: under zero-bubble a backward block mixes activation and weight gradients",
    ),
    Mutation(
        "sink-glue-readers",
        "multimesh_flax/core/fragment/_sink.py",
        "at[pos] -= 1",
        "at[pos] = 0",
        ("tests/core/test_sink_glue.py",),
        "sink: moving one reader out of a fragment forgets the fragment's other readers",
    ),
    Mutation(
        "accumulate-bundle-any",
        "multimesh_flax/core/plan/_accumulate.py",
        "        members = bundles.setdefault((first, second), [])",
        "        members = bundles.setdefault((0, 0), [])",
        ("tests/core/test_accumulate.py",),
        "bundles: every sum over microbatches in one bundle, whatever made its operands",
    ),
    Mutation(
        "accumulate-bundle-link",
        "multimesh_flax/core/plan/_accumulate.py",
        "        first, second = (group_of.get(j, j) for j in sources)",
        "        first, second = sources",
        ("tests/core/test_accumulate.py",),
        "bundles: a sum reading an earlier bundle's output is not bundled with its neighbours",
    ),
    Mutation(
        "step-grad-inside-loop",
        "multimesh_flax/layers/_step.py",
        "        if self.pipeline is None or model_state:",
        "        if True:",
        ("tests/core/test_compile_path.py",),
        "parallelize_step differentiates the loop over microbatches, not each microbatch",
    ),
    Mutation(
        "accumulate-bundle-mixed-only",
        "multimesh_flax/core/plan/_accumulate.py",
        "        if not (glue and equation.microbatch is None and is_sum(eqn)):",
        "        if not (equation.mixed and is_sum(eqn)):",
        ("tests/core/test_accumulate.py",),
        "bundles: the loop's own sums over microbatches (gradients taken inside it) stay unbundled",
    ),
    Mutation(
        "sink-units-off",
        "multimesh_flax/core/fragment/_partition.py",
        "    order = _sink.sink_into_units(traced, order)",
        "    order = list(order)",
        ("tests/core/test_sink_units.py",),
        "a microbatch's input-only glue (the loss's one-hot backward) stays pooled up front",
    ),
    Mutation(
        "sink-units-any-copy",
        "multimesh_flax/core/fragment/_sink.py",
        "        differing = _differing(order, moves)",
        "        differing: set[int] = set()",
        ("tests/core/test_sink_units.py",),
        "moves glue that differs per microbatch (the slices) too: a stage's units differ",
    ),
    Mutation(
        "relocate-off",
        "multimesh_flax/core/run/_compile.py",
        "                return _relocate.relocate(entry.compiled, mapping)",
        "                return None",
        ("tests/core/test_relocate.py", "tests/core/test_mpmd.py"),
        "identical stages on other submeshes compile again instead of being relocated",
    ),
    Mutation(
        "relocate-cached-source",
        "multimesh_flax/core/run/_relocate.py",
        '    return compiled, read()["cache_hits"] == 0',
        "    return compiled, True",
        ("tests/core/test_relocate.py",),
        "an executable from the persistent cache (no kernels when serialized) is relocated",
    ),
    Mutation(
        "initializer-per-submesh",
        "multimesh_flax/core/front/_initializer.py",
        "    if len(by_devices) == 1 or any(d.process_index != jax.process_index() for d in "
        "devices):",
        "    if True:",
        ("tests/core/test_initializer.py",),
        "MPMD initialisers: one program per submesh, compiling identical blocks' kernels again",
    ),
    Mutation(
        "key-split-eager",
        "multimesh_flax/layers/_step.py",
        "        self.key = _root_key(rng)  # split where the keys are used (``_split_key``)",
        "        self.key = _root_key(rng); _split_key(self.key)",
        ("tests/layers/test_step.py",),
        "parallelize_step splits its key eagerly again: small key programs compile before all",
    ),
    Mutation(
        "loops-chunk",
        "multimesh_flax/core/trace/_loops.py",
        "_rows(source, source.aval, k * size, (k + 1) * size, chunk, like)",
        "_rows(source, source.aval, 0, size, chunk, like)",
        ("tests/core/test_microbatch.py", "tests/core/test_loops.py"),
        "loops: every unrolled iteration reads the batch's first chunk",
    ),
    Mutation(
        "loops-hoisted-once",
        "multimesh_flax/core/trace/_trace.py",
        "        if not isinstance(value, _loops.HoistedOut) or value.source.uid != uid:",
        "        if True:",
        ("tests/core/test_loops.py",),
        "loops: what JAX hoisted out of the scan runs once, outside every microbatch",
    ),
    Mutation(
        "loops-residual-iteration",
        "multimesh_flax/core/trace/_trace.py",
        "            return value.parts[k]",
        "            return value.parts[0]",
        ("tests/core/test_loops.py",),
        "loops: every backward iteration reads microbatch 0's residuals",
    ),
    Mutation(
        "loops-first-use",
        "multimesh_flax/core/trace/_trace.py",
        "        if id(source.eqn) in captured.recomputed:",
        "        if False:",
        ("tests/core/test_loops.py",),
        "loops: a hoisted value recomputed before the whole body puts its stage first",
    ),
    Mutation(
        "loops-sum-type",
        "multimesh_flax/core/trace/_blocks.py",
        "v.aval.shape == shape and v.aval.dtype == dtype",
        "v.aval == eqn.outvars[0].aval",
        ("tests/core/test_loops.py",),
        "loops: a loop carry's gradient sums (no mesh in their aval) are not seen as sums",
    ),
    Mutation(
        "fast-path-autoshard",
        "multimesh_flax/core/trace/_trace.py",
        "        autoshard(),\n        _session.trace_session() as session,",
        "        _session.trace_session() as session,",
        ("tests/core/test_parallelize_spmd.py",),
        "tracing: programs (the task-free fast path too) are traced without autoshard",
    ),
    Mutation(
        "host-values-same-arrays",
        "multimesh_flax/distributed/_wire.py",
        "    _check_same_arrays(tree)\n    try:",
        "    try:",
        (
            "tests/distributed/test_multiprocess.py::"
            "test_host_values_of_arrays_made_in_each_process_fails_naming_the_leaf",
        ),
        "host_values: arrays each process made alone go to the broadcast, which waits",
    ),
    Mutation(
        "sequence-no-grace",
        "multimesh_flax/distributed/_sequence.py",
        "PEER_GRACE_S = 2.0",
        "PEER_GRACE_S = 0.0",
        (
            "tests/distributed/test_misuse.py::"
            "test_per_process_batches_fail_at_the_first_step_naming_the_input[seeds_late_in_1]",
        ),
        "a process still unwinding its own error is ended as a bystander of the other's (75)",
    ),
    Mutation(
        "sequence-exiting-ignored",
        "multimesh_flax/distributed/_sequence.py",
        "    return _uncaught() is not None or not threading.main_thread().is_alive()",
        "    return False",
        (
            "tests/distributed/test_misuse.py::"
            "test_per_process_batches_fail_at_the_first_step_naming_the_input"
            "[seeds_slow_exit_in_1]",
        ),
        "a process running its exit handlers is ended as a bystander of another's failure",
    ),
    Mutation(
        "sequence-failed-to-barrier",
        "multimesh_flax/distributed/_sequence.py",
        "        if uncaught is not None:\n            self._end_failed(uncaught)\n",
        "        if uncaught is not None:\n            return\n",
        (
            "tests/distributed/test_misuse.py::"
            "test_a_process_that_raises_keeps_its_status_and_the_waiting_one_names_it",
        ),
        "a failing process waits in jax's shutdown barrier for one that will not come (-6)",
    ),
    Mutation(
        "saves-leftovers-unfiltered",
        "multimesh_flax/_checkpoint_saves.py",
        '    for name in ("absl", "asyncio"):',
        '    for name in ("absl",):',
        ("tests/test_checkpoint_faults.py::test_leftovers_of_a_failed_save_print_no_traceback",),
        "asyncio prints orbax's unretrieved futures of a failed save as tracebacks",
    ),
    Mutation(
        "saves-unraisable-unfiltered",
        "multimesh_flax/_checkpoint_saves.py",
        "    drop_abandoned_orbax_work()\n    with _LOCK:",
        "    with _LOCK:",
        ("tests/test_checkpoint_faults.py::test_leftovers_of_a_failed_save_print_no_traceback",),
        "a save's writes completing after orbax closed its loop print 'Event loop is closed'",
    ),
)


# --- the copy ---------------------------------------------------------------------------------


def make_copy(dest: Path, worktree: bool) -> None:
    """``HEAD`` (``git archive``) or the working tree (without .git/.venv) into ``dest``."""
    if worktree:
        ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "runs", "*.egg-info")
        shutil.copytree(ROOT, dest, ignore=ignore, dirs_exist_ok=True)
        return
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def snippet_status(root: Path, mutation: Mutation) -> str | None:
    """``None`` when the snippet occurs exactly once, else why the mutation cannot apply."""
    path = root / mutation.path
    if not path.exists():
        return f"file {mutation.path} no longer exists: update this mutation"
    count = path.read_text().count(mutation.old)
    if count == 1:
        return None
    found = "not found" if count == 0 else f"found {count} times"
    return f"snippet {found} in {mutation.path}: update this mutation"


# --- running tests ----------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    status: str  # "passed", "failed", "timeout", "error"
    detail: str
    seconds: float


def run_tests(root: Path, tests: tuple[str, ...], timeout: float, stop_first: bool) -> Outcome:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", *(["-x"] if stop_first else [])]
    cmd += list(tests)
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return Outcome("timeout", f"no result within {timeout:.0f} s", time.monotonic() - start)
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return Outcome("passed", _summary(out), seconds)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
    if proc.returncode in (1, 2) and failed:
        return Outcome("failed", failed[0], seconds)
    return Outcome("error", f"pytest exit {proc.returncode}: {_summary(out)}", seconds)


def _summary(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def check_imports_the_copy(root: Path) -> None:
    """Refuses to run if Python in the copy would import the shared tree's package."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = "import multimesh_flax, sys; sys.stdout.write(multimesh_flax.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    ).stdout
    if not Path(where).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"the copy imports multimesh_flax from {where}, not from {root}")


# --- the check --------------------------------------------------------------------------------


def mutate_and_run(root: Path, mutation: Mutation, timeout: float) -> tuple[str, str, float]:
    """``(verdict, caught by / reason, seconds)`` for one mutation."""
    problem = snippet_status(root, mutation)
    if problem is not None:
        return "SNIPPET MISSING", problem, 0.0
    path = root / mutation.path
    original = path.read_text()
    path.write_text(original.replace(mutation.old, mutation.new))
    try:
        outcome = run_tests(root, mutation.tests, timeout, stop_first=True)
    finally:
        path.write_text(original)
    if outcome.status == "failed":
        return "caught", outcome.detail, outcome.seconds
    if outcome.status == "passed":
        return "MISSED", outcome.detail, outcome.seconds
    return outcome.status.upper(), outcome.detail, outcome.seconds


def baseline(root: Path, mutations: list[Mutation], timeout: float) -> dict[tuple[str, ...], str]:
    """Per distinct test selection, ``"ok"`` or why it fails without any mutation."""
    results = {}
    for tests in dict.fromkeys(m.tests for m in mutations):
        outcome = run_tests(root, tests, timeout, stop_first=False)
        results[tests] = "ok" if outcome.status == "passed" else outcome.detail
        print(f"baseline {' '.join(tests)}: {results[tests]} ({outcome.seconds:.0f} s)", flush=True)
    return results


def table(rows: list[tuple[Mutation, str, str, float]]) -> str:
    lines = [
        "| mutation | file | planted bug | verdict | caught by | s |",
        "|---|---|---|---|---|---|",
    ]
    for m, verdict, detail, seconds in rows:
        lines.append(
            f"| `{m.name}` | `{m.path}` | {m.what} | {verdict} | `{detail}` | {seconds:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--list", action="store_true", help="list mutations, run nothing")
    parser.add_argument("--worktree", action="store_true", help="copy the working tree, not HEAD")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="s per run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutations {sorted(unknown)}; see --list")
    with tempfile.TemporaryDirectory(prefix="mmflax-mutants-") as tmp:
        root = Path(tmp)
        make_copy(root, args.worktree)
        if args.list:
            for m in chosen:
                print(f"{m.name:28} {snippet_status(root, m) or 'ok'}")
            return 0
        check_imports_the_copy(root)
        broken = {} if args.no_baseline else baseline(root, chosen, args.timeout)
        rows = []
        for m in chosen:
            if broken.get(m.tests, "ok") != "ok":
                rows.append((m, "BASELINE FAILS", broken[m.tests], 0.0))
                continue
            verdict, detail, seconds = mutate_and_run(root, m, args.timeout)
            print(f"{m.name}: {verdict} ({detail}, {seconds:.0f} s)", flush=True)
            rows.append((m, verdict, detail, seconds))
    print()
    print(table(rows))
    return 0 if all(verdict == "caught" for _, verdict, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
