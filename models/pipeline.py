"""Blocks on submeshes: how the reference models are cut into pipeline stages.

With ``stages=S`` (``GPT(config, stages=S)``, ``Llama(config, stages=S)``) or
``layers_per_stage=(n_0, ..., n_{S-1})`` each part of a model runs as a task on one slice of
a ``MultiMesh`` with axes ``("stage", "data", "model")``:

* the embedding stem on stage 0,
* the blocks in order, ``n_s`` of them on stage ``s``: with ``stages=S`` an even split
  (``S`` must divide ``L``, so every stage gets ``L / S`` blocks and block ``i`` goes to
  stage ``i * S // L``); with ``layers_per_stage`` any split that adds up to ``L``, where
  the first and the last stage may hold no block (they hold the stem and the head),
* the final norm and the output head on stage ``S - 1``.

`get_layers_per_stage` checks the two arguments and returns the split; `block_stages` maps
it to the stage of every block. Inside a stage, logical names shard over the stage's
``data`` and ``model`` axes (`LOGICAL_RULES`): the batch over ``data``; MLP width, heads and
the vocabulary over ``model``. The parameter tree does not depend on the split (``stem``,
``blocks_i``, ``head``), so a checkpoint moves between layouts, even or uneven, unchanged.

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
    if not _is_count(stages) or stages < 1 or num_layers % stages:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise errors.InvalidTaskError(
            f"Expected a stage count that divides the {num_layers} blocks evenly (one of "
            f"{divisors}), got {stages!r}. Pick one of those, change `num_layers`, or give "
            "the blocks of every stage with `layers_per_stage` for an uneven split."
        )


def get_layers_per_stage(
    num_layers: int,
    stages: int | None = None,
    layers_per_stage: Sequence[int] | None = None,
) -> tuple[int, ...] | None:
    """The number of blocks on each pipeline stage, from ``stages`` or ``layers_per_stage``.

    The two are alternatives: ``stages=S`` splits the blocks evenly, ``layers_per_stage``
    gives every stage's count (its length is the stage count; passing ``stages`` too is
    allowed when it agrees). The stem goes with the first stage and the head with the last,
    so those two may hold no block; a stage between them may not.

    Args:
        num_layers: The model's blocks (``config.num_layers``).
        stages: A stage count that divides ``num_layers``, or ``None``.
        layers_per_stage: Blocks per stage, in order, or ``None``.

    Returns:
        One count per stage, or ``None`` when both arguments are ``None`` (unstaged).

    Raises:
        InvalidTaskError: ``stages`` does not divide ``num_layers``; ``layers_per_stage`` is
            not a sequence of ints, has a negative count, does not add up to
            ``num_layers``, leaves a middle stage without blocks, or has another length
            than ``stages``.

    Example:
        >>> get_layers_per_stage(8, stages=4)
        (2, 2, 2, 2)
        >>> get_layers_per_stage(8, layers_per_stage=[1, 3, 3, 1])
        (1, 3, 3, 1)
        >>> get_layers_per_stage(4, layers_per_stage=(0, 4))  # stage 0: the stem alone
        (0, 4)
        >>> get_layers_per_stage(4) is None
        True
        >>> get_layers_per_stage(4, layers_per_stage=(2, 0, 2))
        Traceback (most recent call last):
        ...
        multimesh_flax.errors.InvalidTaskError: Expected every stage between the first and ...
    """
    if layers_per_stage is None:
        if stages is None:
            return None
        check_stages(num_layers, stages)
        return (num_layers // int(stages),) * int(stages)
    split = _as_split(layers_per_stage)
    _check_split(num_layers, split)
    if stages is not None and stages != len(split):
        raise errors.InvalidTaskError(
            f"`stages`={stages!r} and `layers_per_stage`={split} ({len(split)} stages) "
            "disagree. Pass `layers_per_stage` alone (its length is the stage count), or "
            "`stages` alone for an even split."
        )
    return split


def _is_count(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _as_split(layers_per_stage: object) -> tuple[int, ...]:
    """``layers_per_stage`` as a tuple of Python ints, or an error saying what it must be."""
    if isinstance(layers_per_stage, Sequence) and not isinstance(layers_per_stage, str):
        counts = tuple(layers_per_stage)
        if counts and all(_is_count(n) for n in counts):
            return tuple(int(n) for n in counts)
    raise errors.InvalidTaskError(
        "Expected `layers_per_stage` to be a non-empty sequence of block counts, one int "
        f"per pipeline stage (e.g. (1, 3, 3, 1)), got {layers_per_stage!r}. For an even "
        "split pass `stages=S` instead."
    )


def _check_split(num_layers: int, split: tuple[int, ...]) -> None:
    negative = [n for n in split if n < 0]
    if negative:
        raise errors.InvalidTaskError(
            f"Expected every count in `layers_per_stage` to be >= 0, got {split} (with "
            f"{negative[0]}). Give each stage the number of blocks it holds."
        )
    if sum(split) != num_layers:
        raise errors.InvalidTaskError(
            f"Expected `layers_per_stage` to add up to the model's {num_layers} blocks "
            f"(`num_layers`), got {split}, which adds up to {sum(split)}. Change the counts "
            "so every block has a stage, or change `num_layers`."
        )
    empty = [s for s, n in enumerate(split[1:-1], start=1) if n == 0]
    if empty:
        kept = tuple(n for s, n in enumerate(split) if s not in empty)
        raise errors.InvalidTaskError(
            "Expected every stage between the first and the last to hold at least one "
            "block (only the first, which holds the stem, and the last, which holds the "
            f"head, may hold none), got {split}: stage {empty[0]} would run nothing. Drop "
            f"the empty stage, e.g. {kept}, or move a block onto it."
        )


def block_stages(layers_per_stage: Sequence[int]) -> tuple[int, ...]:
    """The stage of every block, in order, for a split from `get_layers_per_stage`.

    Example:
        >>> block_stages((1, 3, 3, 1))
        (0, 1, 1, 1, 2, 2, 2, 3)
        >>> block_stages((0, 2, 1))
        (1, 1, 2)
    """
    return tuple(s for s, count in enumerate(layers_per_stage) for _ in range(count))


def stage_of_block(index: int, num_layers: int, stages: int) -> int:
    """The stage of block ``index`` in an even split: ``index * stages // num_layers``.

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
        >>> dict(make_multimesh(2, 2, 2).shape)
        {'stage': 2, 'data': 2, 'model': 2}
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


