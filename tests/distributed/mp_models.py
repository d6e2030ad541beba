"""Programs the multi-process tests run in every process and, for the reference, in one.

The two-submesh MLP of the README ("Logical sharding inside a task"): ``layer1`` on devices
0-3, ``layer2`` on devices 4-7 (``second=4``), on devices 4-5 with another mesh shape
(``second=2``: transfers between submeshes of different sizes), or on devices 2-5
(``second=-4``: a submesh spanning both processes, overlapping the first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm

RULES = (("batch", "x"), ("model", "x"))
STEPS = 3


def layer1(w, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    return jnp.tanh(x @ mm.with_sharding_constraint(w, P("model", None)))


def layer2(w, h):
    h = mm.with_sharding_constraint(h, P("batch", None))
    return h @ mm.with_sharding_constraint(w, P(None, "model"))


def make_step(second: int, hidden: int = 16):
    stage0 = mm.TaskMesh(devices=[0, 1, 2, 3], axis_sizes=(4, 1), axis_names=("x", "y"))
    if second == 4:
        stage1 = stage0.place([4, 5, 6, 7])
    elif second == -4:  # spans both processes and overlaps the first stage
        stage1 = stage0.place([2, 3, 4, 5])
    else:
        stage1 = mm.TaskMesh(devices=[4, 5], axis_sizes=(2, 1), axis_names=("x", "y"))
    l1 = mm.task(layer1, mesh=stage0, logical_axes=RULES)
    l2 = mm.task(layer2, mesh=stage1, logical_axes=RULES)

    def step(params, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(l2(p[1], l1(p[0], x)) ** 2))(params)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    def init():
        k1, k2 = jax.random.split(jax.random.key(0))
        return (
            jax.random.normal(k1, (16, hidden)) * 0.3,
            jax.random.normal(k2, (hidden, 8)) * 0.3,
        )

    return step, init


def batch() -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.key(1), (8, 16)))


def chunks_read() -> int:
    """How many array chunks tensorstore (under orbax) has read in this process so far."""
    import tensorstore as ts

    metrics = ts.experimental_collect_matching_metrics("/tensorstore/cache/chunk_cache/reads")
    return sum(v["value"] for m in metrics for v in m["values"])  # none before the first read


def run_parallel(
    second: int, hidden: int = 16, checkpoints: tuple[str, str] | None = None
) -> dict[str, np.ndarray]:
    """``STEPS`` steps through ``mm.parallelize``; losses and final parameters as numpy.

    With ``checkpoints=(read, write)``: also restores ``read`` (``{"p0", "p1"}``) onto the
    parameters' shardings (``ckpt/*`` in the result; ``ckpt/shards_read``: how many shards of
    each this process holds after restoring, ``ckpt/chunks_read``: how many stored chunks it
    read, ``ckpt/untargeted_refused``: whether ``restore()`` without a target raised) and
    saves the final parameters to ``write``.
    """
    from multimesh_flax import errors
    from multimesh_flax.checkpoint import Checkpointer
    from multimesh_flax.distributed import host_values

    step, init = make_step(second, hidden)
    x = batch()
    sharded_step, init_params = mm.parallelize(step, init_params=init, initial_batch=x)
    params = init_params()
    out = {}
    if checkpoints is not None:
        target = {"p0": params[0], "p1": params[1]}
        chunks_before = chunks_read()
        restored = Checkpointer(checkpoints[0], read_only=True).restore(target=target)
        out["ckpt/chunks_read"] = np.array(chunks_read() - chunks_before)
        same = [restored[k].sharding == target[k].sharding for k in ("p0", "p1")]
        read_here = [len(restored[k].addressable_shards) for k in ("p0", "p1")]
        out.update({f"ckpt/{k}": v for k, v in host_values(restored).items()})
        out["ckpt/same_shardings"] = np.array(same)
        out["ckpt/shards_read"] = np.array(read_here)
        try:  # no target: refused in a multi-process job, before any collective
            Checkpointer(checkpoints[0], read_only=True).restore()
            out["ckpt/untargeted_refused"] = np.array(False)
        except errors.CheckpointArgumentError:
            out["ckpt/untargeted_refused"] = np.array(True)
    losses = []
    for _ in range(STEPS):
        loss, params = sharded_step(params, x)
        losses.append(host_values(loss))
    if checkpoints is not None:
        with Checkpointer(checkpoints[1]) as ckpt:
            ckpt.save(STEPS, {"p0": params[0], "p1": params[1]})
    p0, p1 = host_values(params)
    return {**out, "losses": np.stack(losses), "p0": p0, "p1": p1}


def run_reference(second: int) -> dict[str, np.ndarray]:
    """The same steps unparallelized: plain ``jax.jit`` on one device."""
    step, init = make_step(second)
    x = jax.device_put(batch(), jax.devices()[0])
    with mm.ignore_transforms():
        jitted = jax.jit(step)
        params = jax.jit(init)()
        losses = []
        for _ in range(STEPS):
            loss, params = jitted(params, x)
            losses.append(np.asarray(loss))
    return {"losses": np.stack(losses), "p0": np.asarray(params[0]), "p1": np.asarray(params[1])}
