"""Searching plans: every configuration's best split, priced by `predict`, ranked.

`search` walks the configurations of a search space -- stage count ``S`` (dividing the
devices), data x tensor per stage (``S * data * tensor = devices``; data must divide the
rows of a microbatch; tensor only along an axis the rules shard parameters over),
schedule, microbatch count ``m`` -- and for each solves the dynamic program of `_split`
(blocks and recomputation per stage) over tables built from a `UnitProfile`: the unit costs
scaled to the configuration's submesh and microbatch by `predict`'s rule, the in-flight
activation sets of every stage from the schedule itself. The dynamic program's cost model
ranks the splits of one schedule; the best few of every schedule are then priced by
`predict` (the simulator), which ranks them all. `min_memory_plan` finds the plan that needs
the least memory per device, for the error when nothing fits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from multimesh_flax import errors
from multimesh_flax.core.declare import make_schedule
from multimesh_flax.planner._costs import TransferCost
from multimesh_flax.planner._predict import (
    Plan,
    Prediction,
    _scales,
    _work,
    collective_per_byte,
    peak_activation_bytes,
)
from multimesh_flax.planner._predict import predict as predict_plan
from multimesh_flax.planner._profile import UnitProfile, state_bytes
from multimesh_flax.planner._split import (
    Split,
    StageTables,
    best_split,
    compose,
    interval_arrays,
    min_peak_split,
)

SEARCH_SCHEDULES = ("gpipe", "1f1b", "zero-bubble-h1", "zero-bubble-h2")
"""The schedules `search` can price stage by stage (one stage per submesh)."""


@dataclasses.dataclass(frozen=True)
class Space:
    """The search space: what `search` may choose, after checking."""

    batch_size: int
    devices: int
    memory: float
    schedules: tuple[str, ...]
    microbatches: tuple[int, ...]
    policies: tuple[str | None, ...]
    stages: tuple[int, ...]
    tensor: tuple[int, ...]
    per_stage_recompute: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: what the dynamic program takes as fixed."""

    stages: int
    mesh: tuple[tuple[str, int], ...]
    schedule: str
    microbatches: int


def _axes(profile: UnitProfile) -> tuple[str | None, str | None]:
    """(the data axis, the tensor axis) of the profiled mesh; ``None`` where there is none."""
    shape = dict(profile.mesh_shape)
    data = profile.data_axes[0] if profile.data_axes else None
    sharded = {
        a
        for name, axes in profile.rules
        if name != "batch"
        for a in ((axes,) if isinstance(axes, str) else (axes or ()))
    }
    tensor = next((a for a in shape if a not in profile.data_axes and a in sharded), None)
    return data, tensor


