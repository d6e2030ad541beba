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
# # `MultiMesh`: a global mesh with a stage axis
#
# The earlier notebooks listed device positions by hand (`TaskMesh(devices=[4, 5, 6, 7])`).
# For real layouts it is easier to describe **one** global mesh and cut it: a `MultiMesh`
# with axes `("stage", "data", "model")` is an ordinary device grid whose `stage` slices are
# the pipeline's submeshes. A task then says `mesh_slice={"stage": 1}` instead of naming
# devices, and inside that slice the usual logical rules shard over `data` and `model`.
#
# What to look at:
#
# * `multi.slice(stage=i)`: the submesh of stage `i`, a `jax.sharding.Mesh` whose sliced
#   axis keeps size 1;
# * a two-stage program written once, with tasks that refer only to `mesh_slice`;
# * the **same program on other layouts** by changing only the `MultiMesh`: more data
#   parallelism, more tensor parallelism, another device order. The values never change.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # set JAX_PLATFORMS=cuda to run on GPUs
import jax

if os.environ["JAX_PLATFORMS"] == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 simulated devices on one CPU
SMOKE = os.environ.get("MMFLAX_SMOKE") == "1"  # the test suite's reduced run

import jax.numpy as jnp
import multimesh_flax as mm
import numpy as np
from jax.sharding import PartitionSpec as P


def show(array):
    """Draws which devices hold which block of a 1-D or 2-D array."""
    jax.debug.visualize_array_sharding(array, scale=0.5, max_width=120)


cache_dir = mm.enable_compilation_cache()  # a re-run loads compiled programs from there


# %% [markdown]
# ## The global mesh and its slices
#
# Eight devices as a 2 x 2 x 2 grid. Slicing `stage=0` keeps the other axes whole: devices
# 0-3 as a `(1, 2, 2)` mesh with the same axis names. `slice_positions` gives the same
# slice as a `TaskMesh` of positions, and `mm.slice_global_mesh` does it for the mesh that
# is current inside `with multi:`.

# %%
multi = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
print(multi, "\n", multi.devices)
for stage in range(2):
    sub = multi.slice(stage=stage)
    print(f"stage {stage}: axes {dict(sub.shape)}, device ids {sub.device_ids.tolist()}")
print(multi.slice_positions(stage=1))
with multi:
    print(mm.slice_global_mesh(stage=0, data=1))

# %% [markdown]
# ## Tasks by `mesh_slice`
#
# Two layers, as in `03-mpmd-autosharding`, but the tasks name a slice of whatever
# `MultiMesh` is current, not devices. The rules map `batch` to `data` and `mlp` to `model`;
# the `stage` axis (size 1 inside a slice) is never used by a rule.

# %%
EMBED, HIDDEN, BATCH = 16, 64, 32
RULES = [("batch", "data"), ("mlp", "model")]


def layer1(w, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    w = mm.with_sharding_constraint(w, P(None, "mlp"))
    return mm.with_sharding_constraint(jnp.tanh(x @ w), P("batch", "mlp"))


def layer2(w, h):
    h = mm.with_sharding_constraint(h, P("batch", "mlp"))
    return h @ mm.with_sharding_constraint(w, P("mlp", None))


stage0 = mm.task(layer1, name="stage0", mesh_slice={"stage": 0}, logical_axes=RULES)
stage1 = mm.task(layer2, name="stage1", mesh_slice={"stage": 1}, logical_axes=RULES)


def train_step(params, batch):
    x, y = batch

    def loss_fn(params):
        return jnp.mean((stage1(params["w2"], stage0(params["w1"], x)) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return loss, jax.tree.map(lambda p, g: p - 0.2 * g, params, grads)


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (EMBED, HIDDEN)) / np.sqrt(EMBED),
        "w2": jax.random.normal(k2, (HIDDEN, EMBED)) / np.sqrt(HIDDEN),
    }


def get_batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, EMBED))
    return x, jnp.roll(x, 1, axis=-1)  # learn a permutation


# %% [markdown]
# `parallelize` inside `with multi:` resolves the slices against `multi`. Stage 0 holds `w1`
# split by columns over `model` (one half on devices 0 and 2, the other on 1 and 3); stage 1
# holds `w2` split by rows on devices 4-7. The batch is split over `data` on stage 0.


# %%
def build(multi):
    with multi:
        step, init, batch = mm.parallelize(
            train_step, init_params=init_params, get_input_batch=get_batch
        )
        return step, init(), batch()


def run(multi, step, params, batch, steps):
    losses = []
    with multi:
        for _ in range(steps):
            loss, params = step(params, batch)
            losses.append(float(loss))
    return losses, params


step, params, batch = build(multi)
for name in ("w1", "w2"):
    print(name, params[name].sharding.spec, "on", sorted(d.id for d in params[name].devices()))
    show(params[name])
print("batch x", batch[0].sharding.spec)
show(batch[0])

# %%
steps = 3 if SMOKE else 25
losses, trained = run(multi, step, params, batch, steps)
with multi:
    print(step.describe(trained, batch))
print("losses:", [round(v, 4) for v in losses[:: max(1, steps // 5)]])

# %% [markdown]
# ## Other layouts, same code
#
# Only the `MultiMesh` changes. The `stage` axis stays 2; the four devices of a stage become
# 4-way data parallel `(2, 4, 1)`, or 4-way tensor parallel `(2, 1, 4)`. A `MultiMesh` can
# also take `devices` in any order: below, stage 0 is the even devices and stage 1 the odd
# ones. Every layout trains to the same losses as the unparallelized step.

# %%
layouts = {
    "2 x 2 x 2": multi,
    "data-parallel stages (2, 4, 1)": mm.MultiMesh(
        axis_sizes=(2, 4, 1), axis_names=("stage", "data", "model")
    ),
    "tensor-parallel stages (2, 1, 4)": mm.MultiMesh(
        axis_sizes=(2, 1, 4), axis_names=("stage", "data", "model")
    ),
    "interleaved devices": mm.MultiMesh(
        axis_sizes=(2, 2, 2),
        axis_names=("stage", "data", "model"),
        devices=np.array(jax.devices()).reshape(4, 2).T.reshape(2, 2, 2),
    ),
}

reference = []
ref_params = init_params()
with mm.ignore_transforms():
    for _ in range(steps):
        loss, ref_params = train_step(ref_params, get_batch())
        reference.append(float(loss))

for title, layout in layouts.items():
    step, params, batch = build(layout)
    print(
        f"{title}: stage 0 = devices {layout.slice(stage=0).device_ids.ravel().tolist()}, "
        f"w1 {params['w1'].sharding.spec}, x {batch[0].sharding.spec}"
    )
    show(params["w1"])
    losses, _ = run(layout, step, params, batch, steps)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
print("all layouts match the unparallelized losses:", [round(v, 4) for v in reference[-3:]])

# %% [markdown]
# ## Next
#
# The reference models in `models/` are built exactly this way: `GPT(config, stages=S)` puts
# its embedding, blocks and head on `mesh_slice={"stage": s}` of a `("stage", "data",
# "model")` `MultiMesh`. `07-finetune-gpt` trains and fine-tunes one.
