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
# # Implicit Flax tasks: placing an unmodified model by name
#
# `04-flax-mpmd` wrote tasks into the model (`Task[MLPBlock]`). Often the model is not yours
# to edit: it comes from a library, or the same code must also run unparallelized. Then you
# place it **from outside**, by name: `register_task(matcher, task=...)` or
# `register_task(matcher, callback=...)`. During tracing, `matcher` (a regular expression)
# is compared with Flax module paths (`block_0`) and `jax.named_scope` names; whatever runs
# inside a matched module becomes that task, forward and backward.
#
# What to look at:
#
# * the model below is plain Flax: `nn.Dense`, `nn.LayerNorm`, Flax's own
#   `nn.with_logical_constraint` and `nn.with_logical_partitioning`; no `multimesh_flax`;
# * with **exact names**, one registration per block puts block `i` on stage `i`;
# * with a **callback**, one regex and a function place any number of blocks, and the
#   callback sees each matched name, for the forward and for the backward;
# * modules that match nothing (`embed`, `head`) run where their inputs are.

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

cache_dir = mm.enable_compilation_cache()  # a re-run loads compiled programs from there

# %% [markdown]
# ## An ordinary Flax model
#
# A residual MLP: an input projection `embed`, `num_blocks` pre-norm MLP blocks
# `block_0 ... block_{n-1}`, and a scalar read-out `head`. The logical names follow Flax's
# usual conventions; without any rules they are ignored.


# %%
def partitioned(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        x = nn.with_logical_constraint(x, ("batch", "embed"))
        h = nn.LayerNorm(name="norm")(x)
        h = nn.Dense(self.hidden, kernel_init=partitioned(("embed", "mlp")), name="up")(h)
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "mlp"))
        return x + nn.Dense(x.shape[-1], kernel_init=partitioned(("mlp", "embed")), name="down")(h)


class ResMLP(nn.Module):
    num_blocks: int
    width: int = 32
    hidden: int = 128

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width, name="embed")(x)
        for i in range(self.num_blocks):
            x = Block(self.hidden, name=f"block_{i}")(x)
        return nn.Dense(1, name="head")(x)[..., 0]


# %% [markdown]
# The task: regress a smooth function of 8 inputs. A fixed pool of batches keeps the notebook
# deterministic.

# %%
BATCH, FEATURES = 32, 8
xs = jax.random.normal(jax.random.key(0), (8, BATCH, FEATURES))
batches = [{"x": x, "y": jnp.sin(x.sum(-1)) + 0.5 * jnp.cos(2 * x[:, 0])} for x in xs]


def loss_fn(model_fn, batch):
    return jnp.mean((model_fn(batch["x"]) - batch["y"]) ** 2)


def placement(params):
    """Prints the devices holding each top-level module's parameters."""
    for name, module in params.items():
        leaves = jax.tree_util.tree_leaves(module)
        devices = sorted({d.id for leaf in leaves for d in leaf.devices()})
        print(f"{name:<8} on devices {devices}")


def train(step_fn, state, steps):
    losses = []
    for i in range(steps):
        loss, state = step_fn(state, batches[i % len(batches)])
        losses.append(float(loss))  # wait for every step
    return losses, state


# %% [markdown]
# ## Exact names
#
# A `MultiMesh` of 8 devices with a `stage` axis (4) and a `data` axis (2). A `Task` with
# `mesh_slice={"stage": i}` runs on slice `i`: two devices, where the rules split the batch
# over `data`. `MultiMesh.register_task` keeps registrations with the mesh; they act inside
# `with multi:`, which `parallelize_step` enters for us when given the mesh.

# %%
RULES = [("batch", "data")]
multi = mm.MultiMesh(axis_sizes=(4, 2), axis_names=("stage", "data"))
for i in range(4):
    multi.register_task(f"block_{i}", task=mm.Task(mesh_slice={"stage": i}, logical_axes=RULES))

model = ResMLP(num_blocks=4)
step_fn, state, _ = mm.parallelize_step(model, optax.adam(3e-3), multi, batches[0], loss_fn=loss_fn)
placement(state.params)

# %% [markdown]
# Each block sits on its stage. `embed` matched nothing: its parameters went where the
# program first uses them, next to its input on stage 0; `head` likewise follows its input
# to stage 3. The compiled step is a chain of four submeshes:

# %%
steps = 3 if SMOKE else 120
losses_exact, state = train(step_fn, state, steps)
print("\n".join(step_fn.describe(state, batches[0]).splitlines()[-1:]))
print(f"loss {losses_exact[0]:.4f} -> {losses_exact[-1]:.4f}")

