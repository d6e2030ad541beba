"""Fragment compilation: one cached ``jax.jit`` per distinct fragment.

Fragments are compiled through a process-wide cache keyed by (structural key of the fragment
jaxpr, donation, output shardings), with sharding constraints rewritten onto abstract meshes,
so identical fragments -- the same stage for every microbatch, identical blocks on different
submeshes, or the same step traced twice -- share one ``jax.jit``: traced and lowered once,
compiled once per device set and input sharding.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.extend.core as jex
from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax.core.fragment import _partition
from multimesh_flax.core.trace import _blocks, _structure, _trace

# Compiled fragments by (structural key, donation, output shardings): shared by every
# program of the process. Bounded: a program keeps the fragments it uses.
_FRAGMENT_CACHE = _structure.BoundedCache(capacity=2048)


def _as_tuple_fun(jaxpr: jex.Jaxpr) -> Any:
    run = jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, []))

    def fragment(*args: Any) -> tuple[Any, ...]:
        return tuple(run(*args))

    return fragment


# The abstract-mesh parameters of each block body: one dict per body, so the copies of a
# block keep sharing their parameters (``structural_key`` memoises them by identity).
_ABSTRACT_BLOCKS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _abstract_block(eqn: Any) -> Any:
    body = eqn.params["call_jaxpr"]
    params = _ABSTRACT_BLOCKS.get(body)
    if params is None:
        inner = body.jaxpr
        eqns = [_abstract_constraint(e) for e in inner.eqns]
        jaxpr = inner.replace(eqns=eqns)
        params = _ABSTRACT_BLOCKS[body] = {**eqn.params, "call_jaxpr": jex.ClosedJaxpr(jaxpr, [])}
    return eqn.replace(params=params)


def _abstract_constraint(eqn: Any) -> Any:
    """The equation with a concrete-mesh sharding constraint rewritten onto the abstract mesh
    (inside a block too).

    Identical stages on different submeshes then have identical fragment jaxprs, so they share
    one ``jax.jit``: traced and lowered once, compiled once per device set.
    """
    if _blocks.is_block(eqn):
        return _abstract_block(eqn)
    sharding = _trace.concrete_constraint(eqn)
    if sharding is None:
        return eqn
    abstract = NamedSharding(
        sharding.mesh.abstract_mesh, sharding.spec, memory_kind=sharding.memory_kind
    )
    return eqn.replace(params={**eqn.params, "sharding": abstract})


def fragment_jaxpr(frag: _partition.Fragment) -> jex.Jaxpr:
    """The fragment as a closed-over-nothing jaxpr, sharding constraints on abstract meshes."""
    eqns = [_abstract_constraint(e) for e in frag.eqns]
    return _trace.make_jaxpr_object(
        [], list(frag.invars), list(frag.outvars), eqns, f"fragment {frag.index}"
    )


def compile_fragment(
    frag: _partition.Fragment,
    mesh: jax.sharding.Mesh,
    donate: tuple[int, ...],
    memo: dict[int, Any] | None = None,
) -> Any:
    """Returns the (cached) ``jax.jit`` of a fragment (``memo``: see ``structural_key``)."""
    jaxpr = fragment_jaxpr(frag)
    out_shardings = None
    if not frag.invars:  # nothing to infer devices from: pin outputs to the place
        out_shardings = tuple(NamedSharding(mesh, PartitionSpec()) for _ in frag.outvars)
    key = (_structure.structural_key(jaxpr, memo), donate, out_shardings)
    return _FRAGMENT_CACHE.get_or_make(
        key,
        lambda _: jax.jit(_as_tuple_fun(jaxpr), donate_argnums=donate, out_shardings=out_shardings),
    )
