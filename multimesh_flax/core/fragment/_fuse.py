"""Fusing a fragment into a later one on its submesh, once the dispatch order is fixed.

Each fragment is one ``jax.jit``: one dispatch per step, its results materialised as
buffers, no XLA fusion across its boundary. In a pipelined step a submesh often runs two
fragments back to back that could be one program -- the last stage's forward and backward
of a microbatch (the forward's residuals are read only by that backward), or, with one
microbatch, the first stage's backward and the optimizer update after it. :func:`fuse_adjacent` runs
such pairs as one fragment, when that changes neither a value, nor any submesh's order, nor
when anything else can start, and does not add an executable to compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

ENABLED = True  # internal switch: False leaves the fragments as partitioned (tests compare)
_MAX_ROUNDS = 4  # a fused fragment may fuse again (F + B, then + W); each round is linear


@dataclasses.dataclass
class _Index:
    """Who produces and reads what, by position in the dispatch order (built once a round)."""

    order: Sequence[Any]
    made_at: dict[Any, int]  # var -> position of the fragment producing it
    readers: dict[Any, set[int]]  # var -> positions of the fragments reading it
    ancestors: list[int]  # per position, the bit set of positions it depends on

    @classmethod
    def build(cls, order: Sequence[Any]) -> _Index:
        made_at: dict[Any, int] = {}
        readers: dict[Any, set[int]] = {}
        ancestors: list[int] = []
        for p, frag in enumerate(order):
            producers = set()
            for v in frag.invars:
                readers.setdefault(v, set()).add(p)
                producers.add(made_at.get(v))
            producers.discard(None)
            bits = 0
            for q in producers:
                bits |= ancestors[q] | (1 << q)
            ancestors.append(bits)
            made_at.update((v, p) for v in frag.outvars)
        return cls(order, made_at, readers, ancestors)

    def waits_for(self, reader: int, p: int) -> bool:
        return bool(self.ancestors[reader] >> p & 1)

    def others_wait_for(self, p: int, b: int) -> bool:
        """Whether every reader of ``p``'s outputs on another place already waits for ``b``."""
        place = self.order[p].place
        return all(
            r == b or self.order[r].place == place or self.waits_for(r, b)
            for v in self.order[p].outvars
            for r in self.readers.get(v, ())
        )


def _may_fuse(index: _Index, a: int, b: int, skipped: Sequence[int], memo: _Memo) -> bool:
    """Whether running ``b`` right after ``a``, as one fragment, delays nothing (see
    :func:`fuse_adjacent`)."""
    order, place = index.order, index.order[a].place
    if any(memo.has_effects(order[p]) for p in (a, b, *skipped)):
        return False
    for v in order[b].invars:  # every input of b is ready when a starts
        q = index.made_at.get(v)
        if q is None or q == a:
            continue
        if (order[q].place == place and q > a) or (
            order[q].place != place and not index.waits_for(a, q)
        ):
            return False
    # a's results reach other places only once b is done: fine if they wait for b anyway;
    # the same holds for same-place glue that b overtakes.
    return all(index.others_wait_for(p, b) for p in (a, *skipped))


