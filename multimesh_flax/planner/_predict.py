"""Predictions: a plan's step time, bubble and peak bytes per device, from unit costs.

A `Plan` says how a pipeline runs: blocks (the profile's ``"layer"`` units) per stage, the
submesh shape of every stage, the schedule, the microbatch count, the global batch and the
recomputation policy of every stage. `predict` turns it and a `UnitProfile` into a
`Prediction`:

1. **Stage costs.** A stage runs the stems (stage 0), its blocks and the heads (last stage).
   Its F, B, W and update times are the sums of its units' (`UnitCost`), under the stage's
   recomputation policy, scaled from the profiled shape to the stage's (the rule below).
   The runtime runs each of them as one program for all the stage's units, so each unit's
   time counts without its own program's launch (`UnitProfile.launch_seconds`, measured)
   and the stage's sum pays one launch. The runtime frees a value in the op that reads it
   last, so freeing the forward's residuals (``PhaseCost.release_seconds``, measured)
   counts in the whole backward, or in a split backward's ``W``.
   The transfer after a stage moves its last unit's output: ``TransferCost.seconds(bytes)``.
2. **Step time and bubble.** ``mm.simulate`` replays ``mm.make_schedule(...)`` with those
   costs. Each row then runs the optimizer updates of its stages after its last op: the
   step time is the latest row's end. The bubble is the simulator's.
   An unsplit schedule's ``B`` costs the unit's whole backward (one program: the
   cotangents are computed once), a split one's ``B`` and ``W`` the halves the runtime
   runs; with several microbatches, the op that makes a stage's gradients also pays one
   gradient accumulation (the runtime adds each microbatch's gradients into the running
   sum inside that op, the first onto zeros: ``core/fragment/_sums.py``).
   Where a row's ``F`` is followed by the same microbatch's ``B`` (the last stage's in
   1F1B and zero-bubble schedules) the runtime runs the two as one program, and the
   simulator prices the pair (``simulate(..., fused=True)``) as the stage's fused program
   (`StageCost.fused`: ``F`` and the whole backward as one) plus the accumulation; a split
   ``B`` (input gradient only) gets the fused program's share of ``F`` and the whole
   backward apart, applied to ``F + B``. Fusing saves the residuals' round trip, one
   launch, and under recomputation the forward recomputed.
3. **Peak bytes per device**, per row (submesh), as the runtime holds them: the state of
   its stages (parameters and optimizer state; exact, from the shapes and the logical
   rules on the stage's submesh shape; optimizer state that mirrors no parameter, such as
   Adam's step counter, once per model on the first stage), plus the larger of two
   moments, each with its programs' largest temporary:

   * while the pipeline runs (`pipeline_bytes`), along the row's op order: an ``F`` adds
     its stage's activation bytes, an unsplit ``B`` frees them, a split ``B`` keeps
     ``weight_kept_bytes`` until its ``W``; an ``F`` fused with the next op (the same
     microbatch's ``B``, as the runtime does on the last stage) keeps nothing beyond it,
     its residuals being the fused program's temporaries (`StageCost.fused_temp_bytes`);
     with several microbatches the running gradient sum is alive from the stage's first
     backward on (made as zeros right before it), and each backward holds one more
     microbatch's gradients and the new sum beside it (the old sum is donated to the op
     but counts until it ends, as in B4's walk); with one microbatch the backward holds the
     gradients once;
   * at the optimizer update (`update_bytes`): the new parameters and optimizer state
     beside the old ones (a step's inputs stay alive), and the gradient sum.

   Each moment adds the largest temporary of the programs that run in it: the forward and
   backward programs' while the pipeline runs, the optimizer updates' at the update (a
   backward's scratch is gone by then).

   ``peak_in_flight`` still says how many activation sets a row holds at once (the
   simulator's count).

**Scaling rule** (what makes a number *derived*). Costs are profiled for ``rows`` examples
per microbatch on one submesh shape. For a stage with ``r`` rows per microbatch on ``n``
devices, ``d`` of them along the batch axes, from a profile of ``r0`` rows on ``n0``
devices, ``d0`` along the batch axes: times and FLOPs scale by ``(r / r0) * (n0 / n)``
(work divides ideally over the devices; the collectives of a larger submesh are not added);
activation, output and temporary bytes by ``(r / r0) * (d0 / d)`` (tensor parallelism is
assumed not to shrink them: an upper bound); optimizer updates by the ratio of parameter
bytes per device. A submesh larger than the profiled one also pays all-reduces over the
link of the transfer cost (ring: ``2 (n - 1) / n`` bytes moved per byte, beyond what the
profiled shape's ``n0`` already paid): along the tensor axes one of every unit's output in
its forward and one in its backward (units with parameters), along the data axes one of
the stage's gradients before its update. Training-state bytes are never scaled: they are
recomputed exactly.
Profile on the plan's own shape and microbatch size to get unscaled numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from multimesh_flax import errors
from multimesh_flax.core.declare import Schedule, make_schedule
from multimesh_flax.core.plan import SimulationResult, fused_backwards, simulate
from multimesh_flax.planner._costs import PhaseCost, Source, TransferCost
from multimesh_flax.planner._profile import UnitCost, UnitProfile, state_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a pipeline runs: the choices `predict` prices.

    Attributes:
        layers_per_stage: Blocks (``"layer"`` units) per stage, in order; the stems go to the
            first stage, the heads to the last. Its length is the stage count.
        microbatches: Microbatches per step ``m``.
        batch_size: Examples per step; ``None``: ``m`` times the profiled microbatch rows.
        schedule: A schedule name of ``mm.make_schedule`` (``"gpipe"``, ``"1f1b"``,
            ``"interleaved-1f1b"``, ``"zero-bubble-h2"``, ...).
        interleave: Stages per submesh for interleaved schedules (stage ``s`` on row
            ``s % R``).
        stage_mesh: The submesh shape ``{axis: size}`` of every stage, or one per stage;
            ``None``: the profiled shape.
        recompute: The recomputation policy of every stage, or one per stage.

    Example:
        >>> from multimesh_flax.planner import Plan
        >>> plan = Plan((2, 2), microbatches=4, stage_mesh={"data": 2, "model": 2})
        >>> plan.num_stages, plan.stage_meshes()
        (2, ({'data': 2, 'model': 2}, {'data': 2, 'model': 2}))
    """

    layers_per_stage: tuple[int, ...]
    microbatches: int = 1
    batch_size: int | None = None
    schedule: str = "1f1b"
    interleave: int | None = None
    stage_mesh: Mapping[str, int] | Sequence[Mapping[str, int]] | None = None
    recompute: str | None | Sequence[str | None] = None

    @property
    def num_stages(self) -> int:
        """The number of pipeline stages."""
        return len(self.layers_per_stage)

    def stage_meshes(self, default: Mapping[str, int] | None = None) -> tuple[dict, ...]:
        """The submesh shape of every stage (``default`` where the plan gives none)."""
        mesh = self.stage_mesh if self.stage_mesh is not None else default
        if mesh is None or isinstance(mesh, Mapping):
            return (dict(mesh or {}),) * self.num_stages
        return tuple(dict(m) for m in mesh)

    def policies(self) -> tuple[str | None, ...]:
        """The recomputation policy of every stage."""
        if self.recompute is None or isinstance(self.recompute, str):
            return (self.recompute,) * self.num_stages
        return tuple(self.recompute)


