"""B0 calibration: how many of this host's simulated devices really run at once.

The same independent program (a chain of matrix products) is jitted on each of the 8
devices. Per ``k`` in 1, 2, 4, 8 we time ``k`` copies dispatched together on ``k`` devices
and waited for together; ``concurrency(k) = k * t(1) / t(k)`` is how many devices' worth of
work the host executes at once (``k`` on ideal hardware). Pipelining can only beat one
device's speed by this much, so it bounds every speed-up the other sections can show on
this machine.

**Programs on submeshes.** The same measurement for SPMD programs on disjoint submeshes of 2
devices (the chain on twice the rows, split over the pair; no collectives): ``k`` programs
on ``k`` pairs, for ``k`` in 1, 2, 4. XLA's CPU client launches programs of several devices
one at a time, each after the one before (it gang-schedules them so that collectives cannot
deadlock: ``PjRtCpuExecutable::Execute``); one-device programs are not held back. On a host
of 16 cores (session 35) 2 and 4 such programs took 2.1 and 4.2 times one program's time,
while 8 one-device programs took 1.4 times one: an MPMD step whose stages have several
devices each cannot overlap its stages on the CPU backend, however many cores the host has.

**Collectives per operand.** The same bytes all-reduced over 4 devices as one tuple
all-reduce of ``N`` operands (``N`` sums in one program, which XLA combines into one
instruction) and as one all-reduce of their concatenation, for ``N`` in 1, 8, 40 (40: about
what a data-parallel stage's backward fragment sums per microbatch) and two payloads per
device (1.7 MB and 160 KB; a smoke run: the smaller only); medians of interleaved rounds,
in ms, and the cost per operand beyond the first: XLA's CPU runtime runs a tuple
all-reduce operand by operand, so a fragment's many small gradients cost more than their
bytes. Each program's all-reduce instructions and operands are read from its HLO
(``_collectives``) to show what was timed.
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


def _program(repeats: int) -> Any:
    """``chain(y, x)``: ``y`` multiplied by ``x`` ``repeats`` times, a ``tanh`` after each."""

    def chain(y: jax.Array, x: jax.Array) -> jax.Array:
        def body(_: int, z: jax.Array) -> jax.Array:
            return jnp.tanh(z @ x) * 0.5

        return jax.lax.fori_loop(0, repeats, body, y)

    return jax.jit(chain)


def _medians_together(
    fn: Any, inputs: list[tuple[Any, ...]], ks: list[int], rounds: int
) -> dict[int, float]:
    """Per ``k`` in ``ks``, the median seconds of ``fn`` on the first ``k`` argument tuples,
    dispatched together and waited for together (interleaved rounds)."""
    jax.block_until_ready([fn(*args) for args in inputs])  # compile for every device set

    def together(k: int) -> Any:
        return lambda: jax.block_until_ready([fn(*args) for args in inputs[:k]])

    times = _common.interleaved([together(k) for k in ks], rounds)
    return {k: _common.median(t) for k, t in zip(ks, times, strict=True)}


SUBMESH_DEVICES = 2


def submesh_concurrency(width: int, repeats: int, rounds: int) -> dict[str, Any]:
    """``concurrency(k)`` of ``k`` programs on ``k`` disjoint 2-device submeshes: each device
    runs the one-device chain's work (its half of ``2 * width`` rows, times the replicated
    ``width x width`` matrix). Empty with fewer than 4 devices."""
    devices = jax.devices()
    pairs = len(devices) // SUBMESH_DEVICES
    if pairs < 2:
        return {}  # nothing to run side by side
    x = jax.random.normal(jax.random.key(0), (width, width)) / width**0.5
    y = jax.random.normal(jax.random.key(1), (SUBMESH_DEVICES * width, width))
    inputs = []
    for i in range(pairs):
        pair = devices[SUBMESH_DEVICES * i : SUBMESH_DEVICES * (i + 1)]
        mesh = jax.make_mesh((SUBMESH_DEVICES,), ("x",), (AxisType.Auto,), devices=pair)
        sharded = jax.device_put(y, NamedSharding(mesh, P("x")))
        inputs.append((sharded, jax.device_put(x, NamedSharding(mesh, P()))))
    ks = [k for k in (1, 2, 4) if k <= pairs]
    medians = _medians_together(_program(repeats), inputs, ks, rounds)
    return {
        "devices_per_program": SUBMESH_DEVICES,
        "median_ms": {str(k): 1e3 * v for k, v in medians.items()},
        "concurrency": {str(k): k * medians[1] / medians[k] for k in ks},
    }


ALLREDUCE_DEVICES = 4
# Floats per device and program, split into N operands: 1.7 MB (40 operands of 44 KB) and
# 160 KB (40 of 4 KB, about a gpt-tiny gradient's size).
ALLREDUCE_FLOATS = (440_000, 40_000)
ALLREDUCE_OPERANDS = (1, 8, 40)


def _allreduce_programs(floats: int, operands: int, mesh: Mesh) -> dict[str, Any]:
    """``"tuple"``: ``operands`` sums over the device axis (one tuple all-reduce);
    ``"concatenated"``: the same pieces concatenated first, one all-reduce of one operand."""
    width = floats // operands
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
    """Per payload (``ALLREDUCE_FLOATS``): the median ms of each program of
    :func:`_allreduce_programs` per operand count, the all-reduces XLA compiled for it
    (instructions, operands), and the cost per operand beyond the first. All programs are
    timed round by round together."""
    mesh = Mesh(np.array(jax.devices()[:ALLREDUCE_DEVICES]), ("data",), axis_types=(AxisType.Auto,))
    fns, hlo = [], {}
    for floats in ALLREDUCE_FLOATS[-1:] if _common.SMOKE else ALLREDUCE_FLOATS:
        x = jax.device_put(jnp.ones((ALLREDUCE_DEVICES, floats)), NamedSharding(mesh, P("data")))
        for n in ALLREDUCE_OPERANDS:
            for kind, fn in _allreduce_programs(floats, n, mesh).items():
                name = (floats, f"{kind} {n}")
                hlo[name] = _collectives.compiled_collectives(fn.lower(x).compile())["all-reduce"]
                jax.block_until_ready(fn(x))
                fns.append((name, lambda fn=fn, x=x: jax.block_until_ready(fn(x))))
    times = _common.interleaved([f for _, f in fns], rounds)
    most = max(ALLREDUCE_OPERANDS)
    sizes: dict[str, Any] = {}
    for ((floats, name), _), t in zip(fns, times, strict=True):
        size = sizes.setdefault(str(floats), {"median_ms": {}, "compiled_all_reduce": {}})
        size["median_ms"][name] = 1e3 * _common.median(t)
        size["compiled_all_reduce"][name] = hlo[(floats, name)]
    for size in sizes.values():
        ms = size["median_ms"]
        size["per_operand_us"] = (
            1e3 * (ms[f"tuple {most}"] - ms[f"concatenated {most}"]) / (most - 1)
        )
    return {"devices": ALLREDUCE_DEVICES, "rounds": rounds, "floats_per_device": sizes}


def _allreduce_rows(cal: dict[str, Any]) -> list[dict[str, Any]]:
    counts = " / ".join(map(str, ALLREDUCE_OPERANDS))
    most = max(ALLREDUCE_OPERANDS)
    rows = []
    for floats, size in cal["floats_per_device"].items():
        ms, hlo = size["median_ms"], size["compiled_all_reduce"]
        compiled = " / ".join(
            f"{hlo[f'tuple {n}']['ops']}x{hlo[f'tuple {n}']['operands']}"
            for n in ALLREDUCE_OPERANDS
        )
        tuples = " / ".join(f"{ms[f'tuple {n}']:.2f}" for n in ALLREDUCE_OPERANDS)
        joined = " / ".join(
            f"{ms[f'concatenated {n}']:.2f}" if n > 1 else "-" for n in ALLREDUCE_OPERANDS
        )
        rows += [
            _common.row(
                SECTION,
                f"all-reduce over {cal['devices']} devices of {4 * int(floats) / 2**20:.2f} MiB "
                f"per device in {counts} pieces: one tuple all-reduce (compiled: instructions x "
                f"operands {compiled}); the pieces concatenated first (one operand), ms",
                f"{tuples}; {joined}",
            ),
            _common.row(
                SECTION,
                f"the same, cost per operand beyond the first ((tuple - concatenated) / "
                f"{most - 1}, {most} pieces)",
                round(size["per_operand_us"], 1),
                unit="us",
            ),
        ]
    return rows


def run(quick: bool) -> dict[str, Any]:
    width, repeats = 256, 24 if quick else 48
    rounds = 5 if quick else 11
    devices = jax.devices()
    placed = [
        jax.device_put(jax.random.normal(jax.random.key(i), (width, width)) / width**0.5, d)
        for i, d in enumerate(devices)
    ]
    ks = [k for k in (1, 2, 4, 8) if k <= len(devices)]
    medians = _medians_together(_program(repeats), [(x, x) for x in placed], ks, rounds)
    concurrency = {k: k * medians[1] / medians[k] for k in ks}
    best = max(concurrency.values())
    submeshes = submesh_concurrency(width, repeats, rounds)
    allreduce = allreduce_calibration(3 if _common.SMOKE else 5 * rounds)
    rows = [
        _common.row(SECTION, "one program on one device", 1e3 * medians[1], unit="ms"),
        *[
            _common.row(SECTION, f"concurrency of {k} programs on {k} devices", round(c, 2))
            for k, c in concurrency.items()
            if k > 1
        ],
        *[
            _common.row(
                SECTION,
                f"concurrency of {k} programs on {k} submeshes of {SUBMESH_DEVICES} devices",
                round(c, 2),
            )
            for k, c in submeshes.get("concurrency", {}).items()
            if k != "1"
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
        "submeshes": submeshes,
        "allreduce": allreduce,
        "rows": rows,
    }
