"""Costs per unit: every distinct unit compiled on one submesh shape, analysed or timed.

`profile_units` finds the units of a model (`_units.find_units`) and, for each distinct unit
and each recomputation policy asked for, compiles these programs with ``jax.jit`` on a mesh
of the requested shape (the first devices of ``jax.devices()``), the unit's parameters
sharded by its logical names through ``rules`` and its batch-sized inputs over the axes the
rules map ``"batch"`` to:

* **F**, the forward: ``jax.vjp`` of the unit's apply, returning the output and the
  residuals it computes, each once (`residual_sources`) -- what the runtime's forward
  fragment hands its backward. Residuals that are the program's own inputs (parameters,
  the unit's input) are not returned: the runtime's backward reads those directly, and
  returning them would make F copy every parameter. Nor are values computed from no input
  that only the backward reads (``jnp.where``'s zero tangent): the runtime makes those in
  the backward, and so does the backward here. The residuals that are not parameters
  (nor inputs without the batch dimension), each counted once, are the *activation bytes*
  a microbatch keeps for its backward (per device). Under a recomputation policy
  the apply is wrapped in ``jax.checkpoint`` first, so the residuals shrink to what the
  policy saves (``"full"``: the inputs) and the backward recomputes the rest.
* the **whole backward** (the inputs F's residuals name, F's returned residuals and the
  output cotangent in, the gradients of the parameters and of the unit's floating-point
  inputs out): what an unsplit schedule runs.
* **F and B as one program**: what the runtime's fused forward and backward of one
  microbatch on the last stage costs (timed in measured mode) and holds inside (its
  temporary bytes); for a unit the model repeats (a block), also two copies chained in one
  such program, whose difference from one copy is what each further copy adds
  (``fused_repeat``, priced like the accumulation below).
* **B**, the activation gradient, and **W**, the weight gradient: the two halves of a split
  backward, cut from the whole backward's jaxpr the way the runtime cuts it
  (`_split_backward`): B computes what the input gradient needs and returns the cotangents
  W reads; W computes the weight gradients from them. Those cotangents and the residuals W
  reads are the *weight-kept bytes*, what a microbatch holds from its B to its W.
* **accumulate**, one microbatch's weight gradients added into a running sum, as the
  runtime adds them: at the end of the backward that makes them, in the same program. It is
  priced as what that costs the program: the whole backward compiled once more with the sum
  added in, and (measured mode) the median of the two programs' difference in the same
  round and in `PAIRED_RUNS` back-to-back pairs after each round (a program of its own
  would pay a launch and an output buffer per parameter, several times what the addition
  costs inside the backward).
* **update**, the optax optimizer's ``update`` and ``apply_updates`` on the unit's
  parameters, gradients and optimizer state (mirroring the parameters' shardings).

``mode="analytic"`` runs nothing: FLOPs and bytes from ``compiled.cost_analysis()``,
temporary bytes from ``compiled.memory_analysis()``, seconds from a `DeviceSpec` roofline.
``mode="measured"`` also runs every compiled program on random inputs: warm-up runs first
(at least 3 and 20 ms), then ``repeats`` rounds in which every program of every unit runs
once, and keeps each program's median wall time (round by round, so that a load coming and
going on a shared host slows all programs alike; every program's inputs stay alive until
the rounds end). A program's time ends when its outputs are ready: freeing them is timed
apart (``PhaseCost.release_seconds``), because the runtime frees a value in the op that
reads it last -- a forward's residuals in its backward -- and `predict` charges it there
(timed together, a six-block GPT stage's forward on 4 CPU devices took 7.3-7.9 ms in the
rounds, 5.9-6.3 ms without it). An empty program on the mesh is timed in the same rounds:
its median is the launch every program pays (`UnitProfile.launch_seconds`), which
`predict` counts once per stage program rather than once per unit. Bytes of the training
state per device (parameters, gradients as large as the parameters, optimizer state) are
not measured: they follow from the shapes and the logical rules on the mesh shape, exactly,
which is also how `predict` gets them for any other submesh shape without its devices.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public name (jax 0.10)
from jax.extend import core as jex_core
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh_flax import errors
from multimesh_flax.core.declare import logical_to_mesh_spec
from multimesh_flax.planner._costs import (
    DEVICE_SPECS,
    DeviceSpec,
    PhaseCost,
    Source,
    StateLeaf,
    bytes_per_device,
)
from multimesh_flax.planner._split_backward import SplitBackward, split_backward
from multimesh_flax.planner._units import Unit, UnitSet, find_units

log = logging.getLogger(__name__)

POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""Recomputation policies a profile can cost, by name (``None``: no recomputation)."""

