"""When and what ``mmflax train`` saves: every N steps or minutes, at the end, never NaN.

``--save-every`` takes a step count (``50``) or a duration of training (``90s``, ``5m``,
``1h``); ``end`` (or ``0``) saves only at the end. `SaveEvery.parse` reads it and
`SaveEvery.due` says whether a save is due after a step. Whatever the setting, a run also
saves when it ends: after its last step, or after the step in flight when SIGINT or SIGTERM
arrived. The default, `DEFAULT`, saves every 5 minutes of training: a preempted job loses at
most that much, and a short run (the default job takes under a minute) saves once.

Example:
  >>> SaveEvery.parse("50").due(steps=50, seconds=1.0)
  True
  >>> SaveEvery.parse("5m").due(steps=1000, seconds=120.0)
  False
  >>> SaveEvery.parse("end").describe()
  'at the end only'
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from multimesh_flax.checkpoint import Checkpointer
from multimesh_flax.cli._interrupts import agreed_each
from multimesh_flax.cli.errors import RunOptionError

DEFAULT = "5m"
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")


@dataclasses.dataclass(frozen=True)
class SaveEvery:
    """A save period: ``steps`` optimizer steps or ``seconds`` of training (or neither)."""

    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> SaveEvery:
        """Reads ``--save-every``: ``N`` steps, ``Ns``/``Nm``/``Nh``, or ``end``/``0``.

        Raises:
            RunOptionError: anything else.
        """
        if text.strip().lower() == "end":
            return cls()
        match = _PATTERN.match(text)
        if match is None:
            raise RunOptionError(
                f"Expected `--save-every` to be a step count (e.g. 50), a duration (90s, 5m, "
                f"1h) or 'end', got {text!r}."
            )
        number, unit = match.groups()
        if unit:
            seconds = float(number) * _UNITS[unit]
            return cls(seconds=seconds) if seconds > 0 else cls()
        if "." in number:
            raise RunOptionError(
                f"Expected a whole number of steps for `--save-every`, got {text!r}. Write "
                "e.g. `--save-every 50`, or add a unit (s, m, h) for a duration."
            )
        return cls(steps=int(number)) if int(number) > 0 else cls()

    def due(self, *, steps: int, seconds: float) -> bool:
        """Whether to save after ``steps`` steps and ``seconds`` of training since the last save."""
        if self.steps is not None:
            return steps >= self.steps
        return self.seconds is not None and seconds >= self.seconds

    def describe(self) -> str:
        """In words, e.g. ``'every 50 steps'``."""
        if self.steps is not None:
            return f"every {self.steps} steps"
        if self.seconds is not None:
            return f"every {self.seconds:g} s of training"
        return "at the end only"


class Saver:
    """Saves the training state into the run's checkpoint when due, and at the end.

    ``due`` says whether ``every`` asks for a save after a step (steps or seconds of
    training since the last save); ``save`` saves, unless a leaf of the state is NaN or
    infinite. Saves are asynchronous: the arrays are copied to host before ``save`` returns,
    so the next step may donate them.
    """

    def __init__(
        self, ckpt: Checkpointer, every: SaveEvery, metadata_at: Callable[[int], dict]
    ) -> None:
        self.ckpt = ckpt
        self.every = every
        self.metadata_at = metadata_at
        self.last_step: int | None = ckpt.latest_step()
        self._since_step = self.last_step or 0
        self._since_time = time.perf_counter()

    @property
    def directory(self) -> str:
        return str(self.ckpt.directory)

    def due(self, step: int) -> bool:
        """Whether a save is due after ``step``."""
        elapsed = time.perf_counter() - self._since_time
        return self.every.due(steps=step - self._since_step, seconds=elapsed)

    def save(self, step: int, state: Any) -> str | None:
        """Saves ``state`` as ``step`` unless a leaf is NaN or infinite; then says which."""
        if step == self.last_step:
            return None
        bad = nonfinite_leaves(state)
        if bad:
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            return f"At step {step}, {len(bad)} leaves of the state are NaN or infinite ({shown})"
        self.ckpt.save(step, state, self.metadata_at(step))
        self.last_step, self._since_step = step, step
        self._since_time = time.perf_counter()
        return None

    def kept(self) -> str:
        """Which checkpoint the run keeps, in words."""
        if self.last_step is None:
            return f"no checkpoint was saved in '{self.directory}'"
        return f"the last one saved, step {self.last_step}, stays in '{self.directory}'"


def nonfinite_leaves(state: Any) -> list[str]:
    """Paths of the floating-point leaves of ``state`` holding a NaN or an infinity.

    Reads each array's shards on this process's devices (the save copies them to host
    anyway); in a multi-process job the processes agree on the answer.
    """
    paths, flags = [], []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(leaf, jax.Array) and jax.numpy.issubdtype(leaf.dtype, np.inexact):
            shards = (np.asarray(shard.data) for shard in leaf.addressable_shards)
            paths.append(jax.tree_util.keystr(path))
            flags.append(not all(np.isfinite(values).all() for values in shards))
    flags = agreed_each(np.asarray(flags, dtype=bool))
    return [path for path, bad in zip(paths, flags, strict=True) if bad]
