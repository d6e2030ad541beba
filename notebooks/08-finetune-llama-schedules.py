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
# # Fine-tuning a Llama-style model: pipeline schedules compared
#
# A pipeline schedule decides the order in which each stage runs the forward (F) and
# backward (B) passes of the microbatches. It never changes the result, only **time** (how
# long stages sit idle: the *bubble*) and **memory** (how many microbatches' activations a
# stage keeps alive until their backward). This notebook fine-tunes the reference
# Llama-style model (`llama-tiny` with 4 blocks: RMSNorm, rotary positions, SwiGLU,
# grouped-query attention) on 4 pipeline stages with 8 microbatches under three schedules:
#
# * **GPipe**: every forward, then every backward. Simple; each stage holds all 8
#   microbatches' activations.
# * **1F1B**: after a short warm-up each stage alternates one forward and one backward, so
#   stage `s` of `p` holds at most `p - s` microbatches. Same bubble as GPipe, less memory.
# * **Zero-bubble (ZB-H2)**: each backward is split into the activation gradient (B), which
#   the previous stage waits for, and the weight gradient (W), which nobody waits for and
#   which fills the idle slots. Smaller bubble, more memory.
#
# What to look at: identical losses under all three; for each schedule the **recorded**
# timeline of one step next to the simulator's **prediction**; and the **per-device
# memory**, measured, next to the simulator's count of microbatches in flight.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # set JAX_PLATFORMS=cuda to run on GPUs
import jax

if os.environ["JAX_PLATFORMS"] == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 simulated devices on one CPU
SMOKE = os.environ.get("MMFLAX_SMOKE") == "1"  # the test suite's reduced run

import tempfile
import time

import jax.numpy as jnp
import matplotlib.pyplot as plt
import multimesh_flax as mm
import numpy as np
import optax
from IPython.display import display
from models import (
    ByteTokenizer,
    Llama,
    cross_entropy_loss,
    generate,
    get_config,
    iterate_batches,
    load_corpus,
)
from models.pipeline import make_multimesh
from multimesh_flax.core.run import OpKind

cache_dir = mm.enable_compilation_cache()  # a re-run loads compiled programs from there

# %% [markdown]
# ## Set-up
#
# Four stages of two devices each (`make_multimesh(4, 2, 1)`: axes `stage`, `data`,
# `model`); each block is one stage, the embedding rides with block 0 and the head with
# block 3. A batch of 16 windows of 128 bytes is cut into 8 microbatches of 2. (The smoke
# run used by the test suite shrinks this to 2 stages and 2 microbatches.)

# %%
STAGES, MICROBATCHES = (2, 2) if SMOKE else (4, 8)
BATCH, SEQ_LEN = (8, 64) if SMOKE else (16, 128)
PRETRAIN_STEPS = 2 if SMOKE else 250
FINETUNE_STEPS = 2 if SMOKE else 60
SCHEDULES = ["1f1b", "gpipe", "zero-bubble-h2"]

