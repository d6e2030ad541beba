"""Every pipeline schedule through ``parallelize_step`` trains the reference GPT like one device.

``gpt-tiny`` (2 blocks) with 4 microbatches runs 3 AdamW steps under GPipe, 1F1B, ZB-H2 and a
custom order on 2 stages x (2 data x 2 model) devices, and under interleaved 1F1B as 4 stages
on 2 submeshes (stem | block 0 | block 1 | head, alternating; placed by name with
``register_task``); 5 steps under ZB-H1 and the automatic zero-bubble schedule (2 stages),
and under ZB-V (the same 4 stages on a V: submeshes 0, 1, 1, 0). Losses and parameters are
compared with the unpipelined model under plain ``jax.jit`` on one device (full batch: the
mean over equal microbatches is the full mean).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import multimesh_flax as mm
from models import GPT, cross_entropy_loss, get_config
from models.pipeline import LOGICAL_RULES, make_multimesh

STEPS = 3
MICROBATCHES = 4
CONFIG = get_config("gpt-tiny")  # 2 blocks, no dropout
# Losses agree to float32 rounding. Adam divides by sqrt(v): in parameters whose gradients
# are nearly zero, rounding differences of the gradient sums (summed in another order per
# schedule) become differences of order the learning rate, hence the looser atol.
LOSS_TOL = dict(rtol=1e-5, atol=0)
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)


def _optimizer():
    return optax.adamw(1e-3, weight_decay=0.1)


def _loss_fn(model_fn, batch):
    return cross_entropy_loss(model_fn(batch["inputs"]), batch["targets"])


def _batches(steps=STEPS):
    out = []
    for seed in range(steps):
        tokens = jax.random.randint(jax.random.key(200 + seed), (8, 17), 0, CONFIG.vocab_size)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def _reference(params, batches):
    """The unpipelined GPT under plain ``jax.jit`` on device 0."""
    model, optimizer = GPT(CONFIG), _optimizer()
    params = jax.device_put(params, jax.devices()[0])
    opt_state = optimizer.init(params)

    @jax.jit
    def step(p, o, batch):
        loss, grads = jax.value_and_grad(
            lambda p: _loss_fn(lambda x: model.apply({"params": p}, x), batch)
        )(p)
        updates, o = optimizer.update(grads, o, p)
        return loss, optax.apply_updates(p, updates), o

    losses = []
    for batch in batches:
        loss, params, opt_state = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params


def _reverse_gpipe(stages):
    """A custom order: each stage runs every forward, then the backwards last microbatch first."""
    return [
        [(s, k, "F") for k in range(MICROBATCHES)]
        + [(s, k, "B") for k in reversed(range(MICROBATCHES))]
        for s in range(stages)
    ]


INTERLEAVED_SUBMESH = {"stem": 0, "blocks_0": 1, "blocks_1": 0, "head": 1}
V_SUBMESH = {"stem": 0, "blocks_0": 1, "blocks_1": 1, "head": 0}  # stage s and 3 - s together


def _build(schedule):
    """``(step, state, expected stages, expected submeshes)`` for one schedule."""
    multi, batch = make_multimesh(2, 2, 2), _batches()[0]
    options = dict(loss_fn=_loss_fn, microbatches=MICROBATCHES, schedule=schedule)
    if schedule == "custom":
        options["custom_schedule"] = _reverse_gpipe(2)
    if schedule not in ("interleaved-1f1b", "zero-bubble-v"):
        step, state, _ = mm.parallelize_step(
            GPT(CONFIG, stages=2), _optimizer(), multi, batch, **options
        )
        return step, state, 2
    submesh = INTERLEAVED_SUBMESH if schedule == "interleaved-1f1b" else V_SUBMESH
    multi.register_task(
        "(stem|blocks_[0-9]+|head)",
        callback=lambda name, _: mm.Task(
            mesh_slice={"stage": submesh[name]}, logical_axes=LOGICAL_RULES
        ),
    )
    if schedule == "interleaved-1f1b":
        options["interleave"] = 2
    step, state, _ = mm.parallelize_step(GPT(CONFIG), _optimizer(), multi, batch, **options)
    return step, state, 4


@pytest.mark.parametrize(
    "schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h2", "custom"]
)
def test_schedule_trains_like_one_device(schedule):
    _train_like_one_device(schedule, _batches())


@pytest.mark.parametrize("schedule", ["zero-bubble-h1", "zero-bubble-auto", "zero-bubble-v"])
def test_zero_bubble_schedules_train_like_one_device(schedule):
    """ZB-H1, the automatic schedule (unit costs, 1F1B's memory) and ZB-V (4 stages on a V
    over 2 submeshes: stem | block 0 on the way down, block 1 | head on the way back), 5 steps."""
    _train_like_one_device(schedule, _batches(5))


def _train_like_one_device(schedule, batches):
    step, state, num_stages = _build(schedule)
    plan = step.executable(state, batches[0]).schedule
    assert (plan.name, plan.num_stages, plan.num_microbatches) == (
        schedule,
        num_stages,
        MICROBATCHES,
    )
    start = jax.tree_util.tree_map(np.asarray, state.params)
    losses = []
    for batch in batches:
        loss, state = step(state, batch)
        losses.append(float(loss))
    ref_losses, ref_params = _reference(start, batches)
    np.testing.assert_allclose(losses, ref_losses, **LOSS_TOL)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, **PARAM_TOL), state.params, ref_params
    )


def test_custom_schedule_without_microbatches_raises():
    with pytest.raises(mm.errors.ParallelizeArgumentError, match="without `microbatches`"):
        mm.parallelize_step(
            GPT(CONFIG, stages=2),
            _optimizer(),
            make_multimesh(2, 2, 2),
            _batches()[0],
            loss_fn=_loss_fn,
            custom_schedule=_reverse_gpipe(2),
        )
