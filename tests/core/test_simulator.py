"""Tests for the schedule simulator (``multimesh_flax.core.plan._simulator``).

Expected values come from closed-form pipeline analysis, not from the simulator: GPipe and
1F1B idle ``(p - 1) / (m + p - 1)`` of the time with equal per-stage costs.
"""

import numpy as np
import pytest

from multimesh_flax import errors
from multimesh_flax.core.declare import Schedule, ScheduleOp, make_schedule
from multimesh_flax.core.plan import SimulationResult, simulate

EXACT = 1e-12  # closed-form answers: only float rounding may differ


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_bubble_of_gpipe_and_1f1b(name, p, m):
    # Unsplit backward costs B + W = 2 and forward 1: every stage is a uniform (1, 2) step,
    # so the formula holds unchanged.
    result = simulate(make_schedule(name, p, m))
    np.testing.assert_allclose(result.bubble_fraction, (p - 1) / (m + p - 1), rtol=0, atol=EXACT)
    np.testing.assert_allclose(result.makespan, 3 * (m + p - 1), rtol=0, atol=EXACT)
    np.testing.assert_allclose(result.busy_time, [3.0 * m] * p, rtol=0, atol=EXACT)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_formula_with_unequal_forward_and_backward(name):
    p, m = 4, 8
    result = simulate(make_schedule(name, p, m), costs={"F": 1.0, "B": 2.5, "W": 0.5})
    # Every stage is a uniform (1, 3) step: makespan 4 (m + p - 1), busy 4 m per row.
    np.testing.assert_allclose(result.bubble_fraction, (p - 1) / (m + p - 1), rtol=0, atol=EXACT)
    np.testing.assert_allclose(result.makespan, 4 * (m + p - 1), rtol=0, atol=EXACT)
    np.testing.assert_allclose(result.busy_time, [4.0 * m] * p, rtol=0, atol=EXACT)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])  # m >= p
def test_zero_bubble_beats_1f1b(p, m):
    zb = simulate(make_schedule("zero-bubble-h2", p, m))
    one_f_one_b = simulate(make_schedule("1f1b", p, m))
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    # Equal costs: every row works without a gap from r to r + 3m (only the ramp is idle).
    np.testing.assert_allclose(zb.makespan, 3 * m + p - 1, rtol=0, atol=EXACT)
    np.testing.assert_allclose(zb.bubble_fraction, (p - 1) / (3 * m + p - 1), rtol=0, atol=EXACT)
    assert max(zb.peak_in_flight) <= 2 * p - 1


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("multiple", [1, 2])
def test_interleaved_beats_1f1b(p, v, multiple):
    m = multiple * p
    interleaved = simulate(make_schedule("interleaved-1f1b", v * p, m, interleave=v))
    one_f_one_b = simulate(make_schedule("1f1b", p, m))
    assert interleaved.bubble_fraction < one_f_one_b.bubble_fraction
    # With m a multiple of p and equal costs the ramp is p - 1 chunk steps (3 time units
    # each) before and after v m steps of work: the bubble shrinks by the chunks per row.
    bubble = (p - 1) / (v * m + p - 1)
    np.testing.assert_allclose(interleaved.bubble_fraction, bubble, rtol=0, atol=EXACT)
    np.testing.assert_allclose(interleaved.makespan, 3 * (v * m + p - 1), rtol=0, atol=EXACT)
    np.testing.assert_allclose(interleaved.busy_time, [3.0 * v * m] * p, rtol=0, atol=EXACT)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_peak_in_flight(p, m):
    assert simulate(make_schedule("gpipe", p, m)).peak_in_flight == (m,) * p
    peaks = simulate(make_schedule("1f1b", p, m)).peak_in_flight
    assert max(peaks) <= p
    assert peaks == tuple(min(p - r, m) for r in range(p))


def test_transfer_cost_adds_to_cross_row_edges():
    p, m, transfer = 4, 8, 0.5
    base = simulate(make_schedule("gpipe", p, m))
    slow = simulate(make_schedule("gpipe", p, m), costs={"transfer": transfer})
    # The critical path crosses p - 1 boundaries forward and p - 1 backward.
    np.testing.assert_allclose(
        slow.makespan, base.makespan + 2 * (p - 1) * transfer, rtol=0, atol=EXACT
    )
    np.testing.assert_allclose(slow.busy_time, base.busy_time, rtol=0, atol=EXACT)


