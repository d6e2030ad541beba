"""Held-out loss of an ``mmflax train --dataset ... --eval-fraction F`` run.

`Evaluator` runs the pipelined model forward only, on the placement the training step uses:
the same model instance under the run's ``MultiMesh``, compiled once by ``mm.jit`` on the
state's parameters where they already live (no copy, no gather). Every batch has the
training batch's shape, so every evaluation reuses that one program. The program returns
the mean cross entropy of each window; the host averages the windows that count (the last
batch is padded, see `_data.TextData.eval_batches`), so the result is the mean over
held-out windows of their mean per-token loss, and the perplexity is its exponential.

The run evaluates before its first step, every ``--eval-every`` steps and after its last:
``metrics.json`` keeps ``eval_history`` (``step``, ``loss``, ``perplexity``), the progress
bar shows the latest, and ``loss.png`` plots them beside the training loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import multimesh_flax as mm
from multimesh_flax.distributed import host_values

Batch = dict[str, np.ndarray]


class Evaluator:
    """Held-out loss and perplexity of parameters placed for the training step.

    Args:
        model: the pipelined model the training step was built from.
        multi: the run's ``MultiMesh``.
        batches: ``(batch, valid rows)`` pairs (`_data.TextData.eval_batches`).
    """

    def __init__(
        self, model: nn.Module, multi: mm.MultiMesh, batches: Sequence[tuple[Batch, int]]
    ) -> None:
        self.multi = multi
        self.batches = list(batches)

        def window_losses(params: Any, batch: Batch) -> jax.Array:
            logits: Any = model.apply({"params": params}, batch["inputs"])
            losses = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["targets"]
            )
            return losses.mean(axis=-1)

        self.program = mm.jit(window_losses)

    def __call__(self, params: Any) -> tuple[float, float]:
        """``(loss, perplexity)`` over the held-out windows (every process calls it)."""
        total, count = 0.0, 0
        with mm.context(strict=True), self.multi:
            for batch, valid in self.batches:
                losses = np.asarray(host_values(self.program(params, batch)))
                total += float(losses[:valid].astype(np.float64).sum())
                count += valid
        loss = total / count
        return loss, math.exp(min(loss, 700.0))  # exp overflows a float past ~709

    @property
    def programs(self) -> int:
        """Programs compiled so far: 1 after any number of evaluations."""
        return len(self.program._cache)
