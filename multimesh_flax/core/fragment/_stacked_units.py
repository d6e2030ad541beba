"""A chain's gradients made stacks of per-device partial sums, unit by unit.

:func:`stack_chain` is what ``_packed_sums`` calls for a chain of running sums on a place of
several devices. For each unit of the chain it finds the blocks that compute the gradients
the unit's link adds (``_plan_unit``) and how each computes them as per-device partial sums
(``_stacked_sums.plan_body``), then rewrites them all (``_rewrite_unit``,
``_stacked_sums.stacked_body``) once every unit qualifies and the chain's one batch is
accepted; otherwise nothing is edited.

A gradient may pass through several blocks of its unit: the Flax step's backward computes it
in one block and lays it out as its parameter in the next (a block of sharding constraints).
Walked backwards from the gradients, a block may take an input stacked where the block
before it makes that input, reads it nowhere else, and can itself make it stacked (an
activation cannot be: it is no sum over rows); that block then stacks it too. A sharding
constraint standing alone in the unit (a gradient's layout that ``trace._blocks`` keeps out
of its block, or the only one left in it) is planned as a block of itself
(``_constraints_as_blocks``), and stays as it was unless it is rewritten.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.extend.core as jex

from multimesh_flax.core.fragment._stacked_sums import Batch, _Plan, plan_body, stacked_body
from multimesh_flax.core.trace import as_block, concrete_constraint, is_block


class _Planned(NamedTuple):
    """A block of a unit to rewrite: its outputs at ``outs`` stacked as ``plan`` says."""

    block: Any
    outs: tuple[int, ...]
    plan: _Plan


def stack_chain(
    order: list[Any],
    links: dict[int, list[Any]],
    chain: list[tuple[int, int]],
    alone: Callable[[Any, int | None], bool],
    batches_at: Callable[[Any], dict[int, Batch]],
    accept: Callable[[Batch], bool],
) -> Batch | None:
    """Makes every gradient the links of ``chain`` add a stack of per-device partial sums
    (module doc), editing the blocks that compute them in ``order`` and the links' operands
    in ``links``; returns the batch they are stacked over, or ``None`` (nothing edited)
    where the chain does not qualify or ``accept(batch)`` refuses its batch.

    A gradient may come from a chain of blocks of its unit (a backward's block, then a
    block of the sharding constraints laying its gradients out as their parameters): a
    block's stacked inputs are stacked outputs of the block making them, which nothing
    else reads. ``alone(v, at)``: whether ``v``'s only reader is the fragment at position
    ``at`` (``None``: a link); ``batches_at(place)``: ``_stacked_sums.batch_axes`` of the place's
    fragments."""
    units: dict[int, list[_Planned]] = {}
    blocked: dict[int, list[Any]] = {}  # per unit, its equations with constraints as blocks
    for pos, k in chain:
        eqn = links[pos][k]
        grads = eqn.invars[len(eqn.outvars) :]
        if not all(alone(v, None) for v in grads):
            return None
        batches = batches_at(order[pos].place)
        eqns = blocked.setdefault(pos, _constraints_as_blocks(order[pos].eqns))
        planned = _plan_unit(eqns, grads, batches, functools.partial(alone, at=pos))
        if planned is None:
            return None
        units[pos] = planned
    found = {b for planned in units.values() for p in planned for b in p.plan.split.values()}
    if len(found) != 1 or not accept(batch := next(iter(found))):
        return None
    rewritten = {pos: _rewrite_unit(blocked[pos], units[pos], batch) for pos in units}
    if any(r is None for r in rewritten.values()):
        return None
    renamed: dict[Any, Any] = {}  # a planned output -> its stack
    for pos, (eqns, names) in rewritten.items():
        kept = zip(eqns, blocked[pos], order[pos].eqns, strict=True)
        eqns = [old if new is block else new for new, block, old in kept]
        order[pos] = dataclasses.replace(order[pos], eqns=eqns)
        renamed.update(names)
    for pos, k in chain:
        eqn = links[pos][k]
        links[pos][k] = eqn.replace(invars=[renamed.get(v, v) for v in eqn.invars])
    return batch


def _constraints_as_blocks(eqns: Sequence[Any]) -> list[Any]:
    """``eqns`` with each sharding constraint onto a mesh standing alone (where it lays out a
    gradient, the last of its block: ``trace._blocks``) made a block of itself, so a
    gradient can be followed through it; the constraints not rewritten stay as they were."""
    return [as_block(e) if concrete_constraint(e) is not None else e for e in eqns]


def _plan_unit(
    eqns: Sequence[Any],
    grads: Sequence[Any],
    batches: dict[int, Batch],
    alone_here: Callable[[Any], bool],
) -> list[_Planned] | None:
    """The blocks of a unit (``eqns``) to rewrite so that ``grads`` come out stacked, in
    order; ``None`` where one cannot be. Walked backwards: a block's stacked inputs are
    outputs its producer must stack too. A block may take an input stacked only where the
    block making it can make it so (an activation it reads cannot be: it is no sum)."""
    made = {v: (e, i) for e in eqns if is_block(e) for i, v in enumerate(e.outvars)}
    if not all(v in made for v in grads):
        return None

    def open_ins(block: Any) -> tuple[int, ...]:
        return tuple(
            i for i, v in enumerate(block.invars) if v in made and alone_here(v) and stackable(v)
        )

    @functools.cache
    def stackable(v: Any) -> bool:
        producer, j = made[v]
        return (
            plan_body(producer.params["call_jaxpr"], (j,), open_ins(producer), batches) is not None
        )

    wanted: dict[int, set[int]] = {}
    for v in grads:
        block, i = made[v]
        wanted.setdefault(id(block), set()).add(i)
    planned = []
    for block in reversed(eqns):
        if id(block) not in wanted:
            continue
        outs = tuple(sorted(wanted[id(block)]))
        plan = plan_body(block.params["call_jaxpr"], outs, open_ins(block), batches)
        if plan is None:
            return None
        planned.append(_Planned(block, outs, plan))
        for i in plan.input_positions():
            producer, j = made[block.invars[i]]
            wanted.setdefault(id(producer), set()).add(j)
    return planned[::-1]


def _rewrite_unit(
    eqns: Sequence[Any], planned: list[_Planned], batch: Batch
) -> tuple[list[Any], dict[Any, Any]] | None:
    """``eqns`` with the ``planned`` blocks rewritten, and each planned output's stack
    (a new variable); ``None`` where a rewrite fails to trace."""
    renamed: dict[Any, Any] = {}
    new: dict[int, Any] = {}
    for block, outs, plan in planned:
        closed = stacked_body(block.params["call_jaxpr"], outs, plan, batch)
        if closed is None:
            return None
        ins = plan.input_positions()
        invars = [renamed[v] if i in ins else v for i, v in enumerate(block.invars)]
        outvars = list(block.outvars)
        for i in outs:
            stack = jex.Var(closed.out_avals[i])
            renamed[outvars[i]] = stack
            outvars[i] = stack
        params = {**block.params, "call_jaxpr": closed}
        new[id(block)] = block.replace(params=params, invars=invars, outvars=outvars)
    return [new.get(id(e), e) for e in eqns], renamed
