"""The core's one thread-local: what the user's ``with`` blocks entered in this thread, and
the trace in progress.

Every ``with`` the user writes -- ``context``/flags, a ``Context`` or ``MultiMesh``,
``record_timeline`` -- and every trace ``jit`` runs pushes onto a field here and pops on exit,
so threads never see each other's settings. Each field belongs to one module, named beside it;
that module is the only one that reads or writes it.
"""

from __future__ import annotations

import threading
from typing import Any


class _ThreadState(threading.local):
    def __init__(self) -> None:
        # declare
        self.flags: Any = None  # _config: the switches in force (a ``_Flags``; None: defaults)
        self.contexts: list[Any] = []  # _registry: entered ``Context``s, innermost last
        self.device_lists: list[tuple[Any, ...]] = []  # _devices: ``jit(devices=...)`` lists
        self.multi_meshes: list[Any] = []  # _multimesh: entered ``MultiMesh``es
        self.recompute: list[Any] = []  # _recompute: step-wide policies, innermost last
        # trace
        self.sessions: list[Any] = []  # _session: open ``TraceSession``s, innermost last
        self.task_stack: list[Any] = []  # _session: ``ResolvedTask``s being traced
        self.microbatch_index: int | None = None  # _session: the microbatch being traced
        self.shape_only = 0  # _session: > 0 inside shape-only traces (initialisers)
        self.flax_rules: list[int] = []  # _colour: uids whose Flax logical rules are active
        # run
        self.timeline: Any = None  # _dispatch: the ``Timeline`` being recorded


STATE = _ThreadState()
