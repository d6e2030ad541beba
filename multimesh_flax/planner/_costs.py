"""The records the planner's numbers travel in, each tagged with where it came from.

* `Source`: ``measured`` (a compiled program ran, median of a few runs), ``analytic``
  (XLA's cost and memory analysis of a compiled program, or a device's data-sheet numbers:
  nothing ran) or ``derived`` (computed from other numbers by a documented rule: scaled to
  another submesh or microbatch size, simulated).
* `DeviceSpec`: the roofline an analytic time comes from, ``max(flops / flops_per_second,
  bytes / bytes_per_second)``, and the link a transfer crosses. `DEVICE_SPECS` holds a few.
* `PhaseCost`: one compiled program of a unit (forward, activation gradient, weight
  gradient, optimizer update): seconds, FLOPs, bytes accessed, temporary bytes.
* `TransferCost`: ``latency + bytes * seconds_per_byte`` between two submeshes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any

import numpy as np


class Source(str, enum.Enum):
    """Where a number came from. Equal to its name as a string (``Source.MEASURED ==
    "measured"``)."""

    MEASURED = "measured"
    ANALYTIC = "analytic"
    DERIVED = "derived"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A device's peak rates, for analytic times (a roofline) and transfers.

    Attributes:
        name: A label.
        flops_per_second: Peak FLOP/s at the compute dtype you train in.
        bytes_per_second: Memory bandwidth.
        link_bytes_per_second: Bandwidth of the link between two devices, one direction.
        link_latency: Seconds a transfer takes before its first byte.

    Example:
        >>> from multimesh_flax.planner import DeviceSpec
        >>> spec = DeviceSpec("toy", flops_per_second=1e9, bytes_per_second=1e8,
        ...                   link_bytes_per_second=1e7)
        >>> spec.seconds(flops=2e9, bytes_accessed=1e8)  # compute-bound: 2 s vs 1 s
        2.0
    """

    name: str
    flops_per_second: float
    bytes_per_second: float
    link_bytes_per_second: float
    link_latency: float = 1e-5

    def seconds(self, flops: float, bytes_accessed: float) -> float:
        """The roofline time of a program: the slower of its compute and its memory traffic."""
        return max(flops / self.flops_per_second, bytes_accessed / self.bytes_per_second)


DEVICE_SPECS = {
    # Data-sheet numbers (dense bf16 tensor-core FLOP/s; HBM; NVLink 4 per direction).
    "h100": DeviceSpec("h100", 989e12, 3.35e12, 450e9, 5e-6),
    "h200": DeviceSpec("h200", 989e12, 4.8e12, 450e9, 5e-6),
    # A rough stand-in for one simulated CPU device of a small host, not a measurement.
    "cpu": DeviceSpec("cpu", 2e10, 1e10, 5e9, 5e-5),
}
"""Device specs by name: ``"h100"``, ``"h200"`` (SXM data sheets) and ``"cpu"`` (a guess)."""


@dataclasses.dataclass(frozen=True)
class PhaseCost:
    """One compiled program of a unit, per device.

    Attributes:
        seconds: Its time: measured (median) or the device spec's roofline (analytic).
        flops: XLA's ``cost_analysis()["flops"]`` of the program on one device.
        bytes_accessed: XLA's ``cost_analysis()["bytes accessed"]``.
        temp_bytes: ``memory_analysis().temp_size_in_bytes``: scratch while it runs.
        source: ``measured`` or ``analytic`` (``seconds``; the rest is always analytic),
            ``derived`` once scaled.
        release_seconds: Measured mode: freeing the program's outputs (median), which
            ``seconds`` leaves out. The runtime frees a value in the op that reads it last
            (a forward's residuals in the backward), so `predict` charges it there; 0 in
            analytic mode.
    """

    seconds: float = 0.0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    temp_bytes: int = 0
    source: Source = Source.ANALYTIC
    release_seconds: float = 0.0

    def scaled(self, time: float, memory: float) -> PhaseCost:
        """Times and FLOPs times ``time``, temporary bytes times ``memory`` (derived)."""
        if time == 1 and memory == 1:
            return self
        return PhaseCost(
            self.seconds * time,
            self.flops * time,
            self.bytes_accessed * time,
            int(round(self.temp_bytes * memory)),
            Source.DERIVED,
            self.release_seconds * time,
        )

    def __add__(self, other: PhaseCost) -> PhaseCost:
        source = self.source if self.source == other.source else Source.DERIVED
        return PhaseCost(
            self.seconds + other.seconds,
            self.flops + other.flops,
            self.bytes_accessed + other.bytes_accessed,
            max(self.temp_bytes, other.temp_bytes),
            source,
            self.release_seconds + other.release_seconds,
        )


@dataclasses.dataclass(frozen=True)
class TransferCost:
    """Moving ``n`` bytes between two submeshes takes ``latency + n * seconds_per_byte``.

    Example:
        >>> from multimesh_flax.planner import TransferCost
        >>> TransferCost(latency=1e-3, seconds_per_byte=1e-6).seconds(1000)  # 1 ms + 1 ms
        0.002
    """

    latency: float
    seconds_per_byte: float
    source: Source = Source.ANALYTIC

    def seconds(self, nbytes: float) -> float:
        """The time to move ``nbytes`` (0 bytes take no time)."""
        return self.latency + nbytes * self.seconds_per_byte if nbytes else 0.0

    @classmethod
    def from_spec(cls, spec: DeviceSpec) -> TransferCost:
        """The link of a `DeviceSpec` (analytic)."""
        return cls(spec.link_latency, 1.0 / spec.link_bytes_per_second, Source.ANALYTIC)


@dataclasses.dataclass(frozen=True)
class StateLeaf:
    """One array of a unit's training state: shape, dtype, logical names (``None``: none).

    ``shared`` marks optimizer state that mirrors no parameter (Adam's step counter): one
    optimizer over the whole model holds it once, not once per unit.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    logical: tuple | None
    shared: bool = False


def shard_count(spec: Any, mesh_shape: dict[str, int]) -> list[int]:
    """How many pieces each dimension is cut into by a mesh ``PartitionSpec``."""
    counts = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        counts.append(math.prod(mesh_shape[a] for a in axes))
    return counts


def bytes_per_device(shape: Sequence[int], dtype: Any, spec: Any, mesh: dict) -> int:
    """Bytes of one device's shard of an array of ``shape`` laid out as ``spec``."""
    counts = shard_count(spec, mesh) + [1] * (len(shape) - len(spec))
    size = math.prod(-(-int(n) // c) for n, c in zip(shape, counts, strict=True))
    return size * np.dtype(dtype).itemsize
