"""A fragment as a jaxpr, the form its program is compiled and compared in.

Sharding constraints on a concrete mesh (a submesh's devices) are rewritten onto its abstract
mesh, inside blocks too: identical stages on different submeshes then have identical jaxprs,
so they share one program (``run._compile``: traced and lowered once, compiled once,
relocated to the others), and passes that look for shared structure
(``_shared_glue``) see it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jex
from jax.sharding import NamedSharding

from multimesh_flax.core.trace import block_body, concrete_constraint, is_block, make_jaxpr_object

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
    (inside a block too)."""
    if is_block(eqn):
        return _abstract_block(eqn)
    sharding = concrete_constraint(eqn)
    if sharding is None:
        return eqn
    abstract = NamedSharding(
        sharding.mesh.abstract_mesh, sharding.spec, memory_kind=sharding.memory_kind
    )
    return eqn.replace(params={**eqn.params, "sharding": abstract})


def constraints_making(eqns: Sequence[Any]) -> dict[Any, Any]:
    """Per result of ``eqns`` that a ``sharding_constraint`` makes, that constraint equation:
    one of ``eqns``, or one inside a block whose result it is (a block's body may end in
    its task's constraints, ``trace._blocks``)."""
    found: dict[Any, Any] = {}
    for eqn in eqns:
        if eqn.primitive.name == "sharding_constraint":
            found[eqn.outvars[0]] = eqn
        elif is_block(eqn):
            body = block_body(eqn)
            inner = constraints_making(body.eqns)
            for b, v in zip(body.outvars, eqn.outvars, strict=True):
                if type(b) is not jex.Literal and b in inner:  # a literal result: no key
                    found[v] = inner[b]
    return found


def fragment_jaxpr(frag: Any) -> jex.Jaxpr:
    """The fragment (a ``Fragment``: its equations and boundaries) as a closed-over-nothing
    jaxpr, sharding constraints on abstract meshes."""
    eqns = [_abstract_constraint(e) for e in frag.eqns]
    return make_jaxpr_object(
        [], list(frag.invars), list(frag.outvars), eqns, f"fragment {frag.index}"
    )