def _candidates(index: _Index, queue: list[int]) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(a, b, skipped)``: each fragment with the next on its place, and a pipeline unit
    with the next unit past the glue between them (that glue, ``skipped``, runs after)."""
    order, pairs = index.order, []
    for i, a in enumerate(queue[:-1]):
        pairs.append((a, queue[i + 1], ()))
        if order[a].unit is None:
            continue
        j = i + 1
        while j < len(queue) and order[queue[j]].unit is None:
            j += 1
        if i + 1 < j < len(queue):
            pairs.append((a, queue[j], tuple(queue[i + 1 : j])))
    return pairs


def _size(frag: Any) -> Hashable:
    """What fragments of one signature share, cheaply: compared first."""
    return frag.place, len(frag.eqns), len(frag.invars), len(frag.outvars)


class _Memo:
    """What is known of each fragment, kept across rounds: its signature and whether it has
    effects, each computed on first use. Keyed by identity (fragments are not hashable);
    each entry holds its fragment, which pins the id while the memo lives."""

    def __init__(self) -> None:
        self._signatures: dict[int, tuple[Any, Hashable]] = {}
        self._effects: dict[int, tuple[Any, bool]] = {}

    def signature(self, frag: Any) -> Hashable:
        """A cheap stand-in for a fragment's executable: equal for the copies of one stage's
        unit (or of one glue pattern) on one place. Collisions only mis-count executables."""
        if id(frag) not in self._signatures:
            key = (
                _size(frag),
                tuple(_shape(e) for e in frag.eqns),
                tuple((v.aval.shape, v.aval.dtype) for v in frag.invars),
            )
            self._signatures[id(frag)] = (frag, key)
        return self._signatures[id(frag)][1]

    def has_effects(self, frag: Any) -> bool:
        if id(frag) not in self._effects:
            self._effects[id(frag)] = (frag, any(e.effects for e in frag.eqns))
        return self._effects[id(frag)][1]


def _shape(eqn: Any) -> Hashable:
    """An equation's primitive; for a block (a call of a run of equations), also the size of
    its body, never its identity: the same block of two microbatch classes is one executable."""
    body = eqn.params.get("call_jaxpr")
    if body is None:
        return eqn.primitive
    return eqn.primitive, len(body.jaxpr.eqns), len(body.jaxpr.invars), len(body.jaxpr.outvars)


def _wiring(index: _Index, a: int, b: int, outputs: set[Any]) -> Hashable:
    """How ``b`` reads ``a`` and what of ``a`` is still needed outside: the pair's shape."""
    first, second = index.order[a], index.order[b]
    out_at = {v: i for i, v in enumerate(first.outvars)}
    in_at = {v: i for i, v in enumerate(first.invars)}
    reads = tuple(
        ("out", out_at[v]) if v in out_at else ("in", in_at.get(v)) for v in second.invars
    )
    kept = tuple(_needed_outside(index, v, (a, b), outputs) for v in first.outvars)
    return reads, kept


def _needed_outside(index: _Index, var: Any, pair: tuple[int, int], outputs: set[Any]) -> bool:
    """Whether a result of ``pair[0]`` is read by anything but ``pair[1]`` (which it cannot
    be: a fragment does not read its own results)."""
    readers = index.readers.get(var, ())
    return var in outputs or len(readers) > (pair[1] in readers)


def _fused(index: _Index, a: int, b: int, outputs: set[Any]) -> Any:
    first, second = index.order[a], index.order[b]
    made = set(first.outvars)
    seen = set(first.invars)
    invars = [*first.invars, *(v for v in second.invars if v not in made and v not in seen)]
    kept = [v for v in first.outvars if _needed_outside(index, v, (a, b), outputs)]
    same_mb = first.microbatch == second.microbatch
    return dataclasses.replace(
        first,
        label=first.label if first.label is not None else second.label,
        unit=first.unit if first.unit is not None else second.unit,
        microbatch=first.microbatch if same_mb else None,
        eqns=[*first.eqns, *second.eqns],
        invars=invars,
        outvars=[*kept, *second.outvars],
        parts=(*(first.parts or (first,)), *(second.parts or (second,))),
    )


