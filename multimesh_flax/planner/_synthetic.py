"""A `UnitProfile` from numbers you give, without a model or a compile.

`profile_from_costs` builds the profile of a chain of units whose costs you already know
(from another profiler, a paper, or a test): per unit its forward seconds, parameter count
and activation bytes per microbatch; backward seconds twice the forward by default, split
evenly into B and W. Under ``"full"`` recomputation a unit keeps only its input
(``output_bytes`` of the unit before it) and its B runs the forward again. Every number is
tagged ``analytic``. `plan` and `predict` take it like a profiled one -- the planner's
search benchmark (48 blocks) and its tests use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from multimesh_flax.planner._costs import DEVICE_SPECS, PhaseCost, Source, StateLeaf
from multimesh_flax.planner._profile import UnitCost, UnitProfile
from multimesh_flax.planner._units import Instance, Unit, UnitSet

RULES = (("batch", "data"), ("mlp", "model"))
"""The logical rules of a synthetic profile: the batch over ``data``, parameters over
``model``."""


@dataclasses.dataclass(frozen=True)
class CostSpec:
    """One unit's known costs, for one microbatch on one device.

    Attributes:
        role: ``"stem"``, ``"layer"`` or ``"head"``.
        forward: Forward seconds.
        params: Float32 parameters (sharded over ``model``).
        activation_bytes: Bytes kept for the backward without recomputation.
        output_bytes: Bytes of the unit's output.
        backward: Backward seconds (``None``: twice the forward), half B and half W; the
            unsplit backward costs the same (the halves share nothing here). Activations
            kept from B to W: half of ``activation_bytes``.
        update: Optimizer-update seconds.
    """

    role: str
    forward: float
    params: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    backward: float | None = None
    update: float = 0.0


def _cost(index: int, spec: CostSpec, policy: str | None, input_bytes: int) -> UnitCost:
    backward = 2 * spec.forward if spec.backward is None else spec.backward
    recompute = spec.forward if policy == "full" else 0.0
    leaf = (StateLeaf((spec.params,), np.dtype(np.float32), ("mlp",)),) if spec.params else ()
    moments = tuple(dataclasses.replace(x) for x in leaf * 2)
    count = (StateLeaf((), np.dtype(np.int32), None, shared=True),) if spec.params else ()
    return UnitCost(
        unit=index,
        recompute=policy,
        forward=PhaseCost(spec.forward),
        backward_input=PhaseCost(backward / 2 + recompute),
        backward_weight=PhaseCost(backward / 2),
        update=PhaseCost(spec.update),
        activation_bytes=input_bytes if policy == "full" else spec.activation_bytes,
        output_bytes=spec.output_bytes,
        params=leaf,
        opt_state=moments + count,
        backward=PhaseCost(backward + recompute),
        weight_kept_bytes=(input_bytes if policy == "full" else spec.activation_bytes) // 2,
    )


def profile_from_costs(
    units: Sequence[CostSpec],
    *,
    rows: int = 1,
    recompute: Sequence[str | None] = (None, "full"),
    mesh_shape: dict[str, int] | None = None,
) -> UnitProfile:
    """A `UnitProfile` of ``units`` (stems first, heads last), every unit distinct.

    Args:
        units: The units in call order (`CostSpec`).
        rows: Rows of the microbatch the costs are for.
        recompute: Policies to cost (``None`` and ``"full"``).
        mesh_shape: The shape the costs are for (default ``{"data": 1, "model": 1}``).

    Example:
        >>> import multimesh_flax as mm
        >>> from multimesh_flax.planner import CostSpec, profile_from_costs
        >>> profile = profile_from_costs([CostSpec("layer", 1.0, params=10)] * 3)
        >>> mm.predict(mm.Plan((2, 1), microbatches=2), profile).step_time
        13.0
    """
    instances, costs, made = [], [], []
    previous = 0
    for i, spec in enumerate(units):
        made.append(Unit(f"unit_{i}", None, None, None))
        instances.append(Instance(f"unit_{i}", spec.role, i))
        costs += [_cost(i, spec, policy, previous) for policy in recompute]
        previous = spec.output_bytes
    shape = mesh_shape or {"data": 1, "model": 1}
    return UnitProfile(
        units=UnitSet(tuple(made), tuple(instances)),
        costs=tuple(costs),
        mesh_shape=tuple(shape.items()),
        rules=RULES,
        data_axes=("data",),
        rows=rows,
        mode=Source.ANALYTIC,
        device=DEVICE_SPECS["cpu"],
        compiles=0,
    )