MODES = ("analytic", "measured")
WARMUP_RUNS, WARMUP_RUNS_MAX, WARMUP_SECONDS = 3, 50, 0.02
"""Measured mode's warm-up of every program: at least 3 runs and 20 ms, at most 50 runs."""
PAIRED_RUNS = 10
"""Measured mode: per round, back-to-back pairs of the two programs a cost is the
difference of (`UnitCost.accumulate`, `UnitCost.fused_repeat`)."""
_PHASE_FIELDS = (
    "forward",
    "backward_input",
    "backward_weight",
    "backward",
    "update",
    "accumulate",
    "fused",
    "fused_repeat",
)


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """The costs of one distinct unit under one recomputation policy, per device.

    Attributes:
        unit: Index into ``profile.units.units``.
        recompute: ``None``, ``"full"`` or ``"dots"``.
        forward, backward_input, backward_weight, update: The four programs (`PhaseCost`):
            forward with residuals (F), activation gradient (B), weight gradient (W),
            optimizer update. B and W are the halves of a split backward as the runtime
            splits it: B computes what the input gradient needs and hands W the
            cotangents W reads; W computes the weight gradients from them.
        backward: The whole backward as one program (what an unsplit schedule runs: it
            computes the cotangents once, where ``B + W`` alone would not share them).
        accumulate: What adding one microbatch's weight gradients into the running sum
            adds to the backward that makes them (the runtime adds them inside it): the
            whole backward with the sum added against the whole backward alone.
        activation_bytes: Bytes a microbatch keeps from F to its backward (the residuals
            that are not parameters), per device.
        weight_kept_bytes: Bytes a microbatch keeps from a split backward's B to its W
            (the residuals W reads and the cotangents B hands it), per device.
        fused: The unit's forward and whole backward as one program (what the runtime runs
            where a row's F is followed by the same microbatch's B, the last stage's in
            1F1B and zero-bubble schedules): its residuals never leave the program, and
            under recomputation XLA need not recompute what the program still holds.
        fused_temp_bytes: ``fused.temp_bytes`` (the fused program's scratch).
        fused_repeat: What one more copy of the unit adds inside a fused program (a
            stage fusing several blocks): two copies chained in one fused program against
            ``fused`` (measured: the median difference of their times, as ``accumulate``).
            The first copy carries costs the others do not: on this CPU host one gpt-tiny
            block's fused program took 3.4 ms, four chained 10.7 ms. Zero for a unit the
            model has once, or whose output is not its own floating-point input.
        output_bytes: Bytes of the unit's output per device: what a stage boundary after it
            sends (its gradient comes back the same size).
        params: The parameters as `StateLeaf` records (shape, dtype, logical names).
        opt_state: The optimizer state's arrays, logical names mirrored from the parameter
            each one mirrors; the others (``shared``: step counters) replicated and counted
            once per model by `predict`.
    """

    unit: int
    recompute: str | None
    forward: PhaseCost
    backward_input: PhaseCost
    backward_weight: PhaseCost
    update: PhaseCost
    activation_bytes: int
    output_bytes: int
    params: tuple[StateLeaf, ...]
    opt_state: tuple[StateLeaf, ...]
    backward: PhaseCost = PhaseCost()
    accumulate: PhaseCost = PhaseCost()
    weight_kept_bytes: int = 0
    fused_temp_bytes: int = 0
    fused: PhaseCost = PhaseCost()
    fused_repeat: PhaseCost = PhaseCost()

    @property
    def pipeline_temp_bytes(self) -> int:
        """The largest temporary of the unit's forward and backward programs (what can
        run while a pipeline holds activations; the optimizer update runs after)."""
        phases = (self.forward, self.backward_input, self.backward_weight, self.backward)
        return max(p.temp_bytes for p in phases)

    @property
    def temp_bytes(self) -> int:
        """The largest temporary of the unit's programs."""
        phases = (
            self.forward,
            self.backward_input,
            self.backward_weight,
            self.backward,
            self.update,
        )
        return max(p.temp_bytes for p in phases)


@dataclasses.dataclass(frozen=True)
class UnitProfile:
    """What `profile_units` measured: the units and their costs on one submesh shape.

    Attributes:
        units: The model's units (`UnitSet`).
        costs: One `UnitCost` per (distinct unit, recomputation policy).
        mesh_shape: The submesh shape profiled, ``((axis, size), ...)``.
        rules: The logical rules used.
        data_axes: The mesh axes the batch is split over (the rules' ``"batch"``).
        rows: Rows (examples) of the microbatch profiled.
        mode: ``Source.ANALYTIC`` or ``Source.MEASURED``.
        device: The `DeviceSpec` of analytic times (and default transfers).
        compiles: Programs compiled: per distinct unit and policy the forward, the whole
            backward, the two as one program (and two chained copies as one, for a unit the
            model repeats whose output is its input) and, for a unit with both input and
            weight gradients, its B and W halves; per unit with parameters the whole backward
            with the gradient sum added in (under the first policy) and, with an
            optimizer, one update; in measured mode also one empty program (the launch).
        launch_seconds: Measured mode: the median time of an empty program on the
            profiled mesh (adding one to one element per device), timed in the same rounds as
            the units' programs: what every program pays however little it computes. A
            runtime fragment runs several units as one program and pays it once, so
            `predict` counts it once per stage op, not once per unit. Analytic mode: 0.
    """

    units: UnitSet
    costs: tuple[UnitCost, ...]
    mesh_shape: tuple[tuple[str, int], ...]
    rules: tuple[tuple[str, Any], ...]
    data_axes: tuple[str, ...]
    rows: int
    mode: Source
    device: DeviceSpec
    compiles: int
    launch_seconds: float = 0.0

    def cost(self, unit: int, recompute: str | None = None) -> UnitCost:
        """The `UnitCost` of distinct unit ``unit`` under ``recompute``.

        Raises:
            PlanMismatchError: the policy was not profiled.
        """
        for c in self.costs:
            if c.unit == unit and c.recompute == recompute:
                return c
        profiled = sorted({str(c.recompute) for c in self.costs})
        raise errors.PlanMismatchError(
            f"Expected a recomputation policy the profile costed ({profiled}), got "
            f"{recompute!r}. Profile it too: `profile_units(..., recompute=(None, "
            f"{recompute!r}))`."
        )


def _mesh_shape(mesh_shape: Any, rules: Sequence) -> dict[str, int]:
    if mesh_shape is None:
        axes = {a for _, m in rules for a in ((m,) if isinstance(m, str) else (m or ()))}
        return {a: 1 for a in sorted(axes)} or {"data": 1}
    shape = dict(mesh_shape)
    bad = {k: v for k, v in shape.items() if not isinstance(v, int) or v < 1}
    if not shape or bad:
        raise errors.ProfileArgumentError(
            f"Expected `mesh_shape` as {{axis: size}} with sizes >= 1, e.g. {{'data': 2, "
            f"'model': 2}}, got {mesh_shape!r}. Name every axis the rules use."
        )
    return shape


def _make_mesh(shape: dict[str, int]) -> jax.sharding.Mesh:
    count = math.prod(shape.values())
    devices = jax.devices()
    if count > len(devices):
        raise errors.ProfileArgumentError(
            f"Expected a `mesh_shape` of at most the {len(devices)} local devices, got "
            f"{shape} ({count} devices). Profile on a smaller submesh: `predict` scales "
            "the costs to the plan's submesh shapes (see the README, 'Planning a pipeline')."
        )
    return jax.make_mesh(
        tuple(shape.values()),
        tuple(shape),
        axis_types=(AxisType.Auto,) * len(shape),
        devices=devices[:count],
    )


