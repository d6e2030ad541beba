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
# # Fine-tuning a pipelined GPT
#
# The workflow this project exists for: take a transformer, cut it into pipeline stages on
# submeshes, train it, save it, and fine-tune it on new text, with every step compiled as
# one MPMD program. The model is the reference GPT-2-style decoder from `models/`
# (`gpt-tiny`: 2 blocks of width 64 over a byte vocabulary, so it trains on a CPU in
# minutes); the texts are the two small public-domain corpora bundled with it.
#
# 1. **Pre-train** on Shakespeare's sonnets, pipelined over 2 stages, each stage a 2 x 2
#    `(data, model)` submesh of 4 devices.
# 2. **Save** the parameters with `mm.checkpoint.Checkpointer`.
# 3. **Fine-tune** on poems by Edgar Allan Poe, starting from the checkpoint.
#
# What to look at:
#
# * the placement table: the embedding on stage 0, the head on stage 1 (the output head
#   reuses the token table, which has a single copy on stage 0), the MLP and attention
#   weights split over each stage's `model` axis;
# * the loss curves, and the same training run unparallelized on one device: the same
#   losses (to float32 round-off, see below);
# * the pipeline timeline of one step, recorded and predicted;
# * samples before and after fine-tuning, and the validation loss on both texts.

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
from models import (
    GPT,
    ByteTokenizer,
    cross_entropy_loss,
    generate,
    get_config,
    iterate_batches,
    load_corpus,
)
from models.pipeline import make_multimesh

cache_dir = mm.enable_compilation_cache()  # a re-run loads compiled programs from there

# %% [markdown]
# ## Data
#
# `ByteTokenizer` maps text to UTF-8 bytes plus three special ids; `iterate_batches` cuts
# seeded random windows (inputs, and targets shifted by one token). The last tenth of each
# text is held out for validation.

# %%
PRETRAIN_STEPS = 3 if SMOKE else 800
FINETUNE_STEPS = 2 if SMOKE else 200
BATCH, SEQ_LEN = 8, 128  # windows as long as the model's context
tokenizer = ByteTokenizer()


def split(name):
    ids = tokenizer.encode(load_corpus(name))
    cut = int(0.9 * ids.size)
    return ids[:cut], ids[cut:]


sonnets_train, sonnets_val = split("shakespeare_sonnets")
poe_train, poe_val = split("poe_poems")
print(
    f"sonnets: {sonnets_train.size} + {sonnets_val.size} tokens; "
    f"Poe: {poe_train.size} + {poe_val.size} tokens"
)


def batches(tokens, count, seed):
    pairs = iterate_batches(tokens, batch_size=BATCH, seq_len=SEQ_LEN, seed=seed, num_batches=count)
    return [{"inputs": jnp.asarray(x), "targets": jnp.asarray(y)} for x, y in pairs]


pretrain_batches = batches(sonnets_train, PRETRAIN_STEPS, seed=0)
finetune_batches = batches(poe_train, FINETUNE_STEPS, seed=1)


def loss_fn(model_fn, batch):
    return cross_entropy_loss(model_fn(batch["inputs"]), batch["targets"])


# %% [markdown]
# ## The model on two stages
#
# `GPT(config, stages=2)` places the embedding stem and block 0 on `stage=0`, block 1 and
# the head on `stage=1` of the current `MultiMesh` (see `models/pipeline.py`; it is
# `mm.layers.task(..., mesh_slice={"stage": s})` around each part). `make_multimesh(2, 2, 2)`
# is the 8 devices as `("stage", "data", "model")`. Inside a stage the batch splits over
# `data` and the MLP width, heads and vocabulary over `model`.

# %%
config = get_config("gpt-tiny")
multi = make_multimesh(2, 2, 2)
model = GPT(config, stages=2)
print(config)
with multi:
    print(mm.tabulate(model, jax.random.key(0), pretrain_batches[0]["inputs"], depth=1))

# %% [markdown]
# ## Pre-training on the sonnets
#
# `parallelize_step` builds the placed `TrainState` and the compiled step. Each batch of 8
# windows is cut into 4 microbatches of 2 that flow through the 2 stages in 1F1B order; the loss is
# their mean, so it equals the full-batch loss.

# %%
optimizer = optax.adamw(3e-3, weight_decay=0.01)
start = time.perf_counter()
step_fn, state, _ = mm.parallelize_step(
    model, optimizer, multi, pretrain_batches[0], loss_fn=loss_fn, microbatches=4, schedule="1f1b"
)
print(f"parallelize_step: {time.perf_counter() - start:.1f} s")
initial_params = jax.device_get(state.params)  # host copy, for the reference run and samples


