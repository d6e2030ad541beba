"""Measured transfer cost between stages: `measure_transfer`.

A stage hands its output to the next one as the runtime moves it: a ``core.run.Move`` of an
array laid out on the source submesh into the same layout on the destination submesh (one
C++ copy per shard where JAX allows it, else ``jax.device_put``). With one device per side
that is a device-to-device copy; with a data-parallel submesh on each side the array is
split over its devices along the first axis, as a stage's activations are, and every shard
moves. The cost is fitted per byte *per device*, which is how `predict` asks for it (a
unit's output bytes are counted per device).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh_flax import errors
from multimesh_flax.core.run import Move
from multimesh_flax.planner._costs import Source, TransferCost


def measure_transfer(
    source: int | Sequence[int] = 0,
    destination: int | Sequence[int] = 1,
    sizes: Sequence[int] = (1 << 12, 1 << 20),
    repeats: int = 5,
) -> TransferCost:
    """Measures moving float32 arrays from one local submesh to another, as the runtime does.

    Fits ``latency + bytes_per_device * seconds_per_byte`` through the medians at two sizes.

    Args:
        source, destination: Positions in ``jax.devices()``: one each, or one submesh each
            (the same number of devices; the array split over them along its first axis,
            as a data-parallel stage's activations are).
        sizes: Two sizes in bytes per device.
        repeats: Timed moves per size (after one warm-up).

    Returns:
        A measured `TransferCost`.

    Raises:
        ProfileArgumentError: positions outside the local devices, repeated, shared by both
            sides, sides of different sizes, or not two sizes.

    Example:
        >>> from multimesh_flax.planner import measure_transfer
        >>> cost = measure_transfer(0, 1, repeats=2)
        >>> cost.seconds_per_byte >= 0 and cost.latency >= 0, str(cost.source)
        (True, 'measured')
        >>> str(measure_transfer([0, 1], [2, 3], repeats=2).source)  # 2-device stages
        'measured'
    """
    src, dst = _group(source), _group(destination)
    devices = jax.devices()
    n = len(devices)
    positions = [*src, *dst]
    valid = all(isinstance(i, int) and 0 <= i < n for i in positions)
    if not valid or len(set(positions)) != len(positions) or len(src) != len(dst):
        raise errors.ProfileArgumentError(
            f"Expected two disjoint groups of the same number of distinct device positions "
            f"below {n}, got source={source!r}, destination={destination!r}. Give one "
            "position or one list of positions per side."
        )
    if len(sizes) != 2 or sizes[0] == sizes[1]:
        raise errors.ProfileArgumentError(
            f"Expected two different sizes in bytes, got sizes={tuple(sizes)!r}."
        )
    start_at, end_at = (_layout([devices[i] for i in g]) for g in (src, dst))
    medians = [_median_move(int(nbytes), len(src), start_at, end_at, repeats) for nbytes in sizes]
    per_byte = max((medians[1] - medians[0]) / (sizes[1] - sizes[0]), 0.0)
    latency = max(medians[0] - per_byte * sizes[0], 0.0)
    return TransferCost(latency, per_byte, Source.MEASURED)


def _group(side: int | Sequence[int]) -> list[int]:
    return [side] if isinstance(side, (int, np.integer)) else list(side)


def _layout(devices: list[jax.Device]) -> NamedSharding:
    """Split along the first axis over ``devices`` (a 1-D mesh of Auto axes)."""
    mesh = Mesh(np.array(devices), ("devices",), axis_types=(AxisType.Auto,))
    return NamedSharding(mesh, P("devices"))


def _median_move(
    nbytes: int, count: int, start_at: NamedSharding, end_at: NamedSharding, repeats: int
) -> float:
    """Median seconds of moving ``nbytes`` per device from ``start_at`` to ``end_at``."""
    x = jax.device_put(jnp.ones(count * max(nbytes // 4, 1), jnp.float32), start_at)
    move = Move([x], [end_at], jax.device_put([x], [end_at]))
    jax.block_until_ready(move([x]))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(move([x]))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
