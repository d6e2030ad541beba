"""The search: the dynamic program against brute force over `predict`'s own stage costs, its
memory tables against `predict`'s peaks, the in-flight rule against built schedules, and
`mm.plan`'s ranking, memory error and bad arguments."""

import itertools

import numpy as np
import pytest

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.planner import CostSpec, Plan, TransferCost, _search, profile_from_costs
from multimesh_flax.planner._planning import make_space, search_plans
from multimesh_flax.planner._split import best_split, interval_arrays

pytestmark = pytest.mark.xdist_group("planner")

FREE = TransferCost(0.0, 0.0)


def _uneven_profile():
    """Six blocks of different speed and size, a cheap stem and a heavy head."""
    units = [CostSpec("stem", 0.2, params=2000, activation_bytes=400, output_bytes=64)]
    for i, (time, act) in enumerate(
        [(1.0, 900), (0.5, 300), (2.0, 1500), (1.0, 700), (0.3, 200), (1.5, 1000)]
    ):
        units.append(
            CostSpec("layer", time, params=1000 * (i + 1), activation_bytes=act, output_bytes=64)
        )
    units.append(CostSpec("head", 2.5, params=6000, activation_bytes=2000, output_bytes=64))
    return profile_from_costs(units)


def _splits(layers, stages):
    """Every split of ``layers`` blocks; only the first and last stage may be empty."""
    for cuts in itertools.combinations_with_replacement(range(layers + 1), stages - 1):
        bounds = (0, *cuts, layers)
        split = tuple(b - a for a, b in itertools.pairwise(bounds))
        if all(n > 0 for n in split[1:-1]):
            yield split


def _brute_force(profile, tables, stages, schedule, m, memory):
    """The least ``sum t + (m - 1) max t`` over every split and policy per stage, each
    priced by `predict` (stage times F + the whole backward), within ``memory`` by the
    tables' peak bytes (the dynamic program's bound of `predict`'s)."""
    best = None
    for split in _splits(6, stages):
        bounds = np.cumsum((0, *split))
        for policies in itertools.product((None, "full"), repeat=stages):
            peaks = [
                tables.peak[s, (None, "full").index(p), bounds[s], bounds[s + 1]]
                for s, p in enumerate(policies)
            ]
            if max(peaks) > memory:
                continue
            plan = Plan(split, microbatches=m, schedule=schedule, recompute=policies)
            prediction = mm.predict(plan, profile, transfer=FREE)
            times = [s.forward.seconds + s.backward.seconds for s in prediction.stages]
            value = sum(times) + (m - 1) * max(times)
            if best is None or value < best[0] - 1e-9:
                best = (value, split)
    return best


@pytest.mark.parametrize(
    "stages, schedule, m, memory",
    [
        (3, "1f1b", 4, np.inf),
        (3, "1f1b", 4, 430_000),
        (2, "gpipe", 3, 550_000),
        (4, "zero-bubble-h2", 4, 384_000),
    ],
)
def test_dynamic_program_equals_brute_force(stages, schedule, m, memory):
    profile = _uneven_profile()
    tables = _search.Tables(profile, (None, "full"), FREE)
    config = _search.Config(stages, (("data", 1), ("model", 1)), schedule, m)
    stage_tables = tables.stage_tables(config, m)
    found = best_split(stage_tables, m, memory)
    expected = _brute_force(profile, stage_tables, stages, schedule, m, memory)
    assert expected is not None
    assert found.objective == pytest.approx(expected[0], rel=1e-12)


def test_memory_tables_equal_predicts_peaks(gpt_profile):
    # a submesh and microbatch size that were not profiled: every number scaled
    tables = _search.Tables(gpt_profile, (None, "full"), FREE)
    config = _search.Config(3, (("data", 4), ("model", 1)), "1f1b", 4)
    stage_tables = tables.stage_tables(config, 32)
    for split in [(0, 2, 2), (1, 1, 2), (2, 2, 0)]:
        for k, policy in enumerate((None, "full")):
            plan = Plan(
                split, microbatches=4, batch_size=32, recompute=policy, stage_mesh=dict(config.mesh)
            )
            prediction = mm.predict(plan, gpt_profile, transfer=FREE)
            bounds = np.cumsum((0, *split))
            for s in range(3):
                peak = stage_tables.peak[s, k, bounds[s], bounds[s + 1]]
                # a bound of predict's: the tables keep every in-flight set to its backward,
                # predict none past the last stage's fused forward and backward; the tables
                # add the largest update scratch of any unit, predict the stage's own
                slack = prediction.stages[s].activation_bytes if s == 2 else 0
                slack += tables._unit(dict(config.mesh), 8)[6]
                assert prediction.peak_bytes[s] <= peak <= prediction.peak_bytes[s] + slack
                stage = prediction.stages[s]
                seconds = stage.forward.seconds + stage.backward.seconds
                assert stage_tables.time[s, k, bounds[s], bounds[s + 1]] == pytest.approx(seconds)