def _data_axes(rules: Sequence, mesh: dict[str, int]) -> tuple[str, ...]:
    for name, axes in rules:
        if name == "batch" and axes is not None:
            return tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a in mesh)
    return ()


def _state_leaves(boxed: Any) -> list[StateLeaf]:
    leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return [
        StateLeaf(tuple(x.value.shape), np.dtype(x.value.dtype), tuple(x.names))
        if isinstance(x, nn.Partitioned)
        else StateLeaf(tuple(x.shape), np.dtype(x.dtype), None)
        for x in leaves
    ]


def mesh_spec(leaf: StateLeaf, mesh: Mapping[str, int], rules: Sequence) -> P:
    """The mesh ``PartitionSpec`` of a state leaf: its logical names through ``rules``."""
    if leaf.logical is None:
        return P()
    return logical_to_mesh_spec(P(*leaf.logical), leaf.shape, dict(mesh), rules)


def state_bytes(leaves: Sequence[StateLeaf], mesh: Mapping[str, int], rules: Sequence) -> int:
    """Bytes per device of ``leaves`` on a mesh of shape ``mesh`` (no devices needed)."""
    shape, rules = tuple(dict(mesh).items()), tuple(rules)
    try:
        return sum(_leaf_bytes(x, shape, rules) for x in leaves)
    except TypeError:  # rules that do not hash: compute without the cache
        return sum(
            bytes_per_device(x.shape, x.dtype, mesh_spec(x, mesh, rules), dict(mesh))
            for x in leaves
        )


@functools.lru_cache(maxsize=65536)
def _leaf_bytes(leaf: StateLeaf, shape: tuple, rules: tuple) -> int:
    """One leaf's bytes per device (cached: the planner asks for the same ones often)."""
    mesh = dict(shape)
    return bytes_per_device(leaf.shape, leaf.dtype, mesh_spec(leaf, mesh, rules), mesh)


def _mirror(opt_state: Any, params: Any, param_leaves: list[StateLeaf]) -> list[StateLeaf]:
    """Optimizer-state leaves, with the logical names of the parameter each one mirrors
    (same trailing key path and shape: Adam's moments), else none (replicated)."""
    by_path = {}
    for (path, _), leaf in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], param_leaves, strict=True
    ):
        by_path[_keys(path)] = leaf
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        keys, hit = _keys(path), None
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and hit.shape == tuple(x.shape):
                break
            hit = None
        logical = hit.logical if hit is not None else None
        out.append(StateLeaf(tuple(x.shape), np.dtype(x.dtype), logical, shared=hit is None))
    return out


def _keys(path: Any) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


