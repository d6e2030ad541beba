"""predict: bubble and step against mm.simulate, in-flight activation sets against the
schedules' known counts, parameter bytes against the placed model, scaling, bad plans."""

import dataclasses

import jax
import optax
import pytest
from flax import linen as nn

import multimesh_flax as mm
from models import GPT, get_config
from models.pipeline import make_multimesh
from multimesh_flax import errors
from multimesh_flax.planner import Plan, Source, TransferCost, peak_activation_bytes
from multimesh_flax.planner._predict import _fused_pair
from tests.planner._planning_models import tokens

pytestmark = pytest.mark.xdist_group("planner")

FREE = TransferCost(0.0, 0.0)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (3, 2)])
def test_1f1b_keeps_min_p_minus_stage_m_sets(p, m):
    schedule = mm.make_schedule("1f1b", num_stages=p, num_microbatches=m)
    expected = tuple(min(p - s, m) for s in range(p))
    assert peak_activation_bytes(schedule, [1] * p) == expected
    assert mm.simulate(schedule).peak_in_flight == expected
    gpipe = mm.make_schedule("gpipe", num_stages=p, num_microbatches=m)
    assert peak_activation_bytes(gpipe, [1] * p) == (m,) * p


def test_interleaved_rows_weigh_each_stage_by_its_bytes():
    schedule = mm.make_schedule("interleaved-1f1b", num_stages=4, num_microbatches=4, interleave=2)
    counts = peak_activation_bytes(schedule, [1] * 4)
    assert counts == mm.simulate(schedule).peak_in_flight
    weighted = peak_activation_bytes(schedule, [1, 1, 0, 0])  # the second chunks weigh nothing
    assert all(w <= c for w, c in zip(weighted, counts, strict=True))


def _apart(profile):
    """``profile`` without its fused programs: a fused F and B priced as the two apart."""
    costs = tuple(dataclasses.replace(c, fused=mm.planner.PhaseCost()) for c in profile.costs)
    return dataclasses.replace(profile, costs=costs)