def check_stage_submeshes(
    stage_submeshes: Sequence[int], split: Sequence[int] | None
) -> tuple[int, ...]:
    """``stage_submeshes`` as a tuple, checked to give one index >= 0 per stage of ``split``.

    Raises:
        InvalidTaskError: the model is not staged, or the count or an index is wrong.

    Example:
        >>> check_stage_submeshes([0, 1, 1, 0], (1, 1, 1, 1))
        (0, 1, 1, 0)
    """
    counts = tuple(stage_submeshes) if isinstance(stage_submeshes, Sequence) else ()
    good = split is not None and len(counts) == len(split)
    if not good or not all(_is_count(i) and i >= 0 for i in counts):
        stages = "an unstaged model" if split is None else f"{len(split)} stages"
        raise errors.InvalidTaskError(
            f"Expected `stage_submeshes` to give one index on the MultiMesh's `stage` axis "
            f"per stage, got {stage_submeshes!r} for {stages}. Pass e.g. "
            f"{tuple(range(len(split or ())))}, and `stages` or `layers_per_stage`."
        )
    return tuple(int(i) for i in counts)


def on_stage(module: type[nn.Module], stage: int, staged: bool) -> type[nn.Module]:
    """``module`` as a task on ``stage`` of the current ``MultiMesh``, or as is if not staged."""
    if not staged:
        return module
    return mm.layers.task(module, mesh_slice={"stage": stage}, logical_axes=LOGICAL_RULES)
