"""`plan`: profile a model once, search the plans of a space, return them ranked.

``plan(model, optimizer, batch, devices=8, memory_per_device="2GiB")`` profiles the model's
units (`profile_units`, analytic by default) on a small submesh, then `_search.search`
solves every configuration's split by dynamic programming and prices the best ones with
`predict`. The answer is `Plans`: `Prediction`s, fastest predicted step first, every one
fitting the memory; ``plans[0].apply()`` gives the arguments to train with (`_apply`).
When nothing fits, `PlanMemoryError` names the least memory per device a plan of the space
needs, and that plan.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import linen as nn

from multimesh_flax import errors
from multimesh_flax.planner import _search
from multimesh_flax.planner._costs import DeviceSpec, TransferCost
from multimesh_flax.planner._predict import Prediction
from multimesh_flax.planner._profile import UnitProfile, _policies, profile_units

log = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | float | str | None) -> float:
    """A memory size in bytes: a number, or text such as ``"2GiB"``, ``"512 MB"``.

    ``None`` is no limit (infinite).

    Raises:
        PlanArgumentError: neither a positive number nor a size with a known unit.

    Example:
        >>> from multimesh_flax.planner import parse_bytes
        >>> parse_bytes("2GiB"), parse_bytes("1.5 MB"), parse_bytes(4096)
        (2147483648.0, 1500000.0, 4096.0)
    """
    if value is None:
        return float("inf")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = found.group(2).upper() if found else None
    if found is None or unit not in _UNITS or float(found.group(1)) <= 0:
        raise errors.PlanArgumentError(
            f"Expected `memory_per_device` as a positive byte count or a size such as "
            f"'2GiB' or '512MB', got {value!r}. Units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB."
        )
    return float(found.group(1)) * _UNITS[unit]


def format_bytes(n: float) -> str:
    """``n`` bytes in MiB or GiB, two decimals (``"1.50 GiB"``)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


class Plans(tuple):
    """The plans `plan` found: `Prediction`s, best predicted step time first.

    ``plans[0]`` (also ``plans.best``) is the fastest plan that fits; ``plans.table()``
    prints them all. ``plans.search_seconds`` is the search's time after profiling,
    ``plans.configurations`` the configurations it solved.
    """

    search_seconds: float = 0.0
    configurations: int = 0
    memory_per_device: float = float("inf")

    @property
    def best(self) -> Prediction:
        """The fastest plan that fits."""
        return self[0]

    def table(self, *, top: int | None = None, console: Any = None) -> Any:
        """Prints the plans as a `rich` table (the first ``top``); returns the table."""
        from multimesh_flax.planner._report import plans_table

        return plans_table(self, top=top, console=console)


DEFAULT_RECOMPUTE = (None, "full")
"""`plan`'s policies by default (with a ``profile``: the policies it costed)."""


def _profiled_policies(profile: UnitProfile, recompute: Any) -> Any:
    costed = tuple(dict.fromkeys(c.recompute for c in profile.costs))
    if recompute is DEFAULT_RECOMPUTE:
        return costed
    missing = [p for p in _policies(recompute) if p not in costed]
    if missing:
        raise errors.PlanArgumentError(
            f"Expected `recompute` among the policies the profile costed {costed}, got "
            f"{recompute!r}. Profile {missing} too, or leave `recompute` out."
        )
    return recompute


def _ints(value: Any, name: str, default: Sequence[int]) -> tuple[int, ...]:
    values = default if value is None else (value,) if isinstance(value, int) else tuple(value)
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
        raise errors.PlanArgumentError(
            f"Expected `{name}` as a positive integer or a sequence of them, got {value!r}."
        )
    return tuple(values)


def _schedules(value: Any) -> tuple[str, ...]:
    names = (
        _search.SEARCH_SCHEDULES
        if value is None
        else (value,)
        if isinstance(value, str)
        else tuple(value)
    )
    bad = [n for n in names if n not in _search.SEARCH_SCHEDULES]
    if bad or not names:
        raise errors.PlanArgumentError(
            f"Expected `schedules` among {_search.SEARCH_SCHEDULES}, got {value!r}. The search "
            "prices one stage per submesh; interleaved schedules are priced by `predict` "
            "for a plan you give."
        )
    return names