def test_equal_stages_bubble_is_p_minus_1_over_m_plus_p_minus_1(mlp_profile):
    for schedule, p, m in [("1f1b", 2, 4), ("gpipe", 4, 4)]:
        plan = Plan((4 // p,) * p, microbatches=m, schedule=schedule)
        bubble = mm.predict(plan, _apart(mlp_profile), transfer=FREE).bubble
        assert bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h2"])
def test_step_and_bubble_are_the_simulators(gpt_profile, schedule):
    plan = Plan((1, 3), microbatches=4, schedule=schedule, recompute=(None, "full"))
    link = TransferCost(1e-5, 1e-9)
    prediction = mm.predict(plan, gpt_profile, transfer=link)
    # the reference: the unit costs summed per stage by hand, the output of the last unit sent
    stage_units = [[0, 1], [1, 1, 1, 2]]
    policies = [None, "full"]

    split = schedule != "1f1b"

    def cost(stage, phase):
        units = [gpt_profile.cost(u, policies[stage]) for u in stage_units[stage]]
        if phase == "transfer":
            return link.seconds(units[-1].output_bytes)
        if phase == "F+B":  # one program: the fused one's share of F and the whole backward
            # (a block again in it: what a second copy added to the profile's fused block)
            repeat = [u.unit in {v.unit for v in units[:k]} for k, u in enumerate(units)]
            fused = sum(
                (u.fused_repeat if again else u.fused).seconds
                for u, again in zip(units, repeat, strict=True)
            )
            share = fused / sum(u.forward.seconds + u.backward.seconds for u in units)
            accumulate = 0.0 if split else sum(u.accumulate.seconds for u in units)
            backward = cost(stage, "B") - accumulate
            return min(share, 1.0) * (cost(stage, "F") + backward) + accumulate
        # an unsplit backward is one program; the gradient op adds into the running sum
        attr = {"F": "forward", "B": "backward_input" if split else "backward"}
        attr["W"] = "backward_weight" if split else None
        seconds = sum(getattr(u, attr[phase]).seconds for u in units) if attr[phase] else 0.0
        if phase == ("W" if split else "B"):
            seconds += sum(u.accumulate.seconds for u in units)
        return seconds

    reference = mm.simulate(mm.make_schedule(schedule, 2, 4), costs=cost, fused=True)
    assert prediction.bubble == pytest.approx(reference.bubble_fraction)
    update = [
        sum(gpt_profile.cost(u, p).update.seconds for u in us)
        for us, p in zip(stage_units, policies, strict=True)
    ]
    ends = [max(e for r, _, _, e in reference.timeline if r == row) for row in (0, 1)]
    assert prediction.step_time == pytest.approx(
        max(e + u for e, u in zip(ends, update, strict=True))
    )
    assert prediction.sources["unit times"] is Source.ANALYTIC
    assert prediction.sources["step_time"] is Source.DERIVED


def test_a_stage_pays_one_launch_per_program(gpt_profile):
    # the runtime runs a stage's units as one program per phase: each unit's time counts
    # without its own program's launch, the stage's once
    phases = ("forward", "backward", "update")
    launch = min(getattr(c, f).seconds for c in gpt_profile.costs for f in phases) / 2
    launched = dataclasses.replace(gpt_profile, launch_seconds=launch)
    plan = Plan((1, 3), microbatches=4)
    plain = mm.predict(plan, gpt_profile, transfer=FREE).stages
    stages = mm.predict(plan, launched, transfer=FREE).stages
    for s, (units, updated) in enumerate([(2, 2), (4, 4)]):  # stage 0: the stem and a block
        for f in ("forward", "backward"):
            got, alone = getattr(stages[s], f).seconds, getattr(plain[s], f).seconds
            assert got == pytest.approx(alone - (units - 1) * launch)
        assert stages[s].update.seconds == pytest.approx(
            plain[s].update.seconds - (updated - 1) * launch
        )


def test_the_backward_frees_the_forwards_residuals(gpt_profile):
    # the runtime frees a value in the op that reads it last: the forward's residuals in
    # the whole backward (or a split backward's W), never in the forward, and not at all
    # where F and B run as one program
    release = 1e-4
    costs = tuple(
        dataclasses.replace(c, forward=dataclasses.replace(c.forward, release_seconds=release))
        for c in gpt_profile.costs
    )
    freed = dataclasses.replace(gpt_profile, costs=costs)
    plan = Plan((1, 3), microbatches=4, schedule="1f1b")
    plain = mm.predict(plan, gpt_profile, transfer=FREE).stages
    stages = mm.predict(plan, freed, transfer=FREE).stages
    for s, units in enumerate((2, 4)):  # stage 0: the stem and a block; 1: 3 blocks, head
        assert stages[s].forward.seconds == pytest.approx(plain[s].forward.seconds)
        assert stages[s].backward_input.seconds == pytest.approx(plain[s].backward_input.seconds)
        for f in ("backward", "backward_weight"):
            got, alone = getattr(stages[s], f).seconds, getattr(plain[s], f).seconds
            assert got == pytest.approx(alone + units * release)
        fused = _fused_pair(stages[s], False, 0.0)
        assert fused == pytest.approx(_fused_pair(plain[s], False, 0.0))


def test_peak_bytes_follow_the_runtimes_live_values(gpt_profile):
    prediction = mm.predict(Plan((2, 2), microbatches=4), gpt_profile)
    c = gpt_profile.cost
    act = c(0).activation_bytes + 2 * c(1).activation_bytes
    # each moment with its own programs' scratch: the backward's is gone at the update
    temp = [max(c(u).pipeline_temp_bytes for u in us) for us in ([0, 1], [1, 2])]
    update_temp = [max(c(u).update.temp_bytes for u in us) for us in ([0, 1], [1, 2])]
    grads = [s.param_bytes for s in prediction.stages]
    # 1F1B, row 0: F F B F B F B B. Two sets and three gradients' worth at every B but the
    # last: the running sum (zeros before the first), the microbatch's own and the new sum
    # (the old one is donated, but counts until the op ends). Row 1 runs F+B fused: no set
    # outlives an op; three gradients' worth beside the fused program's scratch (its
    # units' residuals)
    fused = 2 * c(1).fused_temp_bytes + c(2).fused_temp_bytes
    assert fused > temp[1]  # the residuals do not fit in the largest unit's scratch
    pipeline = [2 * act + 3 * grads[0], 3 * grads[1] + fused - temp[1]]
    assert prediction.peak_in_flight == (2, 1)
    for row in (0, 1):
        stage = prediction.stages[row]
        state = stage.param_bytes + stage.opt_state_bytes
        update = state + grads[row]  # the new state beside the old, and the gradient sum
        assert prediction.state_bytes[row] == state
        assert prediction.activation_bytes[row] == pipeline[row]
        assert prediction.update_bytes[row] == update
        assert prediction.peak_bytes[row] == state + max(
            pipeline[row] + temp[row], update + update_temp[row]
        )


@pytest.mark.parametrize(
    "split, shape", [((2, 2), (2, 2, 2)), ((1, 3), (2, 2, 2)), ((4,), (1, 2, 4))]
)
def test_parameter_bytes_equal_the_placed_models(gpt_profile, split, shape):
    # (data 2, model 4) was never profiled: the planner does not need those devices
    stages, data, model = shape
    config = get_config("gpt-tiny", num_layers=4)
    with make_multimesh(stages, data, model):
        placement = mm.layers.get_placement(
            GPT(config, layers_per_stage=split), jax.random.key(0), tokens()
        )
    per_device = placement.bytes_per_device()
    plan = Plan(split, microbatches=2, batch_size=8, stage_mesh={"data": data, "model": model})
    prediction = mm.predict(plan, gpt_profile)
    per_stage = 8 // stages
    for s, stage in enumerate(prediction.stages):
        assert {per_device[d] for d in range(s * per_stage, (s + 1) * per_stage)} == {
            stage.param_bytes
        }


def test_another_shape_or_microbatch_is_derived_by_the_rule(gpt_profile):
    same = mm.predict(Plan((2, 2), microbatches=2), gpt_profile, transfer=FREE)
    assert same.sources["unit times"] is Source.ANALYTIC
    bigger = Plan((2, 2), microbatches=2, batch_size=16, stage_mesh={"data": 2, "model": 1})
    scaled = mm.predict(bigger, gpt_profile, transfer=FREE)
    assert scaled.sources["unit times"] is Source.DERIVED
    # twice the rows on half the devices: 4x the time; twice the rows on the same data
    # devices: 2x the activations
    for a, b in zip(same.stages, scaled.stages, strict=True):
        assert b.forward.seconds == pytest.approx(4 * a.forward.seconds)
        assert b.activation_bytes == pytest.approx(2 * a.activation_bytes, abs=2)


@pytest.mark.parametrize(
    "plan, error, fragment",
    [
        (Plan((2, 3), microbatches=2), errors.PlanMismatchError, "4 blocks"),
        (Plan((2, 2), microbatches=3, batch_size=8), errors.UnevenMicrobatchError, "3"),
        (Plan((2, 2), recompute="dots"), errors.PlanMismatchError, "'dots'"),
        (Plan((2, 2), stage_mesh={"data": 2}), errors.PlanMismatchError, "profiled axes"),
        (Plan((2, 2), schedule="2f2b"), errors.PlanMismatchError, "'2f2b'"),
    ],
)
def test_bad_plans_raise(gpt_profile, plan, error, fragment):
    with pytest.raises(error, match=fragment):
        mm.predict(plan, gpt_profile)


def test_optimizer_state_bytes_equal_adams_state_of_the_whole_model(gpt_profile):
    model = GPT(get_config("gpt-tiny", num_layers=4))
    params = jax.eval_shape(model.init, jax.random.key(0), tokens())["params"]
    state = jax.eval_shape(optax.adamw(1e-3).init, nn.unbox(params))
    expected = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))
    one_device = mm.predict(Plan((2, 2), stage_mesh={"data": 1, "model": 1}), gpt_profile)
    assert sum(s.opt_state_bytes for s in one_device.stages) == expected
    # on (data 2, model 2): the two moments shard like the parameters; one step counter
    stages = mm.predict(Plan((2, 2)), gpt_profile).stages
    assert stages[0].opt_state_bytes == 2 * stages[0].param_bytes + 4
    assert stages[1].opt_state_bytes == 2 * stages[1].param_bytes


def test_recomputed_stages_hold_every_units_scratch(gpt_profile):
    # the runtime inlines jax.checkpoint: a stage's backward recomputes all its units'
    # forwards before XLA frees any, so their scratch adds up; without recomputation the
    # largest unit's program bounds it
    plan = Plan((1, 3), microbatches=4, recompute=(None, "full"))
    stages = mm.predict(plan, gpt_profile, transfer=FREE).stages
    plain = [gpt_profile.cost(u, None).pipeline_temp_bytes for u in (0, 1)]
    full = [gpt_profile.cost(u, "full").pipeline_temp_bytes for u in (1, 1, 1, 2)]
    assert stages[0].temp_bytes == max(plain)
    assert stages[1].temp_bytes == sum(full)
