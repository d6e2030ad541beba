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
# # Flax NNX: a pipelined Llama, in NNX's own idioms
#
# NNX users write modules as Python objects and train them with `nnx.value_and_grad`,
# `nnx.Optimizer` and `nnx.jit`. multimesh_flax keeps those idioms:
#
# * `mm.task(Block, mesh_slice={"stage": s}, logical_axes=rules)` on an `nnx.Module` class
#   returns `Task[Block]`, with `Block`'s constructor and variable names; constructing it
#   creates its variables **directly on the stage's submesh**, sharded by their logical names;
# * `mm.jit` takes NNX graph objects like `nnx.jit`: the NNX tutorial's train step becomes
#   one MPMD program, and the model and optimizer are updated in place;
# * `mm.tabulate(model, x)` prints `nnx.tabulate`'s table plus where every variable lives.
#
# The model is `models.llama_nnx.LlamaNNX`, the NNX port of the reference Llama (RMSNorm,
# rotary positions, SwiGLU, grouped-query attention), on a `("stage", "data", "model")`
# MultiMesh: 2 stages of 2 x 2 devices, trained with a 1F1B schedule over 4 microbatches,
# next to the same model on one device.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # set JAX_PLATFORMS=cuda to run on GPUs
import jax

if os.environ["JAX_PLATFORMS"] == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 simulated devices on one CPU
SMOKE = os.environ.get("MMFLAX_SMOKE") == "1"  # the test suite's reduced run

import sys

sys.path.insert(0, "..")  # the repository root: the reference models live in `models/`

import jax.numpy as jnp
import matplotlib.pyplot as plt
import multimesh_flax as mm
import numpy as np
import optax
from flax import nnx
from models import ByteTokenizer, cross_entropy_loss, get_config, iterate_batches, load_corpus
from models.llama_nnx import NNX_LOGICAL_RULES, LlamaNNX
from models.pipeline import make_multimesh

cache_dir = mm.enable_compilation_cache()  # a re-run loads compiled programs from there

# %% [markdown]
# ## Born on the stages
#
# `LlamaNNX(config, stages=2)` wraps its stem, blocks and head with `mm.task(...,
# mesh_slice={"stage": s}, logical_axes=NNX_LOGICAL_RULES)`. Constructed inside the
# MultiMesh, each stage's variables are created on its own 4 devices: `nnx.eval_shape` shows
# the placement before anything is allocated (the `task_sharding` metadata), and the real
# construction puts the arrays there.

# %%
STAGES = 2
MICROBATCHES = 2 if SMOKE else 4
BATCH, SEQ_LEN = 8, 32
STEPS = 3 if SMOKE else 60
config = get_config("llama-tiny", num_layers=2 if SMOKE else 4)
multi = make_multimesh(STAGES, 2, 2)
print("rules:", NNX_LOGICAL_RULES)

with multi:
    abstract = nnx.eval_shape(lambda: LlamaNNX(config, stages=STAGES, rngs=nnx.Rngs(0)))
    model = LlamaNNX(config, stages=STAGES, rngs=nnx.Rngs(0))

last = f"blocks_{config.num_layers - 1}"  # the last block, on stage 1
kernel = getattr(abstract, last).mlp.up.kernel
print("abstract:", kernel.get_value(), kernel.get_metadata()["task_sharding"])
real = getattr(model, last).mlp.up.kernel.get_value()
print("real:    ", real.shape, real.sharding.spec, sorted(d.id for d in real.devices()))

# %% [markdown]
# ## The placement table
#
# `nnx.tabulate`'s summary, then for every variable its logical spec (`out_sharding`), its
# mesh spec on the stage's `data` x `model` submesh, the task and devices, and bytes per
# device; then totals per task and per device.

# %%
tokens_example = jnp.zeros((BATCH, SEQ_LEN), jnp.int32)
with multi:  # the tasks' mesh slices resolve against the current MultiMesh
    print(mm.tabulate(model, tokens_example, depth=1))