def configs(space: Space, profile: UnitProfile) -> Iterator[Config]:
    """Every configuration of ``space`` the profile's axes and the batch allow."""
    data_axis, tensor_axis = _axes(profile)
    for stages in space.stages:
        if space.devices % stages:
            continue
        per = space.devices // stages
        for tensor in space.tensor if tensor_axis else (1,):
            if per % tensor or (data_axis is None and per != tensor):
                continue
            data = per // tensor
            mesh = {a: 1 for a, _ in profile.mesh_shape}
            if data_axis:
                mesh[data_axis] = data
            if tensor_axis:
                mesh[tensor_axis] *= tensor
            for m in space.microbatches:
                if space.batch_size % m or (space.batch_size // m) % data:
                    continue
                for schedule in space.schedules:
                    yield Config(stages, tuple(mesh.items()), schedule, m)


@functools.lru_cache(maxsize=4096)
def _built_in_flight(schedule: str, stages: int, m: int) -> tuple[int, ...] | None:
    try:
        built = make_schedule(schedule, stages, m)
    except errors.MultiMeshError:
        return None
    return peak_activation_bytes(built, [1] * stages)


def in_flight(schedule: str, stages: int, m: int) -> tuple[int, ...] | None:
    """The most activation sets alive at once per stage (``None``: not buildable).

    Beyond ``m = 2 S + 2`` microbatches the searched schedules' warm-up depth no longer
    grows: a count below that ``m`` stays, one equal to it grows with ``m`` (GPipe keeps
    all ``m``). So the schedule is built at most at that size (building ZB-H2 for 64
    microbatches takes long); ``tests/planner/test_search.py`` checks the rule against the
    built schedules.
    """
    cap = 2 * stages + 2
    if m <= cap:
        return _built_in_flight(schedule, stages, m)
    counts = _built_in_flight(schedule, stages, cap)
    return None if counts is None else tuple(m if c >= cap else c for c in counts)


class Tables:
    """Per-block arrays of one profile on one submesh and microbatch size, cached."""

    def __init__(self, profile: UnitProfile, policies: Sequence[str | None], link: TransferCost):
        self.profile, self.policies, self.link = profile, tuple(policies), link
        instances = profile.units.instances
        self.layers = [i.unit for i in instances if i.role == "layer"]
        self.stems = [i.unit for i in instances if i.role == "stem"]
        self.heads = [i.unit for i in instances if i.role == "head"]
        self.first = instances[0].unit
        self._cache: dict = {}

    def _unit(self, mesh: dict, rows: int) -> tuple[np.ndarray, ...]:
        """Per distinct unit: time, activation, temp (``[policy, unit]``) and state bytes."""
        key = (tuple(mesh.items()), rows)
        if key not in self._cache:
            p = self.profile
            time, memory = _scales(p, mesh, rows)
            tensor, _ = collective_per_byte(p, mesh, self.link)
            n = len(p.units.units)
            t, a, x, f = (np.zeros((len(self.policies), n)) for _ in range(4))
            s, up = np.zeros(n), np.zeros(n)
            scratch = 0  # the largest update's temporary (a bound of any stage's)
            for u in range(n):
                for k, policy in enumerate(self.policies):
                    c = p.cost(u, policy)
                    phases = (c.forward, c.backward)
                    work = sum(_work(ph, p.launch_seconds).seconds for ph in phases)
                    t[k, u] = (work + c.forward.release_seconds) * time  # predict's F + B
                    if tensor and c.params:
                        t[k, u] += 2 * tensor * c.output_bytes * memory
                    a[k, u] = c.activation_bytes * memory
                    x[k, u] = c.pipeline_temp_bytes * memory
                    f[k, u] = c.fused_temp_bytes * memory
                c = p.cost(u, self.policies[0])
                params = state_bytes(c.params, mesh, p.rules)
                opt = state_bytes([o for o in c.opt_state if not o.shared], mesh, p.rules)
                s[u] = 4 * params + opt  # resident state, the old and new sums, one more
                up[u] = 2 * (params + opt) + params  # old and new state, the gradient sum
                profiled = max(state_bytes(c.params, dict(p.mesh_shape), p.rules), 1)
                scratch = max(scratch, math.ceil(c.update.temp_bytes * params / profiled))
            shared = [o for o in p.cost(self.first, self.policies[0]).opt_state if o.shared]
            shared_bytes = state_bytes(shared, mesh, p.rules)
            self._cache[key] = (t, a, x, s, shared_bytes, up, scratch, f)
        return self._cache[key]

    def _end(self, units: list[int], arrays: tuple, extra: float) -> tuple | None:
        if not units and not extra:
            return None
        t, a, x, s, _, up, _, f = arrays
        summed = np.array([p is not None for p in self.policies])  # recomputed: they add up
        temp = np.where(summed, x[:, units].sum(axis=1), x[:, units].max(axis=1, initial=0.0))
        return (
            t[:, units].sum(axis=1),
            a[:, units].sum(axis=1),
            temp,
            float(s[units].sum()) + extra,
            float(up[units].sum()) + 2 * extra,
            f[:, units].sum(axis=1),
        )

    def stage_tables(self, config: Config, batch_size: int) -> StageTables | None:
        """The dynamic program's tables for ``config`` (``None``: its schedule cannot be
        built for these sizes)."""
        flight = in_flight(config.schedule, config.stages, config.microbatches)
        if flight is None:
            return None
        rows = batch_size // config.microbatches
        arrays = self._unit(dict(config.mesh), rows)
        key = ("intervals", config.mesh, rows)
        if key not in self._cache:
            t, a, x, s, shared, up, _, f = arrays
            layers = self.layers
            state, update = s[layers].copy(), up[layers].copy()
            if not self.stems:  # the optimizer's counters go with the first block then
                state[0] += shared
                update[0] += 2 * shared
            self._cache[key] = interval_arrays(
                t[:, layers],
                a[:, layers],
                state,
                x[:, layers],
                update,
                f[:, layers],
                summed_temp=[p is not None for p in self.policies],
            )
        return compose(
            self._cache[key],
            num_stages=config.stages,
            in_flight=flight,
            stem=self._end(self.stems, arrays, arrays[4] if self.stems else 0.0),
            head=self._end(self.heads, arrays, 0.0),
            policies=self.policies,
            launch=2 * self.profile.launch_seconds,  # a stage's F and B programs
            update_temp=arrays[6],
        )


def _uniform(tables: StageTables) -> list[StageTables]:
    """One table per policy, each allowing only that policy (same policy on every stage)."""
    return [
        StageTables(tables.time[:, k : k + 1], tables.peak[:, k : k + 1], (policy,))
        for k, policy in enumerate(tables.policies)
    ]


def _best(tables: StageTables, m: int, memory: float, per_stage: bool) -> Split | None:
    if per_stage:
        return best_split(tables, m, memory)
    found = [s for t in _uniform(tables) if (s := best_split(t, m, memory)) is not None]
    return min(found, key=lambda s: s.objective, default=None)


def _link(profile: UnitProfile, transfer: TransferCost | None) -> TransferCost:
    return transfer if transfer is not None else TransferCost.from_spec(profile.device)


def _plan(config: Config, split: Split, batch_size: int) -> Plan:
    policies = split.policies
    recompute = policies[0] if len(set(policies)) == 1 else policies
    return Plan(
        split.layers_per_stage,
        microbatches=config.microbatches,
        batch_size=batch_size,
        schedule=config.schedule,
        stage_mesh=dict(config.mesh),
        recompute=recompute,
    )


def search(
    profile: UnitProfile, space: Space, transfer: TransferCost | None, top: int
) -> tuple[list[Prediction], int]:
    """The fitting plans of ``space``, best predicted step time first (at most ``top``), and
    the number of configurations solved."""
    tables = Tables(profile, space.policies, _link(profile, transfer))
    found: dict[str, list[tuple[float, Config, Split]]] = {}
    solved = 0
    for config in configs(space, profile):
        stage_tables = tables.stage_tables(config, space.batch_size)
        if stage_tables is None:
            continue
        solved += 1
        split = _best(stage_tables, config.microbatches, space.memory, space.per_stage_recompute)
        if split is not None:
            found.setdefault(config.schedule, []).append((split.objective, config, split))
    predictions = []
    for candidates in found.values():  # the cost model ranks within a schedule only
        candidates.sort(key=lambda c: c[0])
        for _, config, split in candidates[: max(2 * top, 4)]:
            prediction = predict_plan(
                _plan(config, split, space.batch_size), profile, transfer=transfer
            )
            if prediction.max_peak_bytes <= space.memory:
                predictions.append(prediction)
    predictions.sort(key=lambda p: (p.step_time, p.max_peak_bytes))
    return predictions[:top], solved


def min_memory_plan(
    profile: UnitProfile, space: Space, transfer: TransferCost | None
) -> Prediction | None:
    """The plan of ``space`` needing the least predicted peak memory per device, among each
    configuration's split of the least bound (``None``: no configuration at all)."""
    tables = Tables(profile, space.policies, _link(profile, transfer))
    found: list[tuple[float, int, Config, Split]] = []
    for config in configs(space, profile):
        stage_tables = tables.stage_tables(config, space.batch_size)
        if stage_tables is None:
            continue
        options = [stage_tables] if space.per_stage_recompute else _uniform(stage_tables)
        for t in options:
            need, split = min_peak_split(t)
            if np.isfinite(need):
                found.append((need, len(found), config, split))
    best: Prediction | None = None
    for bound, _, config, split in sorted(found, key=lambda f: f[:2]):
        # the tables bound predict's peak from above: past the best predicted, none is lower
        if best is not None and bound >= best.max_peak_bytes:
            break
        prediction = predict_plan(
            _plan(config, split, space.batch_size), profile, transfer=transfer
        )
        if best is None or prediction.max_peak_bytes < best.max_peak_bytes:
            best = prediction
    return best


def describe(plan: Plan) -> str:
    """One line: ``"(1, 3, 3, 1) on 4 x {'data': 2, 'model': 1}, 1f1b, m=8, recompute full"``."""
    mesh = plan.stage_meshes()[0]
    policies = plan.policies()
    recompute = policies[0] if len(set(policies)) == 1 else ",".join(map(str, policies))
    return (
        f"{tuple(plan.layers_per_stage)} on {plan.num_stages} x {mesh} "
        f"({plan.num_stages * math.prod(mesh.values())} devices), {plan.schedule}, "
        f"m={plan.microbatches}, recompute {recompute}"
    )
