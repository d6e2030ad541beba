"""The SPMD pipeline a JAX user would write instead of ``parallelize_step`` (benchmark B7).

One ``jax.jit`` training step of ``GPT(config)`` on a ``(stage, data)`` ``Mesh`` of the 8
devices (both axes ``AxisType.Auto``; ``(stage, data, replica)`` where a microbatch does not
split over a stage's devices -- batch 32 at m = 16 on 4 devices a stage -- with ``data``
as ``_common.stage_layout`` picks it for ours and the pipeline repeated on each
``replica``, as the weights are):

* the embedding stem and the tied head run outside the pipeline on all devices, the batch
  split over all the mesh's axes together and their parameters replicated;
* the ``L`` blocks' parameters are stacked into one tree whose leaves are ``[S, L/S, ...]``,
  sharded on ``stage`` (replicated over ``data``), see :func:`stack_params`;
* a ``shard_map`` over both axes runs the GPipe loop (:func:`_stage_loop`): ``m + S - 1``
  ticks of a ``lax.scan``; at each tick every stage applies its ``L/S`` blocks (the real
  ``models.GPTBlock`` through ``.apply``, parameters sliced per layer) to its current
  activation, then ``lax.ppermute`` shifts the results one stage on. Stage 0 reads
  microbatch ``t`` at tick ``t``; the last stage's results from tick ``S - 1`` on are the
  outputs. Idle stages in the fill and drain ticks compute on stale values that nobody reads
  (the bubble costs arithmetic, as in every SPMD pipeline). Microbatch ``k`` is rows
  ``k, k + m, k + 2m, ...`` of the batch, so every device's contiguous share of the batch
  holds a part of every microbatch and the split moves no data (contiguous microbatches
  made XLA replicate the activations to reshard them); the loss, a mean over all tokens,
  does not depend on the split;
* ``jax.value_and_grad`` differentiates through it all (the ``ppermute`` transposes to the
  reverse shift, the blocks' gradients are summed over ``data`` by ``shard_map``), then the
  same ``optax`` update as every other benchmark step.

:func:`build_peer` returns a :class:`PeerRunner`; :func:`make_loss` and
:func:`make_train_step` are the bare functions (tests compare them with the unpipelined
model).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _common
from models import GPT, GPTBlock, GPTEmbed, GPTHead, cross_entropy_loss


def make_mesh(stages: int, devices: int = _common.DEVICES, data: int | None = None) -> Mesh:
    """The ``(stage, data)`` mesh of the first ``devices`` devices; with ``data`` smaller
    than a stage's ``devices / stages`` (a microbatch too small to split over all of them),
    ``(stage, data, replica)``: the pipeline computes the same on each ``replica``."""
    per_stage = devices // stages
    data = per_stage if data is None else data
    grid = np.array(jax.devices()[:devices])
    if data == per_stage:
        names: tuple[str, ...] = ("stage", "data")
        grid = grid.reshape(stages, data)
    else:
        names = ("stage", "data", "replica")
        grid = grid.reshape(stages, data, per_stage // data)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def stack_params(params: dict[str, Any], stages: int) -> dict[str, Any]:
    """``GPT(config)`` parameters (``stem``, ``blocks_0`` ... ``blocks_{L-1}``, ``head``) in
    the peer's layout: ``stem``, ``head`` and ``blocks`` with leaves ``[S, L/S, ...]``
    (block ``i`` at ``[i // (L/S), i % (L/S)]``, the models' own stage assignment)."""
    layers = sum(k.startswith("blocks_") for k in params)
    blocks = [params[f"blocks_{i}"] for i in range(layers)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    per_stage = layers // stages
    stacked = jax.tree.map(lambda x: x.reshape(stages, per_stage, *x.shape[1:]), stacked)
    return {"stem": params["stem"], "blocks": stacked, "head": params["head"]}


def unstack_params(stacked: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`stack_params`: back to ``GPT(config)``'s tree."""
    leaf = jax.tree_util.tree_leaves(stacked["blocks"])[0]
    stages, per_stage = leaf.shape[:2]
    out = {"stem": stacked["stem"]}
    for i in range(stages * per_stage):
        s, j = divmod(i, per_stage)
        out[f"blocks_{i}"] = jax.tree.map(lambda x, s=s, j=j: x[s, j], stacked["blocks"])
    out["head"] = stacked["head"]
    return out


def _apply_stage(block: nn.Module, layers: Any, x: jax.Array) -> jax.Array:
    """This stage's ``L/S`` blocks, one after the other (``layers`` leaves ``[L/S, ...]``)."""
    per_stage = jax.tree_util.tree_leaves(layers)[0].shape[0]
    for j in range(per_stage):
        x = block.apply({"params": jax.tree.map(lambda p, j=j: p[j], layers)}, x)
    return x


def _stage_loop(block: nn.Module, stages: int, blocks: Any, xs: jax.Array) -> jax.Array:
    """The ``shard_map`` body: one stage's GPipe loop over ``m + S - 1`` ticks.

    Args:
        block: The block module (``GPTBlock(config)``).
        stages: ``S``.
        blocks: This stage's parameters, leaves ``[1, L/S, ...]``.
        xs: Every microbatch's embedded input (this ``data`` shard), ``[m, mb, T, E]``.

    Returns:
        ``[1, m, mb, T, E]``: what this stage produced from tick ``S - 1`` on (the model's
        output on the last stage, unread elsewhere).
    """
    layers = jax.tree.map(lambda p: p[0], blocks)
    stage = jax.lax.axis_index("stage")
    shift = [(i, i + 1) for i in range(stages - 1)]  # stage 0 receives zeros, reads xs
    feeds = jnp.concatenate([xs, jnp.zeros((stages - 1, *xs.shape[1:]), xs.dtype)])

    def tick(carry: jax.Array, feed: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = _apply_stage(block, layers, jnp.where(stage == 0, feed, carry))
        return jax.lax.ppermute(y, "stage", shift), y

    start = jax.lax.pcast(jnp.zeros_like(xs[0]), "stage", to="varying")
    _, ys = jax.lax.scan(tick, start, feeds)
    return ys[stages - 1 :][None]


def make_loss(config: Any, mesh: Mesh, microbatches: int) -> Any:
    """``loss(params, batch)`` of the stacked layout: stem, pipelined blocks, tied head."""
    stages = mesh.shape["stage"]
    stem, block, head = GPTEmbed(config), GPTBlock(config), GPTHead(config)
    pipeline = jax.shard_map(
        functools.partial(_stage_loop, block, stages),
        mesh=mesh,
        in_specs=(P("stage"), P(None, "data")),
        out_specs=P("stage", None, "data"),
    )

    def loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        x = stem.apply({"params": params["stem"]}, batch["inputs"])
        xs = x.reshape(-1, microbatches, *x.shape[1:]).swapaxes(0, 1)  # strided microbatches
        y = pipeline(params["blocks"], xs)[stages - 1].swapaxes(0, 1).reshape(x.shape)
        table = params["stem"]["embed"]["embedding"]
        logits = head.apply({"params": params["head"]}, y, table)
        return cross_entropy_loss(logits, batch["targets"])

    return loss


def make_train_step(config: Any, optimizer: Any, mesh: Mesh, microbatches: int) -> Any:
    """``train(state, batch) -> (loss, state)`` with ``state = (stacked params, opt state)``."""
    loss = make_loss(config, mesh, microbatches)

    def train(state: Any, batch: Any) -> tuple[Any, Any]:
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, (optax.apply_updates(params, updates), opt_state)

    return train


def state_shardings(params: Any, opt_state: Any, mesh: Mesh) -> tuple[Any, Any]:
    """Blocks on ``stage`` (replicated over ``data``), stem and head replicated; optimizer
    leaves shaped like a parameter follow it."""
    param_sh = {
        "stem": jax.tree.map(lambda _: NamedSharding(mesh, P()), params["stem"]),
        "blocks": jax.tree.map(lambda _: NamedSharding(mesh, P("stage")), params["blocks"]),
        "head": jax.tree.map(lambda _: NamedSharding(mesh, P()), params["head"]),
    }
    return param_sh, _common._mirror_shardings(opt_state, params, param_sh, mesh)


def init_state(workload: _common.Workload, stages: int) -> tuple[Any, Any]:
    """``GPT(config).init`` with key 0 (what ``build_jit`` starts from), stacked, and its
    optimizer state."""
    model = GPT(workload.config())
    inputs = jnp.zeros((workload.batch, workload.length), jnp.int32)  # values unused
    params = stack_params(nn.unbox(model.init(jax.random.key(0), inputs))["params"], stages)
    return params, workload.make_optimizer().init(params)


def peer_name(workload: _common.Workload, stages: int, m: int) -> str:
    return f"{workload.name} S={stages} m={m} SPMD peer"


def build_peer(workload: _common.Workload, stages: int, m: int) -> _common.Runner:
    """The compiled-on-first-call peer step on the 8 devices, its state and batch placed."""
    mesh = make_mesh(stages, data=_common.stage_layout(workload, stages, m)[0])
    init = functools.partial(init_state, workload, stages)
    state_sh = state_shardings(*jax.eval_shape(init), mesh)
    state = jax.jit(init, out_shardings=state_sh)()  # one program, born sharded
    batch_sh = NamedSharding(mesh, P(mesh.axis_names))  # over all 8 devices
    batch = jax.device_put(workload.batch_data(), batch_sh)
    step = jax.jit(
        make_train_step(workload.config(), workload.make_optimizer(), mesh, m),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(NamedSharding(mesh, P()), state_sh),
        donate_argnums=(0,),
    )
    return PeerRunner(peer_name(workload, stages, m), step, state, batch)


class PeerRunner(_common.Runner):
    """The peer's step; ``jitted`` is its ``jax.jit`` function (for ``memory_analysis``)."""

    def __init__(self, name: str, jitted: Any, state: Any, batch: Any) -> None:
        super().__init__(name, jitted, state, batch)
        self.jitted = jitted
