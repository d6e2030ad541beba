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
# # SPMD autosharding: logical names, rules and `parallelize`
#
# Inside one task, arrays are sharded the ordinary JAX way (SPMD, one program on every device
# of the submesh). What `multimesh_flax` adds is *how you say it*: you annotate arrays with
# **logical** axis names that describe the model (`"batch"`, `"embed"`, `"mlp"`), and the task
# carries **rules** that map logical names onto the axes of its submesh (`"batch" -> "data"`).
# The model code never mentions devices, so the same code runs on any layout.
#
# What to look at:
#
# * the rule resolution in `logical_to_mesh_spec`: priority order, one use per mesh axis,
#   uneven splits refused;
# * the sharding pictures (`jax.debug.visualize_array_sharding`, wrapped as `show`)
#   **before** wrapping the function in a `task` (everything replicated: a logical name means
#   nothing without rules) and **after** (parameters and batch split over the 4 x 2 submesh);
# * `parallelize` creating every array directly in its sharding, and the sharded training
#   step matching the unsharded one.

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
# ## A model written with logical names
#
# A two-layer MLP. `mm.with_sharding_constraint(x, P(...))` takes a `PartitionSpec` over
# logical names, one entry per dimension (`None`: no preference). The first constraint applied
# to a parameter or an input is also what `parallelize` uses to decide where it is created.

# %%
EMBED, HIDDEN, BATCH = 16, 64, 32


def mlp(params, x):
    x = mm.with_sharding_constraint(x, P("batch", "embed"))
    w1 = mm.with_sharding_constraint(params["w1"], P("embed", "mlp"))
    w2 = mm.with_sharding_constraint(params["w2"], P("mlp", "embed"))
    h = mm.with_sharding_constraint(jax.nn.relu(x @ w1), P("batch", "mlp"))
    return mm.with_sharding_constraint(h @ w2, P("batch", "embed"))


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (EMBED, HIDDEN)) / np.sqrt(EMBED),
        "w2": jax.random.normal(k2, (HIDDEN, EMBED)) / np.sqrt(HIDDEN),
    }


def get_batch():
    return jax.random.normal(jax.random.key(1), (BATCH, EMBED))


# %% [markdown]
# ## Rules: from logical names to mesh axes
#
# A task's `logical_axes` are priority-ordered `(logical name, mesh axis)` pairs. For one
# array they apply in order; a mesh axis is used at most once per array; a rule is skipped
# when the shards would outnumber the elements of that dimension; names without a rule are
# replicated. `mm.logical_to_mesh_spec` runs exactly this resolution, so you can try rules
# without a model:

# %%
MESH_SHAPE = {"data": 4, "model": 2}
RULES = [("batch", "data"), ("mlp", "model"), ("embed", None)]

for logical, shape in [
    (P("batch", "embed"), (BATCH, EMBED)),  # the input
    (P("embed", "mlp"), (EMBED, HIDDEN)),  # w1
    (P("batch", "mlp"), (BATCH, HIDDEN)),  # the hidden activation
]:
    print(f"{str(logical):<22} -> {mm.logical_to_mesh_spec(logical, shape, MESH_SHAPE, RULES)}")

# Priority: both names want "data"; the first rule takes it, the second finds it used.
greedy = [("batch", "data"), ("mlp", "data")]
spec = mm.logical_to_mesh_spec(P("batch", "mlp"), (8, 8), {"data": 4}, greedy)
print("one use per axis ->", spec)

# A rule may name several mesh axes: pure data parallelism over all 8 devices.
dp_rules = [("batch", ("data", "model"))]
spec = mm.logical_to_mesh_spec(P("batch", "embed"), (BATCH, EMBED), MESH_SHAPE, dp_rules)
print("tuple of axes    ->", spec)

# A dimension that the shard count does not divide is an error, not a silent layout change.
try:
    mm.logical_to_mesh_spec(P("batch"), (6,), MESH_SHAPE, RULES)
except ValueError as error:
    print(f"{type(error).__name__}: {error}")

# %% [markdown]
# ## Before: no task, nothing sharded
#
# `parallelize(fun, init_params=..., get_input_batch=...)` traces `fun` on abstract inputs,
# derives where each parameter and input should live, and returns the compiled function and
# initializers that create the arrays there. Without a task there are no rules, so every
# logical name maps to nothing: each array is **replicated** (one full copy per device of the
# default submesh).

