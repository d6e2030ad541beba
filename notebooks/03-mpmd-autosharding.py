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
# # MPMD autosharding: two layers on two submeshes
#
# `02-spmd-autosharding` sharded one task over all devices. Here two layers become two tasks
# on **different** submeshes, each sharding its own arrays by its own rules. The program is
# now MPMD: different code runs on different devices, and values travel between submeshes.
#
# What to look at:
#
# * **parameter placement**: `parallelize` creates each layer's weights on that layer's
#   submesh only, sharded by its rules;
# * **automatic resharding**: the activation leaving layer 1 (sharded over devices 0-3) is
#   moved and re-laid-out for layer 2 (devices 4-7) without any code for it, and inputs
#   handed in with the wrong sharding are moved to where they belong;
# * a submesh of a **different size** (layer 2 on two devices) works the same way;
# * the backward pass runs in reverse, each layer's gradient on its own submesh.

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


def where(array):
    """The device ids holding ``array`` and its mesh-axis spec."""
    spec = getattr(array.sharding, "spec", "(one device)")
    return f"devices {sorted(d.id for d in array.devices())}, spec {spec}"


cache_dir = mm.enable_compilation_cache()  # a re-run loads compiled programs from there


# %% [markdown]
# ## Two layers, two tasks
#
# Each layer is an ordinary function with logical constraints. The tasks differ only in
# their submesh: `stage0` is devices 0-3 as a 2 x 2 grid `(data, model)`, and
# `stage0.place([4, 5, 6, 7])` is the same grid on devices 4-7. Both use the same rules:
# the batch over `data`, the MLP width over `model`.

# %%
EMBED, HIDDEN, BATCH = 16, 64, 32
RULES = [("batch", "data"), ("mlp", "model")]


def layer1(w, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    w = mm.with_sharding_constraint(w, P(None, "mlp"))
    return mm.with_sharding_constraint(jax.nn.gelu(x @ w), P("batch", "mlp"))


def layer2(w, h):
    h = mm.with_sharding_constraint(h, P("batch", "mlp"))
    w = mm.with_sharding_constraint(w, P("mlp", None))
    return h @ w


stage0 = mm.TaskMesh(devices=[0, 1, 2, 3], axis_sizes=(2, 2), axis_names=("data", "model"))
stage1 = stage0.place([4, 5, 6, 7])
task1 = mm.task(layer1, name="layer1", mesh=stage0, logical_axes=RULES)
task2 = mm.task(layer2, name="layer2", mesh=stage1, logical_axes=RULES)


def model(params, x):
    return task2(params["w2"], task1(params["w1"], x))


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (EMBED, HIDDEN)) / np.sqrt(EMBED),
        "w2": jax.random.normal(k2, (HIDDEN, EMBED)) / np.sqrt(HIDDEN),
    }


def get_batch():
    return jax.random.normal(jax.random.key(1), (BATCH, EMBED))


sharded_model, sharded_init, sharded_batch = mm.parallelize(
    model, init_params=init_params, get_input_batch=get_batch
)
params, x = sharded_init(), sharded_batch()

# %% [markdown]
# ## Parameter placement
#
# `w1` is created on devices 0-3, its `mlp` columns split over `model`; `w2` on devices 4-7,
# its `mlp` rows split. The input batch belongs to layer 1, so it is created on devices 0-3,
# split over `data`. No device holds a full copy of anything it does not use.

# %%
for name, array in [("w1", params["w1"]), ("w2", params["w2"]), ("x", x)]:
    print(f"{name}: {where(array)}")
show(params["w1"])
show(params["w2"])
show(x)

# %% [markdown]
# ## Automatic resharding between submeshes
#
# The program: layer 1 on devices 0-3, one transfer of the hidden activation `h` (32 x 64
# float32 = 8 KiB) to devices 4-7, layer 2 there. The transfer delivers `h` directly in the
# layout layer 2 asked for (`P("batch", "mlp")` on the second grid), so layer 2 starts with no
# further communication. The output stays on devices 4-7.

