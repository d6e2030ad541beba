"""B0 calibration: how many of this host's simulated devices really run at once.

The same independent program (a chain of matrix products) is jitted on each of the 8
devices. Per ``k`` in 1, 2, 4, 8 we time ``k`` copies dispatched together on ``k`` devices
and waited for together; ``concurrency(k) = k * t(1) / t(k)`` is how many devices' worth of
work the host executes at once (``k`` on ideal hardware). Pipelining can only beat one
device's speed by this much, so it bounds every speed-up the other sections can show on
this machine.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import _common

SECTION = "B0"


def _program(width: int, repeats: int) -> Any:
    def chain(x: jax.Array) -> jax.Array:
        def body(_: int, y: jax.Array) -> jax.Array:
            return jnp.tanh(y @ x) * 0.5

        return jax.lax.fori_loop(0, repeats, body, x)

    return jax.jit(chain)


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
    rows = [
        _common.row(SECTION, "one program on one device", 1e3 * medians[1], unit="ms"),
        *[
            _common.row(SECTION, f"concurrency of {k} programs on {k} devices", round(c, 2))
            for k, c in concurrency.items()
            if k > 1
        ],
    ]
    return {
        "description": __doc__.splitlines()[0],
        "width": width,
        "repeats": repeats,
        "rounds": rounds,
        "median_ms": {str(k): 1e3 * v for k, v in medians.items()},
        "concurrency": {str(k): v for k, v in concurrency.items()},
        "effective_parallel_devices": best,
        "rows": rows,
    }