@dataclasses.dataclass(frozen=True)
class StageCost:
    """One stage's per-microbatch costs on its submesh, after scaling.

    Attributes:
        forward, backward_input, backward_weight, update: Summed over the stage's units.
        backward: The unsplit backward (what a schedule without ``W`` ops runs), summed.
        accumulate: Adding one microbatch's gradients into the running sum, summed.
        transfer: Seconds to send the stage's output to the next stage (and its gradient
            back).
        param_bytes: Parameters per device (gradients take as many).
        opt_state_bytes: Optimizer state per device.
        activation_bytes: What one microbatch keeps for the backward, per device.
        temp_bytes: The largest temporary of the stage's forward and backward programs
            (under recomputation their units' summed; the update's is
            ``update.temp_bytes``).
        weight_kept_bytes: What one microbatch keeps from a split ``B`` to its ``W``.
        fused_temp_bytes: The temporary bytes of the stage's ``F`` and ``B`` run as one
            program (the last stage's, fused by the runtime): the sum of its units'
            (`UnitCost.fused_temp_bytes`; each unit's residuals stay inside it).
        fused: The stage's ``F`` and whole backward as one program, summed over its units'
            `UnitCost.fused` (one launch): what the runtime runs where a row's ``F`` is
            followed by the same microbatch's ``B``. Zero when not profiled.
    """

    forward: PhaseCost
    backward_input: PhaseCost
    backward_weight: PhaseCost
    update: PhaseCost
    transfer: float
    param_bytes: int
    opt_state_bytes: int
    activation_bytes: int
    temp_bytes: int
    backward: PhaseCost = PhaseCost()
    accumulate: PhaseCost = PhaseCost()
    weight_kept_bytes: int = 0
    fused_temp_bytes: int = 0
    fused: PhaseCost = PhaseCost()

    @property
    def state_bytes(self) -> int:
        """Parameters, their gradients and the optimizer state, per device."""
        return 2 * self.param_bytes + self.opt_state_bytes


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What `predict` expects a plan to do (seconds and bytes per device).

    Attributes:
        plan: The plan.
        step_time: Seconds per training step: the simulated pipeline, then each row's
            optimizer updates.
        bubble: The simulator's idle fraction of the rows' time.
        peak_bytes: Per row (submesh), peak bytes per device: ``state_bytes + max(
            activation_bytes + temp_bytes, update_bytes + update_temp_bytes)``.
        state_bytes: Per row, parameters and optimizer state (held all step).
        activation_bytes: Per row, the most activations and gradients alive at once
            while the pipeline runs (`pipeline_bytes`).
        temp_bytes: Per row, the largest temporary of its forward and backward programs.
        update_bytes: Per row, what its optimizer updates hold at once beyond the state
            (`update_bytes`): the new state beside the old, and the gradients.
        update_temp_bytes: Per row, the largest temporary of its optimizer updates.
        peak_in_flight: Per row, the most activation sets alive at once.
        stages: Per stage, its `StageCost`.
        simulation: The simulator's `SimulationResult`.
        sources: Where each number came from (`Source`), by name: the inputs (``"unit
            times"``, ``"flops"``, ``"transfer"``, ``"state_bytes"``, ``"activation_bytes"``,
            ``"temp_bytes"``) and the outputs (``"step_time"``, ``"bubble"``,
            ``"peak_bytes"``, always derived).
        stage_paths: Per stage, the module paths of its units (stems, blocks, heads).
        rules: The logical rules of the profile (what `apply` gives every task).
        stage_meshes: Per stage, its submesh shape (the profiled one where the plan gives
            none).
    """

    plan: Plan
    step_time: float
    bubble: float
    peak_bytes: tuple[int, ...]
    state_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    temp_bytes: tuple[int, ...]
    peak_in_flight: tuple[int, ...]
    stages: tuple[StageCost, ...]
    simulation: SimulationResult
    sources: Mapping[str, Source]
    update_bytes: tuple[int, ...] = ()
    update_temp_bytes: tuple[int, ...] = ()
    stage_paths: tuple[tuple[str, ...], ...] = ()
    rules: tuple = ()
    stage_meshes: tuple[dict, ...] = ()

    @property
    def max_peak_bytes(self) -> int:
        """The largest ``peak_bytes`` of any device."""
        return max(self.peak_bytes)

    def apply(self) -> Any:
        """What to train this plan with: an `AppliedPlan` (``layers_per_stage``, the
        ``MultiMesh``, ``parallelize_step`` arguments, ``register_task`` placements)."""
        from multimesh_flax.planner._apply import AppliedPlan

        return AppliedPlan.from_prediction(self)

    def table(self, *, console: Any = None) -> Any:
        """Prints this plan's stages as a `rich` table; returns the table."""
        from multimesh_flax.planner._report import prediction_table

        return prediction_table(self, console=console)

    def plot(self, path: str | None = None, *, memory_per_device: float | None = None) -> Any:
        """The predicted timeline beside per-device memory bars (a matplotlib figure)."""
        from multimesh_flax.planner._report import plot_prediction

        return plot_prediction(self, path, memory_per_device=memory_per_device)

    def __str__(self) -> str:
        lines = [
            f"step {self.step_time * 1e3:.3f} ms ({self.sources['unit times']} unit times), "
            f"bubble {self.bubble:.3f}, peak {self.max_peak_bytes / 2**20:.2f} MiB per device"
        ]
        for row, peak in enumerate(self.peak_bytes):
            lines.append(
                f"row {row}: state {self.state_bytes[row]:,} B + max(activations and "
                f"gradients {self.activation_bytes[row]:,} B ({self.peak_in_flight[row]} in "
                f"flight) + temporary {self.temp_bytes[row]:,} B, update "
                f"{self.update_bytes[row]:,} B + temporary {self.update_temp_bytes[row]:,} B) "
                f"= {peak:,} B"
            )
        return "\n".join(lines)