# %%
y = sharded_model(params, x)
print(sharded_model.describe(params, x))
print("output:", where(y))
show(y)

# %% [markdown]
# Inputs are resharded too. Hand the program a batch that sits whole on device 7 (for example
# one produced by another program) and it is first moved to where layer 1 wants it:

# %%
x_elsewhere = jax.device_put(get_batch(), jax.devices()[7])
print("given   :", where(x_elsewhere))
y2 = sharded_model(params, x_elsewhere)
np.testing.assert_allclose(y2, y, rtol=1e-6)
with mm.ignore_transforms():
    reference = model(init_params(), get_batch())
np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-6)
print("same result; max |mpmd - reference| =", float(jnp.max(jnp.abs(y - reference))))

# %% [markdown]
# ## A submesh of a different size
#
# Submeshes need not match. Put layer 2 on just two devices, 6 and 7, as a 2 x 1 grid: the
# same axis names, so the same rules apply, but `model` has size 1 and `w2` is therefore
# whole on both devices. (Rules must name axes the submesh has: a rule onto a missing axis
# raises `LogicalRulesError`.) The activation now goes from a 2 x 2 layout on four devices
# to a two-way batch split on two devices; the transfer takes care of it.

# %%
small = mm.TaskMesh(devices=[6, 7], axis_sizes=(2, 1), axis_names=("data", "model"))
task2_small = mm.task(layer2, name="layer2", mesh=small, logical_axes=RULES)


def model_small(params, x):
    return task2_small(params["w2"], task1(params["w1"], x))


sharded_small, init_small, batch_small = mm.parallelize(
    model_small, init_params=init_params, get_input_batch=get_batch
)
params_small, x_small = init_small(), batch_small()
print("w2:", where(params_small["w2"]))
y_small = sharded_small(params_small, x_small)
print(sharded_small.describe(params_small, x_small))
print("output:", where(y_small))
show(y_small)
np.testing.assert_allclose(y_small, reference, rtol=1e-5, atol=1e-6)

# %% [markdown]
# ## Training: the backward runs in reverse
#
# Differentiate inside the parallelized function. The forward goes 0-3 then 4-7; the loss
# (glue outside every task) runs where its input lives, the backward of layer 2 runs on 4-7,
# the activation gradient (8 KiB again) travels back, and the backward of layer 1 runs on
# 0-3. Each gradient, and so each updated weight, stays on its layer's submesh. The
# fragments are compiled on the first call; `describe` counts them afterwards.


# %%
def train_step(params, batch):
    x, target = batch

    def loss_fn(params):
        return jnp.mean((model(params, x) - target) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return loss, jax.tree.map(lambda p, g: p - 0.2 * g, params, grads)


def get_pair():
    x = get_batch()
    return x, jnp.sin(x)  # learn a fixed non-linear map


sharded_step, init_step, pair_step = mm.parallelize(
    train_step, init_params=init_params, get_input_batch=get_pair
)
params, batch = init_step(), pair_step()

reference_params = init_params()
steps = 3 if SMOKE else 30
for i in range(steps):
    loss, params = sharded_step(params, batch)
    with mm.ignore_transforms():
        ref_loss, reference_params = train_step(reference_params, get_pair())
    if i % 10 == 0 or i == steps - 1:
        print(f"step {i:2d}  loss {float(loss):.5f}  (unparallelized {float(ref_loss):.5f})")
print(sharded_step.describe(params, batch))
print("w1:", where(params["w1"]))
print("w2:", where(params["w2"]))
np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)

# %% [markdown]
# ## Next
#
# `04-flax-mpmd` does the same with Flax modules: `Task[MLPBlock]` layers on submeshes,
# a placement table, and `parallelize_step` for a whole pipelined training loop.
