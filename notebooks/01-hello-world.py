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
# # Hello, world: two tasks on two devices
#
# The smallest MPMD program: two functions, each a **task** pinned to its own device, called
# one after the other. `multimesh_flax.jit` compiles the pair into one program that runs the
# first function on device 0, moves its result to device 1, and runs the second function
# there. Nothing else in your code changes.
#
# What to look at:
#
# * the result lives on **device 1 only**: it is where the last task ran;
# * `describe()` prints the program the compiler built: two *fragments* and one *transfer*;
# * the values are exactly those of the plain Python function, and so are the gradients.
#
# This notebook simulates 8 CPU devices, so it runs on a laptop. The first code cell must
# configure them before JAX does anything else.

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

cache_dir = mm.enable_compilation_cache()  # a re-run loads compiled programs from there
jax.devices()

# %% [markdown]
# ## Two tasks
#
# `mm.task(fun, mesh=...)` returns a function that computes what `fun` computes, but runs
# on the submesh `mesh`. A `TaskMesh` names devices by their **position** in the program's
# device list (here `jax.devices()`), not by device id, so the same description can be placed
# elsewhere later. A one-device submesh is the simplest case.


# %%
def double(x):
    return x * 2


def add_one(x):
    return x + 1


first = mm.task(double, mesh=mm.TaskMesh(devices=[0]))  # runs on device 0
second = mm.task(add_one, mesh=mm.TaskMesh(devices=[1]))  # runs on device 1


def program(x):
    return second(first(x))


x = jnp.arange(4.0)
out = mm.jit(program)(x)
print("result :", out)
print("devices:", out.devices())

# %% [markdown]
# The result sits on `CpuDevice(id=1)` alone: `jit` leaves outputs on the submesh that produced
# them instead of gathering them somewhere. Compare with plain `jax.jit`, which knows nothing
# about tasks and runs everything on one device. `multimesh_flax` says so: a task traced by
# another transformation gets one `PlacementWarning` naming `multimesh_flax.jit` (under
# `mm.context(strict=True)` it is an error):

# %%
plain = jax.jit(program)(x)
print("plain jax.jit:", plain, plain.devices())
np.testing.assert_array_equal(out, plain)

# %% [markdown]
# ## The program it became
#
# `describe` shows the MPMD program: each `run` line is a *fragment* (a piece of the traced
# function compiled with `jax.jit` for one submesh), each `put` line a transfer between
# submeshes. Here: the forward of `double` on device 0, 16 bytes (four float32 values) to
# device 1, the forward of `add_one` there.

# %%
step = mm.jit(program)
print(step.describe(x))

# %% [markdown]
# `record_timeline` shows the same thing as it executes: each op, where it ran and for how
# long (recording waits for every op, so the durations are real).

# %%
with mm.record_timeline() as timeline:
    jax.block_until_ready(step(x))
for event in timeline.events:
    print(
        f"{event.kind:<8} {event.name:<20} on {list(event.place)}  "
        f"{1e6 * (event.end - event.start):7.1f} us"
    )

# %% [markdown]
# ## Gradients follow the tasks
#
# Take `jax.grad` *inside* the jitted function and the backward of each task runs where its
# forward ran. On device 1 the forward of `add_one`, the loss (glue, placed where its input
# lives) and the backward of `add_one` are consecutive work on one submesh, so they form one
# fragment; the gradient then goes back to device 0 for the backward of `double`
# (`double.bwd`). The gradient with respect to `x` therefore ends on device 0.


# %%
def loss(x):
    return jnp.sum(second(first(x)) ** 2)


grad_step = mm.jit(jax.grad(loss))
g = grad_step(x)
print("gradient:", g, "on", g.devices())
print(grad_step.describe(x))
np.testing.assert_allclose(g, jax.grad(loss)(x))

# %% [markdown]
# ## Outside `jit`
#
# Called eagerly, a task still computes the right values; it just does not move anything.
# `mm.ignore_transforms()` goes further and turns every transformation into the identity:
# the reference the test suite checks parallel programs against.

# %%
print("eager            :", program(x))
with mm.ignore_transforms():
    print("ignore_transforms:", mm.jit(program)(x))

# %% [markdown]
# ## Next
#
# Tasks on one device are the skeleton. `02-spmd-autosharding` shows how a task shards its
# arrays over a submesh of several devices with logical axis names, and
# `03-mpmd-autosharding` combines several such submeshes in one program.