def _stage_instances(plan: Plan, profile: UnitProfile, key: Any = None) -> Any:
    """The distinct-unit index (or ``key(instance)``) of every instance on each stage."""
    get = key or (lambda i: i.unit)
    instances = profile.units.instances
    layers = [get(i) for i in instances if i.role == "layer"]
    split = tuple(plan.layers_per_stage)
    if (
        not split
        or any(not isinstance(n, int) or n < 0 for n in split)
        or sum(split) != len(layers)
    ):
        raise errors.PlanMismatchError(
            f"Expected `layers_per_stage` to split the profiled model's {len(layers)} "
            f"blocks (non-negative counts adding up to {len(layers)}), got {split!r}. "
            f"Change the counts, or profile the model the plan is for."
        )
    stages: list[list[Any]] = [[] for _ in split]
    stages[0] += [get(i) for i in instances if i.role == "stem"]
    start = 0
    for s, n in enumerate(split):
        stages[s] += layers[start : start + n]
        start += n
    stages[-1] += [get(i) for i in instances if i.role == "head"]
    return stages if key is None else tuple(tuple(s) for s in stages)


def _scales(profile: UnitProfile, mesh: dict, rows: int) -> tuple[float, float]:
    """(time scale, activation-memory scale) from the profiled shape to ``mesh``."""
    shape = dict(profile.mesh_shape)
    if set(mesh) != set(shape):
        raise errors.PlanMismatchError(
            f"Expected every stage submesh to have the profiled axes {sorted(shape)}, got "
            f"{mesh}. Give sizes for exactly those axes (1 for an unused one)."
        )
    n0, n = math.prod(shape.values()), math.prod(mesh.values())
    d0 = math.prod(shape[a] for a in profile.data_axes)
    d = math.prod(mesh[a] for a in profile.data_axes)
    r = rows / profile.rows
    return r * n0 / n, r * d0 / d


