"""Blocks: each microbatch's copy of a body traced once, as a few call equations.

A ``microbatch`` body traced once is called ``m`` times: forward, and backward after
differentiation. Inlining every call would copy its equations (about a thousand for a small
transformer) ``m`` times, and every later pass would walk all of them. Instead:

1. The inliner leaves a *placeholder* per call made inside a microbatch scope (a
   :data:`replay_p` equation holding the call's :class:`Body`).
2. The calls of one body under name stacks that differ only in the microbatch index form a
   *class*. Each class's body equations are labelled once, as if inlined at its first call
   (the labels depend on the name stack, and the microbatch index changes no label).
3. A class's body is cut into maximal runs of one task label. Each run of two or more
   equations becomes a *block*: one ``closed_call`` equation whose body (the run) every call
   of the class shares. Glue equations (no task) stay single equations, so glue is still
   placed one equation at a time.
4. Each placeholder becomes its class's blocks and glue over its own variables, under its
   own name stack (so every equation still shows its microbatch).

A call then costs a few dozen equations, and identical blocks keep one body object, so later
passes and the executable cache see them as the same program. Classes in a region whose
schedule may split the backward into ``B`` and ``W`` (``zero-bubble-h2``, ``custom``) also
cut each backward run where it passes between activation and weight gradient, so that the
split ``plan/_pipeline`` makes after tracing never falls inside a block.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax.extend.core as jex
from jax.extend.core import primitives

from multimesh_flax.core.declare._schedules import Phase
from multimesh_flax.core.trace import _session
from multimesh_flax.core.trace._jaxprs import make_jaxpr_object

# Stands for one call of a body traced once, until ``expand`` replaces it.
replay_p = jex.Primitive("mm_replay")
replay_p.multiple_results = True

_MICROBATCH_INDEX = re.compile(r"(mmmb\d+_)\d+")
# Schedules whose backward may be split into B and W per equation after tracing.
_SPLITTING_SCHEDULES = ("zero-bubble-h2", "custom")


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """A placeholder's parameter: the call's body, inlined once over placeholder variables.

    ``template`` has ``invars``, ``consts`` ((variable, value) pairs), ``eqns``, ``suffixes``
    (each equation's name stack below the call's) and ``outvars``. Not a jaxpr, so passes
    that look for loop and branch bodies in parameters do not see it.
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


@dataclasses.dataclass
class Expanded:
    """The program's equations with every placeholder replaced, index-aligned lists."""

    eqns: list[Any]
    stacks: list[str]
    labels: list[Any]
    renamed: dict[Any, Any]  # placeholder outputs that are another variable or a literal
    origins: list[int] = dataclasses.field(default_factory=list)  # index of the source eqn


# (equations, stacks) -> (labels, equations with their constraints concretised)
LabelFn = Callable[[list[Any], list[str]], tuple[list[Any], list[Any]]]


@dataclasses.dataclass
class _Class:
    template: Any
    stack: str  # the name stack of the class's first call
    items: list[Any] = dataclasses.field(default_factory=list)  # eqns over template vars
    labels: list[Any] = dataclasses.field(default_factory=list)
    suffixes: list[str] = dataclasses.field(default_factory=list)


def _class_key(eqn: Any, stack: str) -> tuple[int, str]:
    return id(eqn.params["body"].template), _MICROBATCH_INDEX.sub(r"\1*", stack)


def _join(prefix: str, suffix: str) -> str:
    if not prefix:
        return suffix
    return f"{prefix}/{suffix}" if suffix else prefix


