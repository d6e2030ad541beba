"""A training loss over a chain of tasks, shared by the pipeline tests of the core."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp


def chain_loss(tasks: Sequence[Callable[..., Any]]) -> Callable[..., Any]:
    """``loss(params, (x, y))``: ``x`` through ``tasks[s](params[s], .)`` in order, then the
    mean squared error against ``y``."""

    def loss(params, batch):
        x, y = batch
        for layer, w in zip(tasks, params, strict=True):
            x = layer(w, x)
        return jnp.mean((x - y) ** 2)

    return loss
