"""Zero-bubble schedules against the closed forms of the papers that define them.

Expected values are formulas, never numbers the code printed: the Zero Bubble paper's Table 2
(Qi et al., ICLR 2024) gives the bubble of one step, measured on the longest row when steps
overlap (``steady_bubble_fraction``), as ``(p - 1)(T_F + T_B + T_W)`` for 1F1B,
``(p - 1)(T_F + T_B - T_W)`` for ZB-H1 and ``(p - 1)(T_F + T_B - 2 T_W)`` for ZB-H2, with
``m >= p`` (``m >= 2 p`` for ZB-H2) and ``T_W <= T_F, T_B``. Narayanan et al. (2021) give
interleaved 1F1B's bubble as ``(p - 1) / (v m)`` of the ideal step time.
"""

import itertools

import numpy as np
import pytest

from multimesh_flax import errors
from multimesh_flax.core.declare import make_schedule
from multimesh_flax.core.plan import simulate

EXACT = 1e-12

# (T_F, T_B, T_W) with T_W <= T_F, T_B: the regime where Table 2 holds.
RATIOS = [
    (f, b, w)
    for f, b, w in itertools.product((1.0, 1.5), (0.8, 1.0, 1.3, 2.0), (0.2, 0.5, 0.8))
    if w <= min(f, b)
]
TABLE2 = {
    "1f1b": lambda p, f, b, w: (p - 1) * (f + b + w),
    "zero-bubble-h1": lambda p, f, b, w: (p - 1) * (f + b - w),
    "zero-bubble-h2": lambda p, f, b, w: (p - 1) * (f + b - 2 * w),
}


def _table2_fraction(name, p, m, f, b, w):
    bubble = TABLE2[name](p, f, b, w)
    return bubble / (bubble + m * (f + b + w))


@pytest.mark.parametrize("name", list(TABLE2))
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (8, 24)])
def test_table2_bubble_for_every_cost_ratio(name, p, m):
    schedule = make_schedule(name, p, m)
    for f, b, w in RATIOS:
        result = simulate(schedule, costs={"F": f, "B": b, "W": w})
        expected = _table2_fraction(name, p, m, f, b, w)
        np.testing.assert_allclose(result.steady_bubble_fraction, expected, rtol=0, atol=EXACT)
        np.testing.assert_allclose(result.busy_time, [m * (f + b + w)] * p, rtol=0, atol=EXACT)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 24)])
def test_memory_of_h1_and_h2(p, m):
    one_f_one_b = simulate(make_schedule("1f1b", p, m)).peak_in_flight
    h1 = simulate(make_schedule("zero-bubble-h1", p, m)).peak_in_flight
    h2 = simulate(make_schedule("zero-bubble-h2", p, m)).peak_in_flight
    assert max(h1) == max(one_f_one_b) == p  # ZB-H1: 1F1B's peak memory
    assert max(h2) == 2 * p - 1  # ZB-H2: 2p - 1 activation sets


def test_1f1b_steady_bubble_is_its_bubble():
    result = simulate(make_schedule("1f1b", 4, 8), costs={"F": 1.0, "B": 1.3, "W": 0.4})
    assert result.steady_bubble_fraction == result.bubble_fraction
    assert result.row_spans[0] == result.makespan


def _per_stage(p):
    """A lopsided pipeline: the last stage is 30% slower; transfers cost 0.05."""
    table = {"F": 1.0, "B": 1.1, "W": 0.6}
    return lambda s, phase: (
        0.05 if phase == "transfer" else table[phase] * (1.3 if s == p - 1 else 1)
    )


AUTO_COSTS = [
    {"F": 1.0, "B": 1.0, "W": 1.0},
    {"F": 1.0, "B": 1.0, "W": 0.5},
    {"F": 1.0, "B": 2.0, "W": 1.0},
    {"F": 1.0, "B": 1.2, "W": 0.3, "transfer": 0.05},
    "per-stage",
]


@pytest.mark.parametrize("costs", AUTO_COSTS, ids=str)
def test_auto_matches_or_beats_the_handcrafted_schedules(costs):
    p, m = 4, 12
    costs = _per_stage(p) if costs == "per-stage" else costs
    steady = {
        name: simulate(make_schedule(name, p, m), costs=costs).steady_bubble_fraction
        for name in ("1f1b", "zero-bubble-h1", "zero-bubble-h2")
    }
    one_p = simulate(make_schedule("zero-bubble-auto", p, m, costs=costs), costs=costs)
    two_p = simulate(
        make_schedule("zero-bubble-auto", p, m, costs=costs, max_in_flight=2 * p), costs=costs
    )
    assert max(one_p.peak_in_flight) <= p and max(two_p.peak_in_flight) <= 2 * p
    assert one_p.steady_bubble_fraction <= min(steady["zero-bubble-h1"], steady["1f1b"])
    assert two_p.steady_bubble_fraction <= steady["zero-bubble-h2"]