def expand(
    eqns: Sequence[Any],
    stacks: Sequence[str],
    label: LabelFn,
    const: Callable[[Any], Any],
    session: _session.TraceSession,
) -> Expanded:
    """Labels the program and replaces each placeholder by its class's blocks and glue.

    ``label`` labels a list of equations (and concretises their constraints) in one go; it
    sees the program's own equations and each class's body once. ``const`` makes the
    program variable of a body constant (once per body, shared by all its calls).
    """
    classes: dict[tuple[int, str], _Class] = {}
    for eqn, stack in zip(eqns, stacks, strict=True):
        if eqn.primitive is replay_p:
            key = _class_key(eqn, stack)
            if key not in classes:
                classes[key] = _Class(eqn.params["body"].template, stack)
    own = [i for i, e in enumerate(eqns) if e.primitive is not replay_p]
    all_eqns = [eqns[i] for i in own]
    all_stacks = [stacks[i] for i in own]
    for cls in classes.values():
        all_eqns.extend(cls.template.eqns)
        all_stacks.extend(_join(cls.stack, s) for s in cls.template.suffixes)
    labels, labelled = label(all_eqns, all_stacks)
    at = len(own)
    for cls in classes.values():
        n = len(cls.template.eqns)
        body = _Labelled(labelled[at : at + n], labels[at : at + n], cls.template.suffixes)
        _segment(cls, body, _splits_backward(cls.stack, session))
        at += n
    return _emit(eqns, stacks, own, labelled, labels, classes, const)


@dataclasses.dataclass
class _Labelled:
    eqns: list[Any]
    labels: list[Any]
    suffixes: list[str]


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


def reaches_other_owner(eqns: Sequence[Any], owners: Sequence[Any]) -> list[bool]:
    """Per equation: does an output feed (transitively) an equation of another owner?

    ``owners`` gives each equation's owner, ``None`` for equations that own nothing (their
    readers' owners still count through them).
    """
    reach: dict[Any, set[Any]] = {}
    critical = [False] * len(owners)
    for i in reversed(range(len(owners))):
        out: set[Any] = set()
        for v in eqns[i].outvars:
            out |= reach.get(v, set())
        critical[i] = bool(out - {owners[i]})
        mine = _cap(out | ({owners[i]} if owners[i] is not None else set()))
        for v in eqns[i].invars:
            if not isinstance(v, jex.Literal):
                reach[v] = _cap(reach.get(v, set()) | mine)
    return critical


def _activation_gradient(body: _Labelled) -> set[int]:
    """The backward equations of a body that ``plan/_pipeline`` keeps in ``B`` when it splits
    the backward: those feeding another task's backward, and their producers in their own
    run of the label. The other backward equations become ``W``; blocks must not mix them."""
    owners = [lab.task if lab is not None and lab.phase is Phase.B else None for lab in body.labels]
    critical = reaches_other_owner(body.eqns, owners)
    producer = {v: i for i, eqn in enumerate(body.eqns) for v in eqn.outvars}
    seeds = [i for i, owner in enumerate(owners) if owner is not None and critical[i]]
    return with_producers(body.eqns, producer, seeds, body.labels)


def with_producers(
    eqns: Sequence[Any], producer: dict[Any, int], seeds: Sequence[int], groups: Sequence[Any]
) -> set[int]:
    """``seeds`` and, transitively, the producers of their inputs in their own group
    (``groups[i]``: equation ``i``'s label or pipeline unit)."""
    stack, found = list(seeds), set()
    while stack:
        i = stack.pop()
        if i in found:
            continue
        found.add(i)
        for v in eqns[i].invars:
            j = None if isinstance(v, jex.Literal) else producer.get(v)
            if j is not None and groups[j] == groups[i]:
                stack.append(j)
    return found


def _segment(cls: _Class, body: _Labelled, split: bool) -> None:
    """Fills ``cls.items``: the body's runs of one task label as blocks, glue as is.

    Sums that only feed the body's outputs, directly or through such sums, stay single
    equations too: they may add a parameter's gradient shares from two tasks, which
    ``plan/_accumulate`` re-associates across microbatches (summing each submesh's shares
    before they move). With ``split`` (a schedule splitting the backward), a backward run
    is also cut where it passes between activation and weight gradient.
    """
    last_use = _last_uses(body.eqns, cls.template.outvars)
    single = _output_sums(body.eqns, cls.template.outvars)
    activation = _activation_gradient(body) if split else set()

    def key(i: int) -> tuple[Any, bool]:
        return body.labels[i], i in activation

    start = 0
    while start < len(body.eqns):
        end = start + 1
        if body.labels[start] is not None and start not in single:
            while end < len(body.eqns) and key(end) == key(start) and end not in single:
                end += 1
        run = body.eqns[start:end]
        cls.items.append(run[0] if len(run) == 1 else _block(run, end, last_use))
        cls.labels.append(body.labels[start])
        cls.suffixes.append(body.suffixes[start])
        start = end


