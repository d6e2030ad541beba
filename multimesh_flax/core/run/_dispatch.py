"""The MPMD runtime: a flat op list over the compiled fragments (``_compile``), dispatched in order.

An ``MpmdExecutable`` turns a ``Partition`` into an immutable tuple of ops (``_ops``) over
numbered value slots:

* ``RunOp`` -- call a fragment's executable on its input slots, fill its output slots;
* ``PutOp`` -- move a group of values to another submesh (``_ops.Move``: one C++ copy).

Slots whose last reader has been dispatched are cleared right away, so XLA frees their
buffers as soon as the computations using them finish. Calling the executable dispatches
every op in order and returns without waiting: each device runs its queue in dispatch order,
so the op order *is* the pipeline schedule. What the first call learns (executables,
transfer targets) goes into the executable's ``DispatchState``. In a multi-process job
``multimesh_flax.distributed`` dispatches the same ops through the ``OpProgram`` methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.extend.core as jex
from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax.core.declare import STATE, Phase
from multimesh_flax.core.fragment import (
    Fragment,
    Partition,
    canonical_sharding,
    first_constraint,
    input_sharding,
    nbytes,
)
from multimesh_flax.core.plan import SPLIT_NAMES
from multimesh_flax.core.run import _debug_nans
from multimesh_flax.core.run._compile import compile_fragment
from multimesh_flax.core.run._ops import (
    DispatchState,
    Op,
    OpKind,
    OpUnit,
    ProcessHandOff,
    PutOp,
    RunOp,
)

_SHARDING = operator.attrgetter("sharding")
_PHASE_NAMES = {Phase.F: "fwd", Phase.B: "bwd"}  # in fragment names: ``block.fwd[0]#3``
_PHASE_WORDS = {Phase.F: "forward", Phase.B: "backward", Phase.W: "backward, weight gradients"}


# --- timelines ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimelineEvent:
    """One executed op: where it ran, what it was, and when (seconds, ``perf_counter``).

    ``stage``, ``microbatch`` and ``phase`` (``"F"``, ``"B"`` or ``"W"``) say which pipeline
    unit a ``"run"`` executed (``None`` for glue and transfers; ``microbatch`` is also set for
    glue of one microbatch). ``units`` lists ``(stage, microbatch, phase)`` of every unit the
    op ran, in order: one for a unit's fragment, more when ``fused`` (adjacent fragments on
    one submesh fused into one op, such as the last stage's forward and backward of a
    microbatch; ``stage``/``microbatch``/``phase`` are then its first unit's, and the
    duration covers all its parts). ``index`` is the op's position in its program, ``deps``
    the positions of the ops whose outputs it reads, and ``call`` counts the program calls
    recorded into the same timeline.
    """

    place: tuple[int, ...]
    kind: str  # "run" or "transfer"
    name: str
    start: float
    end: float
    stage: int | None = None
    microbatch: int | None = None
    phase: str | None = None
    index: int = -1
    deps: tuple[int, ...] = ()
    call: int = 0
    units: tuple[tuple[int, int, str], ...] = ()
    fused: bool = False


@dataclasses.dataclass
class Timeline:
    """The events recorded inside :func:`record_timeline`."""

    events: list[TimelineEvent] = dataclasses.field(default_factory=list)
    calls: int = 0  # how many program calls were recorded


@contextlib.contextmanager
def record_timeline() -> Iterator[Timeline]:
    """Records every op that MPMD programs execute inside the block.

    Recording waits for each op to finish before dispatching the next, so the recorded
    times are real execution times (and the program runs without overlap between submeshes).

    Example:
        >>> import multimesh_flax as mm
        >>> f = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[0]))
        >>> g = mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[1]))
        >>> step = mm.jit(lambda x: g(f(x)))
        >>> with mm.record_timeline() as timeline:
        ...     _ = step(jnp.ones(4))
        >>> [e.kind for e in timeline.events]
        ['run', 'transfer', 'run']
    """
    previous = STATE.timeline
    timeline = Timeline()
    STATE.timeline = timeline
    try:
        yield timeline
    finally:
        STATE.timeline = previous


def _event(op: Op, index: int, call: int, start: float) -> TimelineEvent:
    end = time.perf_counter()
    if isinstance(op, PutOp):
        return TimelineEvent(
            op.place, "transfer", op.name, start, end, index=index, deps=op.deps, call=call
        )
    stage, microbatch, phase = op.unit
    return TimelineEvent(
        op.place,
        "run",
        op.name,
        start,
        end,
        stage=stage,
        microbatch=microbatch,
        phase=phase,
        index=index,
        deps=op.deps,
        call=call,
        units=cast("tuple[tuple[int, int, str], ...]", op.units),  # units only: no None
        fused=op.fused,
    )


def _reader(slots: tuple[int, ...]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """``env -> tuple(env[s] for s in slots)``, in one C-level call where there are several."""
    if len(slots) > 1:
        return operator.itemgetter(*slots)
    if slots:
        slot = slots[0]
        return lambda env: (env[slot],)
    return lambda _: ()


# --- the executable -------------------------------------------------------------------------


def _without(frag: Fragment, dropped: set[Any]) -> Fragment | None:
    """``frag`` no longer returning the ``dropped`` values, and without the equations and
    inputs only they needed (``None`` if nothing is left to compute)."""
    if not dropped.intersection(frag.outvars):
        return frag
    outvars = [v for v in frag.outvars if v not in dropped]
    needed = set(outvars)
    kept = []
    for eqn in reversed(frag.eqns):
        if eqn.effects or needed.intersection(eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jex.Literal))
    if not kept:
        return None
    invars = [v for v in frag.invars if v in needed]
    return dataclasses.replace(frag, eqns=kept[::-1], invars=invars, outvars=outvars)


def fits_input(have: Any, want: Any, value: Any) -> bool:
    """Whether ``value`` (an array or ``jax.ShapeDtypeStruct``), in sharding ``have`` (``None``:
    not an array, a Python scalar), runs as it is for an input wanted in ``want``: the same
    or an equivalent sharding (else the call moves it): ``_place_inputs`` for an argument
    whose sharding it has not seen fit, and the walk that compiles ahead (``_ahead``)."""
    return have is not None and (have == want or have.is_equivalent_to(want, len(value.shape)))


def compile_program(
    part: Partition, donate: Sequence[int] = (), processes: ProcessHandOff | None = None
) -> MpmdExecutable:
    """The *compile* pass: one cached program per distinct fragment of ``part``
    (``_compile.compile_fragment``: a ``jax.jit``, shared by identical fragments) and the op
    list over them, ready to dispatch.

    XLA compiles each program at its first dispatch (``_ops``), when the shardings of its
    arguments are known, or relocates an executable compiled for an equally shaped submesh;
    ``describe()`` and ``compile_count()`` report the programs and executables.
    ``donate``: positions of the program inputs whose buffers it may consume. ``processes``:
    in a multi-process job, how each process places constants and dispatches its own ops
    (``multimesh_flax.distributed``'s hand-off); ``None`` runs every op in this process.
    """
    return MpmdExecutable(part, donate, processes)


class MpmdExecutable:
    """A placed, fragmented program, ready to dispatch.

    ``ops`` is its immutable op list (``_ops``), ``state`` what its calls learn; together with
    ``make_env``, ``slot_homes``, ``constant_slots`` and ``floating_point_error`` they are the
    ``OpProgram`` a dispatcher reads (this class's ``__call__``, or ``ProcessDispatch``).
    """

    def __init__(
        self,
        part: Partition,
        donate: Sequence[int] = (),
        processes: ProcessHandOff | None = None,
    ) -> None:
        self.partition = part
        self._slots: dict[tuple[Any, Any], int] = {}
        self._consts: dict[int, Any] = {}
        self._alias: dict[Any, Any] = {}  # see _input_aliases
        jaxpr = part.traced.jaxpr
        self.input_slots = [self._slot(v, part.home.get(v)) for v in jaxpr.invars]
        self.input_shardings = [self._input_sharding(v) for v in jaxpr.invars]
        self._alias = self._input_aliases()
        self.fragments = [
            f for f in (_without(f, set(self._alias)) for f in part.fragments) if f is not None
        ]
        place = jax.device_put if processes is None else processes.place
        for v, value in zip(jaxpr.constvars, part.traced.consts, strict=True):
            if v in part.input_place:
                self._consts[self._slot(v, part.home[v])] = place(value, self._input_sharding(v))
        for frag in self.fragments:  # the passes' own constants: replicated on their place
            replicated = NamedSharding(part.place_meshes[frag.place], PartitionSpec())
            for v, value in frag.consts:
                self._consts[self._slot(v, frag.place)] = place(value, replicated)
        ops = self._build_ops(set(donate))
        self.output_slots = [self._output_slot(v) for v in jaxpr.outvars]
        self.ops: tuple[Op, ...] = self._with_frees(ops)
        self.state = DispatchState(self.ops, len(self.input_shardings))
        # Inputs take the first slots, in order (``_slot`` numbers them first): a call
        # stores its arguments with one slice assignment; outputs are read in one C call.
        self._inputs_first = self.input_slots == list(range(len(self.input_slots)))
        self._read_outputs = _reader(tuple(self.output_slots))
        # Per op what the dispatch loop reads: (index, a RunOp?, its inputs' reader, outs, frees).
        self._steps = tuple(
            (i, isinstance(op, RunOp), _reader(op.ins), op.outs, op.frees)
            for i, op in enumerate(self.ops)
        )
        # In a multi-process job each process dispatches only its own ops (see
        # multimesh_flax.distributed._dispatch); None: this process runs every op.
        self.processes = None if processes is None else processes.dispatcher(self)

    # --- planning ---

    def _slot(self, var: Any, place: Any) -> int:
        var = self._alias.get(var, var)
        return self._slots.setdefault((var, place), len(self._slots))

    def _input_aliases(self) -> dict[Any, Any]:
        """``{y: x}`` for each ``y = sharding_constraint(x)`` that only restates the sharding
        of program input ``x``.

        ``input_sharding`` gives an input the sharding of its first constraint, so on the
        arrays the program receives that constraint is the identity: consumers can read
        ``x`` itself, and the fragment need not take and return it (a training step's
        state constraints would otherwise pass every parameter through one fragment,
        paying JAX's per-argument dispatch cost twice per step).
        """
        part = self.partition
        jaxpr = part.traced.jaxpr
        outputs = {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
        aliases: dict[Any, Any] = {}
        for var, want in zip(jaxpr.invars, self.input_shardings, strict=True):
            place = part.input_place.get(var)
            if want is None or place is None:
                continue
            first = part.first_reader(var, place)
            eqn = next(e for e in first.eqns if var in e.invars)
            if eqn.primitive.name != "sharding_constraint" or eqn.outvars[0] in outputs:
                continue
            if canonical_sharding(eqn.params["sharding"]) == want:
                aliases[eqn.outvars[0]] = var
        return aliases

    def _input_sharding(self, var: Any) -> Any:
        return input_sharding(self.partition, var)

    def _fragment_mesh(self, frag: Fragment) -> Any:
        if frag.label is not None:
            return self.partition.traced.tasks[frag.label.task].mesh
        return self.partition.place_meshes[frag.place]

    def _fragment_name(self, frag: Fragment) -> str:
        if frag.parts:  # fused: ``stage.fwd[0]#9+head.bwd[0]#10``
            return "+".join(self._fragment_name(part) for part in frag.parts)
        mb = "" if frag.microbatch is None else f"[{frag.microbatch}]"
        if frag.label is None:
            return f"glue{mb}#{frag.index}"
        resolved = self.partition.traced.tasks[frag.label.task]
        phase = _PHASE_NAMES[frag.label.phase]
        unit = frag.unit
        if unit is not None and unit.phase is not Phase.F and self._split(unit.region):
            names = resolved.task.split_backprop or SPLIT_NAMES
            phase = names[unit.phase is Phase.W]
        return f"{resolved.name}.{phase}{mb}#{frag.index}"

    def _split(self, region: int) -> bool:
        plan = self.partition.plan
        schedule = plan.regions[region].schedule if plan is not None else None
        return schedule is not None and schedule.split_backward

    @property
    def schedule(self) -> Any:
        """The pipeline ``Schedule`` this program dispatches in (``None``: program order)."""
        plan = self.partition.plan
        return plan.schedule if plan is not None else None

    def _build_ops(self, donate: set[int]) -> list[Op]:
        part = self.partition
        reads: dict[int, int] = {}  # home slot -> fragments reading it (directly or via a put)
        for frag in self.fragments:
            for v in frag.invars:
                home = self._slot(v, part.home[v])
                reads[home] = reads.get(home, 0) + 1
        # A donated input is only given to its one reader: donating to the first of several
        # would delete it before the others run.
        donated_slots = {self.input_slots[i] for i in donate}
        donated_slots = {s for s in donated_slots if reads.get(s, 0) == 1}
        transfers: dict[int, dict[Any, list[tuple[Any, Any]]]] = {}
        producer = {v: f.index for f in self.fragments for v in f.outvars}
        params_keys: dict[int, Any] = {}  # shared by the fragments' structural keys
        runs: list[RunOp] = []
        for frag in self.fragments:
            consumed = set(frag.donate)  # intermediates only this fragment reads (``_sums``)
            for v in frag.invars:
                if part.home[v] != frag.place:
                    hint = first_constraint(frag.eqns, v) or self._fragment_mesh(frag)
                    source = self._alias.get(v, v)
                    group = transfers.setdefault(producer.get(source, -1), {})
                    entries = group.setdefault(frag.place, [])
                    if all(source is not e[0] for e in entries):
                        entries.append((source, hint))
            ins = tuple(self._slot(v, frag.place) for v in frag.invars)
            don = tuple(
                i
                for i, (v, s) in enumerate(zip(frag.invars, ins, strict=True))
                if s in donated_slots or (v in consumed and reads.get(s) == 1)
            )
            program = compile_fragment(frag, part.place_meshes[frag.place], don, params_keys)
            outs = tuple(self._slot(v, frag.place) for v in frag.outvars)
            units = tuple(
                OpUnit(p.unit.stage, p.unit.microbatch, p.unit.phase.value)
                for p in frag.parts or (frag,)
                if p.unit is not None
            )
            unit = units[0] if units else OpUnit(None, frag.microbatch, None)
            name = self._fragment_name(frag)
            runs.append(
                RunOp(
                    ins,
                    outs,
                    frag.place,
                    name,
                    program,
                    unit=unit,
                    units=units,
                    fused=bool(frag.parts),
                )
            )
        ops: list[Op] = list(self._puts(transfers.get(-1, {})))
        for frag, run in zip(self.fragments, runs, strict=True):
            ops.append(run)
            ops.extend(self._puts(transfers.get(frag.index, {})))
        return ops

    def _puts(self, groups: dict[Any, list[tuple[Any, Any]]]) -> list[PutOp]:
        ops = []
        for place, entries in groups.items():
            ins = tuple(self._slot(v, self.partition.home[v]) for v, _ in entries)
            outs = tuple(self._slot(v, place) for v, _ in entries)
            hints = tuple(h for _, h in entries)
            ops.append(PutOp(ins, outs, place, f"to{list(place)}", hints))
        return ops

    def _output_slot(self, var: Any) -> int:
        if isinstance(var, jex.Literal):
            mesh = self.partition.place_meshes[self.partition.default_place]
            slot = len(self._slots)
            self._slots[(object(), None)] = slot
            self._consts[slot] = jax.device_put(var.val, NamedSharding(mesh, PartitionSpec()))
            return slot
        return self._slot(var, self.partition.home.get(var))

    def _with_frees(self, ops: Sequence[Op]) -> tuple[Op, ...]:
        """``ops`` with each one's ``frees`` (the slots it reads last, but for outputs and
        constants) and ``deps`` (the ops whose outputs it reads)."""
        last: dict[int, int] = {}
        for i, op in enumerate(ops):
            for s in op.ins:
                last[s] = i
        keep = set(self.output_slots) | set(self._consts)
        frees: dict[int, list[int]] = {}
        for s, i in last.items():
            if s not in keep:
                frees.setdefault(i, []).append(s)
        writer: dict[int, int] = {}
        done: list[Op] = []
        for i, op in enumerate(ops):
            deps = tuple(sorted({writer[s] for s in op.ins if s in writer}))
            done.append(dataclasses.replace(op, frees=tuple(frees.get(i, ())), deps=deps))
            writer.update((s, i) for s in op.outs)
        return tuple(done)

    # --- execution ---

    def make_env(self, args: Sequence[Any], unread: frozenset[int] = frozenset()) -> list[Any]:
        """A fresh value per slot for one call: the constants, and ``args`` placed into their
        input shardings (``None`` elsewhere).

        ``unread``: positions of inputs this process never reads (a multi-process job,
        ``multimesh_flax.distributed``): stored as they are.
        """
        env: list[Any] = [None] * len(self._slots)
        for slot, value in self._consts.items():
            env[slot] = value
        self._place_inputs(env, args, unread)
        return env

    def slot_homes(self) -> dict[int, tuple[Any, Any]]:
        """``{slot: (var, place)}``: the traced variable each slot holds, and the submesh
        (its device ids) it is held on (``None`` for an input with no placement)."""
        return {slot: key for key, slot in self._slots.items()}

    def constant_slots(self) -> frozenset[int]:
        """The slots of traced constants, filled by ``make_env`` before any op runs."""
        return frozenset(self._consts)

    def constants(self) -> dict[int, Any]:
        """``{slot: placed constant}``: what ``make_env`` puts in ``constant_slots``."""
        return dict(self._consts)

    def _place_inputs(
        self, env: list[Any], args: Sequence[Any], unread: frozenset[int] = frozenset()
    ) -> None:
        """Puts the arguments into their slots, moving those not in their input sharding
        (``unread``: see ``make_env``)."""
        fits = self.state.fitting
        try:
            haves = list(map(_SHARDING, args))
        except AttributeError:  # numpy arrays, Python scalars
            haves = [getattr(x, "sharding", None) for x in args]
        if len(haves) == len(fits) and all(map(operator.is_, haves, fits)):
            # Every argument in the sharding that fitted last time (a step's outputs, fed
            # back): one C-level pass instead of the checks below.
            if self._inputs_first:
                env[: len(fits)] = args
            else:
                for slot, x in zip(self.input_slots, args, strict=True):
                    env[slot] = x
            return
        moves, targets, slots = [], [], []
        for i, (x, have, want, slot) in enumerate(
            zip(args, haves, self.input_shardings, self.input_slots, strict=True)
        ):
            if have is fits[i] or want is None or i in unread:
                env[slot] = x
            elif fits_input(have, want, x):
                # Outputs of one step arrive with the same sharding objects every step:
                # remembering the last one that fitted makes the check an identity test.
                fits[i] = have
                env[slot] = x
            else:
                moves.append(x)
                targets.append(want)
                slots.append(slot)
        if moves:
            for slot, moved in zip(slots, jax.device_put(moves, targets), strict=True):
                env[slot] = moved

    def __call__(self, args: Sequence[Any]) -> list[Any]:
        if self.processes is not None:
            return self.processes(args)
        env = self.make_env(args)
        if STATE.timeline is not None:
            self._dispatch_recorded(env, STATE.timeline)
        else:
            self._dispatch(env)
        return list(self._read_outputs(env))

    def _dispatch(self, env: list[Any]) -> None:
        """Every op in order, with as little Python per op as it takes: one C-level read of
        its input slots, one call (``state.fns``: the fragment's executable, or the
        transfer's ``Move``), its outputs stored and its last-read slots cleared (the values
        it read last are freed here, in the op that reads them, not in the next one)."""
        fns = self.state.fns
        for index, run, read, outs, frees in self._steps:
            values = read(env)
            if run:
                try:
                    results = fns[index](*values)
                except _debug_nans.InternalFloatingPointError as error:  # jax_debug_nans/_infs
                    op = cast("RunOp", self.ops[index])
                    raise self.floating_point_error(op, values, error) from None
            else:
                results = fns[index](values)
            values = None
            for s, r in zip(outs, results, strict=True):
                env[s] = r
            for s in frees:
                env[s] = None

    def _dispatch_recorded(self, env: list[Any], timeline: Timeline) -> None:
        """``_dispatch``, waiting for each op and recording it into ``timeline`` (an op's
        time includes freeing the values it read last, as ``_dispatch`` frees them)."""
        call, timeline.calls = timeline.calls, timeline.calls + 1
        fns = self.state.fns
        for index, op in enumerate(self.ops):
            start = time.perf_counter()
            values = [env[s] for s in op.ins]
            if isinstance(op, RunOp):
                try:
                    results = fns[index](*values)
                except _debug_nans.InternalFloatingPointError as error:
                    raise self.floating_point_error(op, values, error) from None
            else:
                results = fns[index](values)
            values = None
            for s, r in zip(op.outs, results, strict=True):
                env[s] = r
            for s in op.frees:
                env[s] = None
            jax.block_until_ready(results)
            timeline.events.append(_event(op, index, call, start))

    def floating_point_error(
        self, op: RunOp, values: Sequence[Any], error: Exception
    ) -> FloatingPointError:
        """What to raise when RUN op ``op``, called on ``values``, returned a NaN or inf that
        ``jax_debug_nans`` or ``jax_debug_infs`` caught (``error``, JAX's internal error): a
        ``FloatingPointError`` naming the fragment, its tasks, phases and devices, and the
        operation and source line that produced the value (see ``_debug_nans``)."""
        frag = next(f for f in self.fragments if self._fragment_name(f) == op.name)
        where = f"fragment `{op.name}` ({self._fragment_tasks(frag)}) on devices {list(op.place)}"
        return _debug_nans.floating_point_error(where, frag, values, getattr(error, "ty", "nan"))

    def _fragment_tasks(self, frag: Fragment) -> str:
        """``task `head`, backward`` for each part of a fragment (``glue``: none)."""
        words = []
        for part in frag.parts or (frag,):
            if part.label is None:
                words.append("glue outside every task")
                continue
            unit = part.unit
            phase = unit.phase if unit is not None else part.label.phase
            phase_words = _PHASE_WORDS[phase]
            if unit is not None and phase is Phase.B and self._split(unit.region):
                phase_words = "backward, activation gradients"
            task = self.partition.traced.tasks[part.label.task].name
            words.append(f"task `{task}`, {phase_words}")
        return "; ".join(dict.fromkeys(words))

    # --- inspection ---

    def compile_count(self) -> int:
        """How many XLA executables the fragments of this program hold right now (compiled or
        relocated; see ``relocation_count``)."""
        return sum(p.executable_count() for p in self._programs())

    def relocation_count(self) -> int:
        """How many of those were relocated from another submesh instead of compiled."""
        return sum(p.relocations for p in self._programs())

    def _programs(self) -> list[Any]:
        runs = [op for op in self.ops if isinstance(op, RunOp)]
        return list({id(op.program): op.program for op in runs}.values())

    def transfer_bytes(self) -> int:
        """Bytes moved between submeshes per call."""
        var_of = {slot: var for (var, _), slot in self._slots.items()}
        return sum(nbytes(var_of[s]) for op in self.ops if op.kind is OpKind.PUT for s in op.outs)

    def describe(self) -> str:
        """A readable dump: fragments (submesh, equations) and transfers (bytes) in dispatch
        order, the compile step (distinct programs, compiled at their first dispatch) and
        the executables compiled so far."""
        var_of = {slot: var for (var, _), slot in self._slots.items()}
        frag_of = {self._fragment_name(f): f for f in self.fragments}
        lines = []
        for op in self.ops:
            if op.kind is OpKind.RUN:
                frag = frag_of[op.name]
                lines.append(
                    f"run  {op.name:<24} on devices {list(op.place)}: {len(frag.eqns)} eqns, "
                    f"{len(op.ins)} in, {len(op.outs)} out"
                )
            else:
                size = sum(nbytes(var_of[s]) for s in op.outs)
                lines.append(
                    f"put  {len(op.outs)} value(s) to devices {list(op.place)}: {size} bytes"
                )
        runs = sum(op.kind is OpKind.RUN for op in self.ops)
        lines.append(
            f"compile: {len(self._programs())} programs for {runs} fragments (one jax.jit per "
            "distinct fragment), each compiled by XLA at its first dispatch"
        )
        lines.append(
            f"{runs} fragments, {len(self.ops) - runs} transfers "
            f"({self.transfer_bytes()} bytes), {self.compile_count()} compiled executables "
            f"({self.relocation_count()} relocated from another submesh)"
        )
        if self.schedule is not None:
            schedule = self.schedule
            lines.append(
                f"schedule {schedule.name!r}: {schedule.num_stages} stages on "
                f"{schedule.num_submeshes} submeshes, {schedule.num_microbatches} microbatches"
            )
        return "\n".join(lines)
