"""The build driver (``core/front/_build``): its passes run in the order it lists, each takes a
value and returns a new one, and every equation's facts travel in its one record.

The program is ``test_blocks``' two-stage chain of layers, microbatched under 1F1B (so every
pass has work: planning, sums in schedule order, sinking glue, fusing the last stage).
"""

from __future__ import annotations

import jax
import pytest

import multimesh_flax as mm
from multimesh_flax.core.front import PASSES, _build
from multimesh_flax.core.run import OpKind
from multimesh_flax.core.trace import Equation
from tests.core import test_blocks

# The function each pass of the driver calls, as ``_build`` names it.
PASS_FUNCTIONS = {
    "trace": "capture_program",
    "colour": "colour_program",
    "plan": "plan_program",
    "place": "place_program",
    "cut": "cut_fragments",
    "arrange": "arrange_fragments",
    "fuse": "fuse_fragments",
    "compile": "compile_program",
}


def _step_and_data(schedule="1f1b"):
    step, _ = test_blocks._step(schedule)
    return step, test_blocks._data()


def test_the_driver_runs_its_passes_in_the_order_it_lists(monkeypatch):
    assert list(PASS_FUNCTIONS) == list(PASSES)
    ran = []
    for name, function in PASS_FUNCTIONS.items():
        original = getattr(_build, function)

        def recording(*args, _name=name, _original=original, **kwargs):
            ran.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(_build, function, recording)
    step, (params, batch) = _step_and_data()
    step.executable(params, batch)
    assert ran == list(PASSES)


def test_a_program_without_tasks_stops_after_colouring(monkeypatch):
    ran = []
    original = _build.plan_program
    monkeypatch.setattr(_build, "plan_program", lambda *a: ran.append("plan") or original(*a))
    run = mm.core.jit(lambda x: x * 2.0).executable(jax.numpy.ones(3))
    assert isinstance(run, _build.FastPath) and ran == []


def test_passes_leave_their_inputs_as_they_were():
    step, (params, batch) = _step_and_data()
    traced = step.traced(params, batch)
    records = traced.equations
    first = _build.partition_program(traced)
    assert traced.equations is records  # planning and placing made new records
    assert all(e.place is None and e.unit is None for e in records)
    placed = _build.place_program(*_build.plan_program(traced))
    cut = _build.cut_fragments(placed)
    before = [(f.index, list(f.eqns), list(f.invars), list(f.outvars)) for f in cut]
    arranged = _build.arrange_fragments(placed, cut)
    _build.fuse_fragments(placed, arranged)
    assert [(f.index, f.eqns, f.invars, f.outvars) for f in cut] == before
    # The same passes again give the same program (nothing was left changed in between).
    again = _build.partition_program(traced)
    assert [(f.index, f.place, len(f.eqns)) for f in again.fragments] == [
        (f.index, f.place, len(f.eqns)) for f in first.fragments
    ]


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h2"])
def test_each_equation_carries_its_facts_in_one_record(schedule):
    step, (params, batch) = _step_and_data(schedule)
    part = step.executable(params, batch).partition
    equations = part.traced.equations
    assert all(isinstance(e, Equation) for e in equations)
    assert [e.eqn for e in equations] == list(part.traced.jaxpr.eqns)
    assert part.plan is not None and part.plan.equations is equations
    assert all(e.place is not None for e in equations)
    units = [e for e in equations if e.unit is not None]
    assert units and all(e.label is not None and e.microbatch is not None for e in units)
    assert all((u.region, u.microbatch) == e.microbatch for e in units for u in [e.unit])
    placed = {v: f.place for f in part.fragments for e in f.eqns for v in e.outvars}
    assert all(placed[v] == e.place for e in equations for v in e.eqn.outvars if v in placed)


def test_describe_names_the_compile_step():
    step, (params, batch) = _step_and_data()
    executable = step.executable(params, batch)
    runs = sum(op.kind is OpKind.RUN for op in executable.ops)
    (line,) = [s for s in executable.describe().splitlines() if s.startswith("compile:")]
    programs = int(line.split()[1])
    assert line.endswith("each compiled by XLA at its first dispatch")
    assert 0 < programs < runs and f"for {runs} fragments" in line
    step(params, batch)  # each program has an executable once it has run (or had one cached)
    assert executable.compile_count() >= programs


def test_the_program_cache_forgets_the_least_recently_used():
    from multimesh_flax.core.trace import BoundedCache

    cache, made = BoundedCache(capacity=2), []

    def make(key):
        made.append(key)
        return key.upper()

    values = [cache.get_or_make(k, make) for k in "abaac"]  # a is hit twice, the newest
    assert values == ["A", "B", "A", "A", "C"] and made == ["a", "b", "c"]
    assert list(cache) == ["a", "c"]  # b, the least recently used, went
    cache.get_or_make("c", make)  # the newest: nothing moves
    cache.get_or_make("a", make)
    cache.get_or_make("d", make)
    assert list(cache) == ["a", "d"] and made == ["a", "b", "c", "d"]
    cache.clear()
    assert cache.get_or_make("a", make) == "A" and made[-1] == "a"