class _Profiler:
    """Compiles (and in measured mode runs) one unit's programs on one mesh."""

    def __init__(
        self, mesh, rules, data_axes, rows, optimizer, loss_fn, mode, device, repeats, between
    ):
        self.mesh, self.rules, self.data_axes = mesh, tuple(rules), data_axes
        self.rows, self.optimizer, self.loss_fn = rows, optimizer, loss_fn
        self.mode, self.device, self.repeats = mode, device, repeats
        self.between_rounds: Callable[[], Any] | None = between
        self.compiles = 0
        self.shape = dict(mesh.shape)
        self.updates: dict[int, tuple[list[StateLeaf], PhaseCost]] = {}
        self.accumulates: dict[int, PhaseCost] = {}  # by unit: the sum's cost in its backward
        self.pending: list[tuple[PhaseCost, Any, Sequence[Any]]] = []  # measured: to time
        self.seconds: dict[int, float] = {}  # measured: by id of the PhaseCost, once timed
        # measured: (cost, minuend, subtrahend) whose seconds are a difference of two timed
        self.differences: list[tuple[PhaseCost, PhaseCost, PhaseCost]] = []

    # -- building blocks -------------------------------------------------------------------

    def _input_sharding(self, x: jax.ShapeDtypeStruct) -> NamedSharding:
        data = math.prod(self.shape[a] for a in self.data_axes)
        batched = x.ndim and x.shape[0] == self.rows and x.shape[0] % data == 0
        spec = P(self.data_axes or None) if batched and self.data_axes else P()
        return NamedSharding(self.mesh, spec)

    def _compile(self, fun: Callable, *args: Any) -> tuple[Any, Any]:
        """(traced jaxpr, compiled) of ``fun`` on ``args`` (``ShapeDtypeStruct``s with
        shardings), under the rules and the mesh."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            traced = jax.jit(fun).trace(*args)
            compiled = traced.lower().compile()
        self.compiles += 1
        return traced.jaxpr, compiled

    def _phase(self, compiled: Any, inputs: Sequence[Any] | None) -> PhaseCost:
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis or {}
        flops = float(analysis.get("flops", 0.0))
        accessed = float(analysis.get("bytes accessed", 0.0))
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
        if inputs is None:
            seconds = self.device.seconds(flops, accessed)
            return PhaseCost(seconds, flops, accessed, temp, Source.ANALYTIC)
        self._warm(compiled, inputs)  # measured mode: timed later, with all the others
        cost = PhaseCost(0.0, flops, accessed, temp, Source.MEASURED)
        self.pending.append((cost, compiled, inputs))
        return cost

    def _warm(self, compiled: Any, inputs: Sequence[Any]) -> None:
        """Warm-up runs: at least ``WARMUP_RUNS`` and ``WARMUP_SECONDS`` (a process's first
        runs of a program pay one-time costs, such as first touches of its buffers' memory,
        that the runtime's repeated steps do not)."""
        start = time.perf_counter()
        for run in range(WARMUP_RUNS_MAX):
            jax.block_until_ready(compiled(*inputs))
            if run + 1 >= WARMUP_RUNS and time.perf_counter() - start >= WARMUP_SECONDS:
                break

    def launch(self) -> PhaseCost:
        """The empty program, queued to be timed with the others: one added to one element
        per device of the mesh (a program's launch and completion on its devices, nothing
        to compute)."""
        count = math.prod(self.shape.values())
        spec = P(tuple(self.shape)) if count > 1 else P()
        x = jax.ShapeDtypeStruct((count,), jnp.float32, sharding=NamedSharding(self.mesh, spec))
        _, compiled = self._compile(lambda x: x + 1, x)
        return self._phase(compiled, (self._concrete(x, 12),))

    def timed(self, costs: Sequence[UnitCost]) -> tuple[UnitCost, ...]:
        """``costs`` with the measured seconds: every program run once per round, for
        ``repeats`` rounds, and its median kept. Round by round, a load that comes and goes
        on a shared host slows every program alike, not the few timed while it lasted.

        A program's time ends when its outputs are ready; freeing them is timed apart
        (``release_seconds``), since the runtime frees a value in the op that reads it
        last, not in the one that makes it. A cost priced as the difference of two programs
        (the gradient sum inside a backward, a further copy of a block in a fused program)
        is the median of that difference over the rounds and `PAIRED_RUNS` more
        back-to-back pairs after each round."""
        programs = {id(c): (compiled, inputs) for c, compiled, inputs in self.pending}
        times: list[list[float]] = [[] for _ in self.pending]
        releases: list[list[float]] = [[] for _ in self.pending]
        differences: list[list[float]] = [[] for _ in self.differences]
        for _ in range(self.repeats):
            for k, (_, compiled, inputs) in enumerate(self.pending):
                times[k].append(_time(compiled, inputs, releases[k]))
            for k, (_, minuend, subtrahend) in enumerate(self.differences):
                differences[k] += _paired(programs[id(minuend)], programs[id(subtrahend)])
            if self.between_rounds is not None:
                self.between_rounds()
                self._settle()
        rounds = {id(c): t for (c, _, _), t in zip(self.pending, times, strict=True)}
        seconds = {key: statistics.median(t) for key, t in rounds.items()}
        released = {
            id(c): statistics.median(t) for (c, _, _), t in zip(self.pending, releases, strict=True)
        }
        for (cost, minuend, subtrahend), more in zip(self.differences, differences, strict=True):
            pairs = zip(rounds[id(minuend)], rounds[id(subtrahend)], strict=True)
            seconds[id(cost)] = max(statistics.median([a - b for a, b in pairs] + more), 0.0)
        self.pending, self.seconds, self.differences = [], seconds, []

        def fill(phase: PhaseCost) -> PhaseCost:
            if id(phase) not in seconds:
                return phase
            release = released.get(id(phase), 0.0)
            return dataclasses.replace(phase, seconds=seconds[id(phase)], release_seconds=release)

        return tuple(
            dataclasses.replace(c, **{f: fill(getattr(c, f)) for f in _PHASE_FIELDS}) for c in costs
        )

    def _settle(self) -> None:
        """Every program run once, untimed, after ``between_rounds``: on this 2-core CPU host
        the first programs of a round right after a pipeline step ran 12-88% slower than
        after a round of their own (the block forward +16%; later ones -8% to +15%;
        gpt-tiny, 24 alternations), so the next round times them as they run among other
        programs, not in that wake."""
        for _, compiled, inputs in self.pending:
            jax.block_until_ready(compiled(*inputs))

    def _concrete(self, abstract: Any, seed: int) -> Any:
        """Random host arrays (normals of scale 0.02; integers 0) put in the shardings of
        ``abstract`` (made with numpy: random programs would cost compiles)."""
        leaves, tree = jax.tree_util.tree_flatten(abstract)
        rng = np.random.default_rng(seed)
        made = [
            (0.02 * rng.standard_normal(x.shape, np.float32)).astype(x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else np.zeros(x.shape, x.dtype)
            for x in leaves
        ]
        placed = jax.device_put(made, [x.sharding for x in leaves])
        return jax.tree_util.tree_unflatten(tree, placed)

    # -- one unit ----------------------------------------------------------------------------

    def profile(
        self, index: int, unit: Unit, policy: str | None, is_last: bool, repeated: bool
    ) -> UnitCost:
        param_leaves = _state_leaves(unit.params)
        params = self._abstract_params(unit.params)
        leaves, tree = jax.tree_util.tree_flatten(unit.args)
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
        diff = [i for i in dynamic if jnp.issubdtype(leaves[i].dtype, jnp.floating)]
        fixed = [i for i in dynamic if i not in diff]
        place = lambda i: jax.ShapeDtypeStruct(  # noqa: E731
            leaves[i].shape, leaves[i].dtype, sharding=self._input_sharding(leaves[i])
        )
        diff_in = [place(i) for i in diff]
        fixed_in = [place(i) for i in fixed]
        loss_fn = self.loss_fn if is_last else None

        def apply(p: Any, d: Sequence[Any], f: Sequence[Any]) -> Any:
            full = list(leaves)
            for i, x in zip(diff + fixed, list(d) + list(f), strict=True):
                full[i] = x
            args, kwargs = jax.tree_util.tree_unflatten(tree, full)
            out = unit.module.apply({"params": p}, *args, **kwargs)
            return loss_fn(out) if loss_fn is not None else out

        if policy is not None:  # as the runtime's trace, which inlines checkpoint's jaxpr: no
            # barrier keeps XLA from sharing a fused F and B's forward with the recompute
            apply = jax.checkpoint(apply, policy=POLICIES[policy], prevent_cse=False)
        vjp_tree: dict[str, Any] = {}

        def forward(p: Any, d: Any, f: Any) -> Any:
            out, vjp = jax.vjp(lambda p, d: apply(p, d, f), p, d)
            res, vjp_tree["tree"] = jax.tree_util.tree_flatten(vjp)
            return out, res

        abstract_in = (params, diff_in, fixed_in)
        flat_in = jax.tree_util.tree_leaves(abstract_in)
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            whole_forward = jax.jit(forward).trace(*abstract_in).jaxpr
        sources = residual_sources(whole_forward, vjp_tree["tree"].num_leaves)
        first: dict[Any, int] = {}
        for j, (kind, var) in enumerate(sources):
            if kind == "made":
                first.setdefault(var, j)
        position = {var: u for u, var in enumerate(first)}
        reads = sorted({i for kind, i in sources if kind == "in"})

        def forward_kept(p: Any, d: Any, f: Any) -> Any:
            """What the runtime's forward fragment returns: the output and the residuals it
            makes, each once (not the inputs it was given, which the backward reads)."""
            out, res = forward(p, d, f)
            return out, [res[j] for j in first.values()]

        jaxpr, fwd = self._compile(forward_kept, *abstract_in)
        out_sh, kept_sh = fwd.output_shardings
        out_abs, kept_abs = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(fwd.output_shardings), jaxpr.out_avals
        )
        n_params = len(jax.tree_util.tree_leaves(params))
        unbatched = [x.shape[:1] != (self.rows,) for x in diff_in + fixed_in]  # weights passed in
        skip = set(range(n_params)) | {n_params + k for k, u in enumerate(unbatched) if u}
        ins_in = [flat_in[i] for i in reads]
        kept_in = [_with(a, s) for a, s in zip(kept_abs, kept_sh, strict=True)]
        owners = [
            (-1, 0) if i in skip else (k, _sharded_bytes(x, x.sharding))
            for k, (i, x) in enumerate(zip(reads, ins_in, strict=True))
        ]
        owners += [(len(reads) + u, _sharded_bytes(x, x.sharding)) for u, x in enumerate(kept_in)]
        activation = sum(n for j, (first, n) in enumerate(owners) if first == j)
        output_bytes = sum(
            _sharded_bytes(a, s)
            for a, s in zip(
                jax.tree_util.tree_leaves(out_abs), jax.tree_util.tree_leaves(out_sh), strict=True
            )
        )
        ct_in = jax.tree_util.tree_map(_with, out_abs, out_sh)
        inputs = None
        if self.mode == "measured":
            p_, d_, f_ = (self._concrete(t, s) for s, t in enumerate(abstract_in))
            inputs = (p_, d_, f_)
        forward_cost = self._phase(fwd, inputs)
        backward_in = fused_in = None
        if inputs is not None:
            out_v, kept_v = fwd(*inputs)
            flat_v = jax.tree_util.tree_leaves(inputs)
            ct_v = jax.tree_util.tree_map(jnp.ones_like, out_v)
            backward_in = ([flat_v[i] for i in reads], list(kept_v), ct_v)
            fused_in = (*inputs, ct_v)

        constants = constant_residuals(whole_forward, sources)

        def backward(ins: Sequence[Any], kept: Sequence[Any], ct: Any) -> Any:
            made_here = constants()
            value = {
                "in": lambda i: ins[reads.index(i)],
                "made": lambda v: kept[position[v]],
                "constant": made_here.__getitem__,
            }
            res = [value[kind](i) if kind in value else i for kind, i in sources]
            return tuple(jax.tree_util.tree_unflatten(vjp_tree["tree"], res)(ct))

        def fused(p: Any, d: Any, f: Any, ct: Any) -> Any:
            """F and the whole backward in one program, as the runtime fuses them: under
            recomputation XLA may then share the forward with the backward's recompute."""
            out, kept = forward_kept(p, d, f)
            flat = jax.tree_util.tree_leaves((p, d, f))
            return out, backward([flat[i] for i in reads], kept, ct)

        grads = bool(diff) or n_params > 0
        fused_cost = self._fused(fused, (*abstract_in, ct_in), grads, fused_in)
        out_tree = jax.tree_util.tree_structure(out_abs)

        def fused_twice(p: Any, p2: Any, d: Any, f: Any, ct: Any) -> Any:
            """Two copies of the unit chained, each with its own parameters, as a fused
            stage runs them: the first's forward, the second's F and whole backward, the
            first's backward from the cotangent of its output."""
            out, kept = forward_kept(p, d, f)
            last, (g2, ct_out) = fused(p2, jax.tree_util.tree_leaves(out), f, ct)
            flat = jax.tree_util.tree_leaves((p, d, f))
            g1 = backward([flat[i] for i in reads], kept, out_tree.unflatten(ct_out))
            return last, g1, g2

        repeat_cost = PhaseCost(source=fused_cost.source)
        if repeated and not is_last and grads and _chains(out_abs, diff_in):
            p2 = self._concrete(params, 13) if fused_in is not None else None
            twice_in = None if fused_in is None else (fused_in[0], p2, *fused_in[1:])
            twice_abs = (params, params, diff_in, fixed_in, ct_in)
            repeat_cost = self._repeat(fused_twice, twice_abs, fused_cost, twice_in)

        ct_bytes = [_sharded_bytes(x, x.sharding) for x in jax.tree_util.tree_leaves(ct_in)]
        whole, b_cost, w_cost, weight_kept = self._backward(
            backward,
            (ins_in, kept_in, ct_in),
            (n_params, bool(diff)),
            [*owners, *((-1, n) for n in ct_bytes)],
            backward_in,
            forward_cost.source,
        )
        if n_params and index not in self.accumulates:  # the same for every policy
            backward_abs = (ins_in, kept_in, ct_in)
            self.accumulates[index] = self._accumulate(
                backward, backward_abs, params, whole, backward_in
            )
        accumulate = self.accumulates.get(index, PhaseCost(source=forward_cost.source))
        if index not in self.updates:  # the same for every recomputation policy
            self.updates[index] = self._update(params, param_leaves)
        opt_state, update = self.updates[index]
        return UnitCost(
            unit=index,
            recompute=policy,
            forward=forward_cost,
            backward_input=b_cost,
            backward_weight=w_cost,
            update=update,
            activation_bytes=activation,
            output_bytes=output_bytes,
            params=tuple(param_leaves),
            opt_state=tuple(opt_state),
            backward=whole,
            accumulate=accumulate,
            weight_kept_bytes=weight_kept,
            fused_temp_bytes=fused_cost.temp_bytes,
            fused=fused_cost,
            fused_repeat=repeat_cost,
        )

    def _fused(
        self, fused: Callable, abstract_in: tuple, grads: bool, inputs: tuple | None
    ) -> PhaseCost:
        """The cost of ``fused``, the unit's forward and whole backward as one program,
        ``(params, inputs, fixed inputs, output cotangent) -> (output, gradients)``: the
        cotangent an input (a constant one would let XLA turn the matmuls it feeds into
        sums), the output returned (the next unit reads it). Timed with the others in
        measured mode (``inputs``)."""
        if not grads:
            return PhaseCost(source=Source.ANALYTIC if inputs is None else Source.MEASURED)
        _, compiled = self._compile(fused, *abstract_in)
        return self._phase(compiled, inputs)

    def _repeat(
        self, twice: Callable, abstract_in: tuple, once: PhaseCost, inputs: tuple | None
    ) -> PhaseCost:
        """What a second copy of the unit adds inside a fused program: ``twice`` (two
        chained copies, fused) against ``once`` (one), as `_accumulate` prices the sum."""
        _, compiled = self._compile(twice, *abstract_in)
        return self._difference(self._phase(compiled, inputs), once)

    def _difference(self, more: PhaseCost, less: PhaseCost) -> PhaseCost:
        """What program ``more`` costs beyond program ``less`` (analytic: the difference of
        their costs; measured: of their times, `timed` pairing them)."""
        cost = PhaseCost(
            max(more.seconds - less.seconds, 0.0),
            more.flops - less.flops,
            more.bytes_accessed - less.bytes_accessed,
            0,
            more.source,
        )
        if more.source is Source.MEASURED:  # its seconds come with the timing rounds
            self.differences.append((cost, more, less))
        return cost

    def _backward(
        self,
        run: Callable,
        abstract: tuple[Any, Any],
        grads: tuple[int, bool],
        owners: Sequence[tuple[int, int]],
        concrete: tuple[Any, Any] | None,
        source: Source,
    ) -> tuple[PhaseCost, PhaseCost, PhaseCost, int]:
        """The whole backward, its B and W halves (`split_backward`) and the bytes kept from
        B to W, from the backward's abstract and (measured mode) ``concrete`` inputs,
        ``(residuals, output cotangent)``. ``grads``: (weight gradients, whether there are
        input gradients);
        ``owners``: per flat backward input, (the first input holding the same value, or -1
        where it is not an activation the unit keeps; its bytes per device)."""
        weights, has_inputs = grads
        none = PhaseCost(source=source)
        if not weights and not has_inputs:
            return none, none, none, 0
        jaxpr, compiled = self._compile(run, *abstract)
        whole = self._phase(compiled, concrete)
        flat_inputs = None if concrete is None else jax.tree_util.tree_leaves(concrete)
        if not (weights and has_inputs):  # one half only: it is the whole backward
            return (whole, none, whole, 0) if weights else (whole, whole, none, 0)
        halves = split_backward(jaxpr, weights)
        flat_abs = jax.tree_util.tree_leaves(abstract)
        _, b_program = self._compile(jex_core.jaxpr_as_fun(halves.b), *flat_abs)
        b_cost = self._phase(b_program, flat_inputs)
        first_extra = len(halves.b.jaxpr.outvars) - _count(halves, "b")
        extra_abs = [
            _with(v.aval, s)
            for v, s in zip(
                halves.b.jaxpr.outvars[first_extra:],
                list(b_program.output_shardings)[first_extra:],
                strict=True,
            )
        ]
        pick = lambda kind, i, ins, extra: ins[i] if kind == "in" else extra[i]  # noqa: E731
        w_abs = [pick(k, i, flat_abs, extra_abs) for k, i in halves.crossing]
        _, w_program = self._compile(jex_core.jaxpr_as_fun(halves.w), *w_abs)
        w_inputs = None
        if flat_inputs is not None:
            extra_v = list(b_program(*flat_inputs))[first_extra:]
            w_inputs = [pick(k, i, flat_inputs, extra_v) for k, i in halves.crossing]
        w_cost = self._phase(w_program, w_inputs)
        firsts = {owners[i][0] for k, i in halves.crossing if k == "in" and owners[i][0] >= 0}
        cts = sum(owners[i][1] for k, i in halves.crossing if k == "in" and owners[i][0] < 0)
        kept = sum(owners[j][1] for j in firsts) + cts
        kept += sum(_sharded_bytes(x, x.sharding) for x in extra_abs)
        return whole, b_cost, w_cost, kept

    def _abstract_params(self, boxed: Any) -> Any:
        def one(x: Any) -> Any:
            leaf = _state_leaves(x)[0]
            spec = mesh_spec(leaf, self.shape, self.rules)
            return jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=NamedSharding(self.mesh, spec)
            )

        return jax.tree_util.tree_map(one, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))

    def _update(self, params: Any, param_leaves: list[StateLeaf]) -> tuple[list, PhaseCost]:
        """(optimizer-state leaves, the update)."""
        none = PhaseCost(source=Source.ANALYTIC if self.mode == "analytic" else Source.MEASURED)
        if not param_leaves or self.optimizer is None:
            return [], none
        opt = self.optimizer
        state_abs = jax.eval_shape(opt.init, params)
        state_leaves = _mirror(state_abs, params, param_leaves)
        flat, tree = jax.tree_util.tree_flatten(state_abs)
        state_in = jax.tree_util.tree_unflatten(
            tree,
            [
                jax.ShapeDtypeStruct(
                    x.shape,
                    x.dtype,
                    sharding=NamedSharding(self.mesh, mesh_spec(s, self.shape, self.rules)),
                )
                for x, s in zip(flat, state_leaves, strict=True)
            ],
        )

        def step(p: Any, g: Any, s: Any) -> Any:
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s

        compiled = self._compile(step, params, params, state_in)[1]
        inputs = None
        if self.mode == "measured":
            inputs = (
                self._concrete(params, 7),
                self._concrete(params, 8),
                self._concrete(state_in, 9),
            )
        return state_leaves, self._phase(compiled, inputs)

    def _accumulate(
        self, run: Callable, abstract: tuple, params: Any, whole: PhaseCost, concrete: Any
    ) -> PhaseCost:
        """What adding the weight gradients into a running sum adds to the whole backward
        ``run`` (``whole``: its cost): the backward compiled with the sum added in, against
        it (analytic: the difference of the two costs; measured: of their times, per round)."""

        def summed(ins: Any, kept: Any, ct: Any, total: Any) -> Any:
            grads = run(ins, kept, ct)
            return (jax.tree_util.tree_map(jnp.add, total, grads[0]), *grads[1:])

        _, compiled = self._compile(summed, *abstract, params)
        inputs = None if concrete is None else (*concrete, self._concrete(params, 10))
        return self._difference(self._phase(compiled, inputs), whole)


