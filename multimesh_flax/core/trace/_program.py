"""The traced program: a flat jaxpr and one record of facts per equation.

Every pass after the trace learns something about each equation: colouring its task and
phase, planning its microbatch and pipeline unit, placement its submesh. All of it lives in
one :class:`Equation` record per equation, and a pass that learns a fact returns new records
(``record._replace(...)``) in a new :class:`TracedProgram` -- no list of labels or places
kept beside the equations by position. ``TracedProgram.equations`` runs in the order of
``jaxpr.eqns`` and holds the same equation objects.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.extend.core as jex

from multimesh_flax.core.declare import Place
from multimesh_flax.core.trace._session import Label, MicrobatchCall, ResolvedTask, TraceSession


class Equation(NamedTuple):
    """One equation of a traced program and what the passes learnt about it.

    The trace sets ``eqn`` and ``stack``; colouring sets ``label``; planning sets
    ``microbatch``, ``unit`` and ``mixed``; placement sets ``place``. A fact not learnt yet
    keeps its default.
    """

    eqn: Any  # the ``JaxprEqn``
    stack: str = ""  # its full name stack
    label: Label | None = None  # its task and phase; ``None``: glue
    microbatch: tuple[int, int] | None = None  # (region uid, k); ``None``: outside every one
    unit: Any = None  # its pipeline unit (``plan.Unit``); ``None``: glue
    mixed: bool = False  # it combines several microbatches, so it is glue whatever its label
    place: Place | None = None  # the submesh (device ids) it runs on


@dataclasses.dataclass(frozen=True)
class TracedProgram:
    """A flat jaxpr of the program and one :class:`Equation` record per equation."""

    jaxpr: jex.Jaxpr
    consts: list[Any]
    equations: tuple[Equation, ...]  # in the order of ``jaxpr.eqns``
    tasks: dict[int, ResolvedTask]
    out_tree: Any
    default_task: ResolvedTask | None = None  # registered for "default": glue fallback
    session: TraceSession | None = None  # what the trace learnt (tasks, microbatches)

    @functools.cached_property
    def labels(self) -> tuple[Label | None, ...]:
        """Each equation's label (a view of ``equations``, for reading)."""
        return tuple(e.label for e in self.equations)

    @functools.cached_property
    def stacks(self) -> tuple[str, ...]:
        """Each equation's name stack (a view of ``equations``, for reading)."""
        return tuple(e.stack for e in self.equations)

    @functools.cached_property
    def producer(self) -> dict[Any, int]:
        """The index of the equation producing each variable (built once per program)."""
        return {v: i for i, e in enumerate(self.jaxpr.eqns) for v in e.outvars}

    @property
    def microbatch_calls(self) -> dict[int, MicrobatchCall]:
        """The ``microbatch`` calls traced in this program, by scope uid."""
        return self.session.microbatch_calls if self.session is not None else {}


def each_distinct(fn: Callable[[str], Any], stacks: Sequence[str]) -> list[Any]:
    """``[fn(s) for s in stacks]``, calling ``fn`` once per distinct name stack (the m
    microbatches of a program repeat the same few thousand stacks over all its equations).

    >>> each_distinct(len, ["a/b", "a", "a/b"])
    [3, 1, 3]
    """
    memo: dict[str, Any] = {}
    return [memo[s] if s in memo else memo.setdefault(s, fn(s)) for s in stacks]