def _ring(n: int) -> float:
    """Bytes a ring all-reduce moves per byte reduced, per device: ``2 (n - 1) / n``."""
    return 2 * (n - 1) / n


def collective_per_byte(
    profile: UnitProfile, mesh: Mapping[str, int], link: TransferCost
) -> tuple[float, float]:
    """Seconds per byte of the all-reduces a submesh adds beyond the profiled one's:
    (over the tensor axes, over the data axes). Zero on the profiled shape or a smaller one.
    """
    shape = dict(profile.mesh_shape)
    data = profile.data_axes

    def size(m: Mapping[str, int], on_data: bool) -> int:
        return math.prod(v for a, v in m.items() if (a in data) == on_data)

    tensor = max(_ring(size(mesh, False)) - _ring(size(shape, False)), 0.0)
    replica = max(_ring(size(mesh, True)) - _ring(size(shape, True)), 0.0)
    return tensor * link.seconds_per_byte, replica * link.seconds_per_byte


def _work(phase: PhaseCost, launch: float) -> PhaseCost:
    """``phase`` without the launch of its own program (`UnitProfile.launch_seconds`)."""
    if not launch or not phase.seconds:
        return phase
    return dataclasses.replace(phase, seconds=max(phase.seconds - launch, 0.0))


def _fused_copy(c: UnitCost, launch: float, again: bool) -> PhaseCost:
    """One copy of a unit in its stage's fused program: the fused program's work, or for a
    further copy of a unit already in it (``again``) what a second copy added in the
    profile (`UnitCost.fused_repeat`), where it was costed (its FLOPs counted: a measured
    difference clamped to 0 s is still a price)."""
    if again and c.fused_repeat.flops > 0:
        return c.fused_repeat
    return _work(c.fused, launch)


