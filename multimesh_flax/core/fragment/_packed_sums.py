"""One flat running sum per chain of gradient sums (per row shard where rows are split).

``_sums`` runs each link of a chain of running sums over microbatches (``acc_k = acc_{k-1} +
g_k``, one bundle of additions per block) at the end of the unit that makes ``g_k``. The
running sums then cross every unit's boundary: one array per parameter in, one out, in
every microbatch's backward. The arrays are what an op costs the host: JAX's call of a
compiled program grows by about 6 us per output on this CPU host and 2-4 us on an H200's
(``benchmarks/_breakdown.jax_call_costs``), so a gpt-tiny block's 35 running sums cost
more host time than the rest of its backward's call.

:func:`pack_chains` gives such a chain one flat running sum instead: the zeros become one
vector, each link adds its gradients, raveled and concatenated behind the same optimization
barrier, onto it (``flat_k = flat_{k-1} + concat(ravel(g_k))``), and after the last link one
equation slices the vector back into the chain's final sums, behind another barrier, at the
start of the first glue fragment on the place that reads them (the optimizer's update,
usually): no op and no program more. Element for element the additions are the same ones, in
the same order, and the barriers keep XLA from compiling the code around them differently:
the step's results are the same bit for bit. Each sum's offset in the vector is an input of
that fragment, placed there once (``Fragment.consts``), not a literal: so the optimizer's
updates of same-shaped parameters share their compiled kernels (``_offsets``).

On a place of one device no sharding is at stake. On a submesh, concatenating a
tensor-parallel stage's sharded gradients would gather them, and which stages are tensor
parallel is only known once XLA has propagated shardings; but where a stage's rows are
sharded over all its devices (data parallel, read from its sharding constraints), each
device's own partial sums are what the chain carries, stacked (``_stacked_sums``): one
running sum of ``(devices, total size)``, its rows added together where the final sums are
sliced out. Where the rows are sharded over some of its axes and the unit lays each
gradient out on the others (tensor parallel too), each gradient keeps a stack of its own
in that layout, the rows' axes in front (:func:`_stack_apart`): as many arrays as unpacked,
no all-reduce in the units. Elsewhere on a submesh nothing is packed. Only chains of at
least two sums of one dtype are packed (one is enough to stack), and only where each link's
running sum is read by the next link alone, and whose final sums a glue fragment on the
place reads first, before any reader elsewhere (a tied table's head gradient, summed with
the stem's on the first stage, is sliced out on the last stage by its update's glue and
moves from there).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives
from jax.sharding import PartitionSpec

from multimesh_flax.core.fragment._stacked_sums import Batch, batch_axes
from multimesh_flax.core.fragment._stacked_units import stack_chain
from multimesh_flax.core.trace import TracedProgram

_LINK, _OUTPUT = "link", "output"  # readers that are not a fragment (see ``_readers``)


def pack_chains(
    traced: TracedProgram,
    order: list[Any],
    links: dict[int, list[Any]],
    starts: dict[int, list[Any]],
    laid_out: dict[Any, Any],
    *,
    stack: bool = True,
) -> dict[Any, Any]:
    """Packs every chain that qualifies (see module doc), editing ``order`` (fragments in
    dispatch order, without the links yet), ``links`` (position -> the link equations to
    append there) and ``starts`` (position -> the zeros made right before it) in place.
    ``laid_out``: per zeros variable, the sharding its unit constrains the gradient added
    to it to (``_sums._zeros_like_gradients``). ``stack``: also chains on places of several
    devices, as per-device partial sums (``_stacked_sums``). Returns the sharding each such
    chain's zeros must be made in."""
    readers = _readers(traced, order, links)
    zeros_shardings = {}

    @functools.cache
    def batches_at(place: Any) -> dict[int, Batch]:
        return batch_axes([e for frag in order if frag.place == place for e in frag.eqns])

    def alone(v: Any, at: int | None) -> bool:  # whether ``at`` (None: a link) only reads v
        return readers.get(v) == [_LINK if at is None else at]

    for chain in _chains(links, starts):
        (first, _), (last, _) = chain[0], chain[-1]
        finals = list(_link(links, chain[-1]).outvars)  # what the chain's readers read
        reader = _unpack_site(order, readers, last, finals)
        several = any(len(order[pos].place) != 1 for pos, _ in chain)
        if reader is None or not _packable(links, chain, readers, 1 if several else 2):
            continue
        batch = None
        if several:
            if not stack:
                continue
            devices = len(order[first].place)
            shardings = _gradient_shardings(links, chain[0], laid_out)
            accept = functools.partial(_accepts, devices, shardings)
            batch = stack_chain(order, links, chain, alone, batches_at, accept)
            if batch is None:
                continue
            if batch.size != devices:  # tensor parallel too: a stack per gradient
                apart = _stack_apart(order, links, starts, chain, reader, batch, shardings)
                zeros_shardings.update(apart)
                continue
        zeros_shardings.update(_pack_flat(order, links, starts, chain, reader, batch))
    return zeros_shardings


