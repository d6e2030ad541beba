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
# # Fine-tuning a pretrained Hugging Face checkpoint, pipelined
#
# People fine-tune published models. `models.hf` reads a Hugging Face GPT-2
# (`GPT2LMHeadModel`) or Llama (`LlamaForCausalLM`) folder -- `config.json` plus
# safetensors weights, sharded or not, and a `tokenizer.json` -- into the reference models of
# `models/`, with every tensor placed straight onto its pipeline stage, and writes the
# fine-tuned model back in the same format, which `transformers` reads.
#
# 1. **Import** the checkpoint: its config, its BPE tokenizer, its weights onto 2 stages x
#    (2 data x 2 model) devices; check its logits against the ones `transformers` computed.
# 2. **Fine-tune** it pipelined (4 microbatches, 1F1B) on poems by Edgar Allan Poe, next to
#    the same training on one device with plain `jax.jit`.
# 3. **Export** it with `hf.save`, **reload** the folder, and **sample** from it.
#
# There is no network here, so the default checkpoint is the tiny GPT-2 in
# `tests/fixtures/hf/gpt2` that `tests/fixtures/make_hf_fixtures.py` built with
# `transformers` (4 layers, width 32, random weights, a 320-id BPE vocabulary trained on the
# corpus). Point `MMFLAX_HF_CHECKPOINT` at any GPT-2 or Llama folder (for example one
# downloaded with `huggingface-cli download gpt2`) to run the same cells on it.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # set JAX_PLATFORMS=cuda to run on GPUs
import jax

if os.environ["JAX_PLATFORMS"] == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 simulated devices on one CPU
SMOKE = os.environ.get("MMFLAX_SMOKE") == "1"  # the test suite's reduced run

import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import matplotlib.pyplot as plt
import multimesh_flax as mm
import numpy as np
import optax
from models import cross_entropy_loss, generate, hf, iterate_batches, load_corpus, make_model
from models.pipeline import make_multimesh

CHECKPOINT = Path(os.environ.get("MMFLAX_HF_CHECKPOINT", "../tests/fixtures/hf/gpt2"))

cache_dir = mm.enable_compilation_cache()  # a re-run loads compiled programs from there

# %% [markdown]
# ## Import
#
# `hf.load_config` reads only `config.json`; `HFTokenizer` wraps the folder's
# `tokenizer.json` behind the interface of the byte tokenizer (`encode`, `decode`,
# `vocab_size`, `bos_id`, ...). `hf.load_placed` then reads the weights one tensor at a
# time and puts each onto the submesh of its stage, sharded as the pipelined model shards
# it: the embedding on stage 0 split over its `model` axis, the blocks on their stages, the
# final norm on the last stage. The host never holds more than one tensor, and no device
# the whole model. A vocabulary that does not split over the `model` axis (GPT-2's 50257
# ids over 2 devices) is padded with zero rows by `vocab_multiple`; `save` cuts them off.

# %%
STAGES = 2
multi = make_multimesh(STAGES, 2, 2)
original_vocab = hf.load_config(CHECKPOINT).vocab_size
tokenizer = hf.HFTokenizer.from_folder(CHECKPOINT)
start = time.perf_counter()
config, placed = hf.load_placed(
    CHECKPOINT, multi, stages=STAGES, dtype=jnp.float32, vocab_multiple=multi.shape["model"]
)
print(f"loaded in {time.perf_counter() - start:.1f} s: {config}")
for name in ("stem", "blocks_0", f"blocks_{config.num_layers - 1}", "head"):
    leaf = jax.tree.leaves(placed[name])[0]
    print(f"{name:>9}: devices {sorted(d.id for d in leaf.devices())}")
table = placed["stem"]["embed"]["embedding"]
print("token table", table.shape, "one shard:", table.sharding.shard_shape(table.shape))

# %% [markdown]
# The fixture folder comes with the logits `transformers` computed on fixed token ids.
# The same ids through our model, pipelined over the two stages, give the same logits.

# %%
model = type(make_model(config))(config, stages=STAGES)
reference = CHECKPOINT.parent / f"{CHECKPOINT.name}.logits.npz"
if reference.exists():
    recorded = np.load(reference)
    with multi:
        forward = mm.jit(lambda p, x: model.apply({"params": p}, x))
        logits = np.asarray(forward(placed, recorded["tokens"]))[..., :original_vocab]
    gap = np.abs(logits - recorded["logits"]).max()
    print(f"largest difference from transformers' logits: {gap:.1e}")
    np.testing.assert_allclose(logits, recorded["logits"], atol=1e-4, rtol=1e-4)

# %% [markdown]
# ## Data: Poe, in the checkpoint's own tokens
#
# The BPE tokenizer turns the text into fewer ids than bytes. The last tenth is held out.

# %%
STEPS = 2 if SMOKE else 150
BATCH, SEQ_LEN = 8, min(64, config.max_len)
ids = tokenizer.encode(load_corpus("poe_poems"))
cut = int(0.9 * ids.size)
train_ids, val_ids = ids[:cut], ids[cut:]
text_bytes = len(load_corpus("poe_poems").encode())
print(f"{text_bytes} bytes -> {ids.size} tokens ({text_bytes / ids.size:.2f} bytes per token)")