def _pipeline_temp(costs: Sequence[UnitCost]) -> int:
    """A stage's largest forward or backward scratch: its largest unit's, or under
    recomputation the sum of its units' (the runtime's trace inlines ``jax.checkpoint``, so
    the backward recomputes every unit's forward before XLA frees any of it: 3 recomputed
    Llama blocks held 1.54 MB of scratch, one block's program 0.48 MB)."""
    temps = [c.pipeline_temp_bytes for c in costs]
    recomputed = any(c.recompute is not None for c in costs)
    return sum(temps) if recomputed else max(temps, default=0)


def _derived(seconds: float) -> PhaseCost:
    return PhaseCost(seconds, source=Source.DERIVED)


def _stage_cost(
    costs: Sequence[UnitCost],
    profile: UnitProfile,
    mesh: dict,
    rows: int,
    transfer: TransferCost,
    first: bool,
) -> StageCost:
    time, memory = _scales(profile, mesh, rows)
    shape = dict(profile.mesh_shape)
    total = {k: PhaseCost(source=profile.mode) for k in ("f", "b", "w", "u", "bw", "a", "fb")}
    params, opt = 0, 0
    tensor, replica = collective_per_byte(profile, mesh, transfer)
    launch = profile.launch_seconds
    seen: set[int] = set()
    for c in costs:
        params_here = state_bytes(c.params, mesh, profile.rules)
        params_there = state_bytes(c.params, shape, profile.rules)
        update_scale = params_here / params_there if params_there else 1.0
        total["f"] += _work(c.forward, launch).scaled(time, memory)
        total["b"] += _work(c.backward_input, launch).scaled(time, memory)
        total["w"] += _work(c.backward_weight, launch).scaled(time, memory)
        total["bw"] += _work(c.backward, launch).scaled(time, memory)
        total["u"] += _work(c.update, launch).scaled(update_scale, update_scale)
        total["a"] += c.accumulate.scaled(update_scale, update_scale)  # inside the backward
        total["fb"] += _fused_copy(c, launch, c.unit in seen).scaled(time, memory)
        seen.add(c.unit)
        if tensor and c.params:  # one all-reduce of the output in the forward, one back
            reduce = tensor * c.output_bytes * memory
            for key in ("f", "b", "bw"):
                total[key] += _derived(reduce)
            total["fb"] += _derived(2 * reduce)
        if replica and params_here:  # the gradients' all-reduce over the replicas
            total["u"] += _derived(replica * params_here)
        params += params_here
        opt += state_bytes([x for x in c.opt_state if not x.shared], mesh, profile.rules)
    if first:  # the optimizer's own counters: once per model, with the first stage
        shared = [x for c in costs[:1] for x in c.opt_state if x.shared]
        opt += state_bytes(shared, mesh, profile.rules)
    out_bytes = costs[-1].output_bytes * memory if costs else 0
    phases = {"f": "forward", "b": "backward_input", "w": "backward_weight", "bw": "backward"}
    phases |= {"u": "update", "fb": "fused"}
    for key, name in phases.items():  # one program per stage and phase: one launch
        if any(getattr(c, name).seconds > 0 for c in costs):
            total[key] = dataclasses.replace(total[key], seconds=total[key].seconds + launch)
    for key in ("bw", "w"):  # the op that reads the forward's residuals last frees them
        freed = total[key].seconds + total["f"].release_seconds
        total[key] = dataclasses.replace(total[key], seconds=freed)
    return StageCost(
        forward=total["f"],
        backward_input=total["b"],
        backward_weight=total["w"],
        update=total["u"],
        transfer=transfer.seconds(out_bytes),
        param_bytes=params,
        opt_state_bytes=opt,
        activation_bytes=int(round(sum(c.activation_bytes for c in costs) * memory)),
        temp_bytes=int(round(_pipeline_temp(costs) * memory)),
        backward=total["bw"],
        accumulate=total["a"],
        weight_kept_bytes=int(round(sum(c.weight_kept_bytes for c in costs) * memory)),
        fused_temp_bytes=int(round(sum(c.fused_temp_bytes for c in costs) * memory)),
        fused=total["fb"],
    )


