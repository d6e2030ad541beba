"""The placement report: where every parameter of a model lives, and its tables.

``Placement`` is what ``get_placement`` returns for Linen and NNX models alike (``_tabulate``
and ``_nnx_tabulate`` build it); ``str(placement)`` renders the per-parameter, per-task and
per-device tables that ``tabulate`` prints after Flax's own summary.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import rich.console
import rich.table

from multimesh_flax.core.fragment import canonical_spec
from multimesh_flax.layers import _placement


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every parameter of a model lives."""

    params: tuple[_placement.ParamPlacement, ...]

    def bytes_per_device(self) -> dict[int, int]:
        """``{device id: parameter bytes on it}``, every device that holds a parameter."""
        totals: dict[int, int] = {}
        for p in self.params:
            for d in p.device_ids:
                totals[d] = totals.get(d, 0) + p.bytes_per_device
        return dict(sorted(totals.items()))

    def per_task(self) -> dict[str, dict[str, Any]]:
        """``{task: {"params": count, "bytes": total, "devices": ids}}`` (``"-"``: no task)."""
        out: dict[str, dict[str, Any]] = {}
        for p in self.params:
            row = out.setdefault(p.task or "-", {"params": 0, "bytes": 0, "devices": set()})
            row["params"] += int(np.prod(p.shape, dtype=np.int64))
            row["bytes"] += int(np.prod(p.shape, dtype=np.int64)) * np.dtype(p.dtype).itemsize
            row["devices"].update(p.device_ids)
        for row in out.values():
            row["devices"] = tuple(sorted(row["devices"]))
        return out

    def __str__(self) -> str:
        return _render(self, DEFAULT_WIDTH)

    def render(self, width: int = 120) -> str:
        """The tables, ``width`` characters wide; a path too long for its column wraps
        onto more lines rather than being cut, so every path is shown whole."""
        return _render(self, width)


DEFAULT_WIDTH = 120


def _spec_text(spec: Any) -> str:
    return "-" if spec is None else str(canonical_spec(spec))  # P(None,) reads P()


def _ids_text(ids: Sequence[int]) -> str:
    ids = list(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(str(i) for i in ids)


def _render(placement: Placement, width: int) -> str:
    params = rich.table.Table(title="Parameter placement")
    params.add_column("path", overflow="fold")  # wrapped, never cut
    for column in ("shape", "logical", "mesh spec", "task", "devices", "bytes/device"):
        params.add_column(column, overflow="fold")
    for p in placement.params:
        params.add_row(
            p.path,
            f"{p.dtype.name}{list(p.shape)}",
            _spec_text(p.logical),
            _spec_text(p.mesh_spec) + (" !" if p.problem else ""),
            p.task or "-",
            _ids_text(p.device_ids),
            f"{p.bytes_per_device:,}",
        )
    tasks = rich.table.Table(title="Per task")
    for column in ("task", "devices", "params", "bytes"):
        tasks.add_column(column)
    for name, row in placement.per_task().items():
        tasks.add_row(name, _ids_text(row["devices"]), f"{row['params']:,}", f"{row['bytes']:,}")
    devices = rich.table.Table(title="Per device")
    devices.add_column("device")
    devices.add_column("parameter bytes")
    for device, total in placement.bytes_per_device().items():
        devices.add_row(str(device), f"{total:,}")
    notes = [f"{p.path}: {p.problem}" for p in placement.params if p.problem]
    out = io.StringIO()
    console = rich.console.Console(
        file=out, width=width, force_terminal=False, force_jupyter=False, color_system=None
    )
    for table in (params, tasks, devices):
        console.print(table)
    for note in notes:
        console.print(f"! {note}")
    return out.getvalue()


def describe_value(value: Any) -> str:
    """``value`` for an error message: a class by name, anything else by type and repr."""
    if isinstance(value, type):
        return f"the class {value.__name__}"
    return f"{type(value).__name__}: {value!r}"