def _chains(out: Any, diff_in: Sequence[Any]) -> bool:
    """Whether a unit's output (abstract) can be its own floating-point input: the same
    shapes and dtypes, one for one (a block; not a stem or a head)."""
    leaves = jax.tree_util.tree_leaves(out)
    same = lambda a, b: a.shape == b.shape and a.dtype == b.dtype  # noqa: E731
    return len(leaves) == len(diff_in) > 0 and all(map(same, leaves, diff_in))


def _time(compiled: Any, inputs: Sequence[Any], releases: list[float] | None = None) -> float:
    """Seconds until ``compiled(*inputs)``'s outputs are ready; the time to free them after
    that is appended to ``releases``."""
    start = time.perf_counter()
    outputs = jax.block_until_ready(compiled(*inputs))
    ready = time.perf_counter()
    del outputs
    if releases is not None:
        releases.append(time.perf_counter() - ready)
    return ready - start


def _paired(minuend: tuple, subtrahend: tuple) -> list[float]:
    """`PAIRED_RUNS` differences of two programs' times (each ``(compiled, inputs)``), run
    back to back: a gradient sum adds 0.08 ms to a 2.5 ms gpt-tiny block backward, and
    single differences spread from -0.12 to +0.28 ms (quartiles of 300), so the 9 of one
    profile's rounds alone gave 0.05 to 0.56 ms between profiles."""
    return [_time(*minuend) - _time(*subtrahend) for _ in range(PAIRED_RUNS)]