def _batch_rows(batch: Any) -> int:
    leaves = [x for x in jax.tree_util.tree_leaves(batch) if np.ndim(x)]
    if not leaves:
        raise errors.PlanArgumentError(
            f"Expected `batch` as the example inputs of one step with a leading batch "
            f"dimension (an array or a tuple of arrays), got {batch!r}."
        )
    return int(np.shape(leaves[0])[0])


def make_space(
    batch_size: int,
    *,
    devices: int | None,
    memory_per_device: Any,
    schedules: Any,
    microbatches: Any,
    recompute: Any,
    stages: Any,
    tensor: Any,
    per_stage_recompute: bool,
) -> _search.Space:
    """The checked search space (see `plan` for the arguments)."""
    count = len(jax.devices()) if devices is None else devices
    if not isinstance(count, int) or count < 1:
        raise errors.PlanArgumentError(
            f"Expected `devices` as a positive device count, got {devices!r}."
        )
    default_m = tuple(m for m in (1, 2, 4, 8, 16, 32, 64) if batch_size % m == 0)
    ms = _ints(microbatches, "microbatches", default_m)
    if all(batch_size % m for m in ms):
        raise errors.PlanArgumentError(
            f"Expected `microbatches` with at least one divisor of the batch of {batch_size} "
            f"rows, got {ms}. Pick counts that divide it."
        )
    return _search.Space(
        batch_size=batch_size,
        devices=count,
        memory=parse_bytes(memory_per_device),
        schedules=_schedules(schedules),
        microbatches=ms,
        policies=_policies(recompute),
        stages=_ints(stages, "stages", tuple(range(1, min(count, 8) + 1))),
        tensor=_ints(tensor, "tensor", (1, 2, 4, 8)),
        per_stage_recompute=per_stage_recompute,
    )


