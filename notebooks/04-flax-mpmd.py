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
# # Flax MPMD: a pipeline of `Task[MLPBlock]` modules
#
# The Flax layer turns a **module class** into a task: `mm.task(MLPBlock, mesh=...)` returns
# `Task[MLPBlock]`, a subclass that takes the same fields, has the same parameters, and runs
# on its own submesh. Stack four of them on four submeshes and you have a pipeline;
# `mm.parallelize_step` turns the model and an optax optimizer into a placed training state
# and a compiled MPMD training step.
#
# What to look at:
#
# * `Task[MLPBlock]` is an `MLPBlock`: same fields, same parameter tree;
# * the **placement table** from `mm.tabulate`: every parameter's logical spec, mesh spec,
#   task, devices and bytes per device, and totals per device;
# * the training state: each block's weights *and their Adam moments* on that block's
#   submesh only;
# * the loss curve, equal to the unparallelized run, and the pipeline timeline of one step.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # set JAX_PLATFORMS=cuda to run on GPUs
import jax

if os.environ["JAX_PLATFORMS"] == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 simulated devices on one CPU
SMOKE = os.environ.get("MMFLAX_SMOKE") == "1"  # the test suite's reduced run

import jax.numpy as jnp
import matplotlib.pyplot as plt
import multimesh_flax as mm
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import PartitionSpec as P

cache_dir = mm.enable_compilation_cache()  # a re-run loads compiled programs from there

# %% [markdown]
# ## A plain Flax block with logical names
#
# `mm.shard_axes("embed", "mlp")` is a kernel initializer that also records the logical
# names of the parameter's dimensions (Xavier normal by default). Activations are annotated
# with `mm.with_sharding_constraint`, as in the earlier notebooks. Nothing here mentions
# devices.


# %%
class MLPBlock(nn.Module):
    """A residual MLP block: ``x + down(gelu(up(x)))``."""

    hidden: int

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.hidden, kernel_init=mm.shard_axes("embed", "mlp"), name="up")(x)
        h = mm.with_sharding_constraint(nn.gelu(h), P("batch", "mlp"))
        out = nn.Dense(x.shape[-1], kernel_init=mm.shard_axes("mlp", "embed"), name="down")(h)
        return mm.with_sharding_constraint(x + out, P("batch", "embed"))


# %% [markdown]
# ## Four blocks on four submeshes
#
# Block `i` runs on devices `2i` and `2i + 1`, a one-axis submesh `model` of size 2 that
# splits the MLP width (`mlp -> model`). `mm.task` on a module class returns a new class:

# %%
STAGES = 4
RULES = [("mlp", "model")]
BlockOnStage = [
    mm.task(
        MLPBlock,
        mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1], axis_names=("model",)),
        logical_axes=RULES,
    )
    for i in range(STAGES)
]
print(BlockOnStage[0].__name__, "is an MLPBlock:", issubclass(BlockOnStage[0], MLPBlock))


class Pipeline(nn.Module):
    """``STAGES`` blocks, block ``i`` on stage ``i``, and a linear read-out on the last."""

    hidden: int

    @nn.compact
    def __call__(self, x):
        for i, Block in enumerate(BlockOnStage):
            x = Block(self.hidden, name=f"block_{i}")(x)
        return x


EMBED, HIDDEN = 32, 128
BATCH = 16 if SMOKE else 64
MICROBATCHES = 2 if SMOKE else 4
model = Pipeline(HIDDEN)

# %% [markdown]
# ## The placement table
#
# `mm.tabulate(model, rngs, *inputs)` adds to Flax's `model.tabulate` summary where each
# parameter will live. It only traces: nothing is compiled or allocated. Read the
# `mesh spec` column: `up/kernel` (`embed x mlp`) is split over `model` by columns and
# `down/kernel` by rows, while the biases, which carry no logical names here, are replicated
# on their pair; the `devices` column shows each block on its own pair; the per-device
# totals show the four stages holding equal shares.

# %%
x_example = jnp.ones((BATCH, EMBED))
print(mm.tabulate(model, jax.random.key(0), x_example, depth=1))

# %% [markdown]
# ## Data: learn a fixed random residual network
#
# A teacher with the same architecture maps random inputs to targets; the pipelined student
# learns to imitate it.

# %%
teacher = Pipeline(HIDDEN)
with mm.ignore_transforms():  # the plain model, on one device
    teacher_params = teacher.init(jax.random.key(42), x_example)