def residual_sources(closed: Any, num_residuals: int) -> list[tuple[str, Any]]:
    """Where each of a forward's last ``num_residuals`` outputs comes from, as the runtime's
    forward fragment sees it: ``("in", i)``, the forward's input ``i`` (a parameter or an
    input the backward reads directly, never an output of the fragment); ``("made", v)``,
    a value the forward computes (``v`` names it: residuals holding the same value share
    it, and the fragment returns it once); ``("constant", v)``, a value that only the
    backward reads and that is computed from no input, which the runtime computes in that
    backward instead of keeping it (``jnp.where``'s zero tangent, a broadcast ``0.0`` as
    large as the attention logits, is one); ``("literal", value)``, a literal."""
    jaxpr = closed.jaxpr
    inputs = {v: i for i, v in enumerate(jaxpr.invars)}
    out = []
    for var in jaxpr.outvars[len(jaxpr.outvars) - num_residuals :]:
        if isinstance(var, jex_core.Literal):
            out.append(("literal", var.val))
        elif var in inputs:
            out.append(("in", inputs[var]))
        elif not _read_in_forward(jaxpr, var) and _reads_no_input(jaxpr, var):
            out.append(("constant", var))
        else:
            out.append(("made", var))
    return out


def _read_in_forward(jaxpr: Any, var: Any) -> bool:
    """Whether an equation of ``jaxpr`` reads its value ``var``, also inside the call (a
    nested ``jit``) that made it: the runtime inlines calls, so a value a call both uses
    and returns is made in the forward."""
    for eqn in jaxpr.eqns:
        if any(v is var for v in eqn.invars):
            return True
    for eqn in jaxpr.eqns:
        for k, out in enumerate(eqn.outvars):
            if out is var:
                inner = next(jex_core.jaxprs_in_params(eqn.params), None)
                if inner is None:
                    return False
                inner_var = inner.outvars[k]
                if isinstance(inner_var, jex_core.Literal) or inner_var in inner.invars:
                    return True  # passed through: made outside the call
                return _read_in_forward(inner, inner_var)
    return False


