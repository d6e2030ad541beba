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
# # Fine-tuning a Llama 3-style checkpoint on your own data, in bfloat16 with recomputation
#
# The run a researcher starts with: a checkpoint they downloaded, a JSONL file of their own
# text, a few GPUs. This notebook does it end to end with `mmflax train`, the command-line
# job, called from Python:
#
# 1. **The checkpoint.** A Llama 3-style folder (`LlamaForCausalLM` with
#    `rope_type: "llama3"` rope scaling, grouped-query attention, a `tokenizer.json`) is read
#    onto 2 pipeline stages; its logits match the ones `transformers` computed.
# 2. **The data.** A JSONL file, one document per line, is tokenized with the checkpoint's
#    tokenizer, packed into windows with an end-of-text id between documents, and split
#    into training and held-out windows.
# 3. **Fine-tuning**, pipelined (2 stages x (2 data x 2 tensor), 1F1B, 4 microbatches), in
#    bfloat16 compute with float32 parameters and optimizer state, every stage recomputing
#    its forward pass in the backward, with warm-up and cosine decay. The held-out loss is
#    measured before, during and after.
# 4. **Export** back to a Hugging Face folder, **reload** it bit for bit, and **sample**.
#
# There is no network here, so the checkpoint is the tiny random Llama 3-style model that
# `tests/fixtures/make_hf_fixtures.py` built with `transformers` (4 layers, width 32, a
# 320-id BPE vocabulary), and the "user's data" are poems by Edgar Allan Poe written out as
# JSONL. Point `MMFLAX_HF_CHECKPOINT` at a real folder (Llama 3.x, Qwen2/2.5, Qwen3,
# Mistral) and `MMFLAX_DATA` at your own `.jsonl`, `.txt` or `.parquet` file to run the same
# cells on them.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # set JAX_PLATFORMS=cuda to run on GPUs
import jax

if os.environ["JAX_PLATFORMS"] == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 simulated devices on one CPU
SMOKE = os.environ.get("MMFLAX_SMOKE") == "1"  # the test suite's reduced run

import json
import re
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
import matplotlib.pyplot as plt
import multimesh_flax as mm
import numpy as np
from models import generate, hf, load_corpus, make_model
from models.pipeline import make_multimesh
from multimesh_flax.checkpoint import Checkpointer
from multimesh_flax.cli import main as mmflax

FIXTURES = Path("../tests/fixtures/hf")
WORK = Path(tempfile.mkdtemp(prefix="mmflax-finetune-"))

# %% [markdown]
# ## The checkpoint
#
# A downloaded folder holds `config.json`, safetensors weights and `tokenizer.json`. The
# fixture keeps its tokenizer one level up (all fixtures share it), so we assemble the
# folder a user would have. `hf.load_config` shows what the import understood: the rope
# scaling of Llama 3.1 (`RopeScaling`, whose original context here, 8 tokens, is far shorter
# than the windows we train on), 4 query heads sharing 2 key/value heads.

# %%
source = Path(os.environ.get("MMFLAX_HF_CHECKPOINT", FIXTURES / "llama3"))
checkpoint = WORK / source.name
shutil.copytree(source, checkpoint)
if not (checkpoint / "tokenizer.json").exists():
    shutil.copy(FIXTURES / "tokenizer.json", checkpoint / "tokenizer.json")
print(json.loads((checkpoint / "config.json").read_text())["architectures"])
config = hf.load_config(checkpoint, dtype=jnp.float32)
print(config)

# %% [markdown]
# Pipelined over 2 stages, the imported model computes the logits `transformers` recorded
# for the fixture (on 16 tokens, twice the rope scaling's original context).

# %%
STAGES = 2
multi = make_multimesh(STAGES, 2, 2)
_, placed = hf.load_placed(checkpoint, multi, stages=STAGES, dtype=jnp.float32)
model = type(make_model(config))(config, stages=STAGES)
reference = source.parent / f"{source.name}.logits.npz"
if reference.exists():
    recorded = np.load(reference)
    with multi:
        forward = mm.jit(lambda p, x: model.apply({"params": p}, x))
        logits = np.asarray(forward(placed, recorded["tokens"]))
    gap = np.abs(logits - recorded["logits"]).max()
    print(f"largest difference from transformers' logits: {gap:.1e}")
    np.testing.assert_allclose(logits, recorded["logits"], atol=1e-4, rtol=1e-4)

# %% [markdown]
# ## Your data
#
# Any JSONL file with a text field will do (`--text-field` names it). Here each Poe poem
# (a title line in capitals starts one) becomes one record.