def make_batch(seed):
    x = jax.random.normal(jax.random.key(seed), (BATCH, EMBED))
    with mm.ignore_transforms():
        y = teacher.apply(teacher_params, x)
    return {"x": x, "y": y}


def loss_fn(model_fn, batch):
    """``model_fn`` applies the model with the current parameters."""
    return jnp.mean((model_fn(batch["x"]) - batch["y"]) ** 2)


# %% [markdown]
# ## `parallelize_step`
#
# One call builds everything: the parameters and the optimizer state, placed on their
# submeshes (created by one program for all of them, then each moved to its own), and a
# compiled step. `microbatches=4, schedule="1f1b"` splits each batch
# into four microbatches (two in the test suite's smoke run) that flow through the four
# stages as a one-forward-one-backward pipeline; the loss is the mean over microbatches,
# which equals the full-batch mean.

# %%
optimizer = optax.adam(3e-3)
step_fn, state, mesh = mm.parallelize_step(
    model,
    optimizer,
    global_batch=make_batch(0),
    loss_fn=loss_fn,
    microbatches=MICROBATCHES,
    schedule="1f1b",
)


def ids(array):
    return sorted(d.id for d in array.devices())


for i in range(STAGES):
    kernel = state.params[f"block_{i}"]["up"]["kernel"]
    moment = state.opt_state[0].mu[f"block_{i}"]["up"]["kernel"]
    print(
        f"block_{i}/up/kernel {kernel.sharding.spec} on {ids(kernel)};"
        f"  its Adam moment on {ids(moment)}"
    )

# %% [markdown]
# ## Training
#
# `step_fn(state, batch)` returns `(loss, new_state)` and donates the old state. Convert the
# loss to a Python float every step (this also waits for the step to finish, which keeps
# the number of queued multi-device calls small).

# %%
steps = 4 if SMOKE else 150
start_params = jax.tree.map(np.asarray, state.params)  # for the reference run below
losses = []
for i in range(steps):
    loss, state = step_fn(state, make_batch(i % 8))
    losses.append(float(loss))
    if i % 25 == 0 or i == steps - 1:
        print(f"step {i:3d}  loss {losses[-1]:.5f}")

# %% [markdown]
# The same model and optimizer without any parallelism: plain `jax.jit` on one device,
# `ignore_transforms` so that the tasks are the identity. Its losses are the pipelined run's.

# %%
with mm.ignore_transforms():

    @jax.jit
    def reference_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(lambda x: model.apply({"params": p}, x), batch)
        )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    params = jax.device_put(start_params, jax.devices()[0])
    opt_state = optimizer.init(params)
    reference = []
    for i in range(steps):
        loss, params, opt_state = reference_step(params, opt_state, make_batch(i % 8))
        reference.append(float(loss))

np.testing.assert_allclose(losses, reference, rtol=2e-4)
gap = np.abs(np.subtract(losses, reference)) / np.array(reference)
print(f"max relative difference: {gap.max():.1e}")

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(losses, label="pipelined, 4 submeshes, 1F1B")
ax.plot(reference, "--", label="one device (reference)")
ax.set(xlabel="step", ylabel="loss", yscale="log", title="Training loss")
ax.legend()
plt.show()

# %% [markdown]
# ## The program and its timeline
#
# The compiled step has one fragment per (stage, microbatch, forward/backward) plus the
# optimizer update on each submesh; its `schedule` is the 1F1B order the runtime dispatches
# in. `record_timeline` times one step and `plot_timeline` draws it (top) next to the
# simulator's prediction for the same schedule with unit costs (bottom): blue forwards,
# orange backwards, grey glue such as the optimizer update. On this CPU host the eight
# simulated devices share a few cores, so recorded durations are noisy; the *order* of the
# work is what to compare.

# %%
batch = make_batch(0)
print("\n".join(step_fn.describe(state, batch).splitlines()[-2:]))
schedule = step_fn.executable(state, batch).schedule
print(schedule)
with mm.record_timeline() as timeline:
    loss, state = step_fn(state, batch)
    float(loss)
mm.plot_timeline(timeline, schedule=schedule)

# %% [markdown]
# ## Next
#
# Here the model was written with tasks in it. `05-implicit-flax-tasks` places an
# **unmodified** Flax model by registering tasks on module names instead.