def peak_activation_bytes(schedule: Schedule, stage_bytes: Sequence[int]) -> tuple[int, ...]:
    """Per row, the most activation bytes alive at once along the row's op order.

    An ``F`` op adds its stage's bytes; the last backward op of the same stage and
    microbatch (``W`` when the backward is split, else ``B``) frees them. With
    ``stage_bytes`` all 1 this is the simulator's ``peak_in_flight``.

    Example:
        >>> import multimesh_flax as mm
        >>> from multimesh_flax.planner import peak_activation_bytes
        >>> schedule = mm.make_schedule("1f1b", num_stages=3, num_microbatches=8)
        >>> peak_activation_bytes(schedule, [1, 1, 1])  # min(p - stage, m)
        (3, 2, 1)
        >>> peak_activation_bytes(schedule, [10, 20, 30])
        (30, 40, 30)
    """
    last = schedule.phases[-1]
    peaks = []
    for ops in schedule.rows:
        live = peak = 0
        for op in ops:
            if op.phase == "F":
                live += stage_bytes[op.stage]
                peak = max(peak, live)
            elif op.phase == last:
                live -= stage_bytes[op.stage]
        peaks.append(peak)
    return tuple(peaks)


def pipeline_bytes(schedule: Schedule, stages: Sequence[StageCost]) -> tuple[int, ...]:
    """Per row, the most bytes of activations and gradients alive at once along the row's
    op order (beyond parameters and optimizer state), the way the runtime holds them.

    An ``F`` adds its stage's activation bytes; an unsplit ``B`` frees them; a split ``B``
    keeps ``weight_kept_bytes`` of them until its ``W``. An ``F`` fused with the next op
    (the same microbatch's ``B``) keeps nothing beyond that op: its residuals are the fused
    program's temporaries, ``fused_temp_bytes``, counted here beyond the row's largest
    other temporary (which the caller adds to every moment). The op that makes a stage's
    gradients (``B`` unsplit, else ``W``) holds them beside the running sum, which with
    several microbatches exists from the stage's first such op on (zeros made right before
    it), and the new sum it returns. The old sum is donated to the op, but counts until the
    op ends, as B4's walk (the reference) counts every input.
    """
    split = schedule.split_backward
    grad_op = "W" if split else "B"
    accumulates = schedule.num_microbatches > 1
    fused_b = fused_backwards(schedule)  # the B of each fused F and B
    out = []
    for ops in schedule.rows:
        row_temp = max((stages[op.stage].temp_bytes for op in ops), default=0)
        live = peak = sums = 0
        summed: set[int] = set()
        for i, op in enumerate(ops):
            c = stages[op.stage]
            kept = c.weight_kept_bytes if split else 0
            fused_f = i + 1 < len(ops) and ops[i + 1] in fused_b  # residuals stay inside
            if op.phase == "F" and not fused_f:
                live += c.activation_bytes
                peak = max(peak, live + sums)
            if op.phase == grad_op:
                if accumulates and op.stage not in summed:  # the zeros of its running sum
                    summed.add(op.stage)
                    sums += c.param_bytes
                extra = max(c.fused_temp_bytes - row_temp, 0) if op in fused_b else 0
                made = (2 if accumulates else 1) * c.param_bytes  # gradients (and new sum)
                peak = max(peak, live + sums + made + extra)
            if op.phase == "B":
                live += kept if op in fused_b else kept - c.activation_bytes
            elif op.phase == "W":
                live -= kept
            if op.phase == grad_op and not accumulates and op.stage not in summed:
                summed.add(op.stage)  # one microbatch: its gradients are the sum
                sums += c.param_bytes
        out.append(max(peak, 0))
    return tuple(out)


