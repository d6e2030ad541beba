"""A unit's backward split the way the runtime splits a zero-bubble backward.

The runtime (``core.plan._pipeline._split_backward``) gives a split backward's ``B`` op the
equations the input gradient needs and its ``W`` op the rest (the weight-gradient
products), so ``W`` reads the cotangents ``B`` computed instead of computing them again.
`split_backward` does the same to the jaxpr of a unit's whole backward: two jaxprs, ``B``
(the backward's inputs to the input gradients and the values ``W`` reads from ``B``) and
``W`` (those values and the backward inputs it reads, to the weight gradients).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.extend import core as jex_core

from multimesh_flax.core.trace import make_jaxpr_object


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """The two halves of a backward jaxpr.

    Attributes:
        b: ``ClosedJaxpr`` from the backward's inputs to the input gradients, then the
            values of ``crossing_from_b`` (in order).
        w: ``ClosedJaxpr`` from the ``crossing`` values to the weight gradients.
        crossing: ``W``'s inputs: per value, ``("in", i)`` for the backward's input ``i`` or
            ``("b", j)`` for ``B``'s extra output ``j``.
    """

    b: Any
    w: Any
    crossing: tuple[tuple[str, int], ...]


def _needed(jaxpr: Any, outvars: list[Any]) -> set[int]:
    """Indices of the equations the ``outvars`` depend on."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    wanted = [v for v in outvars if not isinstance(v, jex_core.Literal)]
    needed: set[int] = set()
    while wanted:
        i = producer.get(wanted.pop())
        if i is None or i in needed:
            continue
        needed.add(i)
        wanted.extend(v for v in jaxpr.eqns[i].invars if not isinstance(v, jex_core.Literal))
    return needed


def split_backward(closed: Any, num_weight_grads: int) -> SplitBackward:
    """Splits ``closed`` (outputs: the ``num_weight_grads`` weight gradients, then the input
    gradients) into its ``B`` and ``W`` halves."""
    jaxpr = closed.jaxpr
    weight_out, input_out = jaxpr.outvars[:num_weight_grads], jaxpr.outvars[num_weight_grads:]
    in_b = _needed(jaxpr, list(input_out))
    in_w = _needed(jaxpr, list(weight_out)) - in_b
    b_eqns = [e for i, e in enumerate(jaxpr.eqns) if i in in_b]
    w_eqns = [e for i, e in enumerate(jaxpr.eqns) if i in in_w]
    from_b = {v for e in b_eqns for v in e.outvars}
    inputs = {v: i for i, v in enumerate(jaxpr.invars)}
    reads = [v for e in w_eqns for v in e.invars] + list(weight_out)
    crossing_vars = list(
        dict.fromkeys(
            v for v in reads if not isinstance(v, jex_core.Literal) and (v in from_b or v in inputs)
        )
    )
    b_extra = [v for v in crossing_vars if v in from_b]
    crossing = tuple(
        ("b", b_extra.index(v)) if v in from_b else ("in", inputs[v]) for v in crossing_vars
    )
    consts = list(jaxpr.constvars)
    b = make_jaxpr_object(
        consts, list(jaxpr.invars), [*input_out, *b_extra], b_eqns, "a unit's backward, B"
    )
    w = make_jaxpr_object(consts, crossing_vars, list(weight_out), w_eqns, "a unit's backward, W")
    return SplitBackward(
        jex_core.ClosedJaxpr(b, closed.consts), jex_core.ClosedJaxpr(w, closed.consts), crossing
    )
