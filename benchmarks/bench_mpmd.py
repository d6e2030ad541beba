"""MPMD runtime overhead against plain ``jax.jit``, measured in one run.

A training step of two small transformer blocks (attention + MLP, SGD update):

* ``mpmd``: block 0 on devices 0-3, block 1 on devices 4-7 (each data-parallel over its
  4 devices), compiled with ``multimesh_flax.jit``;
* ``jit``: the same step under plain ``jax.jit``, data-parallel over all 8 devices.

Reported (JSON on stdout and in ``benchmarks/results/mpmd.json``):

* ``step_ratio`` -- median step time of ``mpmd`` / median of ``jit``;
* ``dispatch_us_per_fragment`` -- wall time of an MPMD call that only dispatches (tiny
  model), divided by its number of fragments;
* ``compile_ratio`` -- cold first-call time (trace + compile) of ``mpmd`` / ``jit``;
* ``compiles_after_step_1`` -- XLA compilations during steps 2..N (must be 0).

Run: ``.venv/bin/python benchmarks/bench_mpmd.py [--steps 50] [--embed 256]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh_flax as mm  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import replay  # noqa: E402

RULES = (("batch", "data"),)


def block(params: dict, x: jax.Array) -> jax.Array:
    """A pre-norm transformer block (single-head attention + MLP) on ``[batch, len, embed]``."""
    x = mm.with_sharding_constraint(x, P("batch", None, None))
    h = x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6)
    q, k, v = (h @ params[n] for n in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    attn = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    x = x + jnp.einsum("bqk,bkd->bqd", attn, v) @ params["wo"]
    h = x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6)
    return x + jax.nn.gelu(h @ params["w1"]) @ params["w2"]


def init_block(key: jax.Array, embed: int) -> dict:
    names = {
        "wq": (embed, embed),
        "wk": (embed, embed),
        "wv": (embed, embed),
        "wo": (embed, embed),
        "w1": (embed, 4 * embed),
        "w2": (4 * embed, embed),
    }
    keys = jax.random.split(key, len(names))
    return {
        n: jax.random.normal(k, s) / jnp.sqrt(s[0])
        for k, (n, s) in zip(keys, names.items(), strict=True)
    }


def make_step(blocks):
    def loss(params, batch):
        x, y = batch
        for blk, p in zip(blocks, params, strict=True):
            x = blk(p, x)
        return jnp.mean((x - y) ** 2)

    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return value, jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads)

    return step


def mpmd_blocks():
    stage = mm.TaskMesh(devices=[0, 1, 2, 3], axis_names=("data",))
    return [
        mm.task(block, name="block0", mesh=stage, logical_axes=RULES),
        mm.task(block, name="block1", mesh=stage.place([4, 5, 6, 7]), logical_axes=RULES),
    ]


def _placed(mpmd, params, batch):
    """Arguments already in the shardings the program wants (as ``parallelize`` makes them)."""
    exe = mpmd.executable(params, batch)
    leaves, tree = jax.tree.flatten((params, batch))
    return jax.tree.unflatten(tree, jax.device_put(leaves, exe.input_shardings))


def _median_step(fn, params, batch, steps):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(params, batch))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cold(fn, params, batch):
    start = time.perf_counter()
    jax.block_until_ready(fn(params, batch))
    return time.perf_counter() - start


class _CompileCounter(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record):
        self.count += "Compiling" in record.getMessage()


def _inputs(embed, batch_size, length):
    k = jax.random.split(jax.random.key(0), 4)
    params = [init_block(k[0], embed), init_block(k[1], embed)]
    batch = (
        jax.random.normal(k[2], (batch_size, length, embed)),
        jax.random.normal(k[3], (batch_size, length, embed)),
    )
    return params, batch


def measure(embed: int, batch_size: int, length: int, steps: int) -> dict:
    params, batch = _inputs(embed, batch_size, length)
    mesh8 = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    replicated, data = NamedSharding(mesh8, P()), NamedSharding(mesh8, P("data"))
    base_step = make_step([block, block])
    baseline = jax.jit(lambda p, b: base_step(p, b), in_shardings=(replicated, data))
    jit_params = jax.device_put(params, replicated)
    jit_batch = jax.device_put(batch, data)
    mpmd = mm.jit(make_step(mpmd_blocks()))
    with mm.ignore_transforms():  # the baseline traces the same code as plain JAX
        cold_jit = _cold(baseline, jit_params, jit_batch)
    cold_mpmd = _cold(mpmd, params, batch)
    exe = mpmd.executable(params, batch)
    params, batch = _placed(mpmd, params, batch)
    counter = _CompileCounter()
    logging.getLogger("jax").addHandler(counter)
    logging.getLogger("jax").setLevel(logging.DEBUG)
    with jax.log_compiles(True):
        t_mpmd = _median_step(mpmd, params, batch, steps)
    logging.getLogger("jax").removeHandler(counter)
    t_jit = _median_step(baseline, jit_params, jit_batch, steps)
    return {
        "embed": embed,
        "batch": batch_size,
        "length": length,
        "steps": steps,
        "mpmd_step_ms": 1e3 * t_mpmd,
        "jit_step_ms": 1e3 * t_jit,
        "step_ratio": t_mpmd / t_jit,
        "cold_mpmd_s": cold_mpmd,
        "cold_jit_s": cold_jit,
        "compile_ratio": cold_mpmd / cold_jit,
        "compiles_after_step_1": counter.count,
        "fragments": sum(op.kind == 0 for op in exe.ops),
        "transfers": sum(op.kind == 1 for op in exe.ops),
    }


def _median_call(fn, steps):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dispatch_overhead(steps: int) -> dict:
    """Per-fragment cost of our runtime on a model so small that compute is negligible.

    ``runtime_us_per_fragment`` is (a full call) - (replaying the same jitted fragments and
    transfers by hand), per fragment: what the runtime adds on top of JAX's own dispatch.
    ``call_us_per_fragment`` is the whole call time per fragment, JAX's dispatch included.
    """
    params, batch = _inputs(8, 8, 4)
    mpmd = mm.jit(make_step(mpmd_blocks()))
    jax.block_until_ready(mpmd(params, batch))
    exe = mpmd.executable(params, batch)
    params, batch = _placed(mpmd, params, batch)
    leaves = jax.tree.leaves((params, batch))
    fragments = sum(op.kind == 0 for op in exe.ops)
    t_call = _median_call(lambda: mpmd(params, batch), steps)
    t_replay = _median_call(lambda: replay(exe, leaves), steps)
    return {
        "call_us_per_fragment": 1e6 * t_call / fragments,
        "replay_us_per_fragment": 1e6 * t_replay / fragments,
        "runtime_us_per_fragment": 1e6 * (t_call - t_replay) / fragments,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "mpmd.json"))
    args = parser.parse_args()
    result = {
        "jax": jax.__version__,
        "devices": len(jax.devices()),
        **measure(args.embed, args.batch, args.length, args.steps),
        **dispatch_overhead(max(args.steps, 50)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
