"""``_sink.sink_glue``: glue whose results one later glue fragment reads moves there.

Moving an equation must never leave a reader behind: a fragment that still reads a value
through another equation keeps its producer (else the producer runs after its reader).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multimesh_flax.core.fragment import Fragment, _sink
from multimesh_flax.core.trace import Equation, TracedProgram


def _program():
    """``a = -x; b = sin(a); c = cos(a); d = b + 1``; outputs ``c`` and ``d``."""

    def f(x):
        a = -x
        b, c = jnp.sin(a), jnp.cos(a)
        return c, b + 1.0

    closed = jax.make_jaxpr(f)(1.0)
    eqns = closed.jaxpr.eqns
    traced = TracedProgram(
        jaxpr=closed.jaxpr,
        consts=[],
        equations=tuple(Equation(e) for e in eqns),
        tasks={},
        out_tree=None,
    )
    return traced, eqns


def test_a_producer_stays_while_its_fragment_still_reads_it():
    traced, (neg, sin, cos, add) = _program()
    first = Fragment(index=0, place=(0,), label=None, eqns=[neg, sin, cos])
    last = Fragment(index=1, place=(0,), label=None, eqns=[add])
    assert _sink.sink_glue(traced, [first, last])
    # ``sin`` only feeds the last fragment and moves; ``-x`` still feeds ``cos``: it stays.
    assert first.eqns == [neg, cos]
    assert last.eqns == [sin, add]


def test_a_producer_whose_readers_all_moved_follows_them():
    traced, (neg, sin, _, add) = _program()
    first = Fragment(index=0, place=(0,), label=None, eqns=[neg, sin])
    last = Fragment(index=1, place=(0,), label=None, eqns=[add])
    assert _sink.sink_glue(traced, [first, last])
    assert first.eqns == [] and last.eqns == [neg, sin, add]