def _output_sums(eqns: Sequence[Any], outvars: Sequence[Any]) -> set[int]:
    """The indices of sums whose one reader is the body's outputs or another such sum."""
    readers: dict[Any, list[Any]] = {v: ["out"] for v in outvars if not isinstance(v, jex.Literal)}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, jex.Literal):
                readers.setdefault(v, []).append(i)
    found: set[int] = set()
    for i in reversed(range(len(eqns))):
        only = readers.get(eqns[i].outvars[0], []) if is_sum(eqns[i]) else []
        if len(only) == 1 and (only[0] == "out" or only[0] in found):
            found.add(i)
    return found


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


def _emit(
    eqns: Sequence[Any],
    stacks: Sequence[str],
    own: list[int],
    labelled: list[Any],
    labels: list[Any],
    classes: dict[tuple[int, str], _Class],
    const: Callable[[Any], Any],
) -> Expanded:
    out = Expanded([], [], [], {})
    own_at = {i: n for n, i in enumerate(own)}
    consts: dict[int, list[tuple[Any, Any]]] = {}
    for i, (eqn, stack) in enumerate(zip(eqns, stacks, strict=True)):
        if eqn.primitive is not replay_p:
            out.eqns.append(labelled[own_at[i]])
            out.stacks.append(stack)
            out.labels.append(labels[own_at[i]])
            out.origins.append(i)
            continue
        cls = classes[_class_key(eqn, stack)]
        template = cls.template
        if id(template) not in consts:
            consts[id(template)] = [(v, const(value)) for v, value in template.consts]
        _instantiate(cls, eqn, stack, consts[id(template)], out)
        out.origins.extend([i] * (len(out.eqns) - len(out.origins)))
    return out


def _instantiate(
    cls: _Class, call: Any, stack: str, consts: list[tuple[Any, Any]], out: Expanded
) -> None:
    """Appends one call's copy of its class's items to ``out``."""
    template = cls.template
    args = [out.renamed.get(v, v) if isinstance(v, jex.Var) else v for v in call.invars]
    env: dict[Any, Any] = dict(zip(template.invars, args, strict=True))
    env.update(consts)
    # The call's own output variables stand for the body outputs the items compute.
    preset: dict[Any, Any] = {}
    for tv, pv in zip(template.outvars, call.outvars, strict=True):
        if not isinstance(tv, jex.Literal) and tv not in env and tv not in preset:
            preset[tv] = pv
    for item, task, suffix in zip(cls.items, cls.labels, cls.suffixes, strict=True):
        invars = [v if isinstance(v, jex.Literal) else env[v] for v in item.invars]
        outvars = [preset.get(v) or jex.Var(v.aval) for v in item.outvars]
        env.update(zip(item.outvars, outvars, strict=True))
        out.eqns.append(item.replace(invars=invars, outvars=outvars))
        out.stacks.append(_join(stack, suffix))
        out.labels.append(task)
    for tv, pv in zip(template.outvars, call.outvars, strict=True):
        value = tv if isinstance(tv, jex.Literal) else env[tv]
        if value is not pv:
            out.renamed[pv] = value


def rename(eqns: list[Any], renamed: dict[Any, Any]) -> list[Any]:
    """``eqns`` reading ``renamed[v]`` wherever they read a renamed ``v``."""
    if not renamed:
        return eqns
    out = []
    for eqn in eqns:
        if any(not isinstance(v, jex.Literal) and v in renamed for v in eqn.invars):
            invars = [v if isinstance(v, jex.Literal) else renamed.get(v, v) for v in eqn.invars]
            eqn = eqn.replace(invars=invars)
        out.append(eqn)
    return out