def _reads_no_input(jaxpr: Any, var: Any) -> bool:
    """Whether ``jaxpr``'s output ``var`` is computed from none of its inputs."""
    _, used_inputs = pe.dce_jaxpr(jaxpr, [v is var for v in jaxpr.outvars])
    return not any(used_inputs)


def constant_residuals(closed: Any, sources: Sequence[tuple[str, Any]]) -> Callable[[], dict]:
    """A function that computes the ``("constant", v)`` residuals of ``sources`` afresh (in
    the backward that reads them), as ``{v: value}``."""
    wanted = {id(v) for kind, v in sources if kind == "constant"}
    jaxpr = closed.jaxpr
    used = [id(v) in wanted for v in jaxpr.outvars]
    outputs = [v for v, u in zip(jaxpr.outvars, used, strict=True) if u]
    sliced = jex_core.jaxpr_as_fun(
        jex_core.ClosedJaxpr(pe.dce_jaxpr(jaxpr, used)[0], closed.consts)
    )

    def compute() -> dict:
        if not outputs:
            return {}
        values = sliced()
        return dict(zip(outputs, values, strict=True))

    return compute


def _count(halves: SplitBackward, kind: str) -> int:
    return sum(k == kind for k, _ in halves.crossing)


def _with(aval: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)


def _sharded_bytes(aval: Any, sharding: Any) -> int:
    shape = sharding.shard_shape(aval.shape)
    itemsize = 8 if jnp.issubdtype(aval.dtype, jax.dtypes.prng_key) else aval.dtype.itemsize
    return int(math.prod(shape)) * int(itemsize)


def _policies(recompute: Any) -> tuple[str | None, ...]:
    values = (recompute,) if recompute is None or isinstance(recompute, str) else tuple(recompute)
    bad = [r for r in values if r is not None and r not in POLICIES]
    if bad or not values:
        raise errors.RecomputePolicyError(
            f"Expected `recompute` as policies among None, 'full' and 'dots' (one, or a "
            f"sequence of them), got {recompute!r}. Pass e.g. `recompute=(None, 'full')`."
        )
    return tuple(dict.fromkeys(values))


def _rows(inputs: Sequence[Any]) -> int:
    for x in jax.tree_util.tree_leaves(inputs):
        if np.ndim(x):
            return int(np.shape(x)[0])
    raise errors.ProfileArgumentError(
        f"Expected example inputs of one microbatch with a leading batch dimension, got "
        f"{[getattr(x, 'shape', x) for x in inputs]!r}. Pass e.g. `jnp.zeros((8, 64), int)`."
    )


