"""Stopping a training run cleanly on SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption).

`StopRequests` is a context manager that, while active, turns the first SIGINT or SIGTERM
into a *request*: the handler only records the signal, so the step in flight finishes and
the training loop (which polls `StopRequests.signal` between steps) saves a checkpoint and
ends. A second signal restores Python's default behaviour for both and re-raises as usual
(``KeyboardInterrupt`` for SIGINT, termination for SIGTERM): a user who presses Ctrl-C twice
still gets out at once. On exit the previous handlers come back.

In a multi-process job every process must leave the training loop after the same step (the
next step is a collective), but a signal may reach them between different steps: `agreed`
says whether *any* process saw it (through the coordinator's key-value store).

`exit_status` gives the conventional status of a process ended by a signal (128 + its
number: 130 for SIGINT, 143 for SIGTERM).

Signals can only be caught in the main thread; elsewhere (a training run started from a
worker thread) `StopRequests` does nothing and ``signal`` stays ``None``.

Example:
  >>> import os, signal
  >>> with StopRequests() as stop:
  ...     os.kill(os.getpid(), signal.SIGTERM)   # what a scheduler sends
  ...     print(stop.signal_name)
  SIGTERM
  >>> exit_status(signal.SIGTERM)
  143
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import numpy as np

from multimesh_flax.distributed import any_process

HANDLED = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: int) -> int:
    """The status a shell reports for a process ended by signal ``signum`` (128 + number)."""
    return 128 + int(signum)


class StopRequests:
    """Records the first SIGINT/SIGTERM while active instead of stopping the process."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def signal_name(self) -> str | None:
        """``"SIGINT"``/``"SIGTERM"`` once one arrived, else ``None``."""
        return None if self.signal is None else signal.Signals(self.signal).name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signum
            return
        self._restore()  # a second signal: behave as if we had never caught any
        handler = signal.getsignal(signum)
        if callable(handler):
            handler(signum, frame)
        else:
            signal.raise_signal(signum)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()


def agreed(flag: bool) -> bool:
    """``flag`` in one process; in a multi-process job, whether any process raised it.

    Every process must leave the loop after the same step (the next step is a collective),
    but a signal may reach the processes between different steps.
    """
    return bool(agreed_each(np.asarray([flag]))[0])


def agreed_each(flags: np.ndarray) -> np.ndarray:
    """Element-wise "any process" of the boolean vector ``flags`` (`distributed.any_process`)."""
    return np.asarray(any_process(flags.tolist()), dtype=bool)
