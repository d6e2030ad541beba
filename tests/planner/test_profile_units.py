"""profile_units: FLOPs against XLA's analysis of the unit compiled alone, identical blocks
compiled once, activation bytes under recomputation, measured mode, and bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import multimesh_flax as mm
from models import GPT, GPTBlock, get_config
from models.loss import cross_entropy_loss
from models.pipeline import LOGICAL_RULES, make_multimesh
from multimesh_flax import errors
from multimesh_flax.planner import Source
from tests.planner._planning_models import LENGTH, MLP, ROWS, tokens

pytestmark = pytest.mark.xdist_group("planner")


def _xla_flops(fun, *args):
    return jax.jit(fun).lower(*args).compile().cost_analysis()["flops"]


def test_dense_flops_equal_xla_on_one_device(mlp_profile):
    # A dense layer's forward keeps only its input: the F program is the plain forward.
    dense = nn.Dense(16)
    x = jnp.ones((8, 16))
    params = dense.init(jax.random.key(0), x)["params"]
    expected = _xla_flops(lambda p, x: dense.apply({"params": p}, x), params, x)
    cost = mlp_profile.cost(0)
    assert cost.forward.flops == expected
    # and it returns what the runtime's forward fragment does: the output alone, not copies
    # of the input and the kernel it was given (the vjp's residuals; the backward reads them)
    plain = jax.jit(lambda p, x: dense.apply({"params": p}, x)).lower(params, x).compile()
    assert cost.forward.bytes_accessed == plain.cost_analysis()["bytes accessed"]
    # the weight gradient x^T g and the input gradient g W^T are one matmul each
    matmul = 2 * 8 * 16 * 16
    assert cost.backward_weight.flops >= matmul and cost.backward_input.flops >= matmul
    # the whole backward is both; W keeps the input (8 x 16) and the output cotangent
    assert cost.backward.flops >= 2 * matmul
    # the gradient sum, added inside the backward: one addition per parameter
    assert cost.accumulate.flops == 16 * 16 + 16
    # F and B as one program do the work of both apart
    assert cost.fused.flops >= cost.forward.flops + 2 * matmul
    assert cost.weight_kept_bytes == 2 * 8 * 16 * 4


def test_a_repeated_block_prices_its_further_copies_in_a_fused_program(gpt_profile):
    # two chained blocks fused, against one: about one block's fused work more
    for policy in (None, "full"):
        block = gpt_profile.cost(1, policy)
        assert 0.9 * block.fused.flops <= block.fused_repeat.flops <= 1.1 * block.fused.flops
        assert block.fused_repeat.seconds > 0
    # the stem and the head occur once: nothing to price
    for unit in (0, 2):
        assert gpt_profile.cost(unit).fused_repeat.flops == 0


def test_split_backward_halves_share_the_cotangents(gpt_profile):
    block = gpt_profile.cost(1)
    # B + W is the whole backward cut in two, not two backwards: no cotangent computed twice
    halves = block.backward_input.flops + block.backward_weight.flops
    assert halves <= 1.05 * block.backward.flops
    assert 0 < block.weight_kept_bytes < block.activation_bytes + block.output_bytes


def test_block_forward_flops_equal_xla_of_the_block_alone():
    profile = mm.profile_units(
        GPT(get_config("gpt-tiny", num_layers=2)), tokens(), rules=LOGICAL_RULES
    )
    block = GPTBlock(get_config("gpt-tiny", num_layers=2))
    x = jnp.ones((ROWS, LENGTH, 64))
    params = block.init(jax.random.key(0), x)["params"]

    def forward(p, x):  # the forward a pipeline runs: output and the vjp's residuals
        out, vjp = jax.vjp(lambda p, x: block.apply({"params": p}, x), p, x)
        return out, jax.tree_util.tree_leaves(vjp)

    assert profile.cost(1).forward.flops == _xla_flops(forward, params, x)
    plain = _xla_flops(lambda p, x: block.apply({"params": p}, x), params, x)
    assert plain <= profile.cost(1).forward.flops <= 1.2 * plain


def _first_forward_outputs(step, state, batch, stage):
    """The values the runtime's forward op of ``stage`` returns for microbatch 0: the step's
    ops run one by one, as the dispatcher runs them, up to that op."""
    exe = step.executable(state, batch)
    env = exe.make_env([*jax.tree_util.tree_leaves(state), *jax.tree_util.tree_leaves(batch)])
    for index, op in enumerate(exe.ops):
        values = [env[s] for s in op.ins]
        fn = exe.state.fns[index]
        results = fn(*values) if op.kind == 0 else fn(values)
        unit = getattr(op, "unit", None)
        if unit is not None and (unit.stage, unit.phase, unit.microbatch) == (stage, "F", 0):
            return results
        for slot, value in zip(op.outs, results, strict=True):
            env[slot] = value
    raise AssertionError(f"no forward op of stage {stage}")


def test_the_forward_keeps_what_the_runtimes_forward_returns(gpt_profile):
    # gpt_profile's submesh (data 2, model 2) as the first of two stages: the stem and two
    # blocks. Input-free values only the backward reads (jnp.where's zero tangent, as large
    # as the attention logits and replicated) are made in the runtime's backward, not kept:
    # counting them put 16% more bytes here.
    config = get_config("gpt-tiny", num_layers=4)
    batch = {"inputs": tokens(2 * ROWS), "targets": tokens(2 * ROWS)}

    def loss_fn(model_fn, batch):
        return cross_entropy_loss(model_fn(batch["inputs"]), batch["targets"])

    built = mm.parallelize_step(
        GPT(config, layers_per_stage=(2, 2)),
        optax.adamw(1e-3),
        make_multimesh(2, 2, 2),
        batch,
        loss_fn=loss_fn,
        microbatches=2,
        schedule="1f1b",
    )
    outputs = _first_forward_outputs(built.step, built.state, batch, stage=0)
    per_device = [x.addressable_shards[0].data.nbytes for x in outputs]
    c = gpt_profile.cost
    kept = c(0).activation_bytes + 2 * c(1).activation_bytes
    assert kept == pytest.approx(sum(per_device) - c(1).output_bytes, rel=0.01)


def test_identical_blocks_are_compiled_once():
    traced = {}

    def count(next_fun, args, kwargs, context):
        if isinstance(context.module, GPTBlock) and context.method_name == "__call__":
            traced[layers] = traced.get(layers, 0) + 1
        return next_fun(*args, **kwargs)

    compiles = {}
    for layers in (2, 4):
        with nn.intercept_methods(count):
            profile = mm.profile_units(
                GPT(get_config("gpt-tiny", num_layers=layers)), tokens(), rules=LOGICAL_RULES
            )
        compiles[layers] = profile.compiles
    # Two more blocks cost two more calls while finding the units, and nothing else.
    assert traced[4] - traced[2] == 2
    assert compiles[2] == compiles[4]


def test_state_and_activation_bytes_on_a_submesh(gpt_profile):
    block = gpt_profile.cost(1)
    assert str(block.forward.source) == "analytic"
    # full recomputation keeps the block's input alone: (rows, length, embed) float32 over
    # the 2 data devices
    assert gpt_profile.cost(1, "full").activation_bytes == ROWS * LENGTH * 64 * 4 // 2
    assert block.activation_bytes > 4 * gpt_profile.cost(1, "full").activation_bytes
    # recomputation moves forward work into the backward
    assert (
        gpt_profile.cost(1, "full").backward_input.flops
        + gpt_profile.cost(1, "full").backward_weight.flops
        > block.backward_input.flops + block.backward_weight.flops
    )
    # AdamW keeps two moments per parameter (and a step count)
    n_params = sum(int(np.prod(p.shape)) for p in block.params)
    n_state = sum(int(np.prod(p.shape)) for p in block.opt_state)
    assert n_state == 2 * n_params + 1


def test_measured_mode_times_the_programs(mlp_profile):
    rounds = []
    measured = mm.profile_units(
        MLP(),
        jnp.ones((8, 16)),
        patterns=[r"layer_\d+"],
        mode="measured",
        repeats=2,
        between_rounds=lambda: rounds.append(len(rounds)),
    )
    assert rounds == [0, 1]  # after each of the 2 timing rounds
    cost = measured.cost(0)
    assert measured.mode is Source.MEASURED and cost.forward.source is Source.MEASURED
    assert cost.forward.seconds > 0 and cost.backward_weight.seconds > 0
    # freeing a program's outputs is timed apart (the runtime frees them in their reader)
    assert cost.forward.release_seconds > 0 and mlp_profile.cost(0).forward.release_seconds == 0
    assert cost.fused.seconds > 0 and cost.fused.source is Source.MEASURED
    # the sum's share of the backward: a per-round difference of two timed programs
    assert cost.accumulate.source is Source.MEASURED and cost.accumulate.seconds >= 0
    assert cost.accumulate.flops == mlp_profile.cost(0).accumulate.flops
    # the empty program's launch, timed with them (one more compile); none when analytic
    assert measured.launch_seconds > 0 and mlp_profile.launch_seconds == 0
    assert measured.compiles == mlp_profile.compiles + 1
    assert cost.forward.flops == mlp_profile.cost(0).forward.flops  # FLOPs stay analytic


_RUNS: list = []  # one entry per run of a program holding `_Counted`'s forward


class _CountedDense(nn.Module):
    """A dense layer that counts, on the host, every run of a program computing it."""

    @nn.compact
    def __call__(self, x):
        jax.debug.callback(lambda: _RUNS.append(1))
        return nn.Dense(x.shape[-1])(x)


class _Counted(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _CountedDense(name="layer_0")(x)


def test_each_round_after_between_rounds_follows_an_untimed_run_of_every_program():
    # runs of the programs holding the layer's forward: those between two calls of
    # `between_rounds` are an untimed one and a timed round; after the last call, the
    # untimed one alone. So the first count is twice the second.
    _RUNS.clear()
    seen = []
    mm.profile_units(
        _Counted(), jnp.ones((8, 16)), patterns=[r"layer_\d+"], mode="measured",
        repeats=3, between_rounds=lambda: seen.append(len(_RUNS)),
    )  # fmt: skip
    per_settle = len(_RUNS) - seen[-1]
    assert per_settle > 0
    assert [b - a for a, b in zip(seen, seen[1:], strict=False)] == [2 * per_settle] * 2


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (dict(mode="timed"), errors.ProfileArgumentError, "'timed'"),
        (dict(device="tpu9"), errors.ProfileArgumentError, "'tpu9'"),
        (dict(between_rounds=3), errors.ProfileArgumentError, "callable"),
        (dict(mesh_shape={"data": 16}), errors.ProfileArgumentError, "at most the 8"),
        (dict(mesh_shape={"data": 0}), errors.ProfileArgumentError, "sizes >= 1"),
        (dict(recompute="all"), errors.RecomputePolicyError, "'all'"),
    ],
)
def test_bad_arguments_raise(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        mm.profile_units(MLP(), jnp.ones((8, 16)), patterns=[r"layer_\d+"], **kwargs)


def test_inputs_without_batch_dimension_raise():
    with pytest.raises(errors.ProfileArgumentError, match="leading batch dimension"):
        mm.profile_units(MLP(), jnp.float32(1.0), patterns=[r"layer_\d+"])


def test_measure_transfer_between_submeshes():
    # a stage's output split over its 2 devices moves shard by shard, as the runtime moves it
    cost = mm.measure_transfer([0, 1], [2, 3], sizes=(1 << 10, 1 << 14), repeats=2)
    assert cost.source is Source.MEASURED and cost.latency >= 0 and cost.seconds_per_byte >= 0


@pytest.mark.parametrize(
    "source, destination, sizes, fragment",
    [
        ([0, 1], [1, 2], (4, 8), "disjoint"),  # a device on both sides
        ([0, 1], [2], (4, 8), "same number"),
        (0, 99, (4, 8), "below"),
        (0, 1, (4, 4), "two different sizes"),
    ],
)
def test_measure_transfer_refuses_bad_sides(source, destination, sizes, fragment):
    with pytest.raises(errors.ProfileArgumentError, match=fragment):
        mm.measure_transfer(source, destination, sizes=sizes)
