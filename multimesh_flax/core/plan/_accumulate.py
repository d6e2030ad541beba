"""Gradient accumulation in schedule order: re-associating sums over microbatches.

A backward taken outside ``microbatch`` sums each parameter's gradient as a chain of
additions in *reverse* microbatch order (``((g7 + g6) + g5) + ...``: the transpose walks the
program backwards), and ``microbatch`` itself reduces in microbatch order. Under a schedule
the microbatches finish their backward in yet another order (1F1B finishes microbatch 0
first), and a chain in the wrong order cannot start before its first operands exist: the
whole sum becomes a tail of additions after the last backward.

:func:`reassociate_sums` rebuilds every such sum -- a tree of ``add``/``add_any`` glue with
equal operand types over values of at least two microbatches -- as a chain in the order the
schedule's simulation predicts its operands to be ready, so each addition can run as soon as
its microbatch's contribution exists. When the operands come from tasks on several submeshes
(a tied embedding: the stem's and the head's gradient of one table), each submesh first sums
its own operands, and the partial sums meet once, on the submesh whose partial is ready
last: one transfer per step instead of one per microbatch, off the critical path. The result
is the same sum, up to floating-point rounding of the new association order. On
tensor-parallel stages ``parallelize_step`` lays each microbatch's gradient out as its
parameter, so a tied table's two shares are added *and laid out* on the table's submesh
every microbatch; the tree then goes through that layout (``_tied_layouts``) and each share
is laid out alike on its own submesh, with the same partition spec (``_laid_out``): the
head's share, summed where it is made, moves once a step (gpt-tiny S=2 m=16, data 2 x
tensor 2 stages: the [264, 64] table's gradient moved 16 times a step, now once).

:func:`bundle_sums` then makes each microbatch's additions one equation per producing
block: the sums that add outputs of the same two equations (one block's gradients of all its
parameters, onto the running sums of the previous microbatch) become one ``closed_call``
whose body holds those additions. They are one unit of work anyway -- same inputs' producers,
so the same place and the same ready time -- and the passes after it, the runtime's op list
and the fragments' jaxprs then carry a few equations per microbatch instead of one per
parameter (70 of gpt-tiny's 135 per microbatch). The values are the same bit for bit.
Once the fragments are in dispatch order, each bundle runs at the end of the backward unit
that makes its gradients (``fragment._sums``); a bundle lists its sums in the order of
its gradients among the unit's results, so every microbatch's bundle has one body.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.extend.core as jex
from jax.extend.core import primitives
from jax.sharding import NamedSharding

from multimesh_flax.core.declare import place_of
from multimesh_flax.core.plan import _pipeline
from multimesh_flax.core.trace import (
    Equation,
    TracedProgram,
    as_block,
    concrete_constraint,
    is_sum,
    make_jaxpr_object,
)

_EARLY = (-1, float("-inf"))
# internal switch: False leaves a tied gradient's layout where the step put it (tests compare)
THROUGH_LAYOUTS = True
_BUNDLE = "sums over microbatches"  # what a bundle's body says it is (its debug info)


def _ready_times(traced: TracedProgram, plan: _pipeline.PipelinePlan) -> dict[Any, Any]:
    """Per variable, the predicted ``(region rank, end)`` of the last unit it waits for."""
    ends = {unit: (rank, end) for unit, (rank, _, end) in _pipeline.unit_times(plan).items()}
    ready: dict[Any, Any] = {}
    for equation in traced.equations:
        eqn, unit = equation.eqn, equation.unit
        time = ends.get(unit, _EARLY) if unit is not None else _EARLY
        for v in eqn.invars:
            if not isinstance(v, jex.Literal):
                time = max(time, ready.get(v, _EARLY))
        for v in eqn.outvars:
            ready[v] = time
    return ready


@dataclasses.dataclass
class _Tree:
    root: int
    nodes: list[int]
    leaves: list[Any]
    layouts: list[int | None]  # per leaf, the constraint that laid out its sum (see below)


def _sum_trees(traced: TracedProgram, producer: dict[Any, int]) -> list[_Tree]:
    """The trees of additions rooted at sums outside every microbatch.

    A tree's inner nodes are additions whose only reader is another addition of the tree,
    also inside a microbatch: when each microbatch's body is one traced program, a shared
    parameter's gradient shares from two tasks (a tied table) are added inside the
    microbatch's backward before the sum over microbatches adds them up. A training step
    may lay that addition's result out as its parameter (a sharding constraint between it
    and the sum over microbatches, ``_tied_layouts``): the tree goes through the
    constraint, and each leaf below it keeps it in ``layouts``.
    """
    eqns = traced.jaxpr.eqns
    uses: dict[Any, int] = {v: 1 for v in traced.jaxpr.outvars if not isinstance(v, jex.Literal)}
    for e in eqns:
        for v in e.invars:
            if not isinstance(v, jex.Literal):
                uses[v] = uses.get(v, 0) + 1
    sums = {i for i, e in enumerate(eqns) if is_sum(e)}
    layouts = _tied_layouts(traced, producer, uses, sums) if THROUGH_LAYOUTS else {}
    inner = {
        producer[v]
        for i in sums
        for v in eqns[i].invars
        if producer.get(v) in sums and uses[v] == 1
    } | set(layouts.values())
    trees = []
    for root in sorted(sums - inner):
        if traced.equations[root].microbatch is not None:
            continue
        tree = _Tree(root, [], [], [])
        stack: list[tuple[bool, Any, int | None]] = [(True, root, None)]
        while stack:  # in order: leaves come out left to right
            is_node, item, layout = stack.pop()
            if not is_node:
                tree.leaves.append(item)
                tree.layouts.append(layout)
                continue
            tree.nodes.append(item)
            for v in reversed(eqns[item].invars):
                j = producer.get(v)
                if j in layouts:
                    tree.nodes.append(j)
                    stack.append((True, layouts[j], j))
                else:
                    stack.append((True, j, layout) if j in inner else (False, v, layout))
        trees.append(tree)
    return trees


def _tied_layouts(
    traced: TracedProgram, producer: dict[Any, int], uses: dict[Any, int], sums: set[int]
) -> dict[int, int]:
    """``{constraint: sum}``: the sharding constraints, each read by one sum, that lay out
    one sum of gradient shares made on several submeshes (``parallelize_step`` lays each
    microbatch's gradient of a tied table out as the table, on the table's submesh). The
    sums over microbatches then go through them (``_laid_out``)."""
    eqns = traced.jaxpr.eqns
    found: dict[int, int] = {}
    for i in sums:
        for v in eqns[i].invars:
            j = producer.get(v)
            if j is None or uses.get(v) != 1 or concrete_constraint(eqns[j]) is None:
                continue
            shares = eqns[j].invars[0]
            k = producer.get(shares)
            if k not in sums or uses.get(shares) != 1:
                continue
            if len(set(_leaf_places(traced, eqns[k].invars, producer)) - {None}) > 1:
                found[j] = k
    return found


def _microbatches(traced: TracedProgram, leaves: list[Any], producer: dict[Any, int]) -> set[Any]:
    calls = traced.microbatch_calls
    found = {
        _pipeline.microbatch_of(traced.equations[producer[v]].stack, calls)
        for v in leaves
        if v in producer
    }
    found.discard(None)
    return found


def _leaf_places(traced: TracedProgram, leaves: list[Any], producer: dict[Any, int]) -> list[Any]:
    """Per leaf, the place of the task that produced it (``None`` for glue and inputs)."""
    places = []
    for v in leaves:
        label = traced.equations[producer[v]].label if v in producer else None
        places.append(None if label is None else place_of(traced.tasks[label.task].mesh))
    return places


def _sum_in_order(
    template: Any, leaves: list[Any], places: list[Any], ready: dict[Any, Any], out: Any
) -> list[Any]:
    """The sum of ``leaves`` as chains in ready order: one partial sum per place, then the
    partials, starting with the one ready last (see module doc)."""

    def key(v: Any) -> Any:
        return ready.get(v, _EARLY)

    groups: dict[Any, list[Any]] = {}
    for v, place in sorted(zip(leaves, places, strict=True), key=lambda vp: key(vp[0])):
        groups.setdefault(place, []).append(v)
    if len(groups) == 1:
        return _chain(template, sorted(leaves, key=key), out)
    eqns, partials = [], []
    for group in groups.values():
        if len(group) == 1:
            partials.append(group[0])
            continue
        partial = jex.Var(out.aval)
        eqns += _chain(template, group, partial)
        partials.append(partial)
        ready[partial] = key(group[-1])
    partials.sort(key=key)
    # The last-ready partial goes first: glue with equal input bytes from two places runs
    # where its first operand lives (``fragment._place``), so the other partials move to it.
    return eqns + _chain(template, [partials[-1], *partials[:-1]], out)


def _chain(template: Any, leaves: list[Any], out: Any) -> list[Any]:
    """``leaves[0] + leaves[1] + ...`` left to right, the last addition writing ``out``."""
    eqns, acc = [], leaves[0]
    for k, leaf in enumerate(leaves[1:], start=2):
        result = out if k == len(leaves) else jex.Var(out.aval)
        eqns.append(template.replace(invars=[acc, leaf], outvars=[result]))
        acc = result
    return eqns


def reassociate_sums(
    traced: TracedProgram, plan: _pipeline.PipelinePlan
) -> tuple[TracedProgram, _pipeline.PipelinePlan]:
    """Rewrites sums over microbatches as chains in predicted-ready order (see module doc).

    Returns the rewritten program and plan (new equations are glue outside every
    microbatch); both unchanged when no sum needs it.
    """
    ready = _ready_times(traced, plan)
    eqns = traced.jaxpr.eqns
    producer = traced.producer
    # root index -> new chain; a tied layout's index -> its leaves' layouts; other nodes -> []
    replaced: dict[int, list[Any]] = {}
    for tree in _sum_trees(traced, producer):
        if len(tree.leaves) < 3 or len(_microbatches(traced, tree.leaves, producer)) < 2:
            continue
        places = _leaf_places(traced, tree.leaves, producer)
        in_order = tree.leaves == sorted(tree.leaves, key=lambda v: ready.get(v, _EARLY))
        if in_order and len(set(places)) == 1:
            continue  # already summed in ready order, all on one submesh
        root = eqns[tree.root]
        for i in tree.nodes:
            replaced[i] = []
        leaves = _laid_out(traced, tree, places, ready, replaced)
        replaced[tree.root] = _sum_in_order(root, leaves, places, ready, root.outvars[0])
    if not replaced:
        return traced, plan
    return _rebuild(traced, plan, replaced)


def _laid_out(
    traced: TracedProgram,
    tree: _Tree,
    places: list[Any],
    ready: dict[Any, Any],
    replaced: dict[int, list[Any]],
) -> list[Any]:
    """The tree's leaves, each below a tied layout laid out as the layout says, on its own
    submesh: the same partition spec on the mesh of the task that made it (unconstrained
    where the spec does not fit that mesh). The constraints take the layout's place in the
    program (``replaced``), recorded as their leaf's task and microbatch, so each runs with
    the backward that makes its share."""
    eqns, producer = traced.jaxpr.eqns, traced.producer
    leaves = []
    for leaf, layout, place in zip(tree.leaves, tree.layouts, places, strict=True):
        sharding = None if layout is None else _on_place(traced, eqns[layout], leaf, place)
        if sharding is None:
            leaves.append(leaf)
            continue
        out = jex.Var(leaf.aval)
        params = {**eqns[layout].params, "sharding": sharding}
        eqn = as_block(eqns[layout].replace(invars=[leaf], outvars=[out], params=params))
        mine = traced.equations[layout]
        moved = sharding is not concrete_constraint(eqns[layout])  # onto another submesh
        record = traced.equations[producer[leaf]] if moved else mine
        replaced[layout].append(record._replace(eqn=eqn, stack=mine.stack))
        ready[out] = ready.get(leaf, _EARLY)
        leaves.append(out)
    return leaves


def _on_place(traced: TracedProgram, layout: Any, leaf: Any, place: Any) -> Any:
    """``layout``'s sharding for ``leaf`` made on ``place``: its own (the same object) where
    it names that submesh (or ``leaf`` is glue), else its spec on the mesh of the task that
    made ``leaf``; ``None`` where the spec does not fit there."""
    sharding = concrete_constraint(layout)
    if place is None or place == place_of(sharding.mesh):
        return sharding
    label = traced.equations[traced.producer[leaf]].label
    mesh = traced.tasks[label.task].mesh
    try:
        moved = NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
        moved.shard_shape(leaf.aval.shape)
    except ValueError:  # an axis the mesh lacks, or a dimension it does not divide
        return None
    return moved


def _rebuild(
    traced: TracedProgram, plan: _pipeline.PipelinePlan, replaced: dict[int, list[Any]]
) -> tuple[TracedProgram, _pipeline.PipelinePlan]:
    """The program with equation ``i`` replaced by the chain ``replaced[i]``.

    Every other equation keeps its record; a replacement chain is glue that mixes
    microbatches (its records keep only the name stack), except where it is given as
    records (``Equation``, ``_laid_out``).
    """
    equations: list[Equation] = []
    for i, equation in enumerate(traced.equations):
        chain = replaced.get(i)
        if chain is None:
            equations.append(equation)
        else:
            equations.extend(
                e if isinstance(e, Equation) else Equation(e, equation.stack, mixed=True)
                for e in chain
            )
    jaxpr = traced.jaxpr
    program = make_jaxpr_object(
        list(jaxpr.constvars),
        list(jaxpr.invars),
        list(jaxpr.outvars),
        [e.eqn for e in equations],
        "program",
        consts=traced.consts,
    )
    traced = dataclasses.replace(traced, jaxpr=program, equations=tuple(equations))
    return traced, dataclasses.replace(plan, equations=traced.equations)


def bundle_sums(
    traced: TracedProgram, plan: _pipeline.PipelinePlan
) -> tuple[TracedProgram, _pipeline.PipelinePlan]:
    """Bundles the sums over microbatches that add outputs of the same two equations into
    one equation at the first one's position (see module doc).

    Only glue sums outside every microbatch are bundled (sums over microbatches are: the
    loop's own reduction, a backward's accumulation, ``reassociate_sums``' chains), and
    only those whose operands both come from equations: their producers decide where they
    run and when they are ready, so a bundle runs where and when each of its sums would
    have. A sum reading an earlier bundle's output counts that bundle as its producer, so a
    chain over microbatches stays one bundle per link. Returns the program and plan
    unchanged when nothing bundles.
    """
    eqns, producer = traced.jaxpr.eqns, traced.producer
    group_of: dict[int, int] = {}  # sum index -> index of its bundle's first sum
    bundles: dict[tuple[int, int], list[int]] = {}
    for i, equation in enumerate(traced.equations):
        eqn = equation.eqn
        glue = equation.label is None or equation.mixed
        if not (glue and equation.microbatch is None and is_sum(eqn)):
            continue
        sources = [producer.get(v) for v in eqn.invars]
        if None in sources:
            continue
        first, second = (group_of.get(j, j) for j in sources)
        members = bundles.setdefault((first, second), [])
        members.append(i)
        group_of[i] = members[0]
    replaced: dict[int, list[Any]] = {}
    for members in bundles.values():
        if len(members) > 1:
            replaced.update({i: [] for i in members})
            ordered = sorted(members, key=lambda i: _operand_rank(eqns, producer, i))
            replaced[members[0]] = [_bundle([eqns[i] for i in ordered])]
    if not replaced:
        return traced, plan
    return _rebuild(traced, plan, replaced)


def _operand_rank(eqns: Any, producer: dict[Any, int], i: int) -> int:
    """Where the sum ``eqns[i]``'s new operand (its second) is among its producer's results:
    the same for every link of a chain, so each microbatch's bundle lists its sums in the
    same order (the links run inside their units, ``fragment._sums``, and a unit's copies
    must stay one program) whatever order the plan's rewrites left them in."""
    v = eqns[i].invars[1]
    return eqns[producer[v]].outvars.index(v)


def is_bundle(eqn: Any) -> bool:
    """Whether ``eqn`` is a bundle of sums made by :func:`bundle_sums`."""
    body = eqn.params.get("call_jaxpr") if eqn.primitive is primitives.closed_call_p else None
    return body is not None and body.jaxpr.debug_info.func_src_info == _BUNDLE


def _bundle(sums: list[Any]) -> Any:
    """One ``closed_call`` computing every equation of ``sums`` (each ``a + b``)."""
    signature = tuple(
        (e.primitive, tuple(v.aval for v in e.invars), e.outvars[0].aval) for e in sums
    )
    return jex.new_jaxpr_eqn(
        [e.invars[0] for e in sums] + [e.invars[1] for e in sums],
        [e.outvars[0] for e in sums],
        primitives.closed_call_p,
        _bundle_params(signature),
        frozenset(),
        sums[0].source_info,
    )


def behind_barrier(eqn: Any) -> Any:
    """The sum or bundle of sums ``eqn`` as a bundle whose second operands pass an
    optimization barrier first: the same additions, which the compiler cannot fuse into the
    computation of those operands (a matrix product accumulating onto the running sum would
    round differently). For sums that run inside the program making their operands
    (``fragment._sums``)."""
    if is_bundle(eqn):
        body = eqn.params["call_jaxpr"].jaxpr
        signature = tuple(
            (e.primitive, tuple(v.aval for v in e.invars), e.outvars[0].aval) for e in body.eqns
        )
    else:
        signature = ((eqn.primitive, tuple(v.aval for v in eqn.invars), eqn.outvars[0].aval),)
    return eqn.replace(
        primitive=primitives.closed_call_p, params=_bundle_params(signature, barrier=True)
    )


@functools.lru_cache(maxsize=256)
def _bundle_params(signature: tuple[Any, ...], barrier: bool = False) -> dict[str, Any]:
    """The parameters of a bundle of sums (its body), one dict per signature: bundles of the
    same parameters' gradients (one per microbatch) share it, as the copies of a block share
    theirs, and later passes that remember a parameter dict by identity see them as one.
    ``barrier``: the second operands pass an optimization barrier first."""
    lefts = [jex.Var(ins[0]) for _, ins, _ in signature]
    rights = [jex.Var(ins[1]) for _, ins, _ in signature]
    outs = [jex.Var(out) for _, _, out in signature]
    eqns = []
    operands = rights
    if barrier:
        operands = [jex.Var(v.aval) for v in rights]
        eqns.append(jex.new_jaxpr_eqn(rights, operands, _barrier_primitive(), {}, frozenset()))
    eqns += [
        jex.new_jaxpr_eqn([a, b], [c], prim, {}, frozenset())
        for (prim, _, _), a, b, c in zip(signature, lefts, operands, outs, strict=True)
    ]
    body = make_jaxpr_object([], lefts + rights, outs, eqns, _BUNDLE)
    return {"call_jaxpr": jex.ClosedJaxpr(body, [])}


@functools.cache
def _barrier_primitive() -> Any:
    """``lax.optimization_barrier``'s primitive (``jax.extend`` does not name it)."""
    return jax.make_jaxpr(jax.lax.optimization_barrier)(0.0).eqns[0].primitive
