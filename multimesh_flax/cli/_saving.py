"""When ``mmflax train`` saves: every N steps or every so many minutes, and always at the end.

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