def test_auto_with_twice_the_memory_has_no_bubble_at_equal_costs():
    result = simulate(make_schedule("zero-bubble-auto", 4, 8, max_in_flight=8))
    assert result.steady_bubble_fraction == 0.0


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16)])
def test_v_layout_memory_and_bubble(p, m):
    v = make_schedule("zero-bubble-v", 2 * p, m)
    assert v.num_submeshes == p and v.split_backward
    assert v.stage_to_row == (*range(p), *reversed(range(p)))
    # A V stage is half a 1F1B stage: 2p half-size sets are 1F1B's p full ones.
    result = simulate(v, activation_bytes=0.5)
    assert max(result.peak_bytes) <= p
    # Equal costs per half stage: it beats interleaved 1F1B with v = 2 (Narayanan et al.'s
    # (p - 1) / (v m) of the ideal time) and ZB-H1 (Table 2) on the same halves.
    ideal = 6 * m
    interleaved = (p - 1) / (2 * m) * ideal
    h1 = 2 * (p - 1) * (1 + 1 - 1)  # ZB-H1 on full stages (F = B = W = 2 halves)
    idle = max(result.row_spans) - ideal
    assert idle < min(interleaved, h1)


@pytest.mark.parametrize(("f", "b", "w"), RATIOS)
def test_v_built_for_the_costs_against_1f1b_and_zb_h1_at_the_same_memory(f, b, w):
    """Below 1F1B always; below ZB-H1 unless the backward is much slower than the forward
    (with T_B = 2 T_F and T_W = 0.2 T_F our heuristic on the V stays above ZB-H1)."""
    p, m = 4, 12
    half = {"F": f / 2, "B": b / 2, "W": w / 2}  # each V stage is half a stage
    v = simulate(make_schedule("zero-bubble-v", 2 * p, m, costs=half), costs=half)
    assert max(v.peak_in_flight) <= 2 * p
    assert v.steady_bubble_fraction < _table2_fraction("1f1b", p, m, f, b, w)
    if b <= 1.3 * f:
        assert v.steady_bubble_fraction < _table2_fraction("zero-bubble-h1", p, m, f, b, w)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("costs", [{"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 2.0, "W": 0.5}])
def test_interleaved_bubble_is_narayanan(p, v, costs):
    m = 2 * p
    result = simulate(make_schedule("interleaved-1f1b", v * p, m, interleave=v), costs=costs)
    ideal = v * m * sum(costs.values())  # every chunk's F, B and W, one after another
    np.testing.assert_allclose((result.makespan - ideal) / ideal, (p - 1) / (v * m), atol=EXACT)


def test_peak_bytes_per_stage():
    schedule = make_schedule("1f1b", 2, 4)
    uniform = simulate(schedule, activation_bytes=3.0)
    assert uniform.peak_bytes == tuple(3.0 * n for n in uniform.peak_in_flight)
    per_stage = simulate(schedule, activation_bytes=[1.0, 10.0])
    assert per_stage.peak_bytes == (2.0, 10.0)


@pytest.mark.parametrize("value", [-1.0, [1.0], "big", float("nan")])
def test_bad_activation_bytes(value):
    with pytest.raises(errors.InvalidScheduleError, match="`activation_bytes`"):
        simulate(make_schedule("1f1b", 2, 2), activation_bytes=value)


@pytest.mark.parametrize("value", [-0.1, 2, True, None])
def test_bad_w_memory_in_simulate(value):
    with pytest.raises(errors.InvalidScheduleError, match="`w_memory`"):
        simulate(make_schedule("zero-bubble-h1", 2, 2), w_memory=value)


def test_w_memory_in_peak_bytes():
    """ZB-H1 by the paper's Table 2: row i holds (p - i + 1) M_B + (i - 1) M_W at its peak
    (i from 1), so p M_B on the first row whatever M_W."""
    p, m, share = 4, 8, 0.25
    result = simulate(make_schedule("zero-bubble-h1", p, m), activation_bytes=1.0, w_memory=share)
    expected = [(p - i + 1) + (i - 1) * share for i in range(1, p + 1)]
    np.testing.assert_allclose(result.peak_bytes, expected, rtol=0, atol=EXACT)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "zero-bubble-h2", "costs": {"F": 1.0}}, "`costs` shapes only"),
        ({"name": "1f1b", "max_in_flight": 4}, "`max_in_flight` applies"),
        ({"name": "zero-bubble-auto", "max_in_flight": 0}, "positive integer `max_in_flight`"),
        ({"name": "zero-bubble-v", "max_in_flight": 1}, "`max_in_flight` >= 2"),
        ({"name": "zero-bubble-v", "num_submeshes": 4}, "two stages per submesh"),
        ({"name": "zero-bubble-h1", "num_submeshes": 2}, "one stage per submesh"),
        ({"name": "zero-bubble-auto", "costs": {"X": 1.0}}, "Unknown keys"),
        ({"name": "zero-bubble-h1", "w_memory": 0.5}, "`w_memory` applies"),
        ({"name": "zero-bubble-auto", "w_memory": 1.5}, r"`w_memory` to be a number in \[0, 1\]"),
        ({"name": "zero-bubble-v", "w_memory": "half"}, r"`w_memory` to be a number in \[0, 1\]"),
    ],
)
def test_bad_zero_bubble_arguments(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(errors.InvalidScheduleError, match=match):
        make_schedule(name, 4, 8, **kwargs)