# %% [markdown]
# ## A callback
#
# Exact names do not scale to many layers or to layouts computed from a configuration. A
# callback receives the **matched name**, the regex's first group (here the block number),
# and whether the task is for the backward pass, and returns the `Task`. Eight blocks, two per
# stage (the test suite's smoke run uses four). The printout shows the callback being asked
# for every block, for the forward and for the backward.

# %%
NUM_BLOCKS, STAGES = (4 if SMOKE else 8), 4
MICROBATCHES = 2 if SMOKE else 4
calls = []


def stage_of(matched_name, backprop):
    calls.append((matched_name, backprop))
    stage = int(matched_name) * STAGES // NUM_BLOCKS
    return mm.Task(name=f"block_{matched_name}", mesh_slice={"stage": stage}, logical_axes=RULES)


multi8 = mm.MultiMesh(axis_sizes=(4, 2), axis_names=("stage", "data"))
multi8.register_task(r"block_(\d+)", callback=stage_of)

model8 = ResMLP(num_blocks=NUM_BLOCKS)
step8, state8, _ = mm.parallelize_step(
    model8,
    optax.adam(3e-3),
    multi8,
    batches[0],
    loss_fn=loss_fn,
    microbatches=MICROBATCHES,
    schedule="1f1b",
)
start8 = jax.device_get(state8.params)  # for the unplaced reference below
placement(state8.params)
print("callback calls:", sorted(set(calls), key=lambda c: (int(c[0]), c[1])))

# %% [markdown]
# Consecutive tasks on one submesh form one pipeline stage, so the eight blocks make a
# four-stage pipeline, here run with four microbatches (two in the smoke run) in 1F1B order:

# %%
losses_cb, state8 = train(step8, state8, steps)
print(step8.executable(state8, batches[0]).schedule)

# %% [markdown]
# ## Same values as the unplaced model
#
# Registrations only say *where*. The identical model trained with plain `jax.jit` on one
# device gives the same losses (to float32 round-off).


# %%
def reference_losses(model, params, steps):
    optimizer = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(lambda x: model.apply({"params": p}, x), batch)
        )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    losses = []
    for i in range(steps):
        loss, params, opt_state = step(params, opt_state, batches[i % len(batches)])
        losses.append(float(loss))
    return losses


reference = reference_losses(model8, start8, steps)
np.testing.assert_allclose(losses_cb, reference, rtol=1e-4)
gap = np.abs(np.subtract(losses_cb, reference)) / np.array(reference)
print(f"max relative difference: {gap.max():.1e}")

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(losses_exact, label="4 blocks, exact names")
ax.plot(losses_cb, label="8 blocks, callback, 1F1B")
ax.plot(reference, "--", label="8 blocks, one device")
ax.set(xlabel="step", ylabel="loss", yscale="log", title="Training loss")
ax.legend()
plt.show()

# %% [markdown]
# ## Where registrations live
#
# `MultiMesh.register_task` ties registrations to a mesh, and `parallelize_step` enters
# that mesh while it builds the step *and* every time the step runs. `mm.register_task`
# instead adds to the innermost active `mm.Context`, and contexts nest: an inner context
# wins over an outer one, so a placement can be overridden locally without touching the
# outer set-up. Below, a base context puts block `i` on stage `i`, and an inner one moves
# `block_1` to stage 3. The mesh itself now carries no registrations.
#
# Registrations act while a program is **traced**, which for a step function is its first
# call. Keep plain contexts active around both `parallelize_step` and the step calls; a
# step traced outside them would see no tasks at all.

# %%
base = mm.Context()
with base:
    for i in range(4):
        mm.register_task(f"block_{i}", task=mm.Task(mesh_slice={"stage": i}, logical_axes=RULES))
override = mm.Context()
override.register_task("block_1", task=mm.Task(mesh_slice={"stage": 3}, logical_axes=RULES))

bare = mm.MultiMesh(axis_sizes=(4, 2), axis_names=("stage", "data"))
with base, override:
    step_o, state_o, _ = mm.parallelize_step(
        ResMLP(num_blocks=4), optax.adam(3e-3), bare, batches[0], loss_fn=loss_fn
    )
    losses_o, state_o = train(step_o, state_o, 2)
    print("\n".join(step_o.describe(state_o, batches[0]).splitlines()[-1:]))
placement(state_o.params)

# %% [markdown]
# ## Next
#
# `06-mpmd-multimesh` looks at the `MultiMesh` itself: slicing a stage axis, `mesh_slice`
# tasks in plain JAX, and moving a program to another layout by changing only the mesh.
