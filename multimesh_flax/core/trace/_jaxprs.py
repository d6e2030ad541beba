"""Building jaxprs: the one constructor the core uses for the jaxprs it makes."""

from __future__ import annotations

from typing import Any

import jax.extend.core as jex


def make_jaxpr_object(
    constvars: list[Any], invars: list[Any], outvars: list[Any], eqns: list[Any], what: str
) -> jex.Jaxpr:
    """A ``Jaxpr`` with its effects and a ``DebugInfo`` naming what it is."""
    debug = jex.DebugInfo(
        "multimesh_flax",
        what,
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    return jex.Jaxpr(
        constvars=constvars,
        invars=invars,
        outvars=outvars,
        eqns=eqns,
        effects=frozenset().union(*(e.effects for e in eqns)),
        debug_info=debug,
    )
