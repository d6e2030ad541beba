"""B5 transfers: bytes moved between submeshes per step against the analytic count.

A pipelined GPT step must move, per step:

* the residual stream across each of the ``S - 1`` stage boundaries, forward, and its
  cotangent backward: ``2 (S - 1) B L E`` values for a global batch ``B`` of length ``L``
  (microbatching splits it, the total is the same);
* the tied token table (``V x E``) from the stem on stage 0 to the head on the last stage,
  and its gradient back: ``2 V E`` values.

``measured`` is ``MpmdExecutable.transfer_bytes()`` (logical bytes of every value a transfer
moves, per step). The difference to the analytic count is listed transfer by transfer.
Also checked: after a step the new state already sits in the step's input shardings, so the
next call moves nothing outside the program (``hidden_bytes``, target 0).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from benchmarks import _common

SECTION = "B5"


def analytic(workload: _common.Workload, stages: int) -> dict[str, int]:
    cfg = workload.config()
    act = np.dtype(cfg.dtype).itemsize
    par = np.dtype(cfg.param_dtype).itemsize
    boundary = workload.batch * workload.length * cfg.embed_dim * act
    table = cfg.vocab_size * cfg.embed_dim * par if stages > 1 else 0
    return {
        "activations": (stages - 1) * boundary,
        "cotangents": (stages - 1) * boundary,
        "tied_table_and_gradient": 2 * table,
        "total": 2 * (stages - 1) * boundary + 2 * table,
    }


def transfers(exe: Any) -> list[dict[str, Any]]:
    """Every transfer of the program: destination, values and bytes."""
    var_of = {slot: var for (var, _), slot in exe._slots.items()}
    out = []
    for op in exe.ops:
        if op.kind != 1:
            continue
        shapes = [f"{var_of[s].aval.dtype}{list(var_of[s].aval.shape)}" for s in op.outs]
        size = sum(_common.np_bytes(var_of[s].aval) for s in op.outs)
        out.append({"to": list(op.place), "values": shapes, "bytes": size})
    return out


def hidden_bytes(runner: _common.MpmdRunner) -> int:
    """Bytes the next call would move before running (inputs outside their shardings)."""
    exe = runner.executable
    leaves = jax.tree_util.tree_leaves((runner.state, runner.batch))
    total = 0
    for x, want in zip(leaves, exe.input_shardings, strict=True):
        if want is not None and not x.sharding.is_equivalent_to(want, x.ndim):
            total += _common.np_bytes(x)
    return total


def measure(workload: _common.Workload, stages: int, m: int, schedule: str) -> dict[str, Any]:
    from benchmarks import b1_step_time

    runner, owned = b1_step_time.kept_or_built(workload, stages, m, schedule)
    exe = runner.executable
    expected = analytic(workload, stages)
    measured = exe.transfer_bytes()
    listed = transfers(exe)
    by_size: dict[int, int] = {}
    for t in listed:
        by_size[t["bytes"]] = by_size.get(t["bytes"], 0) + 1
    result = {
        "name": runner.name,
        "stages": stages,
        "microbatches": m,
        "schedule": schedule,
        "measured_bytes": measured,
        "analytic_bytes": expected,
        "ratio": measured / expected["total"],
        "excess_bytes": measured - expected["total"],
        "transfer_ops": len(listed),
        "transfers_by_size": {str(k): v for k, v in sorted(by_size.items())},
        "transfers": listed,
        "hidden_bytes": hidden_bytes(runner),
    }
    if owned:
        _common.release(runner)
    return result


def run(quick: bool) -> dict[str, Any]:
    configs = [(2, 1, "gpipe"), (2, 4, "1f1b")]  # --quick: the configs B1 built
    if _common.SMOKE:
        configs = [_common.SMOKE_CONFIG]
    elif not quick:
        configs += [(4, 4, "1f1b"), (2, 4, "gpipe"), (4, 8, "gpipe")]
    results, rows = [], []
    for s, m, sched in configs:
        r = measure(_common.TINY, s, m, sched)
        results.append(r)
        label = f"gpt-tiny S={s} m={m} {sched}"
        rows += [
            _common.row(
                SECTION,
                f"{label}: bytes moved / analytic "
                f"({r['measured_bytes']:,} / {r['analytic_bytes']['total']:,})",
                round(r["ratio"], 3),
            ),
            _common.row(
                SECTION,
                f"{label}: bytes moved outside the program before the next step",
                r["hidden_bytes"],
                target="0",
                passed=r["hidden_bytes"] == 0,
                unit="B",
            ),
        ]
    return {
        "description": __doc__.splitlines()[0],
        "workload": _common.TINY.describe(),
        "configs": results,
        "rows": rows,
    }
