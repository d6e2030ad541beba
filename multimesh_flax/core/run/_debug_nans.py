"""Naming the operation behind a NaN or inf that ``jax_debug_nans`` / ``jax_debug_infs`` caught.

With either flag on, JAX checks the outputs of every compiled call and raises an internal
error that names only the computation (``('jit(fragment)', 'nan')``). ``jax.jit`` then re-runs
the function op by op to find the primitive; the MPMD runtime calls each fragment's executable
itself, so ``floating_point_error`` does the same for one fragment: it evaluates the
fragment's equations eagerly on the inputs the failed call was given, follows the invalid
value from the fragment's first invalid output back to the equation that first produced it
(an intermediate NaN masked by ``jnp.where`` is not blamed), and returns a
``FloatingPointError`` -- JAX's own public type -- naming the fragment and that equation's
primitive and source line.

Nothing here runs unless a fragment's call raised: the dispatch loops' ``except`` clauses are
the only callers, so the flag-off path pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax._src import api_util, source_info_util

from multimesh_flax.core.fragment import Fragment

# What a compiled call raises when its outputs hold a NaN (inf) under jax_debug_nans (_infs);
# JAX has no public name for it.
InternalFloatingPointError = api_util.InternalFloatingPointError

# Call-like primitives whose body the re-run enters, so the blame lands on an operation the
# user wrote (a block's ``closed_call``, an inner ``jax.jit``, ``jax.checkpoint``, custom
# derivatives). Others (loops, ``shard_map``) are blamed whole.
_CALLS = frozenset(
    {
        "closed_call",
        "core_call",
        "pjit",
        "jit",
        "remat",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
    }
)


class _Origin(NamedTuple):
    """Where an invalid value came from: an equation, or the fragment's input ``position``."""

    eqn: Any = None
    position: int | None = None


def floating_point_error(
    where: str, frag: Fragment, values: Sequence[Any], kind: str
) -> FloatingPointError:
    """The error for a fragment whose outputs held a ``kind`` (``"nan"`` or ``"inf"``) value.

    Args:
        where: the fragment in words (its name, tasks, phases and devices).
        frag: the fragment, as dispatched.
        values: the arrays the failed call was given, one per ``frag.invars``.
        kind: what JAX found, ``"nan"`` or ``"inf"``.
    """
    head = f"invalid value ({kind}) encountered in MPMD {where}"
    if any(_deleted(x) for x in values):
        return FloatingPointError(
            f"{head}. Its inputs were donated to the call, so it cannot be re-run op by op to "
            f"find the operation: set `jax_debug_{kind}s` before the program's first call "
            "(JAX then compiles it without donation) to get the operation and its source line."
        )
    if not all(getattr(x, "is_fully_addressable", True) for x in values):
        return FloatingPointError(
            f"{head}. Its inputs span several processes, so it is not re-run op by op here; "
            "run the same program in one process to get the operation and its source line."
        )
    try:
        origin = _first_origin(frag, values, kind)
    except Exception as e:  # noqa: BLE001 -- the re-run is a courtesy; the fragment is named
        return FloatingPointError(f"{head}. Re-running it op by op failed ({e!r}).")
    return FloatingPointError(head + _blame(origin, kind))


def _blame(origin: _Origin | None, kind: str) -> str:
    if origin is None:
        return (
            f". Re-run op by op, it produced no {kind}: XLA's optimisations may have made it "
            "(as `jax.jit` reports in the same case)."
        )
    if origin.eqn is None:
        return (
            f". Its input {origin.position} already held the {kind}: a program argument (or a "
            "value computed outside every checked fragment) carried it in."
        )
    eqn = origin.eqn
    line = source_info_util.summarize(eqn.source_info)
    return (
        f". Re-run op by op, the first operation to produce it is `{eqn.primitive.name}` "
        f"at {line}:\n  {eqn}\nLook at that operation's inputs (`jax.debug.print` there), "
        f"or turn `jax_debug_{kind}s` off to let the {kind} through."
    )


def _first_origin(frag: Fragment, values: Sequence[Any], kind: str) -> _Origin | None:
    """The origin of the fragment's first invalid output, re-run eagerly (``None``: none)."""
    origins = [_Origin(position=i) if _invalid(x, kind) else None for i, x in enumerate(values)]
    with jax.debug_nans(False), jax.debug_infs(False):  # the re-run checks values itself
        _, out_origins = _run(frag.eqns, frag.invars, frag.outvars, values, origins, kind)
    return next((o for o in out_origins if o is not None), None)


def _run(
    eqns: Sequence[Any],
    invars: Sequence[Any],
    outvars: Sequence[Any],
    values: Sequence[Any],
    origins: Sequence[_Origin | None],
    kind: str,
) -> tuple[list[Any], list[_Origin | None]]:
    """Evaluates ``eqns`` one by one; returns the outputs and, per output, where its invalid
    value came from (``None``: valid). An equation with invalid outputs is their origin unless
    one of its inputs was already invalid: then that input's origin is."""
    env = dict(zip(invars, values, strict=True))
    blame = dict(zip(invars, origins, strict=True))

    def value(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    def origin(v: Any) -> _Origin | None:
        return None if isinstance(v, jex.Literal) else blame[v]

    for eqn in eqns:
        ins = [value(v) for v in eqn.invars]
        in_origins = [origin(v) for v in eqn.invars]
        body = _body(eqn)
        if body is not None:
            jaxpr, consts = body
            outs, out_origins = _run(
                jaxpr.eqns,
                [*jaxpr.constvars, *jaxpr.invars],
                jaxpr.outvars,
                [*consts, *ins],
                [None] * len(consts) + in_origins,
                kind,
            )
        else:
            outs = _bind(eqn, ins)
            inherited = next((o for o in in_origins if o is not None), None)
            blamed = inherited or _Origin(eqn=eqn)
            out_origins = [blamed if _invalid(x, kind) else None for x in outs]
        env.update(zip(eqn.outvars, outs, strict=True))
        blame.update(zip(eqn.outvars, out_origins, strict=True))
    return [value(v) for v in outvars], [origin(v) for v in outvars]


def _body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of a call-like equation the re-run enters (``None``: not one)."""
    if eqn.primitive.name not in _CALLS:
        return None
    body = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))
    if isinstance(body, jex.ClosedJaxpr):
        body, consts = body.jaxpr, body.consts
    else:
        consts = []
    if not isinstance(body, jex.Jaxpr) or len(body.invars) != len(eqn.invars):
        return None
    return body, consts


def _bind(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*ins, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _invalid(x: Any, kind: str) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
        return False
    host = np.asarray(x)
    return bool(np.isnan(host).any() if kind == "nan" else np.isinf(host).any())


def _deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()
