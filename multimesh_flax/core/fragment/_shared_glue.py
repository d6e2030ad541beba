"""Glue that another submesh runs too, split off so that both run one program.

At the end of a step each submesh updates its parameters in one glue fragment (the
optimizer's update, with the slicing of its packed running sums, ``_packed_sums``). Stages
that hold the same blocks run the same update program: compiled once, relocated to the
others (``run._relocate``). But the first stage updates its blocks together with the
embedding, and the last together with the head: two programs of their own, each as costly to
compile as the blocks' update alone (gpt-tiny S=4 m=8 GPipe: 0.40 and 0.37 s against
0.31 s for a middle stage's).

:func:`split_shared_glue` cuts such a fragment in two when a part of it is what glue on
another submesh of the same shape runs. The fragment's *pieces* are the connected components
of its equations (a parameter's update, a packed chain's slicing and every update reading it),
and a piece is *shared* when a piece of the same structure is glue on such a submesh too. The
shared pieces become one fragment, the others a second one right after it, when the shared
part has the structure of another submesh's (split or whole) fragment: the program sharing is
then certain, not hoped for. The cost is one op more per step on that submesh; only glue
outside every microbatch is split, so never one more per microbatch.

Structures are compared, and the fragments involved run, with their equations in a
canonical order (:func:`_canonical`): the passes before merge each stage's glue in an order
of their own (gpt-tiny's 2-block stages: one stage computes a gradient's square before
adding it to the first moment, the other after), and that order would otherwise make
two equal updates different programs.

Pieces are independent but for scalars computed from the fragment's scalar inputs (an
optimizer's step count and bias corrections): each part computes its own copy of those
equations. The values are those of the fragment unsplit up to XLA's rounding: the same
equations on the same inputs, but XLA compiles the arithmetic of a smaller program
differently at times (one ulp in one element of a head's update, ``tests/core/
test_shared_glue.py``), as any change of fusion may.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax.extend.core as jex

from multimesh_flax.core.declare import Place
from multimesh_flax.core.fragment._jaxpr import fragment_jaxpr
from multimesh_flax.core.trace import TracedProgram, structural_key

ENABLED = True  # internal switch: False leaves every glue fragment whole (tests compare)


@dataclasses.dataclass
class _Pieces:
    """A glue fragment's equations as independent pieces and the scalars they share."""

    frag: Any  # the Fragment
    pieces: list[list[int]]  # per piece, its equations' positions in ``frag.eqns``
    scalars: dict[int, set[int]]  # per piece number, the shared scalar equations it reads


def split_shared_glue(
    traced: TracedProgram,
    fragments: Sequence[Any],
    shape_of: Callable[[Place], Hashable],
) -> list[Any] | None:
    """``fragments`` (in dispatch order, boundaries set) with each glue fragment outside
    every microbatch whose shared pieces another submesh runs as one program split in two
    (module doc); ``None`` if none is. ``shape_of(place)``: what a place's programs depend on
    besides its devices (its mesh's axes and shape). New fragments have their boundaries
    set; ``fragments`` are not edited."""
    if not ENABLED:
        return None
    needed = _needed(traced, fragments)
    ranks = {v: i for i, v in enumerate(traced.jaxpr.outvars) if not isinstance(v, jex.Literal)}
    found = {
        pos: _pieces(_canonical(frag, ranks, needed), needed)
        for pos, frag in enumerate(fragments)
        if _splittable(frag)
    }
    memo: dict[int, Any] = {}

    def key(part: Any) -> Hashable:
        return shape_of(part.place), structural_key(fragment_jaxpr(part), memo)

    piece_keys = {
        pos: [key(_part(p, [k], needed)) for k in range(len(p.pieces))] for pos, p in found.items()
    }
    shared = _shared_pieces(fragments, found, piece_keys)
    splits: dict[int, tuple[Any, Any]] = {}
    whole_keys: dict[int, Hashable] = {}
    for pos, pieces in found.items():
        mine = shared[pos]
        if len(mine) == len(pieces.pieces):  # a candidate to share with, not to split
            whole_keys[pos] = key(pieces.frag)
        elif mine:
            rest = [k for k in range(len(pieces.pieces)) if k not in mine]
            splits[pos] = (_part(pieces, mine, needed), _part(pieces, rest, needed))
    split_keys = {pos: key(first) for pos, (first, _) in splits.items()}
    kept = _matched(fragments, split_keys, whole_keys)
    if not kept:
        return None
    targets = {split_keys[pos] for pos in kept}
    index = 1 + max(p.index for f in fragments for p in f.parts or (f,))
    result = []
    for pos, frag in enumerate(fragments):
        if pos in kept:
            first, rest = splits[pos]
            result += [first, dataclasses.replace(rest, index=index)]
            index += 1
        elif whole_keys.get(pos) in targets:  # run as compared: in canonical order
            result.append(found[pos].frag)
        else:
            result.append(frag)
    return result


