"""Tests for schedule generation and validation (``multimesh_flax.core.declare._schedules``)."""

import collections

import pytest

from multimesh_flax import errors
from multimesh_flax.core.declare import Schedule, ScheduleOp, make_schedule, validate_schedule

NAMES = [
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "zero-bubble-h1",
    "zero-bubble-h2",
    "zero-bubble-auto",
    "zero-bubble-v",
]
TWO_PER_ROW = ("interleaved-1f1b", "zero-bubble-v")


def _ops(*names):
    return tuple(ScheduleOp.parse(name) for name in names)


def _schedule(rows, num_stages=2, num_microbatches=1, split_backward=False):
    return Schedule(
        rows=rows,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        split_backward=split_backward,
        name="custom",
        stage_to_row=tuple(range(num_stages)),
    )


def _kwargs(name, p):
    return {"interleave": 2} if name == "interleaved-1f1b" else {}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_generators_are_complete_and_valid(name, p, m):
    if name == "interleaved-1f1b" and m % p:
        pytest.skip("interleaved needs m to be a multiple of the submesh count")
    num_stages = 2 * p if name in TWO_PER_ROW else p
    schedule = make_schedule(name, num_stages, m, **_kwargs(name, p))
    validate_schedule(schedule)
    assert schedule.num_submeshes == p
    assert schedule.split_backward == name.startswith("zero-bubble")
    counts = collections.Counter(op for _, op in schedule.ops())
    expected = {
        ScheduleOp(s, i, phase)
        for s in range(num_stages)
        for i in range(m)
        for phase in schedule.phases
    }
    assert set(counts) == expected and set(counts.values()) == {1}
    for row, op in schedule.ops():
        assert schedule.stage_to_row[op.stage] == row


def test_gpipe_and_1f1b_orders():
    assert make_schedule("gpipe", 2, 2).rows == (
        _ops("F0.0", "F0.1", "B0.0", "B0.1"),
        _ops("F1.0", "F1.1", "B1.0", "B1.1"),
    )
    assert make_schedule("1f1b", 3, 4).rows == (
        _ops("F0.0", "F0.1", "F0.2", "B0.0", "F0.3", "B0.1", "B0.2", "B0.3"),
        _ops("F1.0", "F1.1", "B1.0", "F1.2", "B1.1", "F1.3", "B1.2", "B1.3"),
        _ops("F2.0", "B2.0", "F2.1", "B2.1", "F2.2", "B2.2", "F2.3", "B2.3"),
    )


def test_interleaved_layout_and_order():
    schedule = make_schedule("interleaved-1f1b", 4, 2, num_submeshes=2)
    assert schedule.stage_to_row == (0, 1, 0, 1)
    # Row 1 (stages 1, 3): warm-up 2 * 0 + 1 * 2 forwards of chunk 0, then 1F1B.
    assert schedule.rows[1] == _ops("F1.0", "F1.1", "F3.0", "B3.0", "F3.1", "B3.1", "B1.0", "B1.1")


def test_interleaved_with_one_chunk_is_1f1b():
    interleaved = make_schedule("interleaved-1f1b", 4, 8, interleave=1)
    assert interleaved.rows == make_schedule("1f1b", 4, 8).rows


def test_zero_bubble_defers_weight_gradients():
    schedule = make_schedule("zero-bubble-h2", 4, 8)
    row = schedule.rows[0]
    # The first W runs after the first B, and more forwards run before it than 1F1B allows.
    first_b = row.index(ScheduleOp(0, 0, "B"))
    assert row.index(ScheduleOp(0, 0, "W")) > first_b
    assert first_b == 2 * 4 - 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "pipedream"}, "Unknown schedule"),
        ({"name": "1f1b", "num_stages": 0}, "positive integer `num_stages`"),
        ({"name": "1f1b", "num_microbatches": 2.5}, "positive integer `num_microbatches`"),
        ({"name": "1f1b", "interleave": 2}, "one stage per submesh"),
        ({"name": "zero-bubble-h2", "num_submeshes": 2}, "one stage per submesh"),
        ({"name": "gpipe", "num_submeshes": 3}, "multiple of `num_submeshes`"),
        ({"name": "gpipe", "interleave": 2, "num_submeshes": 4}, "`interleave`"),
        ({"name": "interleaved-1f1b"}, "needs `interleave`"),
        ({"name": "interleaved-1f1b", "interleave": 2, "num_microbatches": 3}, "multiple"),
        ({"name": "gpipe", "custom": [["F0.0"]]}, "`custom` goes with"),
        ({"name": "custom"}, "`custom` goes with"),
    ],
)
def test_make_schedule_rejects_bad_arguments(kwargs, match):
    args = {"num_stages": 4, "num_microbatches": 4, **kwargs}
    with pytest.raises(errors.InvalidScheduleError, match=match):
        make_schedule(
            args.pop("name"), args.pop("num_stages"), args.pop("num_microbatches"), **args
        )


def test_unknown_name_lists_valid_names():
    with pytest.raises(errors.InvalidScheduleError) as info:
        make_schedule("pipedream", 2, 2)
    for name in [*NAMES, "custom"]:
        assert repr(name) in str(info.value)