def test_callable_costs_and_unsplit_backward():
    schedule = make_schedule("gpipe", 2, 1)
    costs = {"F": 1.0, "B": 2.0, "W": 3.0, "transfer": 0.25}
    result = simulate(schedule, costs=lambda stage, phase: costs[phase] * (stage + 1))
    # F0 [0, 1], F1 [1.25, 3.25], B1 costs 2 * (2 + 3) = 10: [3.25, 13.25],
    # B0 costs 5 and waits for the gradient transfer 0.5: [13.75, 18.75].
    ends = {str(op): (start, end) for _, op, start, end in result.timeline}
    assert ends == {
        "F0.0": (0.0, 1.0),
        "F1.0": (1.25, 3.25),
        "B1.0": (3.25, 13.25),
        "B0.0": (13.75, 18.75),
    }
    assert result.makespan == 18.75


def test_split_and_unsplit_backward_compare_on_equal_terms():
    split = simulate(make_schedule("zero-bubble-h2", 2, 4))
    unsplit = simulate(make_schedule("1f1b", 2, 4))
    assert split.busy_time == unsplit.busy_time


@pytest.mark.parametrize("name, split", [("1f1b", False), ("zero-bubble-h1", True)])
def test_fused_pairs_cost_their_program(name, split):
    # 1F1B and ZB-H1 run each of the last stage's F right before its B: priced as one
    # program of 1.5, each B takes what is left (0.5), the other ops their own costs
    p, m = 2, 4
    costs = {"F": 1.0, "B": 1.0, "W": 0.5 if split else 0.0, "F+B": 1.5}
    apart = simulate(make_schedule(name, p, m), costs=costs)
    fused = simulate(make_schedule(name, p, m), costs=costs, fused=True)
    durations = {op: end - start for _, op, start, end in fused.timeline}
    for op, seconds in durations.items():
        expected = 0.5 if (op.stage, op.phase) == (p - 1, "B") else costs[op.phase]
        assert seconds == pytest.approx(expected, abs=EXACT), op
    assert fused.makespan < apart.makespan
    # without an "F+B" cost, fusing prices the pair as its two ops apart
    no_price = {k: v for k, v in costs.items() if k != "F+B"}
    same = simulate(make_schedule(name, p, m), costs=no_price, fused=True)
    assert same.timeline == simulate(make_schedule(name, p, m), costs=no_price).timeline


def test_fused_asks_a_callable_for_the_pair_only_when_told():
    asked = []

    def cost(stage, phase):
        asked.append(phase)
        return 0.0 if phase == "transfer" else 1.0

    simulate(make_schedule("1f1b", 2, 2), costs=cost)
    assert "F+B" not in asked
    simulate(make_schedule("1f1b", 2, 2), costs=cost, fused=True)
    assert "F+B" in asked
    # GPipe runs every F before the first B (microbatch 0's): no pair to fuse
    gpipe = make_schedule("gpipe", 2, 4)
    fused = simulate(gpipe, costs={"F+B": 0.0}, fused=True)
    assert fused.timeline == simulate(gpipe).timeline


def test_result_is_frozen_and_timeline_sorted():
    result = simulate(make_schedule("1f1b", 3, 3))
    assert isinstance(result, SimulationResult)
    starts = [(start, row) for row, _, start, _ in result.timeline]
    assert starts == sorted(starts)
    assert len(result.timeline) == 3 * 3 * 2
    with pytest.raises(AttributeError):
        result.makespan = 0.0  # pyright: ignore[reportAttributeAccessIssue]


@pytest.mark.parametrize(
    ("costs", "match"),
    [
        ({"F": -1.0}, "non-negative"),
        ({"X": 1.0}, "Unknown keys"),
        ({"B": float("nan")}, "finite"),
        (lambda stage, phase: -1.0, "non-negative"),
        (3.0, "Expected `costs`"),
    ],
)
def test_bad_costs_raise(costs, match):
    with pytest.raises(errors.InvalidScheduleError, match=match):
        simulate(make_schedule("1f1b", 2, 2), costs=costs)


def test_simulate_validates_first():
    broken = Schedule(
        rows=((ScheduleOp(0, 0, "F"),), (ScheduleOp(1, 0, "F"), ScheduleOp(1, 0, "B"))),
        num_stages=2,
        num_microbatches=1,
        split_backward=False,
        name="custom",
        stage_to_row=(0, 1),
    )
    with pytest.raises(errors.InvalidScheduleError, match="lacks"):
        simulate(broken)


def test_zero_costs_give_zero_bubble():
    result = simulate(make_schedule("1f1b", 2, 2), costs={"F": 0, "B": 0, "W": 0})
    assert result.makespan == 0.0 and result.bubble_fraction == 0.0
