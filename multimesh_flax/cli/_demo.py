"""The placement demo run by ``mmflax demo``: two layers on two submeshes of a MultiMesh.

Builds a ``MultiMesh`` with axes ``("stage", "x")``, puts layer 1 on stage 0 and layer 2 on
stage 1 with logical rules ``batch -> x, model -> x``, parallelizes a training step (loss,
gradients and an SGD update), prints where every array lives with
``jax.debug.visualize_array_sharding``, and checks the step against the same step run
unparallelized under ``ignore_transforms``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm

RULES = (("batch", "x"), ("model", "x"))


def _layer1(w: jax.Array, x: jax.Array) -> jax.Array:
    x = mm.with_sharding_constraint(x, P("batch", None))
    return jnp.tanh(x @ mm.with_sharding_constraint(w, P("model", None)))


def _layer2(w: jax.Array, h: jax.Array) -> jax.Array:
    h = mm.with_sharding_constraint(h, P("batch", None))
    return h @ mm.with_sharding_constraint(w, P(None, "model"))


def _show(title: str, array: jax.Array) -> None:
    ids = sorted(d.id for d in array.devices())
    print(
        f"\n{title}: {array.dtype}{list(array.shape)} on devices {ids}, "
        f"spec {getattr(array.sharding, 'spec', None)}"
    )
    if array.ndim in (1, 2):
        jax.debug.visualize_array_sharding(array)


def run(num_devices: int) -> int:
    """Runs the demo on ``num_devices`` devices; returns a process exit status."""
    half = num_devices // 2
    multi = mm.MultiMesh(
        axis_sizes=(2, half), axis_names=("stage", "x"), devices=jax.devices()[:num_devices]
    )
    layer1 = mm.task(_layer1, name="layer1", mesh_slice={"stage": 0}, logical_axes=RULES)
    layer2 = mm.task(_layer2, name="layer2", mesh_slice={"stage": 1}, logical_axes=RULES)

    def loss(params, batch):
        x, y = batch
        return jnp.mean((layer2(params["w2"], layer1(params["w1"], x)) - y) ** 2)

    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    init = lambda: {
        "w1": jax.random.normal(k1, (16, 32)) / 4,  # noqa: E731
        "w2": jax.random.normal(k2, (32, 8)) / 6,
    }
    batch_fn = lambda: (jax.random.normal(k3, (4 * half, 16)), jnp.ones((4 * half, 8)))  # noqa: E731
    with multi:
        sharded_step, init_params, get_batch = mm.parallelize(
            step, init_params=init, get_input_batch=batch_fn
        )
        params, batch = init_params(), get_batch()
        print(f"{multi}: layer1 on stage 0, layer2 on stage 1, rules {RULES}\n")
        print(sharded_step.describe(params, batch))
        value, new_params = sharded_step(params, batch)
    for name in ("w1", "w2"):
        _show(f"param {name}", params[name])
    _show("input batch x", batch[0])
    _show("updated w2", new_params["w2"])
    _show("loss", value)
    with mm.ignore_transforms():
        ref_value, ref_params = step(init(), batch_fn())
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(
            jax.tree.leaves((value, new_params)),
            jax.tree.leaves((ref_value, ref_params)),
            strict=True,
        )
    )
    print(f"\nloss {float(value):.6f}; max |parallel - unparallelized| = {diff:.2e}")
    return 0 if diff < 1e-5 else 1
