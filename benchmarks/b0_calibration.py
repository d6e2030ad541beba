"""B0 calibration: how many of this host's simulated devices really run at once.

The same independent program (a chain of matrix products) is jitted on each of the 8
devices. Per ``k`` in 1, 2, 4, 8 we time ``k`` copies dispatched together on ``k`` devices
and waited for together; ``concurrency(k) = k * t(1) / t(k)`` is how many devices' worth of
work the host executes at once (``k`` on ideal hardware). Pipelining can only beat one
device's speed by this much, so it bounds every speed-up the other sections can show on
this machine.

**Collectives per operand.** The same bytes all-reduced over 4 devices as one tuple
all-reduce of ``N`` operands (``N`` sums in one program, which XLA combines into one
instruction) and as one all-reduce of their concatenation, for ``N`` in 1, 8, 40 (40: about
what a data-parallel stage's backward fragment sums per microbatch); medians of
interleaved rounds, in ms, and the cost per operand beyond the first: XLA's CPU runtime
runs a tuple all-reduce operand by operand, so a fragment's many small gradients cost more
than their bytes. Each program's all-reduce instructions and operands are read from its
HLO (``_collectives``) to show what was timed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _collectives, _common

SECTION = "B0"


def _program(width: int, repeats: int) -> Any:
    def chain(x: jax.Array) -> jax.Array:
        def body(_: int, y: jax.Array) -> jax.Array:
            return jnp.tanh(y @ x) * 0.5

        return jax.lax.fori_loop(0, repeats, body, x)

    return jax.jit(chain)


ALLREDUCE_DEVICES = 4
ALLREDUCE_FLOATS = 440_000  # per device and program: 1.7 MB, split into N operands
ALLREDUCE_OPERANDS = (1, 8, 40)


def _allreduce_programs(operands: int, mesh: Mesh) -> dict[str, Any]:
    """``"tuple"``: ``operands`` sums over the device axis (one tuple all-reduce);
    ``"concatenated"``: the same pieces concatenated first, one all-reduce of one operand."""
    width = ALLREDUCE_FLOATS // operands
    replicated = NamedSharding(mesh, P())

    def pieces(x: jax.Array) -> list[jax.Array]:
        return [x[:, i * width : (i + 1) * width] for i in range(operands)]

    programs = {"tuple": jax.jit(lambda x: [p.sum(0) for p in pieces(x)], out_shardings=replicated)}
    if operands > 1:  # one piece: the same program
        programs["concatenated"] = jax.jit(
            lambda x: jnp.concatenate(pieces(x), axis=1).sum(0), out_shardings=replicated
        )
    return programs


def allreduce_calibration(rounds: int) -> dict[str, Any]:
    """Median ms of each program of :func:`_allreduce_programs` per operand count, the
    all-reduces XLA compiled (instructions, operands), and the cost per extra operand."""
    devices = np.array(jax.devices()[:ALLREDUCE_DEVICES])
    mesh = Mesh(devices, ("data",), axis_types=(AxisType.Auto,))
    x = jax.device_put(
        jnp.ones((ALLREDUCE_DEVICES, ALLREDUCE_FLOATS)), NamedSharding(mesh, P("data"))
    )
    fns, hlo = [], {}
    for n in ALLREDUCE_OPERANDS:
        for kind, fn in _allreduce_programs(n, mesh).items():
            compiled = fn.lower(x).compile()
            hlo[f"{kind} {n}"] = _collectives.compiled_collectives(compiled)["all-reduce"]
            jax.block_until_ready(fn(x))
            fns.append((f"{kind} {n}", lambda fn=fn: jax.block_until_ready(fn(x))))
    times = _common.interleaved([f for _, f in fns], rounds)
    ms = {name: 1e3 * _common.median(t) for (name, _), t in zip(fns, times, strict=True)}
    most = max(ALLREDUCE_OPERANDS)
    per_operand = (ms[f"tuple {most}"] - ms[f"concatenated {most}"]) / (most - 1)
    return {
        "devices": ALLREDUCE_DEVICES,
        "floats_per_device": ALLREDUCE_FLOATS,
        "median_ms": ms,
        "compiled_all_reduce": hlo,
        "per_operand_us": 1e3 * per_operand,
    }


def _allreduce_rows(cal: dict[str, Any]) -> list[dict[str, Any]]:
    ms, hlo = cal["median_ms"], cal["compiled_all_reduce"]
    mib = 4 * cal["floats_per_device"] / 2**20
    one = hlo["tuple 1"]
    rows = [
        _common.row(
            SECTION,
            f"all-reduce of {mib:.2f} MiB per device over {cal['devices']} devices, one piece "
            f"({one['ops']} op, {one['operands']} operand)",
            round(ms["tuple 1"], 2),
            unit="ms",
        )
    ]
    for n in ALLREDUCE_OPERANDS[1:]:
        t, c = hlo[f"tuple {n}"], hlo[f"concatenated {n}"]
        rows.append(
            _common.row(
                SECTION,
                f"the same bytes in {n} pieces: one tuple all-reduce ({t['ops']} op, "
                f"{t['operands']} operands) / concatenated first ({c['ops']} op, "
                f"{c['operands']} operand), ms",
                f"{ms[f'tuple {n}']:.2f} / {ms[f'concatenated {n}']:.2f}",
            )
        )
    most = max(ALLREDUCE_OPERANDS)
    rows.append(
        _common.row(
            SECTION,
            f"tuple all-reduce: cost per operand beyond the first ((tuple - concatenated) / "
            f"{most - 1}, {most} pieces)",
            round(cal["per_operand_us"], 1),
            unit="us",
        )
    )
    return rows


def run(quick: bool) -> dict[str, Any]:
    width, repeats = 256, 24 if quick else 48
    rounds = 5 if quick else 11
    devices = jax.devices()
    fn = _program(width, repeats)
    inputs = [
        jax.device_put(jax.random.normal(jax.random.key(i), (width, width)) / width**0.5, d)
        for i, d in enumerate(devices)
    ]
    jax.block_until_ready([fn(x) for x in inputs])  # compile on every device

    def together(k: int) -> Any:
        return lambda: jax.block_until_ready([fn(x) for x in inputs[:k]])

    ks = [k for k in (1, 2, 4, 8) if k <= len(devices)]
    times = _common.interleaved([together(k) for k in ks], rounds)
    medians = {k: _common.median(t) for k, t in zip(ks, times, strict=True)}
    concurrency = {k: k * medians[1] / medians[k] for k in ks}
    best = max(concurrency.values())
    allreduce = allreduce_calibration(3 if _common.SMOKE else 5 * rounds)
    rows = [
        _common.row(SECTION, "one program on one device", 1e3 * medians[1], unit="ms"),
        *[
            _common.row(SECTION, f"concurrency of {k} programs on {k} devices", round(c, 2))
            for k, c in concurrency.items()
            if k > 1
        ],
        *_allreduce_rows(allreduce),
    ]
    return {
        "description": __doc__.splitlines()[0],
        "width": width,
        "repeats": repeats,
        "rounds": rounds,
        "median_ms": {str(k): 1e3 * v for k, v in medians.items()},
        "concurrency": {str(k): v for k, v in concurrency.items()},
        "effective_parallel_devices": best,
        "allreduce": allreduce,
        "rows": rows,
    }