def _pack_flat(
    order: list[Any],
    links: dict[int, list[Any]],
    starts: dict[int, list[Any]],
    chain: list[tuple[int, int]],
    reader: int,
    batch: Batch | None,
) -> dict[Any, Any]:
    """Gives ``chain`` one flat running sum (stacked over ``batch``, a data-parallel
    place's, where not ``None``), sliced back into its final sums where ``order[reader]``
    reads them. Edits ``links``, ``starts`` and ``order``; returns the sharding of the new
    zeros variable, if it has one."""
    finals = list(_link(links, chain[-1]).outvars)
    avals = tuple(v.aval for v in finals)
    params = _link_params(avals, batch)
    flat = jex.Var(params["call_jaxpr"].out_avals[0])
    first = chain[0][0]
    at = starts[first].index(_link(links, chain[0]).invars[0])
    starts[first][at : at + len(avals)] = [flat]
    zeros = {} if batch is None else {flat: batch.sharding()}
    for pos, k in chain:
        eqn = links[pos][k]
        out = jex.Var(flat.aval)
        links[pos][k] = eqn.replace(
            invars=[flat, *eqn.invars[len(avals) :]], outvars=[out], params=params
        )
        flat = out
    unpack_params = _unpack_params(avals, batch)
    offsets = [jex.Var(a) for a in unpack_params["call_jaxpr"].in_avals[1:]]
    unpack = jex.new_jaxpr_eqn(
        [flat, *offsets], finals, primitives.closed_call_p, unpack_params, frozenset()
    )
    frag = order[reader]
    consts = (*frag.consts, *zip(offsets, _offsets(avals), strict=True))
    order[reader] = dataclasses.replace(frag, eqns=[unpack, *frag.eqns], consts=consts)
    return zeros


def _gradient_shardings(
    links: dict[int, list[Any]], at: tuple[int, int], laid_out: dict[Any, Any]
) -> list[Any] | None:
    """The shardings the unit of the chain's first link (``at``) constrains the gradients
    that link adds to (the Flax step lays a tensor-parallel stage's gradients out as their
    parameters), read off ``laid_out`` by the zeros each is added to; ``None`` where one
    is unconstrained."""
    eqn = _link(links, at)
    shardings = [laid_out.get(v) for v in eqn.invars[: len(eqn.outvars)]]
    return None if None in shardings else shardings


def _accepts(devices: int, shardings: list[Any] | None, batch: Batch) -> bool:
    """Whether a chain on a place of ``devices`` devices, its gradients laid out as
    ``shardings``, may be stacked over ``batch``: into one flat sum where the batch spans
    the place, else a stack per gradient, each in its own layout: all known (no dimension
    left to the compiler: the zeros are made in it), on the batch's mesh, none split over
    the batch's axes."""
    if batch.size == devices:
        return True
    if shardings is None:
        return False
    for sharding in shardings:
        if sharding.mesh != batch.mesh or PartitionSpec.UNCONSTRAINED in sharding.spec:
            return False
        used = {a for entry in sharding.spec if entry for a in _names(entry)}
        if used & set(batch.axes):
            return False
    return True