# %%
def train(state, batches, log_every=100):
    losses = []
    start = time.perf_counter()
    for i, batch in enumerate(batches):
        loss, state = step_fn(state, batch)
        losses.append(float(loss))  # waits for the step: keeps few calls in flight
        if i == 0:
            seconds = time.perf_counter() - start  # a new program compiles on its first call
            print(f"step 0: loss {losses[0]:.3f}, {seconds:.1f} s including any compilation")
            start = time.perf_counter()
        elif i % log_every == 0 or i == len(batches) - 1:
            print(
                f"step {i}: loss {losses[-1]:.3f}"
                f"  ({1e3 * (time.perf_counter() - start) / i:.0f} ms/step)"
            )
    return losses, state


pretrain_losses, state = train(state, pretrain_batches)
pretrained_params = jax.device_get(state.params)

# %% [markdown]
# ## The same run, unparallelized
#
# The plain model (`GPT(config)`, no stages) with the same initial parameters, optimizer and
# batches, under ordinary `jax.jit` on one device. The first steps agree to about 1e-6.
# Later the two runs drift apart slowly: the pipelined step adds the same numbers in a
# different order (per microbatch, per device), and Adam's update divides by the square root
# of tiny second moments, which magnifies float32 rounding differences step after step, as it
# would between any two parallel layouts. The curves stay on top of each other.

# %%
plain_model = GPT(config)


@jax.jit
def reference_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(lambda x: plain_model.apply({"params": p}, x), batch)
    )(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def reference_run(params, batches):
    params = jax.device_put(params, jax.devices()[0])
    opt_state = optimizer.init(params)
    losses = []
    for batch in batches:
        loss, params, opt_state = reference_step(params, opt_state, batch)
        losses.append(float(loss))
    return losses


reference_pretrain = reference_run(initial_params, pretrain_batches)
early = min(20, PRETRAIN_STEPS)
np.testing.assert_allclose(pretrain_losses[:early], reference_pretrain[:early], rtol=1e-4)
gap = np.abs(np.subtract(pretrain_losses, reference_pretrain)) / np.array(reference_pretrain)
print(
    f"relative loss difference: first {early} steps max {gap[:early].max():.1e}, "
    f"all steps mean {gap.mean():.1e}"
)

# %% [markdown]
# ## Samples after pre-training
#
# `generate` runs the plain model with a KV cache on one device; the parameters come to the
# host first (they live on two different submeshes). The model learns bytes, so after a few
# hundred steps it spells sonnet-like words and line breaks, not sense. (An untrained model
# emits random bytes.)

# %%
PROMPTS = ["Shall I compare thee", "Once upon a midnight"]
SAMPLE_TOKENS = 12 if SMOKE else 100  # prompt + sample within max_len 128


def samples(params, title):
    print(f"--- {title} ---")
    for i, prompt in enumerate(PROMPTS):
        ids = jnp.asarray(tokenizer.encode(prompt))[None]
        out = generate(
            plain_model,
            params,
            ids,
            SAMPLE_TOKENS,
            rng=jax.random.key(i),
            temperature=0.7,
            top_k=20,
        )
        print(repr(tokenizer.decode(out[0])), "\n")


samples(pretrained_params, "pre-trained on the sonnets")

# %% [markdown]
# ## Saving
#
# `Checkpointer` (orbax underneath) writes every array through its own sharding and stores
# it as one logical array, so the checkpoint does not depend on the layout it came from. We
# save the parameters with the config as JSON metadata.

# %%
checkpoint_dir = tempfile.mkdtemp(prefix="gpt-sonnets-")
with mm.checkpoint.Checkpointer(checkpoint_dir) as checkpointer:
    checkpointer.save(
        PRETRAIN_STEPS,
        {"params": state.params},
        metadata={"preset": "gpt-tiny", "corpus": "shakespeare_sonnets"},
    )
print(sorted(os.listdir(checkpoint_dir)), mm.checkpoint.restore_metadata(checkpoint_dir))

# %% [markdown]
# ## Fine-tuning on Poe
#
# Restore onto a *target*: a tree whose leaves say where each array goes. Giving the
# current state's parameters places the checkpoint exactly like the pipelined run; a fresh
# optimizer state and step counter start the fine-tuning run. The model, shapes and
# optimizer are unchanged, so the compiled step is reused: nothing compiles again (the new
# optimizer state is created on the default device; the step moves it to where it belongs
# on the first call).
#
# The unparallelized reference restores the **same checkpoint onto one device**, by giving
# a target of `jax.ShapeDtypeStruct`s with a single-device sharding.

# %%
restored = mm.checkpoint.restore_checkpoint(checkpoint_dir, target={"params": state.params})
state = state.replace(
    params=restored["params"],
    step=jnp.zeros_like(state.step),
    opt_state=optimizer.init(restored["params"]),
)
finetune_losses, state = train(state, finetune_batches, log_every=50)
finetuned_params = jax.device_get(state.params)

one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
single_target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
    {"params": pretrained_params},
)
restored_single = mm.checkpoint.restore_checkpoint(checkpoint_dir, target=single_target)
reference_finetune = reference_run(restored_single["params"], finetune_batches)
early = min(20, FINETUNE_STEPS)
np.testing.assert_allclose(finetune_losses[:early], reference_finetune[:early], rtol=1e-4)

