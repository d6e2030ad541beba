"""Finding the training steps whose loss or gradient norm was NaN or infinite, without waiting.

``mmflax train`` builds its step with ``parallelize_step(..., nonfinite="skip")``: inside the
step, an update whose loss or global gradient norm is not finite is not applied, so the
state never turns non-finite. The host still has to learn which steps were skipped, and
reading the step's ``applied`` flag right after the step would wait for its last fragment
(the parameter update of the first stage), which the loop otherwise overlaps with the next
step: about a fifth of the default job's step time on the CPU.

`SkipWatch` reads each step's flags one step late instead, when they are ready anyway: a
non-finite *loss* is seen at once (the loop reads every loss), a non-finite gradient norm
with a finite loss after the next step. ``--on-nonfinite stop`` then ends the run after the
current step, whose state is finite; ``skip`` records the step and goes on.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from multimesh_flax.distributed import host_values


class Skipped(NamedTuple):
    """A step whose update was not applied, and why (``"Step 3 has a non-finite loss ..."``)."""

    step: int
    message: str


class SkipWatch:
    """Says which step's update was skipped, one step late at most.

    Args:
        step_fn: the step ``parallelize_step(..., nonfinite="skip")`` returned; its
            ``last_check`` holds the flags of the step it ran last.
    """

    def __init__(self, step_fn: Any) -> None:
        self.step_fn = step_fn
        self._pending: tuple[int, Any] | None = None  # an unread step with a finite loss

    def after(self, step: int, loss: float) -> Skipped | None:
        """Called after ``step`` with its ``loss``: the step found skipped, if any."""
        check = self.step_fn.last_check
        if not math.isfinite(loss):
            self._pending = None
            return _describe(step, check)
        found = self.finish()
        self._pending = (step, check)
        return found

    def finish(self) -> Skipped | None:
        """Reads the step still unread (call once the loop ends)."""
        if self._pending is None:
            return None
        step, check = self._pending
        self._pending = None
        (applied,) = host_values((check.applied,))
        return None if bool(applied) else _describe(step, check)


def _describe(step: int, check: Any) -> Skipped:
    """``Step 3 has a non-finite loss (nan) and gradient norm (inf); ...``."""
    loss, norm = (float(v) for v in host_values((check.loss, check.grad_norm)))
    values = {"loss": loss, "gradient norm": norm}
    bad = " and ".join(f"{k} ({v})" for k, v in values.items() if not math.isfinite(v))
    return Skipped(step, f"Step {step} has a non-finite {bad}; its update was not applied")