@pytest.mark.parametrize("schedule", _search.SEARCH_SCHEDULES)
def test_in_flight_rule_equals_the_built_schedules(schedule):
    for stages, m in [(2, 7), (3, 9), (4, 11), (4, 16)]:
        built = mm.make_schedule(schedule, stages, m)
        assert _search.in_flight(schedule, stages, m) == mm.planner.peak_activation_bytes(
            built, [1] * stages
        )


def _space(**kw):
    defaults = dict(
        devices=4,
        memory_per_device=None,
        schedules=("1f1b", "gpipe"),
        microbatches=(2, 4),
        recompute=(None, "full"),
        stages=None,
        tensor=None,
        per_stage_recompute=True,
    )
    return make_space(16, **(defaults | kw))


def test_plans_are_ranked_fit_and_are_predicts(gpt_profile):
    space = _space(memory_per_device="24MiB")
    plans = search_plans(gpt_profile, space, transfer=None, top=6)
    assert 1 <= len(plans) <= 6 and plans.best is plans[0]
    times = [p.step_time for p in plans]
    assert times == sorted(times)
    for p in plans:
        assert p.max_peak_bytes <= 24 * 2**20
        assert p.plan.num_stages * np.prod(list(p.plan.stage_meshes()[0].values())) == 4
        again = mm.predict(p.plan, gpt_profile)
        assert again.step_time == p.step_time and again.peak_bytes == p.peak_bytes


def test_nothing_fits_names_the_least_memory_and_its_plan(gpt_profile):
    with pytest.raises(errors.PlanMemoryError, match="least memory per device") as caught:
        search_plans(gpt_profile, _space(memory_per_device=1000), transfer=None, top=3)
    need, least = caught.value.required_bytes, caught.value.prediction
    assert need == least.max_peak_bytes and f"{need:,} B" in str(caught.value)
    assert str(least.plan.layers_per_stage) in str(caught.value)
    # that much is enough, a little less is not
    assert search_plans(gpt_profile, _space(memory_per_device=need + 64), transfer=None, top=1)
    with pytest.raises(errors.PlanMemoryError):
        search_plans(gpt_profile, _space(memory_per_device=need - 64), transfer=None, top=1)


def test_one_policy_for_all_stages_when_asked(gpt_profile):
    space = _space(memory_per_device="12MiB", per_stage_recompute=False)
    for p in search_plans(gpt_profile, space, transfer=None, top=5):
        assert len(set(p.plan.policies())) == 1


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(schedules="interleaved-1f1b"), "'interleaved-1f1b'"),
        (dict(memory_per_device="2 parsecs"), "'2 parsecs'"),
        (dict(microbatches=(3, 5)), "divide"),
        (dict(devices=0), "devices"),
    ],
)
def test_bad_search_spaces_raise(kw, fragment):
    with pytest.raises(errors.PlanArgumentError, match=fragment):
        _space(**kw)


def test_bytes_parse():
    assert mm.planner.parse_bytes("2GiB") == 2 * 2**30
    assert mm.planner.parse_bytes("512 MB") == 512e6
    assert mm.planner.parse_bytes(None) == np.inf


def test_a_given_profile_bounds_the_policies(mlp_profile):
    x = np.ones((8, 16))
    plans = mm.plan(None, None, x, devices=2, profile=mlp_profile, microbatches=2)
    assert {p.plan.policies() for p in plans} == {(None, None)}
    with pytest.raises(errors.PlanArgumentError, match="'full'"):
        mm.plan(None, None, x, devices=2, profile=mlp_profile, recompute="full")


def test_recomputed_intervals_add_their_blocks_scratch():
    # per policy row: the largest block's temporary, or under recomputation their sum
    temp = np.array([[1.0, 4.0, 2.0], [1.0, 4.0, 2.0]])
    zeros = np.zeros_like(temp)
    intervals = interval_arrays(zeros, zeros, np.zeros(3), temp, summed_temp=[False, True])
    assert intervals.temp[0, 0, 3] == 4.0 and intervals.temp[1, 0, 3] == 7.0  # blocks 0-2
    assert intervals.temp[0, 1, 3] == 4.0 and intervals.temp[1, 1, 3] == 6.0  # blocks 1-2
