"""Running sums over microbatches inside the units that produce their operands.

Under a schedule the plan rewrites each gradient sum over microbatches as a chain in the
order the microbatches' backwards finish, one bundled addition per link
(``plan._accumulate``): ``acc_k = acc_{k-1} + g_k``, where ``g_k`` are one block's
gradients from the backward (or, zero-bubble, the weight-gradient) unit of microbatch ``k``
and ``acc_{k-1}`` comes from the same unit of the previous microbatch on the same submesh.
As glue, each link is a fragment of its own: one more op per microbatch and stage to
dispatch, with 2n arguments and n results for n gradients.

:func:`sums_into_units` moves such a link to the end of the unit fragment that produces its
operands when every other operand is made earlier on the same submesh -- by the previous
microbatch's unit. A submesh runs its fragments in dispatch order, so the unit already
starts after those operands exist: the move adds no ordering constraint, and the sums add
the same values in the same order. What it changes: the link no longer costs an op, and
the unit's results that go to another submesh (the activation gradients for the previous
stage) leave once the additions are done too. A link whose operands meet from two submeshes
(a tied table's partial sums) stays where it was.

*One program per unit.* A chain's first link adds two units' gradients (``g_0 + g_1``); moved
as it is, the first unit would run without a link and the others with one: two programs
of every backward (a full backward compile more each, measured 1.5-2 s for gpt-tiny's
stages). So each chain starts from zeros: ``acc_0 = zeros + g_0`` runs in the first unit,
the zeros made by a small glue fragment dispatched right before it, from the constant 0
placed on its submesh (its one input: so it runs there, replicated, and an equally shaped
submesh's zeros relocate its program rather than compile their own). A unit's links are
appended in the order the unit makes their gradients (``_in_gradient_order``), not the
order the glue held them in, which can differ in a chain's last unit. Every copy
of the unit then runs one program, and the glue programs of the links are gone. ``0 + g`` is
``g`` for every float but ``-0.0``, which becomes ``+0.0``: a final sum differs from the
unmoved chain's only where every microbatch's gradient element is ``-0.0`` (it is then
``+0.0``, an equal value); everywhere else it is the same bit for bit. The zeros are
made replicated, unless the unit constrains the gradient they are added to: then they are made
in that sharding. ``parallelize_step`` constrains each microbatch's gradients to their
parameters' shardings on tensor-parallel stages (``layers._step``), where XLA would otherwise
keep the sums split (a kernel over the tensor axis, even a replicated bias's over the data
axis): the first unit would receive its zeros in another sharding than the others receive
their running sums, and ``jax.jit`` would compile it a second time (gpt-tiny S=2 m=16: 1.6 s
more of compile, still so for a program under ``mm.jit`` that leaves its gradients
unconstrained).

Inside the unit a link's gradients pass an optimization barrier before the additions
(``plan.behind_barrier``): otherwise XLA may fuse an addition into the computation of its
gradient (a tensor-parallel stage's matrix product accumulating onto the running sum), which
rounds differently; with the barrier the sums stay the same bit for bit.

The running sum a link reads (the zeros, for the first) is *donated* to the unit
(``Fragment.donate``) when nothing else reads it, so the sum's buffer is reused for the next
one and memory does not grow.

On a place of one device a chain then carries one flat running sum instead of one per
gradient (``_packed_sums``): fewer arrays for JAX to pass in and out of every unit. On a
place whose rows are split over a mesh axis it carries each row shard's own partial sums,
stacked (``_stacked_sums``; flat on a data-parallel place, a stack per gradient where the
stage is tensor parallel too): no all-reduce over the rows in the units, one a step where
the sums are read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives

from multimesh_flax.core.fragment._jaxpr import constraints_making
from multimesh_flax.core.fragment._packed_sums import pack_chains
from multimesh_flax.core.plan import behind_barrier, is_bundle
from multimesh_flax.core.trace import TracedProgram, concrete_constraint, is_sum

ENABLED = True  # internal switch: False leaves the sums as glue (tests compare)
PACK = True  # internal switch: False leaves every running sum an array of its own
STACK = True  # internal switch: False packs no chain on a place of several devices


def _running_sums(traced: TracedProgram) -> set[int]:
    """Ids of the equations that may move: sums over microbatches the plan made (bundles,
    and single additions outside every microbatch that it left unbundled)."""
    found = set()
    for equation in traced.equations:
        eqn = equation.eqn
        glue = equation.label is None or equation.mixed
        if glue and equation.microbatch is None and (is_bundle(eqn) or is_sum(eqn)):
            found.add(id(eqn))
    return found


def _target(order: Sequence[Any], made_at: dict[Any, int], eqn: Any, pos: int) -> int | None:
    """The position of the unit ``eqn`` (in the glue fragment at ``pos``) may run at the end
    of, or ``None``: the latest producer of its operands, a unit on the same place before
    ``pos``, every other operand made on that place no later."""
    producers = [made_at.get(v) for v in eqn.invars if not isinstance(v, jex.Literal)]
    if not producers or None in producers or eqn.effects:
        return None
    place = order[pos].place
    target = max(producers)
    if target >= pos or order[target].unit is None:
        return None
    if any(order[q].place != place for q in producers):
        return None
    return target


def sums_into_units(
    traced: TracedProgram, order: Sequence[Any]
) -> tuple[list[Any], set[int]] | None:
    """``order`` (fragments in dispatch order) with each running sum over microbatches moved
    to the end of the unit producing its operands, where that adds no ordering constraint,
    and each chain started from zeros (see module doc).

    Returns ``None`` when nothing moves; otherwise the new list, with new fragments where
    equations moved or a chain's zeros are made (their boundaries for the caller to
    recompute, then :func:`donate_running_sums`), and the ids of the links now in units.
    ``order`` is not edited.
    """
    movable = _running_sums(traced) if ENABLED else set()
    if not movable:
        return None
    made_at = {v: p for p, frag in enumerate(order) for e in frag.eqns for v in e.outvars}
    moves: dict[int, list[Any]] = {}  # target position -> equations, in order
    for pos, frag in enumerate(order):
        if frag.unit is not None:
            continue
        for eqn in frag.eqns:
            target = _target(order, made_at, eqn, pos) if id(eqn) in movable else None
            if target is None:
                continue
            moves.setdefault(target, []).append(eqn)
            made_at.update((v, target) for v in eqn.outvars)
    if not moves:
        return None
    moved = {id(e) for eqns in moves.values() for e in eqns}
    new = list(order)
    for pos, frag in enumerate(order):
        if any(id(e) in moved for e in frag.eqns):
            new[pos] = dataclasses.replace(frag, eqns=[e for e in frag.eqns if id(e) not in moved])
    starts = _start_from_zeros(order, made_at, moves)
    laid_out = _zeros_like_gradients(order, moves, starts)
    links = {
        pos: [behind_barrier(e) for e in _in_gradient_order(order[pos], eqns)]
        for pos, eqns in moves.items()
    }
    shardings = pack_chains(traced, new, links, starts, laid_out, stack=STACK) if PACK else {}
    for pos, eqns in links.items():
        new[pos] = dataclasses.replace(new[pos], eqns=[*new[pos].eqns, *eqns])
    zeros = _with_zeros(new, starts, {**laid_out, **shardings})
    return zeros, {id(e) for eqns in links.values() for e in eqns}


def _in_gradient_order(unit: Any, links: list[Any]) -> list[Any]:
    """``links`` (moved to the end of ``unit``) in the order the unit makes their gradients:
    the same in every copy of the unit, whatever order the glue held them in (the last
    copy's links can come from other glue than the earlier ones', e.g. where a tied
    table's partial sums meet), so every copy stays one program."""
    made = {v: (i, j) for i, e in enumerate(unit.eqns) for j, v in enumerate(e.outvars)}
    last = (len(unit.eqns), 0)

    def key(eqn: Any) -> tuple[int, int]:
        return min((made.get(v, last) for v in eqn.invars[len(eqn.outvars) :]), default=last)

    return sorted(links, key=key)


def _left(eqn: Any) -> list[Any]:
    """The running-sum operands of a link (the first half of a bundle's, an addition's
    first)."""
    return list(eqn.invars[: max(1, len(eqn.invars) // 2)])


def _start_from_zeros(
    order: Sequence[Any], made_at: dict[Any, int], moves: dict[int, list[Any]]
) -> dict[int, list[Any]]:
    """Gives the unit each moved chain starts in a first link ``zeros + g``, so every unit
    of the chain runs the same program (edits ``moves``).

    A chain's first link adds the gradients of two units (``g_0 + g_1``): its running-sum
    operands come from a unit, not from a link. It becomes ``acc_0 + g_1``, ``acc_0 = zeros
    + g_0`` running at the end of ``g_0``'s unit. Returns, per position of such a unit, the
    zeros variables it reads (made by a fragment dispatched right before it).
    """
    made_by_link = {v for eqns in moves.values() for e in eqns for v in e.outvars}
    starts: dict[int, list[Any]] = {}
    for pos, eqns in list(moves.items()):
        for k, eqn in enumerate(eqns):
            left = _left(eqn)
            first = {made_at.get(v) for v in left}
            if len(first) != 1 or any(v in made_by_link for v in left):
                continue
            (unit,) = first
            if unit is None or unit >= pos or order[unit].unit is None:
                continue
            zeros = [jex.Var(v.aval) for v in left]
            acc = [jex.Var(v.aval) for v in left]
            moves.setdefault(unit, []).append(eqn.replace(invars=[*zeros, *left], outvars=acc))
            eqns[k] = eqn.replace(invars=[*acc, *eqn.invars[len(left) :]])
            starts.setdefault(unit, []).extend(zeros)
    return starts


def _zeros_like_gradients(
    order: Sequence[Any], moves: dict[int, list[Any]], starts: dict[int, list[Any]]
) -> dict[Any, Any]:
    """The sharding of each zeros variable whose gradient operand its unit constrains (the
    Flax step lays a split parameter's gradients out as the parameter): the zeros are made
    in it, so the chain's first unit receives its running sums as every later one does and
    runs the same program."""
    shardings: dict[Any, Any] = {}
    for pos, zeros in starts.items():
        made_by = constraints_making(order[pos].eqns)  # inside the backward's blocks too
        concrete = {v: concrete_constraint(e) for v, e in made_by.items()}
        constrained = {v: sharding for v, sharding in concrete.items() if sharding is not None}
        wanted = set(zeros)
        for eqn in moves[pos]:
            left = _left(eqn)
            for acc, grad in zip(left, eqn.invars[len(left) :], strict=False):
                if acc in wanted and grad in constrained:
                    shardings[acc] = constrained[grad]
    return shardings


def _with_zeros(
    order: list[Any], starts: dict[int, list[Any]], shardings: dict[Any, Any]
) -> list[Any]:
    """``order`` with, right before each unit position in ``starts``, a glue fragment that
    makes its zeros: each array filled with the fragment's one input, the constant 0 placed
    on its place (``Fragment.consts``), replicated or in the sharding ``shardings`` gives the
    variable. The input places the program: a program without inputs is compiled for its
    place's devices alone, and the same zeros on another place of the same shape would be
    compiled again; with it, they are relocated (``run._relocate``)."""
    if not starts:
        return order
    index = 1 + max(p.index for f in order for p in f.parts or (f,))
    result = []
    for pos, frag in enumerate(order):
        if pos in starts:
            zeros = starts[pos]
            signature = tuple((v.aval.shape, v.aval.dtype, shardings.get(v)) for v in zeros)
            params = _zeros_params(signature)
            fill = jex.Var(params["call_jaxpr"].in_avals[0])
            eqn = jex.new_jaxpr_eqn([fill], zeros, primitives.closed_call_p, params, frozenset())
            consts = ((fill, np.int32(0)),)
            result.append(
                type(frag)(index=index, place=frag.place, label=None, eqns=[eqn], consts=consts)
            )
            index += 1
        result.append(frag)
    return result


@functools.lru_cache(maxsize=64)
def _zeros_params(signature: tuple[Any, ...]) -> dict[str, Any]:
    """The parameters of a call filling arrays of each ``(shape, dtype, sharding or None)``
    with its one input, an int32 scalar (one dict per signature, so the zeros of every
    step's chains share one program)."""

    def zeros(fill: jax.Array) -> tuple[Any, ...]:
        made = [jax.lax.full(shape, fill, dtype) for shape, dtype, _ in signature]
        return tuple(
            x if s is None else jax.lax.with_sharding_constraint(x, s)
            for x, (_, _, s) in zip(made, signature, strict=True)
        )

    closed = jax.make_jaxpr(zeros)(jax.ShapeDtypeStruct((), jnp.int32))
    return {"call_jaxpr": closed}


def donate_running_sums(
    traced: TracedProgram, fragments: Sequence[Any], links: set[int]
) -> list[Any]:
    """``fragments`` (boundaries set) with, in each unit, the operands of its running sums
    (``links``: equation ids) that an earlier fragment made and that nothing else reads nor
    the program returns marked as donated (``Fragment.donate``): the unit may reuse their
    buffers."""
    outputs = {v for v in traced.jaxpr.outvars if not isinstance(v, jex.Literal)}
    made = {v for frag in fragments for v in frag.outvars}
    readers: dict[Any, int] = {}
    for frag in fragments:
        for v in frag.invars:
            readers[v] = readers.get(v, 0) + 1
    result = []
    for frag in fragments:
        inputs = set(frag.invars)
        donate = tuple(
            dict.fromkeys(
                v
                for e in (frag.eqns if frag.unit is not None else ())
                if id(e) in links
                for v in e.invars
                if not isinstance(v, jex.Literal)
                and v in inputs
                and v in made
                and v not in outputs
                and readers[v] == 1
            )
        )
        result.append(dataclasses.replace(frag, donate=donate) if donate else frag)
    return result
