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
    new_first, new_last = _sink.sink_glue(traced, [first, last])
    # ``sin`` only feeds the last fragment and moves; ``-x`` still feeds ``cos``: it stays.
    assert new_first.eqns == [neg, cos]
    assert new_last.eqns == [sin, add]
    assert first.eqns == [neg, sin, cos] and last.eqns == [add]  # the pass edits nothing


def test_a_producer_whose_readers_all_moved_follows_them():
    traced, (neg, sin, _, add) = _program()
    first = Fragment(index=0, place=(0,), label=None, eqns=[neg, sin])
    last = Fragment(index=1, place=(0,), label=None, eqns=[add])
    new_first, new_last = _sink.sink_glue(traced, [first, last])
    assert new_first.eqns == [] and new_last.eqns == [neg, sin, add]


def test_fragments_nothing_moves_between_come_back_as_they_are():
    traced, (neg, sin, cos, add) = _program()
    first = Fragment(index=0, place=(0,), label=None, eqns=[neg, sin, cos])
    elsewhere = Fragment(index=1, place=(1,), label=None, eqns=[add])  # another place
    order = [first, elsewhere]
    assert all(a is b for a, b in zip(_sink.sink_glue(traced, order), order, strict=True))