def profile_units(
    model: nn.Module,
    *inputs: Any,
    mesh_shape: Mapping[str, int] | None = None,
    rules: Sequence[tuple[str, Any]] = (),
    patterns: Sequence[Any] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    loss_fn: Callable[[Any], jax.Array] | None = None,
    recompute: str | None | Sequence[str | None] = None,
    mode: str = "analytic",
    device: DeviceSpec | str = "cpu",
    repeats: int = 5,
    between_rounds: Callable[[], Any] | None = None,
) -> UnitProfile:
    """Costs every distinct unit of ``model`` on a submesh of shape ``mesh_shape``.

    Identical units (the same module class and fields on the same shapes: the blocks of a
    transformer) are compiled once. See the module docstring for the programs and what is
    analysed, measured and derived.

    Args:
        model: A Flax Linen module (unbound), e.g. ``models.GPT(config)``, unstaged (no
            ``stages``/``layers_per_stage``, no ``Task[Module]``s): each unit is compiled
            with plain ``jax.jit`` under ``flax.linen.logical_axis_rules(rules)`` on the
            profiled mesh, outside every task (``mm.with_sharding_constraint`` inside a unit
            is then the identity; Flax's logical constraints apply).
        *inputs: Example inputs of one microbatch (arrays or ``ShapeDtypeStruct``s); their
            leading dimension is the microbatch's rows.
        mesh_shape: ``{axis: size}`` of the submesh to profile on, at most the local
            devices (default: size 1 along every axis the rules name).
        rules: ``(logical_name, mesh_axis)`` pairs; parameters shard by their logical names
            through them, inputs over the axes ``"batch"`` maps to.
        patterns: The units: ``register_task``-style regexes over module paths, or ``(role,
            pattern)`` pairs (roles ``"stem"``, ``"layer"``, ``"head"``). ``None``: the
            reference models' stem, blocks and head.
        optimizer: The optax optimizer whose update is costed (``None``: no update, no
            optimizer state).
        loss_fn: ``loss_fn(output) -> scalar`` appended to the last unit (e.g. the
            cross-entropy against fixed targets); ``None``: the backward starts from a
            cotangent of the output's shape.
        recompute: A policy (``None``, ``"full"``, ``"dots"``) or several to cost.
        mode: ``"analytic"`` (compile only) or ``"measured"`` (also run, median time).
        device: A `DeviceSpec` or a name in `DEVICE_SPECS`: the roofline of analytic times
            and the default link of `predict`'s transfers.
        repeats: Timed runs per program in measured mode.
        between_rounds: Measured mode: called after each timing round (every program run
            once), e.g. to run the work the profile will be compared with, so that a host
            whose speed drifts weighs on both alike (benchmark B9 records its pipeline's
            steps so). Each call is followed by one untimed run of every program, so that
            the next round does not time the wake of what it ran.

    Returns:
        A `UnitProfile`.

    Raises:
        ProfileArgumentError: an unknown ``mode`` or ``device``, a bad ``mesh_shape`` or one
            larger than the local devices, inputs without a batch dimension.
        UnitPatternError: see `find_units`.
        RecomputePolicyError: an unknown policy.

    Example:
        >>> import optax
        >>> from models import GPT, get_config
        >>> from models.pipeline import LOGICAL_RULES
        >>> import multimesh_flax as mm
        >>> profile = mm.profile_units(
        ...     GPT(get_config("gpt-tiny", num_layers=4)), jnp.zeros((4, 32), jnp.int32),
        ...     mesh_shape={"data": 1, "model": 1}, rules=LOGICAL_RULES,
        ...     optimizer=optax.sgd(1e-3))
        >>> [u.kind for u in profile.units.units], profile.compiles  # 5 + 8 + 7
        (['GPTEmbed', 'GPTBlock', 'GPTHead'], 20)
        >>> block = profile.cost(1)
        >>> block.forward.flops > 0, str(block.forward.source)
        (True, 'analytic')
    """
    if mode not in MODES:
        raise errors.ProfileArgumentError(
            f"Expected `mode` in {MODES}, got {mode!r}. 'analytic' compiles only; "
            "'measured' also runs each program."
        )
    if between_rounds is not None and not callable(between_rounds):
        raise errors.ProfileArgumentError(
            f"Expected `between_rounds` to be a callable taking no arguments (or None), got "
            f"{type(between_rounds).__name__}."
        )
    spec = _device_spec(device)
    policies = _policies(recompute)
    rules = tuple((str(name), axes) for name, axes in rules)
    shape = _mesh_shape(mesh_shape, rules)
    rows = _rows(inputs)
    mesh = _make_mesh(shape)
    found = find_units(model, *inputs, patterns=patterns)
    data_axes = _data_axes(rules, shape)
    profiler = _Profiler(
        mesh, rules, data_axes, rows, optimizer, loss_fn, mode, spec, repeats, between_rounds
    )
    last = found.instances[-1].unit
    repeats_of = collections.Counter(i.unit for i in found.instances)
    launch = profiler.launch() if mode == "measured" else None
    costs = profiler.timed(
        [
            profiler.profile(i, unit, policy, i == last, repeats_of[i] > 1)
            for i, unit in enumerate(found.units)
            for policy in policies
        ]
    )
    log.info("profiled %d units, %d compiles", len(found.units), profiler.compiles)
    return UnitProfile(
        units=found,
        costs=costs,
        mesh_shape=tuple(shape.items()),
        rules=rules,
        data_axes=data_axes,
        rows=rows,
        mode=Source(mode),
        device=spec,
        compiles=profiler.compiles,
        launch_seconds=profiler.seconds.get(id(launch), 0.0),
    )


def _device_spec(device: DeviceSpec | str) -> DeviceSpec:
    if isinstance(device, DeviceSpec):
        return device
    if device in DEVICE_SPECS:
        return DEVICE_SPECS[device]
    raise errors.ProfileArgumentError(
        f"Expected `device` as a DeviceSpec or one of {sorted(DEVICE_SPECS)}, got "
        f"{device!r}. Build `DeviceSpec(name, flops_per_second, bytes_per_second, "
        "link_bytes_per_second)` for another device."
    )
