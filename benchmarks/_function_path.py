"""B7's function-path workload: a residual-MLP stack pipelined through ``mm.jit`` +
``mm.microbatch``, and the SPMD pipeline a JAX user writes for it by hand.

The model (:class:`FnWorkload`, by default 8 layers of width 256 on 1,024 tokens) is a
stack of residual layers ``x + tanh(x @ w1) @ w2`` (:func:`layer`), a mean squared error
against targets at the end, trained by plain SGD. Both sides run the same :func:`layer`:

* **ours** (:func:`make_ours_step`), written as a new user would from the README: one
  ``mm.task`` per stage on its own ``TaskMesh`` of ``8 / S`` devices (one ``data`` axis, the
  batch sharded over it by a logical constraint, the weights replicated), the loss outside
  the tasks, ``jax.value_and_grad`` of ``mm.microbatch(loss, ..., schedule=...)``, the SGD
  update, all under ``mm.jit`` with the parameters donated;
* **the peer** (:func:`make_peer_step`): one ``jax.jit`` step on a ``(stage, data)`` mesh of
  the 8 devices, the layers' weights stacked ``[S, L/S, ...]`` on ``stage``, a ``shard_map``
  whose body runs the GPipe loop unrolled in Python (``m + S - 1`` ticks, each stage
  applying its layers, then ``lax.ppermute`` one stage on), autodiff through it all.

:func:`build_ours` and :func:`build_peer` return runners (``_common.MpmdRunner`` and
``_common.Runner``) for B7; :func:`make_ours_value_and_grad`, :func:`make_peer_loss` and
:func:`reference_loss` are the bare functions the tests compare.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from benchmarks import _common

Params = list[dict[str, jax.Array]]  # one {"w1", "w2"} per layer


@dataclasses.dataclass(frozen=True)
class FnWorkload:
    """The residual-MLP stack: ``layers`` layers of ``width``, ``tokens`` rows a step."""

    layers: int = 8
    width: int = 256
    tokens: int = 1024
    learning_rate: float = 0.01

    name = "residual-MLP"

    def describe(self) -> dict[str, Any]:
        return {
            "model": "residual MLP, x + tanh(x @ w1) @ w2 per layer, MSE, SGD",
            "layers": self.layers,
            "width": self.width,
            "tokens": self.tokens,
            "params": 2 * self.layers * self.width**2,
        }


FN = FnWorkload()


# --- the model, shared by both sides --------------------------------------------------------


def layer(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One residual MLP layer."""
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def apply_layers(layers: Params, x: jax.Array) -> jax.Array:
    for p in layers:
        x = layer(p, x)
    return x