def update_bytes(stages: Sequence[StageCost], microbatches: int) -> int:
    """Beyond one row's parameters and optimizer state, the most bytes its optimizer updates
    hold at once: every stage's gradient sum, and while a stage updates, its new parameters
    and optimizer state (the old ones stay: a step's inputs). Every microbatch's gradients,
    the last one's too, are already in the sum (``microbatches`` does not change that)."""
    del microbatches
    sums = sum(c.param_bytes for c in stages)
    return sums + max(c.param_bytes + c.opt_state_bytes for c in stages)


def _sources(profile: UnitProfile, stages: Sequence[StageCost], transfer: TransferCost) -> dict:
    phases = [p for s in stages for p in (s.forward, s.backward_input, s.backward_weight)]
    derived = any(p.source == Source.DERIVED for p in phases)
    times = Source.DERIVED if derived else profile.mode
    memory = Source.DERIVED if derived else Source.ANALYTIC
    return {
        "unit times": times,
        "flops": Source.DERIVED if derived else Source.ANALYTIC,
        "transfer": transfer.source,
        "state_bytes": Source.DERIVED,
        "activation_bytes": memory,
        "temp_bytes": memory,
        "step_time": Source.DERIVED,
        "bubble": Source.DERIVED,
        "peak_bytes": Source.DERIVED,
    }


def predict(
    plan: Plan, profile: UnitProfile, *, transfer: TransferCost | None = None
) -> Prediction:
    """Predicts ``plan``'s step time, bubble and peak bytes per device from ``profile``.

    See the module docstring for the model and the scaling rule.

    Args:
        plan: The `Plan`.
        profile: Unit costs from `profile_units`.
        transfer: The cost of moving bytes between stages (e.g. `measure_transfer`);
            ``None``: the link of the profile's `DeviceSpec` (analytic).

    Returns:
        A `Prediction`.

    Raises:
        PlanMismatchError: the plan's split does not fit the profiled model, a stage submesh
            lacks the profiled axes, a policy was not profiled, or the schedule cannot be
            built for the plan's sizes.
        UnevenMicrobatchError: ``microbatches`` does not divide ``batch_size``.

    Example:
        >>> import multimesh_flax as mm
        >>> from flax import linen as nn
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         for i in range(4):
        ...             x = nn.Dense(32, name=f"layer_{i}")(x)
        ...         return x
        >>> profile = mm.profile_units(MLP(), jnp.ones((8, 32)), patterns=[r"layer_\\d+"])
        >>> prediction = mm.predict(mm.Plan((2, 2), microbatches=4), profile)
        >>> prediction.peak_in_flight, str(prediction.sources["unit times"])
        ((2, 1), 'analytic')
    """
    m = plan.microbatches
    batch = plan.batch_size if plan.batch_size is not None else m * profile.rows
    if not isinstance(m, int) or m < 1 or batch % m:
        raise errors.UnevenMicrobatchError(
            f"Expected `microbatches` to divide the plan's batch of {batch} examples, got "
            f"{m!r}. Pick a divisor of {batch}, or change `batch_size`."
        )
    stages = _stage_instances(plan, profile)
    meshes = plan.stage_meshes(dict(profile.mesh_shape))
    policies = plan.policies()
    if len(meshes) != plan.num_stages or len(policies) != plan.num_stages:
        raise errors.PlanMismatchError(
            f"Expected one `stage_mesh` and one `recompute` entry per stage "
            f"({plan.num_stages}), got {len(meshes)} and {len(policies)}. Give one value "
            "for all stages, or one per stage."
        )
    link = transfer if transfer is not None else TransferCost.from_spec(profile.device)
    costs = tuple(
        _stage_cost(
            [profile.cost(u, policy) for u in units], profile, mesh, batch // m, link, s == 0
        )
        for s, (units, mesh, policy) in enumerate(zip(stages, meshes, policies, strict=True))
    )
    schedule = _schedule(plan)
    prediction = _predict(plan, profile, schedule, costs, link)
    paths = _stage_instances(plan, profile, key=lambda i: i.path)
    return dataclasses.replace(
        prediction, stage_paths=paths, rules=tuple(profile.rules), stage_meshes=meshes
    )