# %%
sharded_mlp, sharded_init, sharded_batch = mm.parallelize(
    mlp, init_params=init_params, get_input_batch=get_batch
)
params, x = sharded_init(), sharded_batch()
print("w1:", params["w1"].sharding.spec, "on", len(params["w1"].devices()), "device(s)")
show(params["w1"])
show(x)

# %% [markdown]
# ## After: the same function as a task on a 4 x 2 submesh
#
# Wrap `mlp` in a task whose submesh has axes `data` (4) and `model` (2) and give it the rules
# above. Nothing inside `mlp` changes. Now the batch splits four ways over `data`, `w1` splits
# its `mlp` columns over `model`, and `w2` its `mlp` rows: the classic Megatron MLP, where the
# first matmul needs no communication and the second ends in one all-reduce over `model`.

# %%
submesh = mm.TaskMesh(devices=range(8), axis_sizes=(4, 2), axis_names=("data", "model"))
mlp_task = mm.task(mlp, mesh=submesh, logical_axes=RULES)

sharded_mlp, sharded_init, sharded_batch = mm.parallelize(
    mlp_task, init_params=init_params, get_input_batch=get_batch
)
params, x = sharded_init(), sharded_batch()
for name, array in [("w1", params["w1"]), ("w2", params["w2"]), ("x", x)]:
    print(
        f"{name}: {str(array.sharding.spec):<20} shard shape "
        f"{array.sharding.shard_shape(array.shape)}"
    )

# %% [markdown]
# `w1` (16 x 64): each device holds one half of the columns; the four devices of one `model`
# index hold the same half.

# %%
show(params["w1"])

# %% [markdown]
# `w2` (64 x 16): the rows are split the same way, so `h @ w2` is a sum of partial products.

# %%
show(params["w2"])

# %% [markdown]
# The batch `x` (32 x 16): four row blocks, each replicated over the two `model` devices.

# %%
show(x)

# %% [markdown]
# The output carries the last constraint, `P("batch", "embed")`, i.e. split like the input:

# %%
y = sharded_mlp(params, x)
show(y)
with mm.ignore_transforms():
    reference = mlp(init_params(), get_batch())
np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-6)
print("max |sharded - reference| =", float(jnp.max(jnp.abs(y - reference))))

# %% [markdown]
# ## Same code, other layouts
#
# Only the rules change. Data parallelism over all 8 devices (`batch` over both axes,
# parameters replicated), and tensor parallelism only (`mlp` over all 8 devices, batch
# replicated):

# %%
layouts = {
    "data parallel": [("batch", ("data", "model"))],
    "tensor parallel": [("mlp", ("data", "model"))],
}
for title, rules in layouts.items():
    fun = mm.task(mlp, mesh=submesh, logical_axes=rules)
    _, init, batch = mm.parallelize(fun, init_params=init_params, get_input_batch=get_batch)
    p, b = init(), batch()
    print(f"{title}: w1 {p['w1'].sharding.spec}, x {b.sharding.spec}")
    show(p["w1"])

# %% [markdown]
# ## A sharded training step
#
# Differentiate inside the function you parallelize: the gradients come out sharded like the
# parameters, and the SGD update happens in place on each device's shard.


# %%
def loss_fn(params, x):
    return jnp.mean((mlp_task(params, x) - x) ** 2)  # a tiny auto-encoder


def train_step(params, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


sharded_step, sharded_init, sharded_batch = mm.parallelize(
    train_step, init_params=init_params, get_input_batch=get_batch
)
params, x = sharded_init(), sharded_batch()
reference_params = init_params()
steps = 3 if SMOKE else 20
for i in range(steps):
    loss, params = sharded_step(params, x)
    with mm.ignore_transforms():
        ref_loss, reference_params = train_step(reference_params, get_batch())
    if i % 5 == 0 or i == steps - 1:
        print(f"step {i:2d}  loss {float(loss):.5f}  (unsharded {float(ref_loss):.5f})")
print("w1 after training:", params["w1"].sharding.spec)
np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)

# %% [markdown]
# ## Next
#
# One task covered every device here. `03-mpmd-autosharding` places two layers as two tasks
# on **different** submeshes, each with its own rules, in one program.
