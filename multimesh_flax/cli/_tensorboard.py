"""TensorBoard event files of ``mmflax train --tensorboard``.

`TrainLog` writes one scalar per step and tag under ``<run folder>/tensorboard/`` with
tensorboardX (``tensorboard --logdir RUN_DIR/tensorboard`` shows them):

* ``train/loss``, ``train/tokens_per_s`` and ``train/learning_rate`` (the rate the step's
  update used: the schedule at the count of updates applied before it) at every step;
* ``train/grad_norm``, the global norm of the step's gradient before clipping (from the
  step's ``last_check``), written one step late like `_nonfinite.SkipWatch` reads it:
  reading it at once would wait for the step's last fragment;
* ``eval/loss`` and ``eval/perplexity`` where the run evaluates (``--eval-fraction``).

Only process 0 writes; every process reads the gradient norm, since reading it
(`host_values`) is a collective in a multi-process job. A resumed run appends a new event
file whose first event purges the steps after the one it resumed from, so TensorBoard shows
one curve even when the earlier invocation ran past its last checkpoint. A disabled log
(``--tensorboard`` not given) does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from multimesh_flax.distributed import host_values

FOLDER = "tensorboard"
TAGS = (
    "train/loss",
    "train/learning_rate",
    "train/grad_norm",
    "train/tokens_per_s",
    "eval/loss",
    "eval/perplexity",
)


class TrainLog:
    """Scalars of one ``mmflax train`` invocation for TensorBoard (see the module docstring).

    Args:
        run_dir: the run folder; events go to ``run_dir/tensorboard/``.
        start: the step this invocation starts after (0 for a fresh run).
        rate: the learning-rate schedule (a function of the count of applied updates).
        enabled: whether to log at all (``--tensorboard``).
    """

    def __init__(
        self, run_dir: Path, start: int, rate: Callable[[Any], Any], enabled: bool
    ) -> None:
        self.enabled = enabled
        self.rate = rate
        self.writer = None
        self._pending: tuple[int, Any] | None = None  # a step whose gradient norm is unread
        if enabled and jax.process_index() == 0:
            from tensorboardX import SummaryWriter

            purge = start + 1 if start else None  # drop what ran past the resumed checkpoint
            self.writer = SummaryWriter(str(run_dir / FOLDER), purge_step=purge, flush_secs=30)

    def step(self, step: int, loss: float, tokens_per_s: float, skipped: int, check: Any) -> None:
        """Logs step ``step``; ``skipped``: updates not applied before it; ``check``: its
        ``StepCheck`` (the gradient norm is read at the next call or at `close`)."""
        if not self.enabled:
            return
        self._read_pending()
        self._pending = (step, check)
        if self.writer is not None:
            rate = float(np.asarray(self.rate(step - 1 - skipped)))
            self._scalars(step, {"loss": loss, "learning_rate": rate}, "train")
            self._scalars(step, {"tokens_per_s": tokens_per_s}, "train")

    def evaluation(self, step: int, loss: float, perplexity: float) -> None:
        """Logs the held-out loss and perplexity measured at ``step``."""
        if self.writer is not None:
            self._scalars(step, {"loss": loss, "perplexity": perplexity}, "eval")

    def close(self) -> None:
        """Reads the last gradient norm and closes the event file (every process calls it)."""
        if not self.enabled:
            return
        self._read_pending()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _read_pending(self) -> None:
        if self._pending is None:
            return
        step, check = self._pending
        self._pending = None
        (norm,) = host_values((check.grad_norm,))  # every process: a collective
        if self.writer is not None:
            self._scalars(step, {"grad_norm": float(norm)}, "train")

    def _scalars(self, step: int, values: dict[str, float], group: str) -> None:
        assert self.writer is not None
        for name, value in values.items():
            self.writer.add_scalar(f"{group}/{name}", value, step)