# %% [markdown]
# ## Data and the NNX train step
#
# Byte-level windows of Shakespeare's sonnets. The step is the NNX tutorial's, with the
# gradient taken over microbatches by `mm.microbatch` (1F1B over the two stages) and
# `mm.jit` in place of `nnx.jit`. (`trace_once=False`: NNX objects cannot be closed over by
# the inner `jax.jit` that microbatching uses by default to trace once.)

# %%
tokenizer = ByteTokenizer()
pairs = iterate_batches(
    tokenizer.encode(load_corpus("shakespeare_sonnets")),
    batch_size=BATCH,
    seq_len=SEQ_LEN,
    seed=0,
    num_batches=STEPS,
)
batches = [{"inputs": jnp.asarray(x), "targets": jnp.asarray(y)} for x, y in pairs]


def loss_fn(model, batch):
    return cross_entropy_loss(model(batch["inputs"]), batch["targets"])


def train_step(model, optimizer, batch):
    def grad_fn(b):
        return nnx.value_and_grad(loss_fn)(model, b)

    size = BATCH // MICROBATCHES
    pipelined = mm.microbatch(grad_fn, 0, size, schedule="1f1b", reduce="mean", trace_once=False)
    loss, grads = pipelined(batch)
    optimizer.update(model, grads)
    return loss


tx = optax.adam(3e-3)
with multi:
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = mm.jit(train_step)

# %% [markdown]
# ## Training, pipelined and on one device
#
# The reference is the same model class without stages, started from the same values
# (`nnx.state` / `nnx.update`: the variable names are the same), trained with the plain NNX
# step under `nnx.jit` on one device.

# %%
with nnx.use_eager_sharding(False):
    reference = LlamaNNX(config, rngs=nnx.Rngs(1))
start = nnx.state(reference, nnx.Param)
start.replace_by_pure_dict(
    jax.device_put(nnx.state(model, nnx.Param).to_pure_dict(), jax.devices()[0])
)
nnx.update(reference, start)
ref_optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)

losses, ref_losses = [], []
with multi:
    for i, batch in enumerate(batches):
        losses.append(float(step(model, optimizer, batch)))
        if i % 10 == 0 or i == STEPS - 1:
            print(f"step {i:3d}  loss {losses[-1]:.4f}")
with mm.ignore_transforms():
    ref_step = nnx.jit(train_step)
    ref_losses = [float(ref_step(reference, ref_optimizer, b)) for b in batches]

np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
print(
    f"max relative difference: {np.max(np.abs(np.subtract(losses, ref_losses)) / ref_losses):.1e}"
)
moment = optimizer.opt_state[0].mu[last]["mlp"]["up"]["kernel"].get_value()
print(f"Adam moment of {last}/mlp/up/kernel on", sorted(d.id for d in moment.devices()))

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(losses, label=f"NNX, 2 stages, 1F1B, {MICROBATCHES} microbatches")
ax.plot(ref_losses, "--", label="NNX, one device (reference)")
ax.set(xlabel="step", ylabel="loss", title="Training loss")
ax.legend()
plt.show()

# %% [markdown]
# ## The program and its timeline
#
# One step is an MPMD program: a fragment per (stage, microbatch, forward/backward) and the
# optimizer update on each stage's submesh. `record_timeline` times one step; `plot_timeline`
# draws it above the simulator's 1F1B prediction (on this CPU host the simulated devices
# share a few cores: compare the order of the work, not the durations).

# %%
with multi:
    print("\n".join(step.describe(model, optimizer, batches[0]).splitlines()[-2:]))
    schedule = step.executable(model, optimizer, batches[0]).schedule
    with mm.record_timeline() as timeline:
        float(step(model, optimizer, batches[0]))
mm.plot_timeline(timeline, schedule=schedule)