def plan(
    model: nn.Module,
    optimizer: optax.GradientTransformation | None,
    batch: Any,
    *,
    devices: int | None = None,
    memory_per_device: int | float | str | None = None,
    schedules: str | Sequence[str] | None = None,
    microbatches: int | Sequence[int] | None = None,
    recompute: str | None | Sequence[str | None] = DEFAULT_RECOMPUTE,
    stages: int | Sequence[int] | None = None,
    tensor: int | Sequence[int] | None = None,
    per_stage_recompute: bool = True,
    rules: Sequence[tuple[str, Any]] = (),
    patterns: Sequence[Any] | None = None,
    loss_fn: Callable[[Any], jax.Array] | None = None,
    mesh_shape: Mapping[str, int] | None = None,
    mode: str = "analytic",
    device: DeviceSpec | str = "cpu",
    transfer: TransferCost | None = None,
    profile: UnitProfile | None = None,
    top: int = 10,
) -> Plans:
    """Plans a pipeline: stages, data x tensor per stage, schedule, microbatches,
    recomputation per stage, ranked by predicted step time.

    Profiles the model's units once (`profile_units` on ``mesh_shape``, one microbatch of
    ``batch`` at the largest microbatch count; or pass ``profile``), then for every stage
    count, submesh shape, schedule and microbatch count finds the best contiguous split of
    the blocks and the recomputation of every stage by dynamic programming (``sum of stage
    times + (m - 1) x the slowest``, within ``memory_per_device``), and prices the best of
    every schedule with `predict`. See the README, "Planning a pipeline".

    Args:
        model: A Flax Linen module (unstaged), e.g. ``models.GPT(config)``.
        optimizer: The optax optimizer (its update and state are costed).
        batch: Example inputs of one training step (arrays, leading dimension the batch).
        devices: Devices to plan for (default: the local count; they need not exist).
        memory_per_device: Bytes, or a size such as ``"2GiB"``; ``None``: no limit.
        schedules: Among ``"gpipe"``, ``"1f1b"``, ``"zero-bubble-h1"``,
            ``"zero-bubble-h2"`` (default: all four).
        microbatches: Counts to try (default: the powers of two up to 64 dividing the batch).
        recompute: The policies a stage may use (``None``, ``"full"``, ``"dots"``; default
            ``None`` and ``"full"``, or those ``profile`` costed).
        stages: Stage counts to try (default 1 to 8, dividing ``devices``).
        tensor: Tensor-parallel sizes to try (default 1, 2, 4, 8; only along a mesh axis the
            rules shard parameters over).
        per_stage_recompute: ``False``: one policy for all stages (what
            ``parallelize_step``'s ``recompute`` can apply to the reference models).
        rules, patterns, loss_fn, mesh_shape, mode, device: As `profile_units`.
        transfer: The cost of moving bytes between stages (default: ``device``'s link).
        profile: A `UnitProfile` to plan from instead of profiling.
        top: How many plans to return.

    Returns:
        `Plans`, best first.

    Raises:
        PlanArgumentError: a bad search space (see the class).
        PlanMemoryError: no plan fits ``memory_per_device``; it names the least memory per
            device a plan needs, and that plan.

    Example:
        >>> import numpy as np
        >>> import multimesh_flax as mm
        >>> from multimesh_flax.planner import CostSpec, profile_from_costs
        >>> profile = profile_from_costs(  # 6 equal blocks and a head as slow as 3 of them
        ...     [CostSpec("layer", 1.0, params=100)] * 6 + [CostSpec("head", 3.0)])
        >>> plans = mm.plan(None, None, np.zeros((8, 1)), devices=3, stages=3,
        ...                 schedules="1f1b", microbatches=8, profile=profile)
        >>> plans[0].plan.layers_per_stage  # not (2, 2, 2): the head's stage gets fewer
        (3, 3, 0)
    """
    rows = _batch_rows(batch)
    if profile is not None:
        recompute = _profiled_policies(profile, recompute)
    space = make_space(
        rows,
        devices=devices,
        memory_per_device=memory_per_device,
        schedules=schedules,
        microbatches=microbatches,
        recompute=recompute,
        stages=stages,
        tensor=tensor,
        per_stage_recompute=per_stage_recompute,
    )
    if profile is None:
        inputs = batch if isinstance(batch, tuple) else (batch,)
        per = max(rows // max(space.microbatches), 1)
        one = jax.tree_util.tree_map(lambda x: x[:per] if np.ndim(x) else x, inputs)
        profile = profile_units(
            model,
            *one,
            mesh_shape=mesh_shape,
            rules=rules,
            patterns=patterns,
            optimizer=optimizer,
            loss_fn=loss_fn,
            recompute=space.policies,
            mode=mode,
            device=device,
        )
    return search_plans(profile, space, transfer=transfer, top=top)


def search_plans(
    profile: UnitProfile, space: _search.Space, *, transfer: TransferCost | None, top: int
) -> Plans:
    """`plan`'s search over a profile (no compiles): ranked `Plans` or `PlanMemoryError`."""
    start = time.perf_counter()
    found, solved = _search.search(profile, space, transfer, top)
    elapsed = time.perf_counter() - start
    if solved == 0:
        raise errors.PlanArgumentError(
            f"Expected a search space with at least one configuration, got none: "
            f"{space.devices} devices, stages {space.stages}, tensor {space.tensor}, "
            f"microbatches {space.microbatches} for a batch of {space.batch_size}, schedules "
            f"{space.schedules}. Allow stage counts dividing the devices and microbatch "
            "counts whose microbatches the data-parallel size divides."
        )
    if not found:
        _raise_memory(profile, space, transfer)
    plans = Plans(found)
    plans.search_seconds, plans.configurations = elapsed, solved
    plans.memory_per_device = space.memory
    log.info("planned: %d configurations in %.2f s", solved, elapsed)
    return plans


def _raise_memory(profile: UnitProfile, space: _search.Space, transfer: Any) -> None:
    least = _search.min_memory_plan(profile, space, transfer)
    need = least.max_peak_bytes
    raise errors.PlanMemoryError(
        f"Expected a plan that fits `memory_per_device` = {format_bytes(space.memory)} "
        f"({space.memory:,.0f} B), got none among {space.devices} devices, stages "
        f"{space.stages}, schedules {space.schedules}, microbatches {space.microbatches}, "
        f"recompute {space.policies}. The least memory per device any of them needs is "
        f"{format_bytes(need)} ({need:,} B), by {_search.describe(least.plan)}. Give at "
        "least that, or widen the search (more devices, microbatches or recomputation).",
        required_bytes=need,
        prediction=least,
    )
