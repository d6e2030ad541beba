"""Blocks on submeshes: how the reference models are cut into pipeline stages.

With ``stages=S`` (``GPT(config, stages=S)``, ``Llama(config, stages=S)``) each part of a
model runs as a task on one slice of a ``MultiMesh`` with axes ``("stage", "data", "model")``:

* the embedding stem on stage 0,
* block ``i`` of ``L`` on stage ``i * S // L`` (``S`` must divide ``L``, so every stage gets
  ``L / S`` blocks),
* the final norm and the output head on stage ``S - 1``.

Inside a stage, logical names shard over the stage's ``data`` and ``model`` axes
(`LOGICAL_RULES`): the batch over ``data``; MLP width, heads and the vocabulary over
``model``. The parameter tree does not depend on ``S`` (``stem``, ``blocks_i``, ``head``), so
a checkpoint moves between layouts unchanged.

**Tied embeddings (GPT).** The token table has exactly one copy, owned by the stem on stage
0. The head on the last stage receives it as an input each step; its gradient flows back to
stage 0 and is added to the stem's own gradient before the one update, so input and output
embeddings stay exactly tied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import linen as nn

import multimesh_flax as mm
from multimesh_flax import errors

STAGE_AXES = ("stage", "data", "model")
"""Axis names of the global mesh a pipelined model runs on."""

LOGICAL_RULES = (
    ("batch", "data"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("vocab", "model"),
)
"""How the models' logical names map onto a stage's ``data`` and ``model`` axes."""


def check_stages(num_layers: int, stages: int) -> None:
    """Raises unless ``stages`` splits ``num_layers`` blocks evenly.

    Raises:
        InvalidTaskError: ``stages`` is not a positive divisor of ``num_layers``.
    """
    if not isinstance(stages, int) or stages < 1 or num_layers % stages:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise errors.InvalidTaskError(
            f"Expected a stage count that divides the {num_layers} blocks evenly (one of "
            f"{divisors}), got {stages!r}. Pick one of those or change `num_layers`."
        )


def stage_of_block(index: int, num_layers: int, stages: int) -> int:
    """The stage of block ``index``: ``index * stages // num_layers``.

    Example:
        >>> [stage_of_block(i, 4, 2) for i in range(4)]
        [0, 0, 1, 1]
    """
    return index * stages // num_layers


def make_multimesh(
    stages: int, data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None
) -> mm.MultiMesh:
    """A ``MultiMesh`` of shape ``(stages, data, model)`` over ``devices`` (default: all).

    Raises:
        MeshShapeError: the product of the sizes is not the number of devices.

    Example:
        >>> make_multimesh(2, 2, 2).shape
        OrderedDict([('stage', 2), ('data', 2), ('model', 2)])
    """
    pool = list(jax.devices() if devices is None else devices)
    if stages * data * model != len(pool):
        raise errors.MeshShapeError(
            f"Expected stages x data x model = {len(pool)} (the devices available), got "
            f"{stages} x {data} x {model} = {math.prod((stages, data, model))}. Change the "
            "sizes so that their product is the device count."
        )
    grid = np.array(pool, dtype=object).reshape(stages, data, model)
    return mm.MultiMesh(devices=grid, axis_sizes=(stages, data, model), axis_names=STAGE_AXES)


def on_stage(module: type[nn.Module], stage: int, stages: int | None) -> type[nn.Module]:
    """``module`` as a task on ``stage`` of the current ``MultiMesh``, or as is if unstaged."""
    if stages is None:
        return module
    return mm.layers.task(module, mesh_slice={"stage": stage}, logical_axes=LOGICAL_RULES)
