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
in that layout, the rows' axes in front: as many arrays as unpacked, no all-reduce in the
units. Elsewhere on a submesh nothing is packed. Only chains of at least two sums of one
dtype are packed (one is enough to stack), and only where each link's running sum is read
by the next link alone, and whose final sums a glue fragment on the place reads first,
before any reader elsewhere (a tied table's head gradient, summed with the stem's on the
first stage, is sliced out on the last stage by its update's glue and moves from there).

Concatenating is a copy. On XLA's CPU backend it is not fused into the addition after it,
so a big gradient costs more copied than its own array costs the host: a sum of
``OWN_SUM_BYTES`` or more (32 KiB on CPU) keeps a running sum of its own beside the flat one
(stacked per device on a data-parallel place), and a chain left with fewer than two small
sums on one device is not packed (:func:`_own_sums`). On a residual-MLP stack of 256 x 256
weights (B7's function path) that took 9-13% off the step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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

# Per backend, the bytes from which a gradient keeps a running sum of its own instead of
# joining its chain's flat sum (``_own_sums``). Measured on this CPU host (design notes,
# "Own running sums"): a link pays ~0.3 us per KiB copied against ~6 us per array. Not listed
# (GPU): XLA fuses the concatenation into the addition there, and everything is packed.
OWN_SUM_BYTES = {"cpu": 32 * 1024}


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
        batch, shardings, devices = None, None, len(order[first].place)
        if several:
            if not stack:
                continue
            shardings = _gradient_shardings(links, chain[0], laid_out)
            accept = functools.partial(_accepts, devices, shardings)
            batch = stack_chain(order, links, chain, alone, batches_at, accept)
            if batch is None:
                continue
        avals = tuple(v.aval for v in finals)
        own = _own_sums(avals, batch, devices, shardings, own_sum_bytes())
        if own is not None:
            zeros_shardings.update(_pack(order, links, starts, chain, reader, batch, own))
    return zeros_shardings


def own_sum_bytes() -> float:
    """How big a gradient must be (bytes) to keep a running sum of its own on this backend
    instead of joining its chain's flat sum (``OWN_SUM_BYTES``; no limit where not listed)."""
    return OWN_SUM_BYTES.get(jax.default_backend(), math.inf)


@dataclasses.dataclass(frozen=True)
class _Own:
    """A sum of a packed chain that keeps a running sum of its own: made in ``stack`` (its
    devices' partial sums with the batch's axes in front; ``None`` on one device), summed
    over the rows into ``final`` at the end (``None``: left to the compiler)."""

    stack: Any = None
    final: Any = None


def _own_sums(
    avals: tuple[Any, ...],
    batch: Batch | None,
    devices: int,
    shardings: list[Any] | None,
    limit: float,
) -> tuple[_Own | None, ...] | None:
    """Per sum of a chain (final sums ``avals``), ``None`` where it joins the flat sum, else
    how it keeps its own; ``None`` where packing gains nothing.

    On a tensor-parallel place (the batch spans only some of its ``devices``) every sum
    keeps a stack of its own in its layout (``shardings``: concatenating would gather the
    sharded ones). Elsewhere a sum of ``limit`` bytes or more keeps its own: raveling and
    concatenating copies it, and XLA's CPU backend does not fuse a concatenation into the
    addition after it, so each link would copy the gradient twice more (a 256 x 256 fp32
    gradient: ~80 us a link on this host) to save the ~6 us a host call pays per array.

    >>> small, big = (jax.ShapeDtypeStruct(shape, np.float32) for shape in [(8,), (64, 64)])
    >>> _own_sums((small, big, small), None, 1, None, limit=1024)
    (None, _Own(stack=None, final=None), None)
    >>> _own_sums((small, big), None, 1, None, limit=1024) is None  # one left to pack
    True
    """
    if batch is not None and batch.size != devices:
        assert shardings is not None  # ``_accepts`` stacks no unconstrained gradient here
        return tuple(_Own(batch.stacked(s.spec), s) for s in shardings)
    big = [a.size * a.dtype.itemsize >= limit for a in avals]
    if batch is None:
        return None if len(big) - sum(big) < 2 else tuple(_Own() if b else None for b in big)
    own = _Own(batch.stacked(PartitionSpec()))  # data parallel: whole partial sums per device
    return tuple(own if b else None for b in big)


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


def _pack(
    order: list[Any],
    links: dict[int, list[Any]],
    starts: dict[int, list[Any]],
    chain: list[tuple[int, int]],
    reader: int,
    batch: Batch | None,
    own: tuple[_Own | None, ...],
) -> dict[Any, Any]:
    """Gives ``chain`` one flat running sum of the sums ``own`` leaves ``None`` (stacked over
    ``batch``, a data-parallel place's, where not ``None``) and the others a running sum of
    their own, sliced (or summed over rows) back into its final sums where ``order[reader]``
    reads them. Edits ``links``, ``starts`` and ``order``; returns the sharding of each new
    zeros variable that has one."""
    first_link = _link(links, chain[0])
    n = len(first_link.outvars)
    finals = list(_link(links, chain[-1]).outvars)
    avals = tuple(v.aval for v in finals)
    params = _link_params(avals, batch, own)
    running = [jex.Var(a) for a in params["call_jaxpr"].out_avals]
    first = chain[0][0]
    at = starts[first].index(first_link.invars[0])
    starts[first][at : at + n] = running
    flat = [batch.sharding() if batch is not None else None] if None in own else []
    made_in = [*flat, *(o.stack for o in own if o is not None)]
    zeros = {v: s for v, s in zip(running, made_in, strict=True) if s is not None}
    for pos, k in chain:
        eqn = links[pos][k]
        outs = [jex.Var(v.aval) for v in running]
        links[pos][k] = eqn.replace(invars=[*running, *eqn.invars[n:]], outvars=outs, params=params)
        running = outs
    unpack_params = _unpack_params(avals, batch, own)
    offsets = [jex.Var(a) for a in unpack_params["call_jaxpr"].in_avals[len(running) :]]
    packed = tuple(a for a, o in zip(avals, own, strict=True) if o is None)
    unpack = jex.new_jaxpr_eqn(
        [*running, *offsets], finals, primitives.closed_call_p, unpack_params, frozenset()
    )
    frag = order[reader]
    consts = (*frag.consts, *zip(offsets, _offsets(packed) if packed else [], strict=True))
    order[reader] = dataclasses.replace(frag, eqns=[unpack, *frag.eqns], consts=consts)
    return zeros


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


def _split_own(own: tuple[_Own | None, ...]) -> tuple[list[int], list[int]]:
    """The positions of the sums packed into the flat sum and of those keeping their own."""
    packed = [i for i, o in enumerate(own) if o is None]
    return packed, [i for i, o in enumerate(own) if o is not None]


def _running_avals(
    avals: tuple[Any, ...], batch: Batch | None, own: tuple[_Own | None, ...]
) -> tuple[list[Any], list[Any]]:
    """A packed chain's running sums (its flat sum if any sum joins it, then each own sum's)
    and the gradients a link adds, with the batch's rows in front where stacked."""
    rows = () if batch is None else (batch.size,)
    grads = [jax.ShapeDtypeStruct((*rows, *a.shape), a.dtype) for a in avals]
    packed, owned = _split_own(own)
    size = sum(avals[i].size for i in packed)
    flat = [jax.ShapeDtypeStruct((*rows, size), avals[0].dtype)] if packed else []
    return [*flat, *(grads[i] for i in owned)], grads


@functools.lru_cache(maxsize=256)
def _link_params(
    avals: tuple[Any, ...], batch: Batch | None, own: tuple[_Own | None, ...]
) -> dict[str, Any]:
    """A packed link's body, one per chain signature (every microbatch's unit runs one
    program): ``(flat, *running, *g) -> (flat + concat(ravel(barrier(g_i))), *(running_j +
    barrier(g_j)))``, ``i`` the sums packed, ``j`` those keeping their own (``own``);
    stacked over ``batch`` (``_stacked_sums``), each ``g`` is ``(d, *shape)``, raveled per
    device row, and each running sum stays in its stack's sharding."""
    packed, owned = _split_own(own)

    def link(*args: Any) -> tuple[Any, ...]:
        flat = args[: bool(packed)]
        running, grads = args[len(flat) : -len(avals)], args[-len(avals) :]
        grads = jax.lax.optimization_barrier(grads)
        sums = []
        if packed and batch is None:
            sums.append(flat[0] + jnp.concatenate([grads[i].ravel() for i in packed]))
        elif packed:
            rows = jnp.concatenate([grads[i].reshape(batch.size, -1) for i in packed], axis=1)
            sums.append(jax.lax.with_sharding_constraint(flat[0] + rows, batch.sharding()))
        for r, i in zip(running, owned, strict=True):
            total, stack = r + grads[i], own[i].stack
            sums.append(total if stack is None else jax.lax.with_sharding_constraint(total, stack))
        return tuple(sums)

    sums, grads = _running_avals(avals, batch, own)
    return {"call_jaxpr": jax.make_jaxpr(link)(*sums, *grads)}


@functools.lru_cache(maxsize=256)
def _unpack_params(
    avals: tuple[Any, ...], batch: Batch | None, own: tuple[_Own | None, ...]
) -> dict[str, Any]:
    """The body turning a packed chain's running sums back into its sums of ``avals``
    (stacked: after adding each stack's device rows, the chain's all-reduce once a step):
    ``(flat, *running, *offsets) -> sums``, each packed sum read from its offset
    (``_offsets``) on, each own sum laid out as its ``final`` where it has one."""
    packed, owned = _split_own(own)

    def unpack(*args: Any) -> tuple[Any, ...]:
        flat = args[: bool(packed)]
        running, offsets = args[len(flat) : len(flat) + len(owned)], args[len(flat) + len(owned) :]
        sums: list[Any] = [None] * len(avals)
        if packed:
            whole = flat[0] if batch is None else flat[0].sum(0)
            for i, offset in zip(packed, offsets, strict=True):
                part = jax.lax.dynamic_slice_in_dim(whole, offset, avals[i].size)
                sums[i] = part.reshape(avals[i].shape)
        for r, i in zip(running, owned, strict=True):
            total, final = (r if batch is None else r.sum(0)), own[i].final
            sums[i] = total if final is None else jax.lax.with_sharding_constraint(total, final)
        # The barrier keeps XLA from rewriting what reads the sums (the optimizer's update)
        # across the slicing; it still fuses each slice into its reader (see ``_offsets``).
        return jax.lax.optimization_barrier(tuple(sums))

    sums, _ = _running_avals(avals, batch, own)
    offsets = [jax.ShapeDtypeStruct((), np.int32)] * len(packed)
    return {"call_jaxpr": jax.make_jaxpr(unpack)(*sums, *offsets)}


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