def _accepted(index: _Index, outputs: set[Any], memo: _Memo) -> list[tuple[int, int]]:
    """The pairs to fuse: every pair of one shape, and only if that fuses *all* fragments of
    both its classes (so each accepted shape turns two executables into one).

    Pairs are grouped by their fragments' signatures first; how ``b`` reads ``a``
    (:func:`_wiring`, the costly part of a shape) is asked only of a group that covers both
    classes, and the group is a shape only if every pair of it is wired alike (a part of
    it could not cover them).
    """
    queues: dict[Any, list[int]] = {}
    for p, frag in enumerate(index.order):
        queues.setdefault(frag.place, []).append(p)
    groups: dict[Hashable, list[tuple[int, int]]] = {}
    sig: dict[int, Hashable] = {}
    for queue in queues.values():
        for a, b, skipped in _candidates(index, queue):
            if _may_fuse(index, a, b, skipped, memo):
                sig.setdefault(a, memo.signature(index.order[a]))
                sig.setdefault(b, memo.signature(index.order[b]))
                groups.setdefault((sig[a], sig[b]), []).append((a, b))
    if not groups:
        return []
    sizes = {_size(index.order[p]) for p in sig}
    count: dict[Hashable, int] = {}
    for p, frag in enumerate(index.order):
        if p in sig or _size(frag) in sizes:  # others cannot share a candidate's signature
            key = sig[p] if p in sig else memo.signature(frag)
            count[key] = count.get(key, 0) + 1
    taken: set[int] = set()
    accepted = []
    for (first, second), pairs in groups.items():
        members = {p for pair in pairs for p in pair}
        whole = len(pairs) == count[first] == count[second] and first != second
        disjoint = len(members) == 2 * len(pairs) and not members & taken
        if whole and disjoint and len({_wiring(index, a, b, outputs) for a, b in pairs}) == 1:
            taken |= members
            accepted.extend(pairs)
    return accepted


def fuse_adjacent(order: Sequence[Any], outputs: set[Any]) -> list[Any]:
    """Fuses fragment ``b`` into an earlier fragment ``a`` on the same place, at ``a``'s
    position in the dispatch order, wherever that is exactly equivalent and not costlier.

    Contract (``order``: fragments in dispatch order, ``outputs``: the program's outputs):

    * **Candidates.** ``b`` is the next fragment on ``a``'s place; or, when ``a`` is a
      pipeline unit, the next unit on the place, past glue that then runs after ``b`` (the
      last stage's loss sums sit between its ``F_k`` and ``B_k``).
    * **Nothing waits longer.** Every input of ``b`` is ready when ``a`` starts: a program
      input, made by ``a``, made earlier on the same place, or made on another place by a
      fragment ``a`` depends on (only that value's own transfer, dispatched right after its
      producer, may still be in flight). So the fused fragment starts when ``a`` would, and
      ``b`` starts when ``a`` ends, as before. Results of ``a`` (and of skipped glue) delayed by
      ``b`` go only to the same place or to fragments that wait for ``b`` anyway. No fragment
      with effects moves. Each place runs the same equations in the same order (but for
      skipped glue, now after ``b``), so values, every place's order of units (the
      schedule's rows) and every cross-place dependency are unchanged; only ``b``'s
      dispatch moves earlier.
    * **Not more executables.** Pairs are grouped by shape (the two fragments' signatures
      and how ``b`` reads ``a``): a shape fuses only if its pairs cover every fragment of
      both signatures (last-stage ``F_k`` + ``B_k`` for every ``k`` under 1F1B; under
      GPipe only the last microbatch's pair is adjacent, so nothing fuses). With one
      microbatch each fragment runs once, so every allowed pair fuses.
    * **No residual buffers.** A value only ``b`` read stops being an output; the fused
      fragment records its ``parts`` (for names and timelines).

    Rounds repeat (a fused fragment may fuse again) until none fuses, at most a few times.
    Each round is linear in the fragments' equations and boundary values (plus a bit set
    per fragment). ``tests/core/test_fuse.py`` shows the rule on pipelined training steps.
    """
    order = list(order)
    memo = _Memo()
    for _ in range(_MAX_ROUNDS if ENABLED else 0):
        index = _Index.build(order)
        pairs = _accepted(index, outputs, memo)
        if not pairs:
            break
        into = dict(pairs)
        dropped = set(into.values())
        order = [
            _fused(index, p, into[p], outputs) if p in into else frag
            for p, frag in enumerate(order)
            if p not in dropped
        ]
    return order