def _names(entry: Any) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` names."""
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _stack_apart(
    order: list[Any],
    links: dict[int, list[Any]],
    starts: dict[int, list[Any]],
    chain: list[tuple[int, int]],
    reader: int,
    batch: Batch,
    shardings: list[Any],
) -> dict[Any, Any]:
    """Gives ``chain`` (its gradients stacked over ``batch``, on a place that is tensor
    parallel too) a stack of running sums per gradient, each in its gradient's layout with
    the batch's axes in front (concatenating them would gather the tensor-parallel ones),
    its devices' rows added where ``order[reader]`` reads the final sums. Edits ``links``,
    ``starts`` and ``order``; returns the sharding of each new zeros variable."""
    stacks = tuple(batch.stacked(s.spec) for s in shardings)
    first_link = _link(links, chain[0])
    n = len(first_link.outvars)
    finals = list(_link(links, chain[-1]).outvars)
    grads = tuple(v.aval for v in first_link.invars[n:])  # renamed: stacked already
    params = _apart_link_params(grads, stacks)
    running = [jex.Var(a) for a in params["call_jaxpr"].out_avals]
    first = chain[0][0]
    at = starts[first].index(first_link.invars[0])
    starts[first][at : at + n] = running
    zeros = dict(zip(running, stacks, strict=True))
    for pos, k in chain:
        eqn = links[pos][k]
        outs = [jex.Var(v.aval) for v in running]
        links[pos][k] = eqn.replace(invars=[*running, *eqn.invars[n:]], outvars=outs, params=params)
        running = outs
    params = _apart_sum_params(grads, tuple(shardings))
    unpack = jex.new_jaxpr_eqn(running, finals, primitives.closed_call_p, params, frozenset())
    order[reader] = dataclasses.replace(order[reader], eqns=[unpack, *order[reader].eqns])
    return zeros


@functools.lru_cache(maxsize=256)
def _apart_link_params(grads: tuple[Any, ...], stacks: tuple[Any, ...]) -> dict[str, Any]:
    """A link of stacks kept apart (``_stack_apart``): ``(*running, *g) -> running +
    barrier(g)``, each sum in its stack's sharding; ``grads``: the stacks' avals."""

    def link(*args: Any) -> tuple[Any, ...]:
        running, added = args[: len(grads)], jax.lax.optimization_barrier(args[len(grads) :])
        return tuple(
            jax.lax.with_sharding_constraint(r + g, s)
            for r, g, s in zip(running, added, stacks, strict=True)
        )

    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in grads]
    return {"call_jaxpr": jax.make_jaxpr(link)(*shapes, *shapes)}


@functools.lru_cache(maxsize=256)
def _apart_sum_params(grads: tuple[Any, ...], shardings: tuple[Any, ...]) -> dict[str, Any]:
    """The final sums of stacks kept apart: each stack's rows added (the step's one
    all-reduce of the chain), in its gradient's sharding, behind a barrier (as
    ``_unpack_params``)."""

    def unpack(*running: Any) -> tuple[Any, ...]:
        sums = [
            jax.lax.with_sharding_constraint(r.sum(0), s)
            for r, s in zip(running, shardings, strict=True)
        ]
        return jax.lax.optimization_barrier(tuple(sums))

    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in grads]
    return {"call_jaxpr": jax.make_jaxpr(unpack)(*shapes)}


def _link(links: dict[int, list[Any]], at: tuple[int, int]) -> Any:
    pos, k = at
    return links[pos][k]


def _chains(links: dict[int, list[Any]], starts: dict[int, list[Any]]) -> list[list[Any]]:
    """Each chain that starts from zeros, as its links' ``(position, index)`` in order."""
    zeros = {v for vs in starts.values() for v in vs}
    by_left: dict[tuple[Any, ...], tuple[int, int]] = {}
    firsts = []
    for pos, eqns in links.items():
        for k, eqn in enumerate(eqns):
            left = tuple(eqn.invars[: len(eqn.outvars)])
            if all(v in zeros for v in left):
                firsts.append((pos, k))
            else:
                by_left[left] = (pos, k)
    chains = []
    for at in firsts:
        chain = [at]
        while (after := by_left.get(tuple(_link(links, chain[-1]).outvars))) is not None:
            chain.append(after)
        chains.append(chain)
    return chains


def _packable(
    links: dict[int, list[Any]], chain: list[Any], readers: dict[Any, list[Any]], least: int
) -> bool:
    """Whether ``chain`` qualifies (module doc): ``least`` or more sums of one dtype (one
    is enough to stack), fewer than 2**31 elements in all, each running sum but the last
    read by the next link alone."""
    outs = _link(links, chain[0]).outvars
    if len(outs) < least or len({v.aval.dtype for v in outs}) != 1:
        return False
    if sum(v.aval.size for v in outs) > np.iinfo(np.int32).max:  # offsets are int32
        return False
    inner = [v for at in chain[:-1] for v in _link(links, at).outvars]
    return all(len(readers.get(v, ())) == 1 for v in inner)


def _readers(
    traced: TracedProgram, order: list[Any], links: dict[int, list[Any]]
) -> dict[Any, list[Any]]:
    """Per variable, one entry per equation reading it: the position in ``order`` of the
    fragment holding the equation, or ``_LINK`` for a link; ``_OUTPUT`` if the program
    returns it."""
    readers: dict[Any, list[Any]] = {}
    sources = [(pos, frag.eqns) for pos, frag in enumerate(order)]
    sources += [(_LINK, eqns) for eqns in links.values()]
    for reader, eqns in sources:
        for eqn in eqns:
            for v in eqn.invars:
                if not isinstance(v, jex.Literal):
                    readers.setdefault(v, []).append(reader)
    for v in traced.jaxpr.outvars:
        if not isinstance(v, jex.Literal):
            readers.setdefault(v, []).append(_OUTPUT)
    return readers


def _unpack_site(
    order: list[Any], readers: dict[Any, list[Any]], after: int, finals: list[Any]
) -> int | None:
    """Where ``finals`` (a chain's final sums, made at ``after``) can be sliced out of the
    flat sum: the position of the first fragment on ``order[after]``'s place that reads
    them -- or, where only other places read them, of the place's first glue fragment after
    the chain -- if it is glue, no link reads them and every fragment elsewhere reading one
    comes later (a tied table's head gradient, added to the stem's on the first stage: its
    transfer now leaves from the slicing fragment); else ``None``."""
    found = [r for v in finals for r in readers.get(v, ()) if r != _OUTPUT]
    if _LINK in found:
        return None
    place = order[after].place
    here = [pos for pos in found if order[pos].place == place]
    if not here and found:
        here = [p for p in range(after + 1, len(order)) if order[p].place == place][:1]
    if not here:
        return None
    first = min(here)
    if order[first].unit is not None or min(found) < first:
        return None
    return first


@functools.lru_cache(maxsize=256)
def _link_params(avals: tuple[Any, ...], batch: Batch | None) -> dict[str, Any]:
    """A packed link's body, one per chain signature (every microbatch's unit runs one
    program): ``(flat, *g) -> flat + concat(ravel(barrier(g)))``; stacked over ``batch``
    (``_stacked_sums``), each ``g`` is ``(d, *shape)`` and raveled per device row."""

    def link(flat: Any, *grads: Any) -> Any:
        grads = jax.lax.optimization_barrier(grads)
        if batch is None:
            return flat + jnp.concatenate([g.ravel() for g in grads])
        rows = jnp.concatenate([g.reshape(batch.size, -1) for g in grads], axis=1)
        return jax.lax.with_sharding_constraint(flat + rows, batch.sharding())

    size = sum(a.size for a in avals)
    rows = () if batch is None else (batch.size,)
    flat = jax.ShapeDtypeStruct((*rows, size), avals[0].dtype)
    shapes = [jax.ShapeDtypeStruct((*rows, *a.shape), a.dtype) for a in avals]
    return {"call_jaxpr": jax.make_jaxpr(link)(flat, *shapes)}


@functools.lru_cache(maxsize=256)
def _unpack_params(avals: tuple[Any, ...], batch: Batch | None) -> dict[str, Any]:
    """The body slicing a chain's flat sum back into its sums of ``avals`` (stacked: after
    adding the devices' rows, the step's one all-reduce of the chain): ``(flat, *offsets)
    -> sums``, each sum read from its offset (``_offsets``) on."""

    def unpack(flat: Any, *offsets: Any) -> tuple[Any, ...]:
        if batch is not None:
            flat = flat.sum(0)
        parts = [
            jax.lax.dynamic_slice_in_dim(flat, offset, a.size).reshape(a.shape)
            for offset, a in zip(offsets, avals, strict=True)
        ]
        # The barrier keeps XLA from rewriting what reads the sums (the optimizer's update)
        # across the slicing; it still fuses each slice into its reader (see ``_offsets``).
        return jax.lax.optimization_barrier(tuple(parts))

    size = sum(a.size for a in avals)
    rows = () if batch is None else (batch.size,)
    flat = jax.ShapeDtypeStruct((*rows, size), avals[0].dtype)
    offsets = [jax.ShapeDtypeStruct((), np.int32)] * len(avals)
    return {"call_jaxpr": jax.make_jaxpr(unpack)(flat, *offsets)}


def _offsets(avals: tuple[Any, ...]) -> list[np.int32]:
    """Where each of ``avals`` starts in a flat sum of them all, in order.

    The offsets are the unpacking fragment's inputs (``Fragment.consts``), not literals: XLA
    fuses each slice into the update that reads it, and compiles one kernel per distinct
    fused computation. With the offset a literal, every gradient's update is distinct (a
    block's 12 weights: 12 kernels of its optimizer, each 10-20 ms of compile on this CPU
    host); read from an input, updates of one shape share a kernel.

    >>> [int(s) for s in _offsets((jax.ShapeDtypeStruct((2, 3), np.float32),) * 2)]
    [0, 6]
    """
    offsets = np.cumsum([0, *(a.size for a in avals[:-1])])
    return [np.int32(o) for o in offsets]
