"""Tracing: capture a program once as a flat jaxpr and colour every equation by task.

Two passes, each a value in and a value out:

* :func:`capture_program` (*trace*) runs ``jax.make_jaxpr`` inside a trace session (so each
  task call records its resolved mesh), inlines nested ``jit``/``checkpoint``/custom-derivative
  calls so that task boundaries become visible at the top level, unrolls each microbatch loop
  (a ``scan``, see ``_loops``) into one run of its body per microbatch -- each microbatch's
  call of a body traced once stays a placeholder -- and drops what no output needs: a
  :class:`CapturedProgram`.
* :func:`colour_program` (*colour*) labels every equation with a ``Label(task uid, phase)``
  -- phase ``F`` or ``B`` (the name stack shows ``transpose(`` before the task's marker) --
  or ``None`` for glue (``_colour``: explicit markers, then tasks registered by name), and
  turns each placeholder into its call's blocks, one per run of a label (``_blocks``): a
  :class:`~._program.TracedProgram`.

:func:`trace_program` runs both. Tasks registered by name (``register_task``) are entered
around matching Flax modules while tracing and matched on name stacks afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex

from multimesh_flax import errors
from multimesh_flax.core.declare import autoshard, use_device_list
from multimesh_flax.core.trace import _blocks, _colour, _loops, _session
from multimesh_flax.core.trace._jaxprs import make_jaxpr_object
from multimesh_flax.core.trace._program import Equation, TracedProgram

# Call-like primitives whose body is inlined (evaluation only: our programs are not
# differentiated after tracing, so dropping custom derivative rules is exact).
_INLINE_PARAM = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


@dataclasses.dataclass(frozen=True)
class CapturedProgram:
    """A program as :func:`capture_program` hands it to :func:`colour_program`: inlined, no
    equation labelled yet, each microbatch's call of a body traced once still a placeholder
    (``_blocks.replay_p``)."""

    equations: tuple[Equation, ...]  # ``eqn`` and ``stack`` of each equation
    consts: dict[Any, Any]  # constant variable -> its value
    invars: list[Any]
    outvars: list[Any]
    recomputed: frozenset[int]  # ids of the equations recomputing hoisted values (``_loops``)
    out_tree: Any
    default_task: _session.ResolvedTask | None  # registered for "default": glue fallback
    session: _session.TraceSession
    devices: Any  # the device list registered backward tasks resolve against


def _open(jaxpr: Any) -> tuple[jex.Jaxpr, list[Any]]:
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


@dataclasses.dataclass
class _Template:
    """A call's body inlined once, over placeholder variables, for replay at every call.

    The ``m`` microbatches of a body traced once call the same jaxpr ``m`` times (forward
    and backward); each call is a replay: fresh variables, the call's name stack prefixed.
    """

    invars: list[Any]  # placeholders for the body's inputs
    consts: list[tuple[Any, Any]]  # (placeholder, value): each call gets fresh const vars
    equations: list[Equation]  # over placeholders; ``stack``: below the call's own
    outvars: list[Any]
    has_replays: bool = False  # whether its equations hold microbatch-call placeholders


_PLAIN = (jex.Var, jex.Literal)  # values that are their own variable (``_Inliner._value``)


class _Inliner:
    """Rebuilds a jaxpr with call primitives inlined and full name stacks kept.

    Each distinct call body is inlined once into a :class:`_Template` and replayed per call,
    so the cost per call is a rename of its equations, not a walk of nested bodies.
    """

    def __init__(self, templates: dict[int, tuple[Any, _Template]] | None = None) -> None:
        self.equations: list[Equation] = []  # what it emitted, with full name stacks
        self.consts: dict[Any, Any] = {}
        # Templates by id of the call parameter holding the body (the value pins the id).
        self.templates: dict[int, tuple[Any, _Template]] = {} if templates is None else templates
        self.batch_splits: dict[Any, Any] = {}  # stacked chunks -> the reshape that made them
        self.slices: dict[tuple[Any, int], Any] = {}  # (loop input, k) -> iteration k's slice
        self.zeros: set[Any] = set()  # variables that are arrays of zeros (broadcast literals)
        self.recomputed: set[int] = set()  # ids of the equations recomputing hoisted values
        self.stacks_of: dict[tuple[int, str], tuple[Any, list[str]]] = {}  # see _stacks

    def run(
        self,
        jaxpr: jex.Jaxpr,
        consts: Sequence[Any],
        args: Sequence[Any],
        prefix: str,
        loop: tuple[int, int] | None = None,
    ) -> list[Any]:
        """Inlines ``jaxpr`` applied to ``args`` under name stack ``prefix``; returns its
        outputs. ``loop=(uid, k)``: the body of microbatch loop ``uid`` in iteration ``k``."""
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(a: Any) -> Any:
            return a if isinstance(a, jex.Literal) else env[a]

        for eqn, stack in zip(jaxpr.eqns, self._stacks(jaxpr, prefix), strict=True):
            if loop is not None:
                stack = _loops.in_iteration(stack, *loop)
            values = [read(a) for a in eqn.invars]
            uid = _loops.loop_uid(eqn)
            if uid is not None:
                outs = self._unroll(eqn, values, stack, uid)
            elif "_loop" in stack and (hoisted := _loops.hoisted_uid(stack)) is not None:
                source = _loops.Hoisted(eqn, values, stack, hoisted)
                outs = [_loops.HoistedOut(source, i) for i in range(len(eqn.outvars))]
            elif (kept := _loops.plus_zero(eqn, values)) is not None:
                outs = [self._value(kept)]
            else:
                outs = self._emit(eqn, [self._value(v) for v in values], stack)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [self._value(read(a)) for a in jaxpr.outvars]

    def _stacks(self, jaxpr: jex.Jaxpr, prefix: str) -> list[str]:
        """The name stack of each of ``jaxpr``'s equations under ``prefix`` (made once: a
        loop body runs once per iteration)."""
        key = (id(jaxpr), prefix)
        hit = self.stacks_of.get(key)
        if hit is None or hit[0] is not jaxpr:
            stacks = [_join(prefix, str(e.source_info.name_stack)) for e in jaxpr.eqns]
            hit = self.stacks_of[key] = (jaxpr, stacks)
        return hit[1]

    def _emit(self, eqn: Any, invars: list[Any], stack: str) -> list[Any]:
        """Appends ``eqn`` over ``invars`` (a call: its body, or its microbatch placeholder)."""
        key = _INLINE_PARAM.get(eqn.primitive.name)
        if key is not None and key in eqn.params:
            template = self._template(eqn.params[key])
            if _blocks.in_microbatch(stack) and not template.has_replays:
                # One microbatch's call of a body traced once: ``_blocks.expand``.
                replay = _blocks.placeholder(template, eqn, invars)
                self._append(replay, stack)
                return list(replay.outvars)
            return self._replay(template, invars, stack)
        _check_no_inner_tasks(eqn)
        outvars = [jex.Var(v.aval) for v in eqn.outvars]
        new = eqn.replace(invars=invars, outvars=outvars)
        self._append(new, stack)
        if _loops.splits_leading_axis(new):
            self.batch_splits[outvars[0]] = new
        elif _loops.is_zeros(new):
            self.zeros.add(outvars[0])
        return outvars

    def _append(self, eqn: Any, stack: str) -> None:
        self.equations.append(Equation(eqn, stack))

    # --- microbatch loops (``_loops``) ------------------------------------------------------

    def _unroll(self, eqn: Any, values: list[Any], stack: str, uid: int) -> list[Any]:
        """Microbatch loop ``uid`` (a ``scan``) as one run of its body per iteration."""
        params = eqn.params
        inner, body_consts = _open(params["jaxpr"])
        const_vars = [self._const(c) for c in body_consts]
        n_consts, n_carry = _scan_counts(params)
        length = params["length"]
        loop_consts, xs = values[:n_consts], values[n_consts + n_carry :]
        carry = [self._carried(v) for v in values[n_consts : n_consts + n_carry]]
        ys: list[list[Any]] = [[None] * length for _ in eqn.outvars[n_carry:]]
        order = reversed(range(length)) if params["reverse"] else range(length)
        for k in order:
            here = _loops.in_iteration(_join(stack, _loops.loop_scope(uid)), uid, k)
            args = [
                *(self._at(c, uid, k) for c in loop_consts),
                *carry,
                *(self._slice(x, k, eqn, here) for x in xs),
            ]
            outs = self.run(inner, const_vars, args, stack, loop=(uid, k))
            carry = outs[:n_carry]
            for parts, y in zip(ys, outs[n_carry:], strict=True):
                parts[k] = y
        stacked = [
            _loops.Stacked(parts, v.aval, stack, eqn)
            for parts, v in zip(ys, eqn.outvars[n_carry:], strict=True)
        ]
        return [*carry, *stacked]

    def _carried(self, value: Any) -> Any:
        """A loop's initial carry; zeros (a sum's start) are marked, so the first iteration's
        addition to them is no equation (``_loops.plus_zero``)."""
        value = self._value(value)
        zero = value in self.zeros if isinstance(value, jex.Var) else _loops.is_zero(value)
        return _loops.Zero(value) if zero else value

    def _value(self, value: Any) -> Any:
        """A variable for ``value``: a loop's stacked output is concatenated, a hoisted
        equation computed once, outside every iteration (readers other than the loops)."""
        if type(value) in _PLAIN:
            return value
        if isinstance(value, _loops.Stacked):
            if value.whole is None:
                parts = [self._value(p) for p in value.parts]
                eqns = _loops.stack_of(parts, value.aval, value.loop)
                for e in eqns:
                    self._append(e, value.stack)
                value.whole = eqns[-1].outvars[0]
            return value.whole
        if isinstance(value, _loops.HoistedOut):
            source = value.source
            if source.once is None:
                invars = [self._value(a) for a in source.invars]
                source.once = self._emit(
                    source.eqn, invars, _loops.outside(source.stack, source.uid)
                )
            return source.once[value.index]
        if isinstance(value, _loops.Zero):
            return value.var
        return value

    def _at(self, value: Any, uid: int, k: int) -> Any:
        """A constant of loop ``uid`` in iteration ``k``: what JAX hoisted out of the loop is
        computed again in the iteration, as the body itself would (``_loops`` doc)."""
        if not isinstance(value, _loops.HoistedOut) or value.source.uid != uid:
            return self._value(value)
        source = value.source
        outs = source.per_iteration.get(k)
        if outs is None:
            invars = [self._at(a, uid, k) for a in source.invars]
            start = len(self.equations)
            outs = self._emit(source.eqn, invars, _loops.in_iteration(source.stack, uid, k))
            self.recomputed.update(id(e.eqn) for e in self.equations[start:])
            source.per_iteration[k] = outs
        return outs[value.index]

    def _slice(self, value: Any, k: int, loop: Any, stack: str) -> Any:
        """Iteration ``k``'s slice of a loop input (made once, shared by both loops)."""
        if isinstance(value, _loops.Stacked):
            return value.parts[k]
        var = self._value(value)
        if (var, k) not in self.slices:
            eqns = _loops.slice_of(var, k, self.batch_splits.get(var), loop)
            for e in eqns:
                self._append(e, stack)
            self.slices[var, k] = eqns[-1].outvars[0]
        return self.slices[var, k]

    def _template(self, body: Any) -> _Template:
        """The template of a call body (a ``Jaxpr`` or ``ClosedJaxpr``), built on first use."""
        hit = self.templates.get(id(body))
        if hit is not None:
            return hit[1]
        inner, values = _open(body)
        sub = _Inliner(self.templates)
        const_vars = [jex.Var(jax.typeof(c)) for c in values]
        in_vars = [jex.Var(v.aval) for v in inner.invars]
        outs = sub.run(inner, const_vars, in_vars, "")
        consts = [*zip(const_vars, values, strict=True), *sub.consts.items()]
        replays = any(e.eqn.primitive is _blocks.replay_p for e in sub.equations)
        template = _Template(in_vars, consts, sub.equations, outs, replays)
        self.templates[id(body)] = (body, template)
        return template

    def _replay(self, template: _Template, args: Sequence[Any], prefix: str) -> list[Any]:
        env: dict[Any, Any] = dict(zip(template.invars, args, strict=True))
        for var, value in template.consts:
            env[var] = self._const(value)
        append = self.equations.append
        for item in template.equations:  # ``stack``: below the call's own
            eqn = item.eqn
            invars = [a if isinstance(a, jex.Literal) else env[a] for a in eqn.invars]
            outvars = [jex.Var(v.aval) for v in eqn.outvars]
            env.update(zip(eqn.outvars, outvars, strict=True))
            append(Equation(eqn.replace(invars=invars, outvars=outvars), _join(prefix, item.stack)))
        return [a if isinstance(a, jex.Literal) else env[a] for a in template.outvars]

    def _const(self, value: Any) -> Any:
        var = jex.Var(jax.typeof(value))
        self.consts[var] = value
        return var


