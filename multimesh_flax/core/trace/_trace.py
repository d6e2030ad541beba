"""Tracing: capture a program once as a flat jaxpr and colour every equation by task.

``trace_program`` runs ``jax.make_jaxpr`` inside a trace session (so each task call records
its resolved mesh), inlines nested ``jit``/``checkpoint``/custom-derivative calls so that task
boundaries become visible at the top level -- except each microbatch's call of a body traced
once, which ``_blocks`` turns into a few block equations -- and labels every equation with
a ``Label(task uid, phase)`` -- phase ``F`` or ``B`` (the name stack shows ``transpose(``
before the task's marker) -- or ``None`` for glue. Tasks registered by name
(``register_task``) are entered around matching Flax modules while tracing and matched on name
stacks afterwards; ``_named_tasks`` does both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
from jax.sharding import Mesh, NamedSharding

from multimesh_flax import errors
from multimesh_flax.core.declare import _config, _devices
from multimesh_flax.core.trace import _blocks, _colour, _session
from multimesh_flax.core.trace._jaxprs import make_jaxpr_object

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


@dataclasses.dataclass
class TracedProgram:
    """A flat jaxpr of the program with a task label per equation."""

    jaxpr: jex.Jaxpr
    consts: list[Any]
    labels: list[_session.Label | None]  # per equation; None: glue
    tasks: dict[int, _session.ResolvedTask]
    out_tree: Any
    stacks: list[str] = dataclasses.field(default_factory=list)  # name stack per equation
    default_task: _session.ResolvedTask | None = None  # registered for "default": glue fallback
    session: _session.TraceSession | None = None  # what the trace learnt (tasks, microbatches)

    @functools.cached_property
    def producer(self) -> dict[Any, int]:
        """The index of the equation producing each variable (built once per program)."""
        return {v: i for i, e in enumerate(self.jaxpr.eqns) for v in e.outvars}

    @property
    def microbatch_calls(self) -> dict[int, _session.MicrobatchCall]:
        """The ``microbatch`` calls traced in this program, by scope uid."""
        return self.session.microbatch_calls if self.session is not None else {}


def concrete_constraint(eqn: Any) -> NamedSharding | None:
    """The sharding of a ``sharding_constraint`` equation that names a concrete mesh
    (devices), else ``None`` (another primitive, or an abstract mesh)."""
    if eqn.primitive.name != "sharding_constraint":
        return None
    sharding = eqn.params.get("sharding")
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        return None
    return sharding


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
    eqns: list[Any]  # over placeholders
    suffixes: list[str]  # name stack of each equation below the call's own
    outvars: list[Any]
    has_replays: bool = False  # whether its equations hold microbatch-call placeholders


class _Inliner:
    """Rebuilds a jaxpr with call primitives inlined and full name stacks kept.

    Each distinct call body is inlined once into a :class:`_Template` and replayed per call,
    so the cost per call is a rename of its equations, not a walk of nested bodies.
    """

    def __init__(self, templates: dict[int, tuple[Any, _Template]] | None = None) -> None:
        self.eqns: list[Any] = []
        self.stacks: list[str] = []
        self.consts: dict[Any, Any] = {}
        # Templates by id of the call parameter holding the body (the value pins the id).
        self.templates: dict[int, tuple[Any, _Template]] = {} if templates is None else templates

    def run(
        self, jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any], prefix: str
    ) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(a: Any) -> Any:
            return a if isinstance(a, jex.Literal) else env[a]

        for eqn in jaxpr.eqns:
            stack = _join(prefix, str(eqn.source_info.name_stack))
            invars = [read(a) for a in eqn.invars]
            key = _INLINE_PARAM.get(eqn.primitive.name)
            if key is not None and key in eqn.params:
                template = self._template(eqn.params[key])
                if _blocks.in_microbatch(stack) and not template.has_replays:
                    # One microbatch's call of a body traced once: ``_blocks.expand``.
                    replay = _blocks.placeholder(template, eqn, invars)
                    env.update(zip(eqn.outvars, replay.outvars, strict=True))
                    self.eqns.append(replay)
                    self.stacks.append(stack)
                    continue
                outs = self._replay(template, invars, stack)
                env.update(zip(eqn.outvars, outs, strict=True))
                continue
            _check_no_inner_tasks(eqn)
            outvars = [jex.Var(v.aval) for v in eqn.outvars]
            env.update(zip(eqn.outvars, outvars, strict=True))
            self.eqns.append(eqn.replace(invars=invars, outvars=outvars))
            self.stacks.append(stack)
        return [read(a) for a in jaxpr.outvars]

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
        replays = any(e.primitive is _blocks.replay_p for e in sub.eqns)
        template = _Template(in_vars, consts, sub.eqns, sub.stacks, outs, replays)
        self.templates[id(body)] = (body, template)
        return template

    def _replay(self, template: _Template, args: Sequence[Any], prefix: str) -> list[Any]:
        env: dict[Any, Any] = dict(zip(template.invars, args, strict=True))
        for var, value in template.consts:
            env[var] = self._const(value)
        append_eqn, append_stack = self.eqns.append, self.stacks.append
        for eqn, suffix in zip(template.eqns, template.suffixes, strict=True):
            invars = [a if isinstance(a, jex.Literal) else env[a] for a in eqn.invars]
            outvars = [jex.Var(v.aval) for v in eqn.outvars]
            env.update(zip(eqn.outvars, outvars, strict=True))
            append_eqn(eqn.replace(invars=invars, outvars=outvars))
            append_stack(_join(prefix, suffix))
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


def each_distinct(fn: Callable[[str], Any], stacks: Sequence[str]) -> list[Any]:
    """``[fn(s) for s in stacks]``, calling ``fn`` once per distinct name stack (the m
    microbatches of a program repeat the same few thousand stacks over all its equations).

    >>> each_distinct(len, ["a/b", "a", "a/b"])
    [3, 1, 3]
    """
    memo: dict[str, Any] = {}
    return [memo[s] if s in memo else memo.setdefault(s, fn(s)) for s in stacks]


def trace_program(
    fun: Callable[..., Any],
    args: Sequence[Any],
    devices: Any = None,
) -> TracedProgram:
    """Traces ``fun(*args)`` (args: pytrees of arrays or ``ShapeDtypeStruct``s).

    The program's inputs are the flattened leaves of ``args``; its outputs the flattened
    leaves of the result, whose tree is ``out_tree``.
    """
    with (
        _devices.use_device_list(devices),
        _config.autoshard(),
        _session.trace_session() as session,
        _colour.intercept_flax_modules(),  # registered Flax modules enter their tasks
    ):
        # A fresh wrapper: jax caches traces per function object, and our contexts (task
        # stack, flags) are not part of its cache key.
        closed, out_shape = jax.make_jaxpr(lambda *a: fun(*a), return_shape=True)(*args)
        default = _colour.default_task()
    inliner = _Inliner()
    outer, consts = _open(closed)
    const_vars = [inliner._const(c) for c in consts]
    in_vars = [jex.Var(v.aval) for v in outer.invars]
    outs = inliner.run(outer, const_vars, in_vars, "")

    def label(eqns: list[Any], stacks: list[str]) -> tuple[list[Any], list[Any]]:
        labels = each_distinct(lambda s: _colour.marker_label(s, session.tasks), stacks)
        # Registered tasks (named scopes, backward callbacks) where they are innermost.
        labels = _colour.label_equations(eqns, stacks, labels, session, devices)
        return labels, _colour.concretise_constraints(eqns, labels, session)

    program = _blocks.expand(inliner.eqns, inliner.stacks, label, inliner._const, session)
    eqns = _blocks.rename(program.eqns, program.renamed)
    outs = [a if isinstance(a, jex.Literal) else program.renamed.get(a, a) for a in outs]
    const_items = list(inliner.consts.items())
    jaxpr = make_jaxpr_object([v for v, _ in const_items], in_vars, outs, eqns, "program")
    return TracedProgram(
        jaxpr=jaxpr,
        consts=[c for _, c in const_items],
        labels=program.labels,
        tasks=session.tasks,
        out_tree=jax.tree_util.tree_structure(out_shape),
        stacks=program.stacks,
        default_task=default,
        session=session,
    )