def _splittable(frag: Any) -> bool:
    """Glue run once a step (fused glue too, ``_fuse``), without effects (their order would
    be split too)."""
    return (
        frag.label is None
        and frag.unit is None
        and frag.microbatch is None
        and len(frag.eqns) > 1
        and not any(e.effects for e in frag.eqns)
    )


def _canonical(frag: Any, ranks: dict[Any, int], needed: set[Any]) -> Any:
    """``frag`` with its equations in an order that depends on what they compute, not on
    how the passes before merged them: each equation right after the ones it reads, first
    those of the program's first output (``ranks``: a variable's position among the
    program's outputs), operands in order -- a depth-first walk back from the outputs.

    The optimizer's update of the same blocks on two stages then lists its equations in one
    order (a parameter's moments and update, then the next parameter's), though the glue
    merged into each (``_partition._merge_glue``, one fragment per dependency pattern) came
    in different orders."""
    eqns = frag.eqns
    made = {v: i for i, e in enumerate(eqns) for v in e.outvars}

    def rank(i: int) -> tuple[int, int]:
        outs = [ranks[v] for v in eqns[i].outvars if v in ranks]
        return min(outs, default=len(ranks)), i

    roots = sorted((i for i, e in enumerate(eqns) if any(v in needed for v in e.outvars)), key=rank)
    order: list[int] = []
    done: set[int] = set()
    for root in [*roots, *range(len(eqns))]:  # then whatever no output needs, as it was
        stack = [(root, False)]
        while stack:
            i, ready = stack.pop()
            if i in done:
                continue
            if ready:
                done.add(i)
                order.append(i)
                continue
            stack.append((i, True))
            reads = [made.get(v) for v in eqns[i].invars if not isinstance(v, jex.Literal)]
            stack += [(j, False) for j in reversed(reads) if j is not None and j not in done]
    if order == list(range(len(eqns))):
        return frag
    return _with_boundaries(frag, [eqns[i] for i in order], needed)


def _with_boundaries(frag: Any, eqns: list[Any], needed: set[Any]) -> Any:
    """``frag`` running ``eqns``: inputs in order of first use, outputs (those read
    elsewhere) in order of making, the constants it still reads."""
    made = {v for e in eqns for v in e.outvars}
    invars = list(
        dict.fromkeys(
            v for e in eqns for v in e.invars if not isinstance(v, jex.Literal) and v not in made
        )
    )
    outvars = [v for e in eqns for v in e.outvars if v in needed]
    inputs = set(invars)
    consts = tuple((v, x) for v, x in frag.consts if v in inputs)
    return dataclasses.replace(
        frag, eqns=eqns, invars=invars, outvars=outvars, consts=consts, parts=()
    )


def _needed(traced: TracedProgram, fragments: Sequence[Any]) -> set[Any]:
    """The variables read outside the fragment making them: program outputs and every
    fragment's inputs."""
    needed = {v for v in traced.jaxpr.outvars if not isinstance(v, jex.Literal)}
    for frag in fragments:
        needed.update(frag.invars)
    return needed


