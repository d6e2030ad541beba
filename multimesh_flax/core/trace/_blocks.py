"""Blocks: each microbatch's copy of a body traced once, as a few call equations.

A ``microbatch`` body traced once is called ``m`` times: forward, and backward after
differentiation. Inlining every call would copy its equations (about a thousand for a small
transformer) ``m`` times, and every later pass would walk all of them. Instead:

1. The inliner leaves a *placeholder* per call made inside a microbatch scope (a
   :data:`replay_p` equation holding the call's :class:`Body`).
2. The calls of one body under name stacks that differ only in the microbatch index form a
   *class* (:func:`gather`). Colouring labels each class's body equations once, as if
   inlined at its first call (the labels depend on the name stack, and the microbatch index
   changes no label). A glue sharding constraint that pins a value of a task onto that
   task's own submesh takes the task's label (:func:`_constraints_joining_their_task`).
3. A class's body is cut into maximal runs of one task label. Each run of two or more
   equations becomes a *block*: one ``closed_call`` equation whose body (the run) every call
   of the class shares. Glue equations (no task) stay single equations, so glue is still
   placed one equation at a time.
4. Each placeholder becomes its class's blocks and glue over its own variables, under its
   own name stack (so every equation still shows its microbatch): :func:`expand`.

A call then costs a few dozen equations, and identical blocks keep one body object, so later
passes and the executable cache see them as the same program. Classes in a region whose
schedule may split the backward into ``B`` and ``W`` (``zero-bubble-*``, ``custom``) also
cut each backward run where it passes between activation and weight gradient, so that the
split ``plan/_pipeline`` makes after tracing never falls inside a block.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
from jax.extend.core import primitives

from multimesh_flax.core.declare import Phase, place_of
from multimesh_flax.core.trace import _session
from multimesh_flax.core.trace._constraints import concrete_constraint
from multimesh_flax.core.trace._jaxprs import make_jaxpr_object
from multimesh_flax.core.trace._program import Equation
from multimesh_flax.core.trace._structure import RETURNED, equation_readers

# Stands for one call of a body traced once, until ``expand`` replaces it.
replay_p = jex.Primitive("mm_replay")
replay_p.multiple_results = True

_MICROBATCH_INDEX = re.compile(r"(mmmb\d+_)\d+")
# Schedules whose backward may be split into B and W per equation after tracing.
_SPLITTING_SCHEDULES = (
    "zero-bubble-h1",
    "zero-bubble-h2",
    "zero-bubble-auto",
    "zero-bubble-v",
    "custom",
)


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """A placeholder's parameter: the call's body, inlined once over placeholder variables.

    ``template`` has ``invars``, ``consts`` ((variable, value) pairs), ``equations`` (each
    an ``Equation`` whose ``stack`` is its name stack below the call's) and ``outvars``. Not
    a jaxpr, so passes that look for loop and branch bodies in parameters do not see it.
    """

    template: Any


def is_block(eqn: Any) -> bool:
    """Whether ``eqn`` is a block (after tracing, every ``closed_call`` is one: the inliner
    inlines the program's own calls; partitioning adds ``_accumulate``'s bundles of sums)."""
    return eqn.primitive is primitives.closed_call_p


def block_body(eqn: Any) -> jex.Jaxpr:
    """The run of equations a block stands for."""
    return eqn.params["call_jaxpr"].jaxpr


def in_microbatch(stack: str) -> bool:
    """Whether a name stack lies inside a microbatch scope (``mmmb<uid>_<k>``)."""
    return _session.MICROBATCH_RE.search(stack) is not None


def placeholder(template: Any, call: Any, invars: list[Any]) -> Any:
    """The placeholder equation for ``call`` (a call equation) of ``template``'s body."""
    outvars = [jex.Var(v.aval) for v in call.outvars]
    return jex.new_jaxpr_eqn(
        invars, outvars, replay_p, {"body": Body(template)}, call.effects, call.source_info
    )


class _Class(NamedTuple):
    """The calls of one body whose name stacks differ only in the microbatch index."""

    template: Any
    stack: str  # the name stack of the class's first call


@dataclasses.dataclass(frozen=True)
class Calls:
    """A program's microbatch calls grouped into classes, and the equations colouring labels:
    the program's own (every equation but the placeholders), then each class's body once,
    under its first call's name stack."""

    classes: dict[tuple[int, str], _Class]
    to_colour: tuple[Equation, ...]
    own: int  # how many of ``to_colour`` are the program's own equations (they come first)


@dataclasses.dataclass(frozen=True)
class Expanded:
    """The program's equations with every placeholder replaced.

    ``copies`` holds, per equation of the program given to :func:`expand`, what replaces it:
    the equation itself, labelled, or a placeholder's blocks and glue.
    """

    copies: list[tuple[Equation, ...]]
    renamed: dict[Any, Any]  # placeholder outputs that are another variable or a literal
    consts: dict[Any, Any]  # the program variable of each body constant -> its value


def _class_key(eqn: Any, stack: str) -> tuple[int, str]:
    return id(eqn.params["body"].template), _MICROBATCH_INDEX.sub(r"\1*", stack)


def _join(prefix: str, suffix: str) -> str:
    if not prefix:
        return suffix
    return f"{prefix}/{suffix}" if suffix else prefix


def gather(equations: Sequence[Equation]) -> Calls:
    """The classes of ``equations``' placeholders, and the equations to colour (see
    :class:`Calls`)."""
    classes: dict[tuple[int, str], _Class] = {}
    own = []
    for equation in equations:
        eqn = equation.eqn
        if eqn.primitive is not replay_p:
            own.append(equation)
            continue
        key = _class_key(eqn, equation.stack)
        if key not in classes:
            classes[key] = _Class(eqn.params["body"].template, equation.stack)
    bodies = [
        Equation(item.eqn, _join(cls.stack, item.stack))
        for cls in classes.values()
        for item in cls.template.equations
    ]
    return Calls(classes, (*own, *bodies), len(own))


def expand(
    equations: Sequence[Equation],
    calls: Calls,
    coloured: Sequence[Equation],
    session: _session.TraceSession,
) -> Expanded:
    """Replaces each placeholder of ``equations`` by its class's blocks and glue.

    ``coloured`` is ``calls.to_colour`` labelled (with constraints concretised): the
    program's own equations, then each class's body. Each body constant becomes one program
    variable, shared by all calls of its body.
    """
    items: dict[tuple[int, str], tuple[Equation, ...]] = {}
    at = calls.own
    for key, cls in calls.classes.items():
        n = len(cls.template.equations)
        body = [
            labelled._replace(stack=item.stack)
            for labelled, item in zip(coloured[at : at + n], cls.template.equations, strict=True)
        ]
        body = _constraints_joining_their_task(body, session)
        items[key] = _segment(cls.template, body, _splits_backward(cls.stack, session))
        at += n
    return _emit(equations, iter(coloured[: calls.own]), calls.classes, items)


def _constraints_joining_their_task(
    body: Sequence[Equation], session: _session.TraceSession
) -> list[Equation]:
    """``body`` with each glue ``sharding_constraint`` of a task's result onto that task's
    own submesh labelled as the task, so that it joins the task's run (and block).

    A training step's backward constrains every gradient to its parameter's sharding (the
    transpose of the forward's constraint, or ``parallelize_step``'s own), outside every
    task: left as glue, that is one equation per parameter and microbatch (gpt-tiny on 2
    stages at 32 microbatches: 2,176 of 8,633), each walked by every later pass. Placement
    would pin it to the task's submesh anyway (``fragment._place``), and it ended up in its
    producer's unit fragment; labelled, it is placed and cut with its producer from the
    start: the same fragments, less to walk (``tests/core/test_blocks.py``). A constraint
    onto another submesh (a value leaving its task) stays glue.
    """
    producer = {v: i for i, e in enumerate(body) for v in e.eqn.outvars}
    out = list(body)
    for i, equation in enumerate(body):
        sharding = None if equation.label is not None else concrete_constraint(equation.eqn)
        if sharding is None or (j := producer.get(equation.eqn.invars[0])) is None:
            continue
        label = out[j].label  # a constraint of a joined constraint joins too
        if label is not None and place_of(session.tasks[label.task].mesh) == place_of(
            sharding.mesh
        ):
            out[i] = equation._replace(label=label)
    return out


def _splits_backward(stack: str, session: _session.TraceSession) -> bool:
    """Whether the innermost microbatch region of ``stack`` has a schedule that may split
    the backward into ``B`` and ``W`` (``plan/_pipeline`` then splits it per equation)."""
    for found in reversed(_session.MICROBATCH_RE.findall(stack)):
        call = session.microbatch_calls.get(int(found[0]))
        if call is not None:
            return call.options.schedule in _SPLITTING_SCHEDULES
    return False


def _cap(items: set[Any]) -> set[Any]:
    """At most two distinct items: enough to tell whether a set holds one other than x."""
    return items if len(items) <= 2 else set(list(items)[:2])


def reaches_other_owner(
    equations: Sequence[Equation], owner: Callable[[Equation], Any]
) -> list[bool]:
    """Per equation: does an output feed (transitively) an equation of another owner?

    ``owner(equation)`` is the equation's owner, ``None`` for equations that own nothing
    (their readers' owners still count through them).
    """
    owners = [owner(e) for e in equations]
    reach: dict[Any, set[Any]] = {}
    critical = [False] * len(owners)
    for i in reversed(range(len(owners))):
        eqn = equations[i].eqn
        out: set[Any] = set()
        for v in eqn.outvars:
            out |= reach.get(v, set())
        critical[i] = bool(out - {owners[i]})
        mine = _cap(out | ({owners[i]} if owners[i] is not None else set()))
        for v in eqn.invars:
            if not isinstance(v, jex.Literal):
                reach[v] = _cap(reach.get(v, set()) | mine)
    return critical


def _backward_task(equation: Equation) -> int | None:
    label = equation.label
    return label.task if label is not None and label.phase is Phase.B else None


def _activation_gradient(body: Sequence[Equation]) -> set[int]:
    """The backward equations of a body that ``plan/_pipeline`` keeps in ``B`` when it splits
    the backward: those feeding another task's backward, and their producers in their own
    run of the label. The other backward equations become ``W``; blocks must not mix them."""
    critical = reaches_other_owner(body, _backward_task)
    producer = {v: i for i, e in enumerate(body) for v in e.eqn.outvars}
    seeds = [i for i, e in enumerate(body) if critical[i] and _backward_task(e) is not None]
    return with_producers(body, producer, seeds, lambda e: e.label)


def with_producers(
    equations: Sequence[Equation],
    producer: dict[Any, int],
    seeds: Sequence[int],
    group: Callable[[Equation], Any],
) -> set[int]:
    """``seeds`` and, transitively, the producers of their inputs in their own group
    (``group(equation)``: its label or pipeline unit)."""
    stack, found = list(seeds), set()
    while stack:
        i = stack.pop()
        if i in found:
            continue
        found.add(i)
        mine = group(equations[i])
        for v in equations[i].eqn.invars:
            j = None if isinstance(v, jex.Literal) else producer.get(v)
            if j is not None and group(equations[j]) == mine:
                stack.append(j)
    return found


def _segment(template: Any, body: Sequence[Equation], split: bool) -> tuple[Equation, ...]:
    """A class's items: the body's runs of one task label as blocks, glue as is (``body``:
    its equations labelled, each ``stack`` below the call's own; so are the items').

    Sums that only feed the body's outputs, directly or through such sums, stay single
    equations too, and so does a sharding constraint between such a sum and the outputs:
    they may add a parameter's gradient shares from two tasks, which ``plan/_accumulate``
    re-associates across microbatches (summing each submesh's shares before they move).
    With ``split`` (a schedule splitting the backward), a backward run is also cut where it
    passes between activation and weight gradient.
    """
    eqns = [e.eqn for e in body]
    last_use = _last_uses(eqns, template.outvars)
    single = _output_sums(body, template.outvars)
    activation = _activation_gradient(body) if split else set()

    def key(i: int) -> tuple[Any, bool]:
        return body[i].label, i in activation

    items = []
    start = 0
    while start < len(body):
        end = start + 1
        if body[start].label is not None and start not in single:
            while end < len(body) and key(end) == key(start) and end not in single:
                end += 1
        run = eqns[start:end]
        item = run[0] if len(run) == 1 else _block(run, end, last_use)
        items.append(body[start]._replace(eqn=item))
        start = end
    return tuple(items)


def _output_sums(body: Sequence[Equation], outvars: Sequence[Any]) -> set[int]:
    """The indices of sums whose one reader is the body's outputs or another such sum, and
    of sums of two tasks' results (a tied parameter's gradient shares) whose one reader is
    a sharding constraint (a training step lays each gradient out as its parameter) whose
    one reader is an output, with those constraints."""
    eqns = [e.eqn for e in body]
    readers = equation_readers(eqns, outvars)
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    found: set[int] = set()
    laying_out: set[int] = set()  # constraints laying out a sum of two tasks' results
    for i in reversed(range(len(eqns))):
        only = readers.get(eqns[i].outvars[0], [])
        if len(only) != 1 or not is_sum(eqns[i]):
            continue
        if only[0] == "out" or only[0] in found:
            found.add(i)
        elif _lays_out_output(eqns, readers, only[0]) and _of_two_tasks(body, producer, i):
            found.add(i)
            laying_out.add(only[0])
    return found | laying_out


def _lays_out_output(eqns: Sequence[Any], readers: dict[Any, list[Any]], i: int) -> bool:
    """Whether ``eqns[i]`` is a sharding constraint onto a mesh whose one reader is an
    output."""
    only_returned = readers.get(eqns[i].outvars[0]) == [RETURNED]
    return concrete_constraint(eqns[i]) is not None and only_returned


def _of_two_tasks(body: Sequence[Equation], producer: dict[Any, int], i: int) -> bool:
    """Whether the sum ``body[i]`` adds results of equations of two different tasks."""
    made_by = [producer.get(v) for v in body[i].eqn.invars]
    labels = {body[j].label.task for j in made_by if j is not None and body[j].label is not None}
    return len(labels) > 1


def is_sum(eqn: Any) -> bool:
    """An addition of two (non-literal) values of the result's shape and dtype (their
    avals may name different meshes: a loop body's carry names none).

    >>> import jax
    >>> [is_sum(e) for e in jax.make_jaxpr(lambda a, b: (a + b) + 1.0)(1.0, 2.0).eqns]
    [True, False]
    """
    if eqn.primitive.name not in ("add", "add_any") or len(eqn.invars) != 2:
        return False
    shape, dtype = eqn.outvars[0].aval.shape, eqn.outvars[0].aval.dtype
    return all(
        not isinstance(v, jex.Literal) and v.aval.shape == shape and v.aval.dtype == dtype
        for v in eqn.invars
    )


def _last_uses(eqns: Sequence[Any], outvars: Sequence[Any]) -> dict[Any, int]:
    """Per variable, the index of the last equation reading it (``len(eqns)``: an output)."""
    last: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, jex.Literal):
                last[v] = i
    for v in outvars:
        if not isinstance(v, jex.Literal):
            last[v] = len(eqns)
    return last


