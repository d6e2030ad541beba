"""Pictures of plans: `rich` tables and the predicted timeline beside memory bars.

* `plans_table`: one row per plan of `plan`'s answer -- layout, data x tensor, schedule,
  microbatches, recomputation, predicted step time, bubble, peak memory per device.
* `prediction_table`: one row per stage of one plan -- its units, submesh, times per
  microbatch, state, activations in flight, temporary and peak bytes per device.
* `plot_prediction`: the simulator's timeline of the plan (F blue, B orange, W green, the
  optimizer update grey, milliseconds) beside a stacked bar per submesh of its predicted
  peak bytes per device (state, activations in flight, temporary), with the memory limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import rich.console
import rich.table

_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "update": "#9a9a9a"}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _recompute(policies: Sequence[str | None]) -> str:
    names = ["none" if p is None else p for p in policies]
    return names[0] if len(set(names)) == 1 else ",".join(names)


def _print(table: rich.table.Table, console: Any) -> rich.table.Table:
    console = console or rich.console.Console(width=140)
    console.print(table)
    return table


def plans_table(plans: Sequence[Any], *, top: int | None = None, console: Any = None) -> Any:
    """Prints ``plans`` (`Prediction`s) as a `rich` table; returns it."""
    limit = getattr(plans, "memory_per_device", math.inf)
    title = "Plans, fastest predicted step first"
    if math.isfinite(limit):
        title += f" (memory per device {_mib(limit)} MiB)"
    table = rich.table.Table(title=title)
    for name in ("#", "blocks per stage", "data x tensor", "schedule", "m", "recompute"):
        table.add_column(name)
    for name in ("step ms", "bubble", "peak MiB"):
        table.add_column(name, justify="right")
    for rank, p in enumerate(plans[:top] if top else plans):
        mesh = p.plan.stage_meshes()[0]
        table.add_row(
            str(rank),
            ",".join(map(str, p.plan.layers_per_stage)),
            " x ".join(f"{size}" for size in mesh.values()) + f" ({','.join(mesh)})",
            p.plan.schedule,
            str(p.plan.microbatches),
            _recompute(p.plan.policies()),
            f"{p.step_time * 1e3:,.3f}",
            f"{p.bubble:.3f}",
            _mib(p.max_peak_bytes),
        )
    return _print(table, console)


def prediction_table(prediction: Any, *, console: Any = None) -> Any:
    """Prints one plan's stages as a `rich` table; returns it."""
    plan = prediction.plan
    table = rich.table.Table(
        title=f"{plan.schedule}, m={plan.microbatches}: step "
        f"{prediction.step_time * 1e3:,.3f} ms ({prediction.sources['unit times']} unit "
        f"times), bubble {prediction.bubble:.3f}"
    )
    for name in ("stage", "units", "submesh", "recompute"):
        table.add_column(name)
    for name in ("F+B ms", "state MiB", "act. MiB", "in flight", "temp MiB", "peak MiB"):
        table.add_column(name, justify="right")
    meshes, policies = prediction.stage_meshes or plan.stage_meshes(), plan.policies()
    for s, stage in enumerate(prediction.stages):
        row = min(s, len(prediction.peak_bytes) - 1)
        paths = prediction.stage_paths[s] if prediction.stage_paths else ()
        units = ", ".join(paths) if len(paths) <= 3 else f"{paths[0]} .. {paths[-1]}"
        seconds = stage.forward.seconds + stage.backward.seconds  # the whole backward
        table.add_row(
            str(s),
            f"{units} ({len(paths)})",
            str(meshes[s]),
            _recompute([policies[s]]),
            f"{seconds * 1e3:,.3f}",
            _mib(stage.state_bytes),
            _mib(stage.activation_bytes),
            str(prediction.peak_in_flight[row]),
            _mib(stage.temp_bytes),
            _mib(prediction.peak_bytes[row]),
        )
    return _print(table, console)


def _timeline_bars(prediction: Any) -> list[tuple[int, float, float, str]]:
    """``(row, start, end, phase)`` in milliseconds: the simulated ops, then each row's
    optimizer updates after its last op."""
    bars = [(row, s * 1e3, e * 1e3, op.phase) for row, op, s, e in prediction.simulation.timeline]
    ends: dict[int, float] = {}
    for row, _, end, _ in bars:
        ends[row] = max(ends.get(row, 0.0), end)
    for s, stage in enumerate(prediction.stages):
        row = min(s, len(prediction.peak_bytes) - 1)
        start = ends.get(row, 0.0)
        ends[row] = start + stage.update.seconds * 1e3
        bars.append((row, start, ends[row], "update"))
    return bars


def plot_prediction(
    prediction: Any, path: str | None = None, *, memory_per_device: float | None = None
) -> Any:
    """Draws ``prediction``'s timeline beside its per-submesh peak bytes; returns the figure.

    Example:
        >>> import multimesh_flax as mm
        >>> from flax import linen as nn
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         for i in range(4):
        ...             x = nn.Dense(8, name=f"layer_{i}")(x)
        ...         return x
        >>> profile = mm.profile_units(MLP(), jnp.ones((4, 8)), patterns=[r"layer_\\d"])
        >>> figure = mm.predict(mm.Plan((1, 3), microbatches=2), profile).plot()
        >>> len(figure.axes)
        2
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = len(prediction.peak_bytes)
    figure = Figure(figsize=(13, 1.5 + 0.6 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    timeline, memory = figure.subplots(1, 2, width_ratios=(3, 1))
    for row, start, end, phase in _timeline_bars(prediction):
        timeline.barh(row, end - start, left=start, height=0.8, color=_COLOURS[phase])
    timeline.set_yticks(range(rows), [f"submesh {r}" for r in range(rows)])
    timeline.invert_yaxis()
    timeline.set_xlabel("ms (predicted)")
    plan = prediction.plan
    timeline.set_title(
        f"{plan.schedule}, m={plan.microbatches}, blocks {tuple(plan.layers_per_stage)}: step "
        f"{prediction.step_time * 1e3:.3f} ms, bubble {prediction.bubble:.3f}"
    )
    left = [0.0] * rows
    moments = [  # (held, temporary) of the larger moment: the pipeline's or the update's
        max((a, t), (u, ut), key=sum)
        for a, t, u, ut in zip(
            prediction.activation_bytes,
            prediction.temp_bytes,
            prediction.update_bytes or (0,) * rows,
            prediction.update_temp_bytes or (0,) * rows,
            strict=True,
        )
    ]
    parts = (
        ("state", prediction.state_bytes, "#4c72b0"),
        ("activations + gradients, or update", [h for h, _ in moments], "#dd8452"),
        ("temporary", [t for _, t in moments], "#9a9a9a"),
    )
    for label, values, colour in parts:
        widths = [v / 2**20 for v in values]
        memory.barh(range(rows), widths, left=left, height=0.8, color=colour, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    if memory_per_device is not None and math.isfinite(memory_per_device):
        memory.axvline(memory_per_device / 2**20, color="#c44e52", linestyle="--", label="limit")
    memory.set_yticks(range(rows), [f"submesh {r}" for r in range(rows)])
    memory.invert_yaxis()
    memory.set_xlabel("peak MiB per device (predicted)")
    memory.legend(fontsize=7, loc="lower right")
    if path is not None:
        figure.savefig(path, dpi=120)
    return figure