def _pieces(frag: Any, needed: set[Any]) -> _Pieces:
    """``frag``'s pieces (module doc).

    A *shared scalar* equation makes scalars only nothing outside ``frag`` reads, from
    ``frag``'s scalar inputs, literals and other shared scalars: each piece reading it gets a
    copy. Every other equation belongs to one piece, with each equation it shares a variable
    with. Shared scalars that no piece reads are dropped (nothing reads them).
    """
    eqns = frag.eqns
    made = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    scalar: set[int] = set()

    def shared_input(v: Any) -> bool:  # a literal, a scalar input, a shared scalar's result
        if isinstance(v, jex.Literal):
            return True
        return made[v] in scalar if v in made else v.aval.shape == ()

    for i, e in enumerate(eqns):
        outs = all(v.aval.shape == () and v not in needed for v in e.outvars)
        if e.outvars and outs and all(shared_input(v) for v in e.invars):
            scalar.add(i)
    parent = list(range(len(eqns)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, e in enumerate(eqns):
        if i in scalar:
            continue
        for v in e.invars:
            j = None if isinstance(v, jex.Literal) else made.get(v)
            if j is not None and j not in scalar:
                parent[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(eqns)):
        if i not in scalar:
            groups.setdefault(root(i), []).append(i)
    pieces = list(groups.values())
    return _Pieces(
        frag, pieces, {k: _scalars_read(eqns, p, scalar, made) for k, p in enumerate(pieces)}
    )


def _scalars_read(
    eqns: list[Any], piece: list[int], scalar: set[int], made: dict[Any, int]
) -> set[int]:
    """The shared scalar equations ``piece`` reads, directly or through others."""
    found: set[int] = set()
    todo = [
        made[v]
        for i in piece
        for v in eqns[i].invars
        if not isinstance(v, jex.Literal) and v in made
    ]
    while todo:
        j = todo.pop()
        if j in scalar and j not in found:
            found.add(j)
            todo += [
                made[v] for v in eqns[j].invars if not isinstance(v, jex.Literal) and v in made
            ]
    return found


def _part(pieces: _Pieces, which: Sequence[int], needed: set[Any]) -> Any:
    """The fragment running ``pieces``' pieces ``which`` (in the original equations' order),
    with its own copies of the shared scalars they read, and its boundaries."""
    frag = pieces.frag
    keep = {i for k in which for i in pieces.pieces[k]}
    copies = set().union(*(pieces.scalars[k] for k in which))
    renamed: dict[Any, Any] = {}

    def reads(e: Any) -> list[Any]:
        return [v if isinstance(v, jex.Literal) else renamed.get(v, v) for v in e.invars]

    eqns = []
    for i in sorted(keep | copies):  # the part's own positions: linear in its size, so
        e = frag.eqns[i]  # keying every piece of a fragment costs one pass over it
        if i in copies:
            outs = [jex.Var(v.aval) for v in e.outvars]
            eqns.append(e.replace(invars=reads(e), outvars=outs))
            renamed.update(zip(e.outvars, outs, strict=True))
        else:
            new = reads(e)
            same = all(a is b for a, b in zip(new, e.invars, strict=True))
            eqns.append(e if same else e.replace(invars=new))
    return _with_boundaries(frag, eqns, needed)


def _shared_pieces(
    fragments: Sequence[Any], found: dict[int, _Pieces], piece_keys: dict[int, list[Hashable]]
) -> dict[int, list[int]]:
    """Per fragment in ``found``, its pieces of a structure that a piece of glue on another
    place has too."""
    places: dict[Hashable, set[Place]] = {}
    for pos, keys in piece_keys.items():
        for k in keys:
            places.setdefault(k, set()).add(fragments[pos].place)
    return {
        pos: [k for k, key in enumerate(piece_keys[pos]) if places[key] - {fragments[pos].place}]
        for pos in found
    }


def _matched(
    fragments: Sequence[Any], split_keys: dict[int, Hashable], whole_keys: dict[int, Hashable]
) -> set[int]:
    """The fragments to split: those whose shared part has the structure of another place's
    shared part, or of another place's fragment made of shared pieces only."""
    places: dict[Hashable, set[Place]] = {}
    for pos, k in [*split_keys.items(), *whole_keys.items()]:
        places.setdefault(k, set()).add(fragments[pos].place)
    return {pos for pos, k in split_keys.items() if places[k] - {fragments[pos].place}}