def _block(run: Sequence[Any], end: int, last_use: dict[Any, int]) -> Any:
    """One ``closed_call`` equation computing ``run``; ``end``: the index after it."""
    defined: set[Any] = set()
    invars: dict[Any, None] = {}
    for eqn in run:
        for v in eqn.invars:
            if not isinstance(v, jex.Literal) and v not in defined:
                invars[v] = None
        defined.update(eqn.outvars)
    outvars = [v for eqn in run for v in eqn.outvars if last_use.get(v, -1) >= end]
    effects = frozenset().union(*(e.effects for e in run))
    body = make_jaxpr_object([], list(invars), outvars, list(run), "block")
    params = {"call_jaxpr": jex.ClosedJaxpr(body, [])}
    return jex.new_jaxpr_eqn(
        list(invars), outvars, primitives.closed_call_p, params, effects, run[0].source_info
    )


def as_block(constraint: Any) -> Any:
    """The sharding constraint equation ``constraint`` as a block (``closed_call``) of
    itself. The running sums' passes follow a gradient through blocks
    (``fragment._stacked_units``); the copies of one constraint (one per microbatch) share
    one body, as a block's copies share theirs.

    Example:
        >>> from jax.sharding import NamedSharding
        >>> mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> laid_out = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P()))
        >>> (eqn,) = jax.make_jaxpr(laid_out)(jnp.ones(3)).eqns
        >>> block = as_block(eqn)
        >>> is_block(block), [e.primitive.name for e in block_body(block).eqns]
        (True, ['sharding_constraint'])
        >>> block_body(block) is block_body(as_block(eqn))
        True
    """
    (x,) = constraint.invars
    key = (x.aval, constraint.primitive, tuple(constraint.params.items()))
    try:
        params = _block_params(*key)
    except TypeError:  # a parameter that cannot be hashed: a body of its own
        params = _block_params.__wrapped__(*key)
    return jex.new_jaxpr_eqn(
        constraint.invars,
        constraint.outvars,
        primitives.closed_call_p,
        params,
        frozenset(),
        constraint.source_info,
    )