def _join(prefix: str, stack: str) -> str:
    if not prefix:
        return stack
    return f"{prefix}/{stack}" if stack else prefix


def _check_no_inner_tasks(eqn: Any) -> None:
    for stack in _colour.inner_stacks(eqn):
        marker = _session.MARKER_RE.search(stack)
        if marker:
            name = stack[marker.end() :].split("/")[0]  # the marker is mmtask<uid>_<name>
            raise errors.TaskInControlFlowError(
                f"Task {name!r} is called inside `{eqn.primitive.name}`. A loop or "
                "conditional runs as one unit on one submesh, so it cannot contain a task "
                "boundary. Unroll the loop in Python, or make the whole loop one task."
            )


def _live(equations: list[Equation], outs: Sequence[Any]) -> tuple[Equation, ...]:
    """The equations that an output or an effect needs: unrolling a microbatch loop leaves
    the batch's reshape into stacked chunks unread (``_loops``)."""
    live = {v for v in outs if not isinstance(v, jex.Literal)}
    keep = []
    for equation in reversed(equations):
        eqn = equation.eqn
        if eqn.effects or any(v in live for v in eqn.outvars):
            keep.append(equation)
            live.update(v for v in eqn.invars if not isinstance(v, jex.Literal))
    return tuple(reversed(keep))