def batches(tokens, count, seed):
    pairs = iterate_batches(tokens, batch_size=BATCH, seq_len=SEQ_LEN, seed=seed, num_batches=count)
    return [{"inputs": jnp.asarray(x), "targets": jnp.asarray(y)} for x, y in pairs]


train_batches = batches(train_ids, STEPS, seed=0)
val_batches = batches(val_ids, 4, seed=1)


def loss_fn(model_fn, batch):
    return cross_entropy_loss(model_fn(batch["inputs"]), batch["targets"])


# %% [markdown]
# ## Fine-tuning, pipelined
#
# `parallelize_step` builds the compiled step and a training state whose parameters sit
# where the pipelined model keeps them -- the same shardings `load_placed` used -- so the
# imported weights replace the fresh ones with `state.replace(params=...)`, without moving.

# %%
optimizer = optax.adamw(2e-3, weight_decay=0.01)
step_fn, state, _ = mm.parallelize_step(
    model, optimizer, multi, train_batches[0], loss_fn=loss_fn, microbatches=4, schedule="1f1b"
)
state = state.replace(params=placed)
imported = jax.device_get(placed)  # host copy, for the reference run and the samples

losses = []
start = time.perf_counter()
for batch in train_batches:
    loss, state = step_fn(state, batch)
    losses.append(float(loss))
print(f"{STEPS} steps in {time.perf_counter() - start:.1f} s (first one compiles)")
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")

# %% [markdown]
# The same fine-tuning on one device, unparallelized, under plain `jax.jit`: same start,
# same batches, same optimizer. The losses agree to float32 round-off.

# %%
single = make_model(config)


@jax.jit
def reference_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(lambda x: single.apply({"params": p}, x), batch)
    )(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


params = jax.device_put(imported, jax.devices()[0])
opt_state, reference_losses = optimizer.init(params), []
for batch in train_batches:
    loss, params, opt_state = reference_step(params, opt_state, batch)
    reference_losses.append(float(loss))
early = min(20, STEPS)
np.testing.assert_allclose(losses[:early], reference_losses[:early], rtol=1e-4)
relative = np.abs(np.subtract(losses, reference_losses)) / np.array(reference_losses)
print(f"largest relative difference over the first {early} steps: {relative[:early].max():.1e}")

fig, ax = plt.subplots(figsize=(8, 3.5))
ax.plot(losses, label="pipelined, 2 stages x (2 x 2)")
ax.plot(reference_losses, "--", color="black", lw=0.8, label="unparallelized, one device")
ax.set_xlabel("step")
ax.set_ylabel("cross entropy (nats per token)")
ax.set_title(f"fine-tuning {CHECKPOINT.name} on Poe")
ax.legend()
plt.show()


# %%
@jax.jit
def val_loss(params, batch):
    return loss_fn(lambda x: single.apply({"params": params}, x), batch)


def validation(params):
    params = jax.device_put(jax.device_get(params), jax.devices()[0])
    return float(np.mean([val_loss(params, b) for b in val_batches]))


print(f"held-out Poe loss: {validation(imported):.3f} before, {validation(state.params):.3f} after")

# %% [markdown]
# ## Export, reload, sample
#
# `hf.save` writes `config.json`, the safetensors weights (split into
# `model-0000i-of-0000n.safetensors` files with an index above `max_shard_size`) and the
# tokenizer. It builds the folder under a temporary name and renames it when complete.
# Reading it back gives the trained parameters bit for bit; `transformers`'
# `AutoModelForCausalLM.from_pretrained(folder)` reads it too.

# %%
out = Path(tempfile.mkdtemp()) / f"{CHECKPOINT.name}-poe"
hf.save(out, config, state.params, vocab_size=original_vocab, tokenizer=tokenizer)
for path in sorted(out.iterdir()):
    print(f"{path.name:<22} {path.stat().st_size:>10,} bytes")
reloaded_config, reloaded = hf.load(out, vocab_multiple=multi.shape["model"])
trained = jax.device_get(state.params)
same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), trained, reloaded)
print("reloaded parameters identical to the trained ones:", all(jax.tree.leaves(same)))
assert all(jax.tree.leaves(same))

# %% [markdown]
# `generate` decodes with a KV cache on one device; the tokenizer turns the ids back into
# text. Before fine-tuning the fixture's random weights produce noise; after it, words and
# line breaks of the poems appear (a real checkpoint starts from fluent English instead).

# %%
prompt = "Once upon a midnight"
prompt_ids = tokenizer.encode(prompt)[None]
count = min(40, config.max_len - prompt_ids.shape[1])
for label, weights in (("imported", imported), ("fine-tuned, reloaded", reloaded)):
    out_ids = generate(single, weights, prompt_ids, count, rng=jax.random.key(0), temperature=0.7)
    print(f"--- {label} ---\n{tokenizer.decode(np.asarray(out_ids[0]))}\n")