def _schedule(plan: Plan) -> Schedule:
    try:
        return make_schedule(
            plan.schedule, plan.num_stages, plan.microbatches, interleave=plan.interleave
        )
    except errors.InvalidScheduleError as e:
        raise errors.PlanMismatchError(
            f"Expected a schedule the plan's {plan.num_stages} stages and "
            f"{plan.microbatches} microbatches can build, got {plan.schedule!r}: {e}"
        ) from e


def _fused_pair(c: StageCost, split: bool, accumulate: float) -> float:
    """An ``F`` and the same microbatch's ``B`` run as one program: the share of the two
    apart that the stage's fused program (`StageCost.fused`: ``F`` and the whole backward)
    takes of its ``F`` and whole backward, applied to the pair (a split ``B`` computes the
    input gradient only), plus the gradient accumulation an unsplit ``B`` pays."""
    # the programs apart (the whole backward less the residuals' release: fused, they stay
    # inside the one program)
    apart = c.forward.seconds + c.backward.seconds - c.forward.release_seconds
    share = min(c.fused.seconds / apart, 1.0) if c.fused.seconds and apart else 1.0
    if split:
        return share * (c.forward.seconds + c.backward_input.seconds)
    return share * apart + accumulate


def _predict(
    plan: Plan,
    profile: UnitProfile,
    schedule: Schedule,
    costs: tuple[StageCost, ...],
    link: TransferCost,
) -> Prediction:
    split = schedule.split_backward
    share = 1.0 if plan.microbatches > 1 else 0.0  # each backward adds into the running sum

    def cost(stage: int, phase: str) -> float:
        c = costs[stage]
        accumulate = share * c.accumulate.seconds
        if phase == "F+B":
            return _fused_pair(c, split, accumulate)
        return {
            "F": c.forward.seconds,
            "B": c.backward_input.seconds if split else c.backward.seconds + accumulate,
            "W": c.backward_weight.seconds + accumulate if split else 0.0,
            "transfer": c.transfer,
        }[phase]

    result = simulate(schedule, costs=cost, fused=True)
    rows = range(schedule.num_submeshes)
    on_row = [[s for s in range(plan.num_stages) if schedule.stage_to_row[s] == r] for r in rows]
    ends = [0.0] * schedule.num_submeshes
    for row, _, _, end in result.timeline:
        ends[row] = max(ends[row], end)
    step = max(ends[r] + sum(costs[s].update.seconds for s in on_row[r]) for r in rows)
    activations = pipeline_bytes(schedule, costs)
    updates = tuple(update_bytes([costs[s] for s in on_row[r]], plan.microbatches) for r in rows)
    state = tuple(
        sum(costs[s].param_bytes + costs[s].opt_state_bytes for s in on_row[r]) for r in rows
    )
    temp = tuple(max(costs[s].temp_bytes for s in on_row[r]) for r in rows)
    update_temp = tuple(max(costs[s].update.temp_bytes for s in on_row[r]) for r in rows)
    return Prediction(
        plan=plan,
        step_time=step,
        bubble=result.bubble_fraction,
        peak_bytes=tuple(
            state[r] + max(activations[r] + temp[r], updates[r] + update_temp[r]) for r in rows
        ),
        state_bytes=state,
        activation_bytes=activations,
        temp_bytes=temp,
        update_bytes=updates,
        update_temp_bytes=update_temp,
        peak_in_flight=peak_activation_bytes(schedule, [1] * plan.num_stages),
        stages=costs,
        simulation=result,
        sources=_sources(profile, costs, link),
    )