def _without_mesh(leaf: Any) -> Any:
    """``leaf`` as the program sees it: an array typed on a mesh (``jax.set_mesh``, Explicit
    axes) becomes a ``ShapeDtypeStruct`` with no sharding, so that inside each task its
    value is typed on the task's submesh, not on the mesh it happened to arrive on."""
    try:
        aval = jax.typeof(leaf)
    except TypeError:
        return leaf
    sharding = getattr(aval, "sharding", None)
    if sharding is None or sharding.mesh.empty:
        return leaf
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def capture_program(
    fun: Callable[..., Any], args: Sequence[Any], devices: Any = None
) -> CapturedProgram:
    """The *trace* pass: ``fun(*args)`` as one flat program, nothing labelled yet.

    ``args`` are pytrees of arrays or ``ShapeDtypeStruct``\\ s; the program's inputs are their
    flattened leaves, its outputs the flattened leaves of the result (tree: ``out_tree``).
    """
    with (
        use_device_list(devices),
        autoshard(),
        _session.trace_session() as session,
        _colour.intercept_flax_modules(),  # registered Flax modules enter their tasks
    ):
        # A fresh wrapper: jax caches traces per function object, and our contexts (task
        # stack, flags) are not part of its cache key.
        closed, out_shape = jax.make_jaxpr(lambda *a: fun(*a), return_shape=True)(
            *[_without_mesh(a) for a in args]
        )
        default = _colour.default_task()
    inliner = _Inliner()
    outer, consts = _open(closed)
    const_vars = [inliner._const(c) for c in consts]
    in_vars = [jex.Var(v.aval) for v in outer.invars]
    outs = inliner.run(outer, const_vars, in_vars, "")
    return CapturedProgram(
        equations=_live(inliner.equations, outs),
        consts=inliner.consts,
        invars=in_vars,
        outvars=outs,
        recomputed=frozenset(inliner.recomputed),
        out_tree=jax.tree_util.tree_structure(out_shape),
        default_task=default,
        session=session,
        devices=devices,
    )


