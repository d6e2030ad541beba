# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Planning a pipeline: the planner against the even split
#
# Splitting a model's blocks evenly over pipeline stages ignores what rides with the ends:
# the embedding with the first stage, the output head with the last. With a large
# vocabulary the head costs several blocks, the last stage is the slowest, and every
# other stage waits for it. This notebook asks `mm.plan` for a layout instead:
#
# 1. profile the model's stem, one block and the head once (`mm.profile_units`: each
#    compiled alone, timed here in `measured` mode);
# 2. search the splits of 8 blocks over 4 stages (`mm.plan`: a dynamic program over
#    contiguous splits, priced by the schedule simulator), and read the plan
#    (`plans.table()`, `best.table()`, `best.plot()`);
# 3. train one step of the planned split and of the even split, record both
#    (`mm.record_timeline`) and compare the replayed makespans with the predictions.
#
# The smoke run of the test suite plans from made-up unit costs
# (`mm.planner.profile_from_costs`) and compiles nothing.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

if os.environ["JAX_PLATFORMS"] == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 simulated devices on one CPU
SMOKE = os.environ.get("MMFLAX_SMOKE") == "1"  # the test suite's reduced run

import dataclasses
import io

import jax.numpy as jnp
import multimesh_flax as mm
import numpy as np
import optax
from IPython.display import Image, display
from models import Llama, cross_entropy_loss, get_config
from models.pipeline import LOGICAL_RULES, make_multimesh
from multimesh_flax.core.run._timeline_plot import replay_timeline
from multimesh_flax.planner import CostSpec, profile_from_costs


def show(figure):
    """Displays a matplotlib figure as a PNG."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    display(Image(buffer.getvalue()))


# %% [markdown]
# ## The model and its unit costs
#
# Llama-tiny with 8 blocks and a 4,096-token vocabulary: its untied head multiplies every
# position by a 64 x 4,096 matrix, several blocks' worth of work. Four stages of two
# devices (data parallel), a batch of 16 windows of 32 tokens in 4 microbatches, 1F1B.

# %%
STAGES, DATA, M, BATCH, LENGTH = 4, 2, 4, 16, 32
config = get_config("llama-tiny", num_layers=8, vocab_size=4096)


def head_loss(logits):
    return cross_entropy_loss(logits, jnp.zeros(logits.shape[:-1], jnp.int32))


if SMOKE:  # made-up costs in the same proportions: blocks 1, the head 5
    units = [CostSpec("stem", 0.1, params=2**18, activation_bytes=2**16, output_bytes=2**14)]
    units += [CostSpec("layer", 1.0, params=2**16, activation_bytes=2**18, output_bytes=2**14)] * 8
    units += [CostSpec("head", 5.0, params=2**18, activation_bytes=2**20, output_bytes=4)]
    profile = profile_from_costs(units, rows=BATCH // M, mesh_shape={"data": DATA, "model": 1})
    transfer = mm.planner.TransferCost(0.0, 0.0)
else:
    profile = mm.profile_units(
        Llama(config),
        jnp.zeros((BATCH // M, LENGTH), jnp.int32),  # one microbatch
        mesh_shape={"data": DATA, "model": 1},
        rules=LOGICAL_RULES,
        optimizer=optax.adamw(1e-3),
        loss_fn=head_loss,
        mode="measured",
    )
    transfer = mm.measure_transfer(range(DATA), range(DATA, 2 * DATA))  # stage 0 to stage 1
for unit in profile.units.units:
    cost = next(c for c in profile.costs if c.unit == profile.units.units.index(unit))
    seconds = cost.forward.seconds + cost.backward_input.seconds + cost.backward_weight.seconds
    print(f"{unit.name:10s} F+B+W {seconds * 1e3:8.3f} ms ({cost.forward.source})")

# %% [markdown]
# ## The plans
#
# Four stages of two devices, 1F1B, 4 microbatches: `mm.plan` searches the splits (and,
# were more allowed, stage counts, submesh shapes, schedules, microbatch counts and
# recomputation) and ranks them by predicted step time.

# %%
plans = mm.plan(None, None, np.zeros((BATCH, LENGTH), np.int32), devices=8, profile=profile,
                stages=STAGES, tensor=1, schedules="1f1b", microbatches=M, transfer=transfer,
                top=5)  # fmt: skip
plans.table()
best = plans[0]
even_plan = dataclasses.replace(best.plan, layers_per_stage=(2, 2, 2, 2))
even = mm.predict(even_plan, profile, transfer=transfer)
print(f"planned {best.plan.layers_per_stage}: {best.step_time * 1e3:.1f} ms predicted; "
      f"even (2, 2, 2, 2): {even.step_time * 1e3:.1f} ms; predicted speedup "
      f"{even.step_time / best.step_time:.2f}")  # fmt: skip

# %%
best.table()
show(best.plot())

# %% [markdown]
# ## Measured: one recorded step of each split
#
# `plan.apply()` gives the arguments; the reference model takes the split as
# `layers_per_stage`. Each step is recorded op by op (`mm.record_timeline`, so durations
# are real) and replayed with its dependencies, as if the submeshes ran at once. On a shared
# host a step's ops can be slowed by other work at any moment, so each split runs five
# steps and keeps its fastest replay.

# %%
CALLS = 5
if not SMOKE:

    def replayed(split):
        multi = make_multimesh(STAGES, DATA, 1)
        tokens = jax.random.randint(jax.random.key(0), (BATCH, LENGTH + 1), 0, 259)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        built = mm.parallelize_step(
            Llama(config, layers_per_stage=split), optax.adamw(1e-3), multi, batch,
            loss_fn=lambda f, b: cross_entropy_loss(f(b["inputs"]), b["targets"]),
            microbatches=M, schedule="1f1b",
        )  # fmt: skip
        state = built.state
        _, state = built.step(state, batch)  # compile
        with mm.record_timeline() as timeline:
            for _ in range(CALLS):
                _, state = built.step(state, batch)
                jax.block_until_ready(state)
        spans = []
        for call in range(CALLS):
            events = [e for e in replay_timeline(timeline, call) if e.kind == "run"]
            spans.append(max(e.end for e in events) - min(e.start for e in events))
        return min(spans), timeline, built.step.executable(state, batch)

    planned_s, planned_timeline, planned_exe = replayed(best.plan.layers_per_stage)
    even_s, _, _ = replayed(even_plan.layers_per_stage)
    print(f"replayed makespan: planned {planned_s * 1e3:.1f} ms, even {even_s * 1e3:.1f} ms; "
          f"measured speedup {even_s / planned_s:.2f} (predicted "
          f"{even.step_time / best.step_time:.2f})")  # fmt: skip
    recorded_costs = mm.measured_costs(planned_timeline)
    show(mm.plot_timeline(planned_timeline, planned_exe.schedule, costs=recorded_costs))

# %% [markdown]
# On this host the measurements are noisy (several users share two cores; each op is
# timed alone) and the planner leaves out the runtime's glue and transfers' real cost,
# so expect the direction, not the digits: `benchmarks/README.md` (B9) lists how far the
# predictions were off, op by op and in makespan.