def test_custom_accepts_strings_tuples_and_ops():
    schedule = make_schedule(
        "custom",
        2,
        2,
        custom=[
            ["F0.0", (0, 1, "F"), "B0.0", ScheduleOp(0, 1, "B"), "W0.0", "W0.1"],
            ["F1.0", "B1.0", "W1.0", "F1.1", "B1.1", "W1.1"],
        ],
    )
    assert schedule.split_backward and schedule.name == "custom"
    assert schedule.rows[0][1] == ScheduleOp(0, 1, "F")


@pytest.mark.parametrize(
    ("custom", "match"),
    [
        ([["F0.0", "B0.0"]], "one sequence of ops per submesh"),
        ([["F0.0", "B0.0"], ["F1.0"]], r"lacks 1 op\(s\): B1.0"),
        ([["F0.0", "B0.0", "B0.0"], ["F1.0", "B1.0"]], "B0.0 appears twice"),
        ([["F0.0", "B0.0", "F1.0"], ["B1.0"]], "F1.0 sits on row 0"),
        ([["F0.0", "B0.0"], ["F1.0", "B1.0", "F2.0"]], "stage 2"),
        ([["F0.0", "B0.0"], ["F1.0", "B1.0", "F1.1"]], "microbatch 1"),
        ([["F0.0", "X0.0"], ["F1.0", "B1.0"]], "Expected an op written"),
        ([["F0.0", (0, 0, "X")], ["F1.0", "B1.0"]], "Expected each `custom` entry"),
        ([["F0.0", 7], ["F1.0", "B1.0"]], "Expected each `custom` entry"),
        ([["B0.0", "F0.0"], ["F1.0", "B1.0"]], "deadlocks"),
        ([["F0.0", "B0.0", "W0.0"], ["F1.0", "B1.0"]], "lacks 1 op"),
    ],
)
def test_custom_rejects_broken_orders(custom, match):
    with pytest.raises(errors.InvalidScheduleError, match=match):
        make_schedule("custom", 2, 1, custom=custom)


def test_validator_rejects_duplicate():
    schedule = _schedule([_ops("F0.0", "F0.0", "B0.0"), _ops("F1.0", "B1.0")])
    with pytest.raises(errors.InvalidScheduleError, match="F0.0 appears twice.*remove one"):
        validate_schedule(schedule)


def test_validator_rejects_missing():
    schedule = _schedule([_ops("F0.0"), _ops("F1.0", "B1.0")])
    with pytest.raises(errors.InvalidScheduleError, match=r"lacks 1 op\(s\): B0.0 \(row 0\)"):
        validate_schedule(schedule)


def test_validator_rejects_wrong_row():
    schedule = _schedule([_ops("F0.0", "B0.0", "F1.0"), _ops("B1.0")])
    with pytest.raises(errors.InvalidScheduleError, match="F1.0 sits on row 0.*Move it to row 1"):
        validate_schedule(schedule)


def test_validator_rejects_w_without_split_backward():
    schedule = _schedule([_ops("F0.0", "B0.0", "W0.0"), _ops("F1.0", "B1.0")])
    with pytest.raises(errors.InvalidScheduleError, match="split_backward=True"):
        validate_schedule(schedule)


@pytest.mark.parametrize(
    "rows",
    [
        # Row 1 runs B1.0 before F1.0, which it needs.
        [_ops("F0.0", "B0.0"), _ops("B1.0", "F1.0")],
        # Cross-row cycle: row 0 waits for B0.0's gradient before sending microbatch 1.
        [_ops("F0.0", "B0.0", "F0.1", "B0.1"), _ops("F1.1", "F1.0", "B1.0", "B1.1")],
    ],
)
def test_validator_rejects_deadlock(rows):
    schedule = _schedule(rows, num_microbatches=len(rows[0]) // 2)
    with pytest.raises(errors.InvalidScheduleError, match="deadlocks: row .* waits at"):
        validate_schedule(schedule)


def test_validator_rejects_deadlock_in_split_backward():
    rows = [_ops("F0.0", "W0.0", "B0.0"), _ops("F1.0", "B1.0", "W1.0")]
    schedule = _schedule(rows, split_backward=True)
    with pytest.raises(errors.InvalidScheduleError, match="waits at W0.0 .* for B0.0"):
        validate_schedule(schedule)


def test_validator_rejects_bad_layout():
    schedule = Schedule(
        rows=(_ops("F0.0", "B0.0"), _ops("F1.0", "B1.0")),
        num_stages=2,
        num_microbatches=1,
        split_backward=False,
        name="custom",
        stage_to_row=(0, 2),
    )
    with pytest.raises(errors.InvalidScheduleError, match="`stage_to_row`"):
        validate_schedule(schedule)


def test_schedule_is_hashable_data():
    schedule = _schedule([list(_ops("F0.0", "B0.0")), list(_ops("F1.0", "B1.0"))])
    assert isinstance(schedule.rows[0], tuple)
    assert hash(schedule) == hash(_schedule([_ops("F0.0", "B0.0"), _ops("F1.0", "B1.0")]))
    assert str(schedule) == "row 0: F0.0 B0.0\nrow 1: F1.0 B1.0"


@pytest.mark.parametrize("text", ["F0.3", " W12.0 ", "B1.1"])
def test_op_string_round_trip(text):
    assert str(ScheduleOp.parse(text)) == text.strip()


@pytest.mark.parametrize("text", ["F0", "X0.1", "F-1.0", "f0.1", ""])
def test_op_parse_rejects_malformed(text):
    with pytest.raises(errors.InvalidScheduleError, match="Expected an op written"):
        ScheduleOp.parse(text)