@functools.lru_cache(maxsize=256)
def _block_params(aval: Any, primitive: Any, params: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """The parameters of a block whose body is one ``primitive`` of ``params`` on ``aval``."""
    x, out = jex.Var(aval), jex.Var(aval)
    eqn = jex.new_jaxpr_eqn([x], [out], primitive, dict(params), frozenset())
    body = make_jaxpr_object([], [x], [out], [eqn], "block")
    return {"call_jaxpr": jex.ClosedJaxpr(body, [])}


def _emit(
    equations: Sequence[Equation],
    own: Any,
    classes: dict[tuple[int, str], _Class],
    items: dict[tuple[int, str], tuple[Equation, ...]],
) -> Expanded:
    """Each equation's replacement: the next of ``own`` (coloured) for an equation of the
    program's own, its class's items over its own variables for a placeholder."""
    out = Expanded([], {}, {})
    consts: dict[int, list[tuple[Any, Any]]] = {}  # per body: (body variable, program variable)
    for equation in equations:
        eqn, stack = equation.eqn, equation.stack
        if eqn.primitive is not replay_p:
            out.copies.append((next(own),))
            continue
        key = _class_key(eqn, stack)
        template = classes[key].template
        if id(template) not in consts:
            consts[id(template)] = [(v, _const(value, out.consts)) for v, value in template.consts]
        out.copies.append(_instantiate(template, items[key], eqn, stack, consts[id(template)], out))
    return out


def _const(value: Any, consts: dict[Any, Any]) -> Any:
    """A new program variable for a body constant, recorded in ``consts``."""
    var = jex.Var(jax.typeof(value))
    consts[var] = value
    return var


def _instantiate(
    template: Any,
    items: tuple[Equation, ...],
    call: Any,
    stack: str,
    consts: list[tuple[Any, Any]],
    out: Expanded,
) -> tuple[Equation, ...]:
    """One call's copy of its class's items (``out.renamed``: what the call's outputs are)."""
    args = [out.renamed.get(v, v) if isinstance(v, jex.Var) else v for v in call.invars]
    env: dict[Any, Any] = dict(zip(template.invars, args, strict=True))
    env.update(consts)
    # The call's own output variables stand for the body outputs the items compute.
    preset: dict[Any, Any] = {}
    for tv, pv in zip(template.outvars, call.outvars, strict=True):
        if not isinstance(tv, jex.Literal) and tv not in env and tv not in preset:
            preset[tv] = pv
    copies = []
    for item in items:
        eqn = item.eqn
        invars = [v if isinstance(v, jex.Literal) else env[v] for v in eqn.invars]
        outvars = [preset.get(v) or jex.Var(v.aval) for v in eqn.outvars]
        env.update(zip(eqn.outvars, outvars, strict=True))
        copy = eqn.replace(invars=invars, outvars=outvars)
        copies.append(Equation(copy, _join(stack, item.stack), item.label))
    for tv, pv in zip(template.outvars, call.outvars, strict=True):
        value = tv if isinstance(tv, jex.Literal) else env[tv]
        if value is not pv:
            out.renamed[pv] = value
    return tuple(copies)


def rename(equations: list[Equation], renamed: dict[Any, Any]) -> list[Equation]:
    """``equations`` reading ``renamed[v]`` wherever they read a renamed ``v``."""
    if not renamed:
        return equations
    out = []
    for equation in equations:
        eqn = reading_renamed(equation.eqn, renamed)
        out.append(equation if eqn is equation.eqn else equation._replace(eqn=eqn))
    return out


def reading_renamed(eqn: Any, renamed: dict[Any, Any]) -> Any:
    """``eqn`` reading ``renamed[v]`` wherever it reads a renamed ``v`` (``eqn`` itself if it
    reads none)."""
    if not any(not isinstance(v, jex.Literal) and v in renamed for v in eqn.invars):
        return eqn
    invars = [v if isinstance(v, jex.Literal) else renamed.get(v, v) for v in eqn.invars]
    return eqn.replace(invars=invars)