def colour_program(captured: CapturedProgram) -> TracedProgram:
    """The *colour* pass: every equation labelled with its task and phase (or as glue), each
    microbatch's call expanded into its blocks.

    Colouring sees the program's own equations and each class of microbatch calls' body
    once (``_blocks.gather``); the blocks are runs of one label (``_blocks.expand``); hoisted
    values recomputed per microbatch move to their first reader (``_loops``).
    """
    session = captured.session
    calls = _blocks.gather(captured.equations)
    coloured = _colour.colour_equations(calls.to_colour, session, captured.devices)
    expanded = _blocks.expand(captured.equations, calls, coloured, session)
    equations: list[Equation] = []
    late: set[int] = set()  # positions of the equations recomputing hoisted values
    for source, copies in zip(captured.equations, expanded.copies, strict=True):
        if id(source.eqn) in captured.recomputed:
            late.update(range(len(equations), len(equations) + len(copies)))
        equations.extend(copies)
    equations = _blocks.rename(equations, expanded.renamed)
    order = _loops.first_use_order([e.eqn for e in equations], late)
    equations = [equations[i] for i in order]
    renamed = expanded.renamed
    outs = [a if isinstance(a, jex.Literal) else renamed.get(a, a) for a in captured.outvars]
    consts = {**captured.consts, **expanded.consts}
    eqns = [e.eqn for e in equations]
    jaxpr = make_jaxpr_object(
        list(consts), captured.invars, outs, eqns, "program", consts=list(consts.values())
    )
    return TracedProgram(
        jaxpr=jaxpr,
        consts=list(consts.values()),
        equations=tuple(equations),
        tasks=session.tasks,
        out_tree=captured.out_tree,
        default_task=captured.default_task,
        session=session,
    )


def trace_program(
    fun: Callable[..., Any],
    args: Sequence[Any],
    devices: Any = None,
) -> TracedProgram:
    """Traces ``fun(*args)`` and colours it: :func:`capture_program`, then
    :func:`colour_program` (args: pytrees of arrays or ``ShapeDtypeStruct``\\ s).

    The program's inputs are the flattened leaves of ``args``; its outputs the flattened
    leaves of the result, whose tree is ``out_tree``.
    """
    return colour_program(capture_program(fun, args, devices))


def _scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """A ``scan`` equation's (constants, carried values) counts: jax 0.10 names them in its
    params (``num_consts``, ``num_carry``); later versions pack the inputs as one flat tree
    of (constants, carry, xs) in ``ft_in``."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
