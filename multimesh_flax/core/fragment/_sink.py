"""Moving an equation into the one later fragment that reads it, once the order is fixed.

Two steps of the arrange pass (``_partition.arrange_fragments``) share one mechanism
(:func:`_moves`): an equation of a glue fragment whose results exactly one later fragment on
its submesh reads, that reads no pipeline unit's output (so nothing it waits for changes) and
is no program output, runs at the start of that reader. Both return a new fragment list:
the fragments an equation left or joined are new (their boundaries are for the arrange pass
to recompute), the others are the ones given, and nothing given is edited.

* :func:`sink_glue` -- into later glue. Glue is dispatched as soon as its inputs exist, so
  work that only the optimizer update at the end of a step needs (Adam's ``b1 * mu``, weight
  decay) would otherwise run in the step's first fragment and hand every such value to the
  last one: two dispatch handles per parameter and the values held all step.
* :func:`sink_into_units` -- a microbatch's input-only glue into its unit. Glue that depends
  only on the program's inputs is *free*: the cutter pools it into one fragment per submesh,
  dispatched first (``_partition._Cutter``). That is right for batch slicing, which differs
  per microbatch, but it also pools what a microbatch computes from its slice alone -- with
  the gradient taken inside the loop, the loss's backward through the targets (a
  vocabulary-sized scatter per microbatch), positions, masks: one fragment growing with the
  number of microbatches (more to compile) holding ``m`` such arrays from the first
  dispatch until each microbatch's backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.extend.core as jex

from multimesh_flax.core.trace import TracedProgram, equation_key

# A move: (position of the equation's glue fragment, the equation, position of its reader)
_Move = tuple[int, Any, int]


def sink_glue(traced: TracedProgram, order: Sequence[Any]) -> list[Any]:
    """``order`` with the glue equations whose results only one later glue fragment on the
    same place reads moved into that fragment.

    Only equations that read no output of a pipeline unit move, so gradient sums still run
    as each microbatch's gradients arrive; pipeline units themselves are left as they are.
    """
    moves = _moves(traced, order, lambda eqn: True, lambda eqn, target: order[target].unit is None)
    return _apply(order, moves)


def sink_into_units(traced: TracedProgram, order: Sequence[Any]) -> list[Any]:
    """``order`` with the microbatch glue that only one unit of its microbatch reads moved
    into that unit (at its start).

    Besides :func:`_moves`' conditions, the equation belongs to the unit's microbatch, and
    moves are kept per *unit group* (the units of one region, stage and phase on one place,
    one per microbatch) only where every unit of the group receives an equation identical
    to the others' at the same position (``_structure.equation_key``): the
    copies then stay structurally equal and compile once. An equation that differs between
    microbatches (a slice at the microbatch's offset) stays where it is, and so does
    everything it would have needed to move with it.

    Example: in gpt-tiny's 2-stage step each microbatch's target slice stays in the free
    fragment and the one-hot gradient of the loss computed from it moves into the last
    stage's forward/backward unit of that microbatch.
    """
    equations = traced.equations
    position = {id(e): i for i, e in enumerate(traced.jaxpr.eqns)}
    excluded: set[int] = set()

    def of_a_microbatch(eqn: Any) -> bool:
        return id(eqn) not in excluded and equations[position[id(eqn)]].microbatch is not None

    def of_its_microbatch(eqn: Any, target: int) -> bool:
        unit = order[target].unit
        mb = equations[position[id(eqn)]].microbatch
        return unit is not None and mb == (unit.region, unit.microbatch)

    while True:
        moves = _moves(traced, order, of_a_microbatch, of_its_microbatch)
        differing = _differing(order, moves)
        if not differing:
            break
        excluded |= differing
    return _apply(order, moves)


def _moves(
    traced: TracedProgram,
    order: Sequence[Any],
    admits: Callable[[Any], bool],
    accepts: Callable[[Any, int], bool],
) -> list[_Move]:
    """The equations of glue fragments that may move to their one later reader on their
    place, in program order: those ``admits(eqn)`` (checked first: it is cheap) and
    ``accepts(eqn, reader position)``.

    Fragments and equations are visited last first: an equation whose readers all moved
    into one fragment follows them there; one a fragment still reads stays.
    """
    outputs = {v for v in traced.jaxpr.outvars if not isinstance(v, jex.Literal)}
    from_units = {v for f in order if f.unit is not None for e in f.eqns for v in e.outvars}
    admitted = [
        (pos, eqn)
        for pos, frag in enumerate(order)
        if frag.unit is None
        for eqn in frag.eqns
        if admits(eqn)
    ]
    # var -> {position of a fragment reading it: how many of its equations do}, for the
    # results of admitted equations: the only readers asked about
    readers: dict[Any, dict[int, int]] = {v: {} for _, eqn in admitted for v in eqn.outvars}
    literal = jex.Literal
    for pos, frag in enumerate(order):
        for eqn in frag.eqns:
            for v in eqn.invars:
                at = None if type(v) is literal else readers.get(v)
                if at is not None:
                    at[pos] = at.get(pos, 0) + 1
    moves: list[_Move] = []
    for pos, eqn in reversed(admitted):
        users = set().union(*(readers[v].keys() for v in eqn.outvars))
        target = next(iter(users)) if len(users) == 1 else None
        if (
            target is None
            or target <= pos
            or eqn.effects
            or order[target].place != order[pos].place
            or outputs.intersection(eqn.outvars)
            or any(v in from_units for v in eqn.invars if not isinstance(v, jex.Literal))
            or not accepts(eqn, target)
        ):
            continue
        moves.append((pos, eqn, target))
        for v in eqn.invars:  # the fragment may still read v through other equations
            at = None if type(v) is literal else readers.get(v)
            if at is not None:
                at[pos] -= 1
                if not at[pos]:
                    del at[pos]
                at[target] = at.get(target, 0) + 1
    return moves[::-1]


def _apply(order: Sequence[Any], moves: list[_Move]) -> list[Any]:
    """``order`` with the moving equations taken out of their fragments and put, in program
    order, at the start of their readers (every reader lies after the fragments moving into
    it). Fragments no equation left or joined are returned as they are."""
    moved = {id(eqn) for _, eqn, _ in moves}
    prepended: dict[int, list[Any]] = {}
    for _, eqn, target in moves:
        prepended.setdefault(target, []).append(eqn)
    touched = {pos for pos, _, _ in moves} | prepended.keys()
    return [
        dataclasses.replace(
            frag,
            eqns=[*prepended.get(pos, ()), *(e for e in frag.eqns if id(e) not in moved)],
        )
        if pos in touched
        else frag
        for pos, frag in enumerate(order)
    ]


def _differing(order: Sequence[Any], moves: list[_Move]) -> set[int]:
    """Ids of the moving equations that would make a unit group's copies differ."""
    groups: dict[Any, dict[int, list[Any]]] = {}  # unit group -> {microbatch: equations}
    for _, eqn, target in moves:
        unit = order[target].unit
        group = (unit.region, unit.stage, unit.phase, order[target].place)
        groups.setdefault(group, {}).setdefault(unit.microbatch, []).append(eqn)
    members: dict[Any, set[int]] = {}  # unit group -> the microbatches it has units of
    for frag in order:
        unit = frag.unit
        if unit is not None:
            group = (unit.region, unit.stage, unit.phase, frag.place)
            members.setdefault(group, set()).add(unit.microbatch)
    differing: set[int] = set()
    memo: dict[int, Any] = {}  # the copies of one equation share their parameter dicts
    for group, by_mb in groups.items():
        lists = list(by_mb.values())
        if len(lists) != len(members[group]) or len({len(x) for x in lists}) != 1:
            differing.update(id(e) for x in lists for e in x)  # not every copy gets them
            continue
        for column in zip(*lists, strict=True):
            if len({equation_key(e, memo) for e in column}) > 1:
                differing.update(id(e) for e in column)
    return differing