def mse(y: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((y - target) ** 2)


def init_params(workload: FnWorkload, seed: int = 0) -> Params:
    keys = jax.random.split(jax.random.key(seed), 2 * workload.layers)
    scale = workload.width**-0.5
    shape = (workload.width, workload.width)
    return [
        {
            "w1": scale * jax.random.normal(keys[2 * i], shape),
            "w2": scale * jax.random.normal(keys[2 * i + 1], shape),
        }
        for i in range(workload.layers)
    ]


def batch_data(workload: FnWorkload, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    """``(inputs, targets)``, each ``[tokens, width]``."""
    kx, ky = jax.random.split(jax.random.key(seed))
    shape = (workload.tokens, workload.width)
    return jax.random.normal(kx, shape), jax.random.normal(ky, shape)


def reference_loss(params: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """The unpipelined loss of the whole batch."""
    x, y = batch
    return mse(apply_layers(params, x), y)


def sgd(params: Any, grads: Any, learning_rate: float) -> Any:
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)


def _check(workload: FnWorkload, stages: int, m: int) -> None:
    per_stage = _common.DEVICES // stages
    if workload.layers % stages or workload.tokens % m or (workload.tokens // m) % per_stage:
        raise ValueError(
            f"Expected {workload.layers} layers to split over {stages} stages and "
            f"{workload.tokens} tokens into {m} microbatches that split over {per_stage} "
            "devices; choose stages and microbatches that divide them."
        )


# --- ours: mm.task per stage, mm.microbatch, mm.jit -----------------------------------------

RULES = (("batch", "data"),)  # the stage's logical rules: the batch over its devices


def _stage_body(layers: Params, x: jax.Array) -> jax.Array:
    x = mm.with_sharding_constraint(x, P("batch", None))
    return apply_layers(layers, x)


def stage_tasks(stages: int, devices: int = _common.DEVICES) -> list[Any]:
    """One task per stage, stage ``s`` on devices ``s * d .. (s + 1) * d - 1`` (``d = 8 /
    S``), data parallel over them."""
    d = devices // stages
    return [
        mm.task(
            _stage_body,
            name=f"stage{s}",
            mesh=mm.TaskMesh(
                devices=list(range(s * d, (s + 1) * d)), axis_sizes=(d,), axis_names=("data",)
            ),
            logical_axes=RULES,
        )
        for s in range(stages)
    ]


def make_ours_loss(workload: FnWorkload, stages: int) -> Any:
    """``loss(params, batch)``: the stages' tasks in order, the loss outside them."""
    tasks, per_stage = stage_tasks(stages), workload.layers // stages

    def loss(params: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        for s, task in enumerate(tasks):
            x = task(params[s * per_stage : (s + 1) * per_stage], x)
        return mse(x, y)

    return loss


def make_ours_value_and_grad(workload: FnWorkload, stages: int, m: int, schedule: str) -> Any:
    """``(params, batch) -> (loss, grads)``: ``value_and_grad`` of the microbatched loss
    (averaged over the ``m`` microbatches: the whole batch's loss)."""
    _check(workload, stages, m)
    return jax.value_and_grad(
        mm.microbatch(
            make_ours_loss(workload, stages),
            0,
            workload.tokens // m,
            argnum=1,
            schedule=schedule,
            num_stages=stages,
            reduce="mean",
        )
    )


def make_ours_step(workload: FnWorkload, stages: int, m: int, schedule: str) -> Any:
    """The training step, ``mm.jit`` of value and grad and the SGD update, params donated."""
    value_and_grad = make_ours_value_and_grad(workload, stages, m, schedule)

    def step(params: Params, batch: Any) -> tuple[jax.Array, Params]:
        value, grads = value_and_grad(params, batch)
        return value, sgd(params, grads, workload.learning_rate)

    return mm.jit(step, donate_argnums=0)


def ours_name(stages: int, m: int, schedule: str) -> str:
    return f"{FN.name} S={stages} m={m} {schedule} mm.jit"


def build_ours(stages: int, m: int, schedule: str, workload: FnWorkload = FN) -> _common.MpmdRunner:
    """Our step, its parameters and batch on the host (the first call places them)."""
    step = make_ours_step(workload, stages, m, schedule)
    name = ours_name(stages, m, schedule)
    return _common.MpmdRunner(name, step, init_params(workload), batch_data(workload), None)


# --- the SPMD peer: stacked weights, shard_map + ppermute, the loop unrolled ----------------


def make_mesh(stages: int, devices: int = _common.DEVICES) -> Mesh:
    """The ``(stage, data)`` mesh of the first ``devices`` devices."""
    grid = np.array(jax.devices()[:devices]).reshape(stages, devices // stages)
    return Mesh(grid, ("stage", "data"), axis_types=(AxisType.Auto, AxisType.Auto))


def stack_params(params: Params, stages: int) -> dict[str, jax.Array]:
    """Per-layer weights as ``{"w1", "w2"}`` of shape ``[S, L/S, W, W]`` (layer ``i`` at
    ``[i // (L/S), i % (L/S)]``, ours' stage assignment)."""
    per_stage = len(params) // stages
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params)
    return jax.tree.map(lambda x: x.reshape(stages, per_stage, *x.shape[1:]), stacked)


def unstack_params(stacked: dict[str, jax.Array]) -> Params:
    """The inverse of :func:`stack_params`."""
    stages, per_stage = stacked["w1"].shape[:2]
    return [
        {k: v[i // per_stage, i % per_stage] for k, v in stacked.items()}
        for i in range(stages * per_stage)
    ]


def _stage_loop(stages: int, blocks: dict[str, jax.Array], xs: jax.Array) -> jax.Array:
    """The ``shard_map`` body: one stage's GPipe ticks, unrolled.

    ``blocks``: this stage's weights, ``[1, L/S, W, W]``; ``xs``: every microbatch's input
    (this ``data`` shard), ``[m, mb, W]``. Returns ``[1, m, mb, W]``: what this stage
    produced from tick ``S - 1`` on (the model's output on the last stage)."""
    per_stage = blocks["w1"].shape[1]
    layers = [{k: v[0, j] for k, v in blocks.items()} for j in range(per_stage)]
    stage = jax.lax.axis_index("stage")
    shift = [(i, i + 1) for i in range(stages - 1)]  # stage 0 receives zeros, reads xs
    m = xs.shape[0]
    carry = jax.lax.pcast(jnp.zeros_like(xs[0]), "stage", to="varying")
    outs = []
    for t in range(m + stages - 1):
        feed = xs[min(t, m - 1)]  # past the last microbatch stage 0's result is unread
        y = apply_layers(layers, jnp.where(stage == 0, feed, carry))
        if t >= stages - 1:
            outs.append(y)
        if t < m + stages - 2:
            carry = jax.lax.ppermute(y, "stage", shift)
    return jnp.stack(outs)[None]


def make_peer_loss(mesh: Mesh, m: int) -> Any:
    """``loss(stacked, batch)``: the pipelined stack and the loss. Microbatch ``k`` is rows
    ``k, k + m, ...`` (every device's contiguous share of the batch holds part of each, so
    the split moves nothing); the mean over all tokens does not depend on the split."""
    stages = mesh.shape["stage"]
    pipeline = jax.shard_map(
        functools.partial(_stage_loop, stages),
        mesh=mesh,
        in_specs=(P("stage"), P(None, "data")),
        out_specs=P("stage", None, "data"),
    )

    def loss(stacked: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        xs = x.reshape(-1, m, x.shape[-1]).swapaxes(0, 1)
        ys = y.reshape(-1, m, y.shape[-1]).swapaxes(0, 1)
        return mse(pipeline(stacked, xs)[stages - 1], ys)

    return loss


def make_peer_step(workload: FnWorkload, mesh: Mesh, m: int) -> Any:
    """The peer's ``jax.jit`` step: value and grad through the pipeline, SGD, donated."""
    _check(workload, mesh.shape["stage"], m)
    value_and_grad = jax.value_and_grad(make_peer_loss(mesh, m))
    params_sh = NamedSharding(mesh, P("stage"))
    batch_sh = NamedSharding(mesh, P("data"))

    def step(stacked: Any, batch: Any) -> tuple[jax.Array, Any]:
        value, grads = value_and_grad(stacked, batch)
        return value, sgd(stacked, grads, workload.learning_rate)

    return jax.jit(
        step,
        in_shardings=(params_sh, batch_sh),
        out_shardings=(NamedSharding(mesh, P()), params_sh),
        donate_argnums=(0,),
    )


def peer_name(stages: int, m: int) -> str:
    return f"{FN.name} S={stages} m={m} SPMD peer"


def build_peer(stages: int, m: int, workload: FnWorkload = FN) -> Any:
    """The peer's step (``PeerRunner``), its stacked weights and batch placed."""
    from benchmarks._spmd_pipeline import PeerRunner

    mesh = make_mesh(stages)
    state = jax.device_put(
        stack_params(init_params(workload), stages), NamedSharding(mesh, P("stage"))
    )
    batch = jax.device_put(batch_data(workload), NamedSharding(mesh, P("data")))
    return PeerRunner(peer_name(stages, m), make_peer_step(workload, mesh, m), state, batch)