# %%
fig, ax = plt.subplots(figsize=(9, 4))
ax.plot(pretrain_losses, label="pre-training on the sonnets (2 stages x 4 devices)")
ax.plot(reference_pretrain, "--", color="black", lw=0.8, label="unparallelized, one device")
ft_x = np.arange(PRETRAIN_STEPS, PRETRAIN_STEPS + FINETUNE_STEPS)
ax.plot(ft_x, finetune_losses, label="fine-tuning on Poe (from the checkpoint)")
ax.plot(ft_x, reference_finetune, "--", color="black", lw=0.8)
ax.axvline(PRETRAIN_STEPS, color="grey", lw=0.5)
ax.set(xlabel="step", ylabel="training loss (nats/byte)", title="gpt-tiny, pipelined")
ax.legend()
plt.show()

# %% [markdown]
# ## Validation: what fine-tuning changed
#
# Loss on the held-out tenth of each text. Pre-training lowers both (they share the
# language) but favours the sonnets; fine-tuning lowers the loss on Poe and raises it on the
# sonnets: the model has moved to the new text.


# %%
@jax.jit
def eval_loss(params, batch):
    return loss_fn(lambda x: plain_model.apply({"params": params}, x), batch)


def validation(params, tokens):
    held_out = batches(tokens, 2 if SMOKE else 8, seed=123)
    return float(np.mean([eval_loss(params, b) for b in held_out]))


print(f"{'parameters':<22}{'sonnets val':>12}{'Poe val':>10}")
for title, params in [
    ("initial", initial_params),
    ("pre-trained", pretrained_params),
    ("fine-tuned on Poe", finetuned_params),
]:
    print(
        f"{title:<22}{validation(params, sonnets_val):>12.3f}{validation(params, poe_val):>10.3f}"
    )

# %%
samples(finetuned_params, "fine-tuned on Poe")

# %% [markdown]
# ## The pipeline timeline
#
# One recorded step: each lane is a stage's submesh, each bar a fragment (F forward,
# B backward, grey glue such as the optimizer update), labelled `<phase><stage>.<microbatch>`.
# Recording runs one op at a time and the replay re-times them as if the submeshes ran in
# parallel. Below it, the simulator's prediction of the same 1F1B schedule with the recorded
# median durations. Eight simulated devices share this host's few CPU cores, so the recorded
# durations are noisy; compare the order and the shape of the bubble.

# %%
batch = finetune_batches[-1]
executable = step_fn.executable(state, batch)
print("\n".join(executable.describe().splitlines()[-2:]))
with mm.record_timeline() as timeline:
    for _ in range(3):
        loss, state = step_fn(state, batch)
        float(loss)
bubbles = [mm.recorded_bubble(timeline, call=c) for c in range(3)]
call = int(np.argsort(bubbles)[1])  # the median of three recorded steps
mm.plot_timeline(
    timeline, schedule=executable.schedule, costs=mm.measured_costs(timeline, call=call), call=call
)

# %% [markdown]
# ## Where to go from here
#
# * More stages: `GPT(get_config("gpt-tiny", num_layers=4), stages=4)` with
#   `make_multimesh(4, 2, 1)`; the checkpoint above restores onto it unchanged, since the
#   parameter tree does not depend on the number of stages.
# * Other schedules and what they cost in memory: `08-finetune-llama-schedules`.