# %%
data = Path(os.environ.get("MMFLAX_DATA", WORK / "poems.jsonl"))
if "MMFLAX_DATA" not in os.environ:
    titled = re.split(r"\n\n(?=[A-Z][A-Z ,.'-]+\n\n)", load_corpus("poe_poems"))
    poems = [p.strip() for p in titled if p.strip()]
    with data.open("w", encoding="utf-8") as f:
        for poem in poems:
            f.write(json.dumps({"title": poem.splitlines()[0], "text": poem}) + "\n")
    print(f"{len(poems)} documents, {data.stat().st_size:,} bytes; the first begins:")
    print(json.loads(data.read_text().splitlines()[0])["text"][:160])

# %% [markdown]
# ## Fine-tuning
#
# One command. `--init-from` loads the checkpoint onto its stages and uses its tokenizer;
# `--dataset` tokenizes the file once into the run folder's `data_cache/` (a memory-mapped
# file, reused while the file does not change) and streams windows from it through grain;
# `--eval-fraction` holds out a share of the windows, evaluated before the first step, every
# `--eval-every` steps and after the last. `--precision bf16` computes in bfloat16 with
# float32 parameters and Adam moments; `--recompute full` makes every stage keep only its
# inputs and recompute its activations in the backward pass. A stopped run (Ctrl-C, a
# scheduler's SIGTERM) saves and continues with `--resume`, the data stream included.

# %%
STEPS = 4 if SMOKE else 120
run = WORK / "run"
os.environ["TQDM_MININTERVAL"] = "5"  # a progress line every 5 s in this notebook
status = mmflax(
    [
        "train",
        *("--init-from", str(checkpoint), "--dataset", str(data), "--text-field", "text"),
        *("--eval-fraction", "0.1", "--eval-every", str(max(STEPS // 6, 2))),
        *("--precision", "bf16", "--recompute", "full"),
        *("--stages", str(STAGES), "--data", "2", "--tensor", "2"),
        *("--microbatches", "4", "--schedule", "1f1b"),
        *("--steps", str(STEPS), "--batch-size", "16", "--seq-len", "32"),
        *("--lr", "3e-3", "--warmup", str(max(STEPS // 10, 1)), "--lr-schedule", "cosine"),
        *("--log-every", "5", "--compile-cache", "off", "--out", str(run)),
        "--no-samples",  # this notebook samples the exported model below
    ]
)
assert status == 0, status

# %% [markdown]
# The run folder holds the metrics as strict JSON. The held-out loss falls from the
# imported model's to the fine-tuned one's.

# %%
metrics = json.loads((run / "metrics.json").read_text())
history, evals = metrics["history"], metrics["eval_history"]
print(json.dumps({k: v for k, v in metrics["summary"].items() if "eval" in k}, indent=1))
first, last = evals["loss"][0], evals["loss"][-1]
print(f"held-out loss {first:.3f} -> {last:.3f}")
if not SMOKE:
    assert last < first

fig, ax = plt.subplots(figsize=(8, 3.5))
ax.plot(history["step"], history["loss"], label="training loss (bf16, recomputed)")
ax.plot(evals["step"], evals["loss"], "o-", label="held-out loss")
ax.set_xlabel("step")
ax.set_ylabel("cross entropy (nats per token)")
ax.set_title(f"fine-tuning {source.name} on {data.name}")
ax.legend()
plt.show()

# %% [markdown]
# ## Export, reload, sample
#
# `mmflax export` writes the run's last checkpoint as a Hugging Face folder of the same
# architecture (rope scaling included), with its tokenizer; `transformers` reads it. Read
# back with `hf.load`, it holds the trained parameters bit for bit.

# %%
exported = WORK / "exported"
assert mmflax(["export", "--checkpoint", str(run), "--to", str(exported)]) == 0
print(sorted(p.name for p in exported.iterdir()))
reloaded_config, reloaded = hf.load(exported, dtype=jnp.float32)
trained = Checkpointer(run / "checkpoint", read_only=True).restore()["params"]
same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), jax.device_get(trained), reloaded)
print("reloaded parameters identical to the trained ones:", all(jax.tree.leaves(same)))
assert all(jax.tree.leaves(same))

# %%
tokenizer = hf.HFTokenizer.from_folder(exported)
single = make_model(reloaded_config)
prompt = "Once upon a midnight"
prompt_ids = tokenizer.encode(prompt)[None]
count = min(40, reloaded_config.max_len - prompt_ids.shape[1])
imported = jax.device_get(placed)
for label, weights in (("imported", imported), ("fine-tuned, reloaded", reloaded)):
    out_ids = generate(single, weights, prompt_ids, count, rng=jax.random.key(0), temperature=0.7)
    print(f"--- {label} ---\n{tokenizer.decode(np.asarray(out_ids[0]))}\n")
