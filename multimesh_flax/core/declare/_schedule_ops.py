"""Pipeline ops: the phases and the ``(stage, microbatch, phase)`` unit of work, and what an
op waits for.

:class:`Phase` names the phases, :class:`ScheduleOp` is one unit of work written
``<phase><stage>.<microbatch>``, and :func:`op_deps` gives the ops it depends on:
``F(s,i) <- F(s-1,i)``, ``B(s,i) <- F(s,i), B(s+1,i)`` and ``W(s,i) <- B(s,i)``. Schedules
(``_schedules``) and their builders (``_zero_bubble``) are orders of these ops.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from multimesh_flax import errors


class Phase(str, enum.Enum):
    """A pipeline phase: ``F`` forward; ``B`` backward, or its activation-gradient half when
    the backward is split; ``W`` the weight-gradient half. Equal to its letter as a string."""

    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


_PHASES = tuple(p.value for p in Phase)
_OP_PATTERN = re.compile(r"^\s*([FBW])(\d+)\.(\d+)\s*$")


@dataclasses.dataclass(frozen=True, order=True)
class ScheduleOp:
    """One unit of pipeline work: a phase of one stage on one microbatch.

    Attributes:
      stage: The pipeline stage (task) index, ``0 <= stage < num_stages``.
      microbatch: The microbatch index, ``0 <= microbatch < num_microbatches``.
      phase: ``"F"`` (forward), ``"B"`` (backward, or its activation-gradient half when the
        backward is split) or ``"W"`` (weight-gradient half of a split backward).

    Example:
      >>> from multimesh_flax.core import ScheduleOp
      >>> op = ScheduleOp.parse("B1.3")
      >>> op
      ScheduleOp(stage=1, microbatch=3, phase='B')
      >>> str(op)
      'B1.3'
    """

    stage: int
    microbatch: int
    phase: str

    def __str__(self) -> str:
        return f"{self.phase}{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> ScheduleOp:
        """Reads an op written ``<phase><stage>.<microbatch>``, such as ``"F0.3"``.

        Raises:
          InvalidScheduleError: If ``text`` does not have that form.
        """
        match = _OP_PATTERN.match(text)
        if match is None:
            raise errors.InvalidScheduleError(
                f"Expected an op written `<phase><stage>.<microbatch>` with phase F, B or W "
                f"(for example 'F0.3'), got {text!r}."
            )
        phase, stage, microbatch = match.groups()
        return cls(int(stage), int(microbatch), phase)


def op_deps(op: ScheduleOp, num_stages: int) -> tuple[ScheduleOp, ...]:
    """The ops that must finish before ``op`` starts."""
    s, i = op.stage, op.microbatch
    if op.phase == "F":
        return (ScheduleOp(s - 1, i, "F"),) if s > 0 else ()
    if op.phase == "W":
        return (ScheduleOp(s, i, "B"),)
    upstream = (ScheduleOp(s + 1, i, "B"),) if s < num_stages - 1 else ()
    return (ScheduleOp(s, i, "F"), *upstream)
