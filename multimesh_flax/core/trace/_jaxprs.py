"""Building jaxprs: the one constructor the core uses for the jaxprs it makes."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jex

# jax >= 0.12 keeps a jaxpr's constant values on the jaxpr itself: its ``constvars`` are the
# leading inputs that have values attached, and constvars given without values become plain
# inputs. Earlier versions keep the values apart (a ``ClosedJaxpr``, or our own lists).
_ATTACHES_CONSTS = "consts" in inspect.signature(jex.Jaxpr.__init__).parameters


def make_jaxpr_object(
    constvars: list[Any],
    invars: list[Any],
    outvars: list[Any],
    eqns: list[Any],
    what: str,
    consts: Sequence[Any] = (),
) -> jex.Jaxpr:
    """A ``Jaxpr`` with its effects and a ``DebugInfo`` naming what it is.

    ``consts``: the values of ``constvars`` (in order), which the core also keeps beside the
    jaxpr; on a JAX that attaches them to the jaxpr they are attached, so that
    ``jaxpr.constvars`` names them on every version.
    """
    attached = {"consts": list(consts)} if _ATTACHES_CONSTS and constvars else {}
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
        **attached,
    )