config = get_config("llama-tiny", num_layers=STAGES)
multi = make_multimesh(STAGES, 8 // STAGES, 1)
model = Llama(config, stages=STAGES)
optimizer = optax.adamw(3e-3, weight_decay=0.01)
tokenizer = ByteTokenizer()


def batches(name, count, seed):
    tokens = tokenizer.encode(load_corpus(name))
    pairs = iterate_batches(tokens, batch_size=BATCH, seq_len=SEQ_LEN, seed=seed, num_batches=count)
    return [{"inputs": jnp.asarray(x), "targets": jnp.asarray(y)} for x, y in pairs]


def loss_fn(model_fn, batch):
    return cross_entropy_loss(model_fn(batch["inputs"]), batch["targets"])


pretrain_batches = batches("shakespeare_sonnets", PRETRAIN_STEPS, seed=0)
finetune_batches = batches("poe_poems", FINETUNE_STEPS, seed=1)
print(config)


def build(schedule):
    """The placed state and compiled step for one schedule (timed)."""
    start = time.perf_counter()
    step_fn, state, _ = mm.parallelize_step(
        model,
        optimizer,
        multi,
        pretrain_batches[0],
        loss_fn=loss_fn,
        microbatches=MICROBATCHES,
        schedule=schedule,
    )
    print(f"{schedule}: parallelize_step {time.perf_counter() - start:.1f} s")
    return step_fn, state


def train(step_fn, state, batches):
    losses = []
    for batch in batches:
        loss, state = step_fn(state, batch)
        losses.append(float(loss))  # wait for every step
    return losses, state


# %% [markdown]
# ## Pre-training, then a checkpoint
#
# A short pre-training on the sonnets with 1F1B gives the starting point; every schedule
# then fine-tunes from the same checkpoint.

# %%
steps = {}
step_fn, state = build("1f1b")
steps["1f1b"] = step_fn
start = time.perf_counter()
pretrain_losses, state = train(step_fn, state, pretrain_batches)
print(
    f"pre-training: {time.perf_counter() - start:.1f} s, "
    f"loss {pretrain_losses[0]:.3f} -> {pretrain_losses[-1]:.3f}"
)
checkpoint_dir = tempfile.mkdtemp(prefix="llama-sonnets-")
mm.checkpoint.save_checkpoint(checkpoint_dir, PRETRAIN_STEPS, {"params": state.params})
print(step_fn.executable(state, pretrain_batches[0]).schedule)

# %% [markdown]
# ## Fine-tuning under each schedule
#
# For each schedule: build its step (GPipe reuses most of the 1F1B fragments' compiled code;
# ZB-H2 has different fragments, the backward being split), restore the checkpoint onto its
# state, fine-tune on Poe, then record three steps with `mm.record_timeline()`.


# %%
def from_checkpoint(state):
    restored = mm.checkpoint.restore_checkpoint(checkpoint_dir, target={"params": state.params})
    return state.replace(
        params=restored["params"],
        step=jnp.zeros_like(state.step),
        opt_state=optimizer.init(restored["params"]),
    )


results = {}
for schedule in SCHEDULES:
    if schedule == "1f1b":
        step_fn = steps["1f1b"]  # the state is the pre-trained one: restore onto it
    else:
        step_fn, state = build(schedule)
        steps[schedule] = step_fn
    state = from_checkpoint(state)
    start = time.perf_counter()
    losses, state = train(step_fn, state, finetune_batches)
    seconds = time.perf_counter() - start
    batch = finetune_batches[-1]
    with mm.record_timeline() as timeline:
        for _ in range(3):
            loss, state = step_fn(state, batch)
            float(loss)
    results[schedule] = {
        "losses": losses,
        "timeline": timeline,
        "state": state,
        "executable": step_fn.executable(state, batch),
    }
    print(f"{schedule}: fine-tuning {seconds:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")

# %% [markdown]
# The schedules reorder the same computation, so the losses agree to float32 round-off:

# %%
for schedule in SCHEDULES[1:]:
    np.testing.assert_allclose(results[schedule]["losses"], results["1f1b"]["losses"], rtol=1e-4)
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.plot(pretrain_losses, color="grey", label="pre-training on the sonnets (1F1B)")
x = np.arange(PRETRAIN_STEPS, PRETRAIN_STEPS + FINETUNE_STEPS)
for schedule, style in zip(SCHEDULES, ["-", "--", ":"], strict=True):
    ax.plot(x, results[schedule]["losses"], style, label=f"fine-tuning on Poe, {schedule}")
ax.set(xlabel="step", ylabel="training loss (nats/byte)", title="llama-tiny, 4 stages")
ax.legend()
plt.show()

# %% [markdown]
# ## Timelines: recorded and predicted
#
# `plot_timeline` draws one recorded step (top: one lane per stage's submesh, F blue,
# B orange, W green, grey glue such as the optimizer update) and the simulator's prediction
# of the same schedule with the recorded median duration of each phase (bottom). Recording
# runs one op at a time, so the top panel replays the recorded durations in the runtime's
# dispatch order, as if the submeshes ran in parallel; the eight simulated devices share two
# CPU cores here, so durations are noisy and the glue is relatively expensive. Compare the
# *order* of the ops and the shape of the idle gaps: GPipe and 1F1B leave the same
# triangle of bubbles, zero-bubble fills part of it with W.


# %%
def median_call(timeline):
    bubbles = [mm.recorded_bubble(timeline, call=c) for c in range(timeline.calls)]
    return int(np.argsort(bubbles)[len(bubbles) // 2])


for schedule in SCHEDULES:
    result = results[schedule]
    call = median_call(result["timeline"])
    costs = mm.measured_costs(result["timeline"], call=call)
    result.update(call=call, costs=costs)
    figure = mm.plot_timeline(
        result["timeline"], schedule=result["executable"].schedule, costs=costs, call=call
    )
    figure.suptitle(schedule, fontsize=14)
    display(figure)

# %% [markdown]
# The bubble fractions side by side. "Unit costs" is the textbook number (F = B = W = 1;
# `(p - 1) / (m + p - 1)` = 3/11 for GPipe and 1F1B); "measured costs" feeds the simulator the
# recorded phase durations; "recorded" is the replayed step itself, glue included.

# %%
print(f"{'schedule':<16}{'unit costs':>12}{'measured costs':>16}{'recorded':>10}{'ops/step':>10}")
for schedule in SCHEDULES:
    result = results[schedule]
    plan = result["executable"].schedule
    unit = mm.simulate(plan).bubble_fraction
    measured = mm.simulate(plan, costs=result["costs"]).bubble_fraction
    recorded = mm.recorded_bubble(result["timeline"], call=result["call"])
    print(
        f"{schedule:<16}{unit:>12.3f}{measured:>16.3f}{recorded:>10.3f}"
        f"{len(result['executable'].ops):>10}"
    )

# %% [markdown]
# ## Memory per device
#
# The simulator counts, for each stage, the largest number of microbatches whose
# activations are alive at once (`peak_in_flight`). To measure the real thing, the helper
# below replays one step's op list (`executable.ops`, the fragments and transfers exactly as
# the runtime dispatches them, with the same points where values are freed) and records after
# every op how many bytes of live arrays each device holds: parameters, optimizer state,
# inputs, the activations stashed between a stage's forward and its backward, gradients.
# Memory used *inside* a fragment while it runs is not counted. (CPU devices report no
# allocator statistics; on GPUs `device.memory_stats()` gives the peak directly.)


# %%
def live_bytes_per_device(executable, args):
    """Peak and initial bytes of live arrays per device id over one replayed step."""
    env = dict(getattr(executable, "_consts", {}))
    leaves = jax.tree.leaves(args)
    for slot, sharding, leaf in zip(
        executable.input_slots, executable.input_shardings, leaves, strict=True
    ):
        leaf = jnp.copy(leaf)  # the fragments donate the state: replay on copies
        env[slot] = leaf if sharding is None else jax.device_put(leaf, sharding)

    def now():
        totals = {}
        for value in env.values():
            if value.is_deleted():  # donated to a fragment
                continue
            for shard in value.addressable_shards:
                totals[shard.device.id] = totals.get(shard.device.id, 0) + shard.data.nbytes
        return totals

    initial = now()
    peak = dict(initial)
    state = executable.state  # what the first call learnt: executables, transfer targets
    for index, op in enumerate(executable.ops):
        values = [env[s] for s in op.ins]
        if op.kind is OpKind.RUN:  # a fragment
            outs = state.fns[index](*values)
        else:  # a transfer between submeshes
            outs = jax.device_put(values, state.put_shardings[index])
        jax.block_until_ready(outs)
        env.update(zip(op.outs, outs, strict=True))
        for device, size in now().items():
            peak[device] = max(peak.get(device, 0), size)
        for slot in op.frees:
            env.pop(slot, None)
    return initial, peak


MiB = 2**20
memory = {}
for schedule in SCHEDULES:
    result = results[schedule]
    initial, peak = live_bytes_per_device(
        result["executable"], (result["state"], finetune_batches[-1])
    )
    in_flight = mm.simulate(result["executable"].schedule).peak_in_flight
    memory[schedule] = (initial, peak, in_flight)

devices = sorted(memory["1f1b"][1])
stage_of = {d: i // (8 // STAGES) for i, d in enumerate(devices)}
print(f"{'':<16}" + "".join(f"{'stage ' + str(s):>12}" for s in range(STAGES)))
for schedule in SCHEDULES:
    initial, peak, in_flight = memory[schedule]
    first = {stage_of[d]: d for d in reversed(devices)}  # one device per stage
    print(
        f"{schedule:<16}"
        + "".join(f"{peak[first[s]] / MiB:>8.2f} MiB" for s in range(STAGES))
        + "   peak live"
    )
    print(
        f"{'':<16}"
        + "".join(f"{(peak[first[s]] - initial[first[s]]) / MiB:>8.2f} MiB" for s in range(STAGES))
        + "   above the state"
    )
    print(
        f"{'':<16}" + "".join(f"{n:>12}" for n in in_flight) + "   microbatches in flight"
        " (simulated)"
    )

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
width = 0.25
for k, schedule in enumerate(SCHEDULES):
    initial, peak, in_flight = memory[schedule]
    above = [(peak[d] - initial[d]) / MiB for d in devices]
    axes[0].bar(np.arange(len(devices)) + (k - 1) * width, above, width, label=schedule)
    axes[1].bar(np.arange(STAGES) + (k - 1) * width, in_flight, width, label=schedule)
axes[0].set(
    xticks=range(len(devices)),
    xticklabels=[f"dev {d}" for d in devices],
    ylabel="MiB",
    title="measured: peak live bytes above the training state",
)
axes[1].set(
    xticks=range(STAGES),
    xticklabels=[f"stage {s}" for s in range(STAGES)],
    ylabel="microbatches",
    title="simulated: activation sets in flight",
)
axes[0].legend()
plt.show()

# %% [markdown]
# Reading the numbers: GPipe keeps all 8 microbatches alive on every stage; 1F1B keeps
# `p - s` (4, 3, 2, 1), which is the whole point of 1F1B; ZB-H2 keeps up to `2p - 1` = 7 to
# have W work ready for the gaps, trading memory for a smaller bubble. The measured bytes
# follow the same pattern; the last stage also holds the logits over the vocabulary, the
# largest activation of this small model.
#
# On this CPU host the simulated devices do not really run in parallel, so none of the
# schedules is faster in wall time here; on real accelerators the bubble fractions above are
# the idle time you would pay.
#
# ## Samples after fine-tuning
#
# The same parameters under any schedule; here from the zero-bubble run.

# %%
plain = Llama(config)
params = jax.device_get(results["zero-bubble-h2"]["state"].params)
prompt = jnp.asarray(tokenizer.encode("Once upon a midnight"))[None]
sample = generate(
    plain, params, prompt, 16 if SMOKE else 100, rng=jax.random.key(0), temperature=0.7, top_k=20
)
print(repr(tokenizer.decode(sample[0])))
