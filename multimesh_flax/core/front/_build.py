"""The build driver: the passes that turn a function into an MPMD program, in the order they run.

Each pass takes a value and returns a new one; reading :func:`build_program` and
:func:`partition_program` is reading the pipeline:

==========  ===========================================  =======================================
pass        function (stage)                             value in -> value out
==========  ===========================================  =======================================
trace       ``trace.capture_program``                    function, arguments -> CapturedProgram
colour      ``trace.colour_program``                     CapturedProgram -> TracedProgram
plan        ``plan.plan_program``                        TracedProgram -> (TracedProgram, plan)
place       ``fragment.place_program``                   program, plan -> PlacedProgram
cut         ``fragment.cut_fragments``                   PlacedProgram -> fragments
arrange     ``fragment.arrange_fragments``               fragments -> fragments, dispatch order
fuse        ``fragment.fuse_fragments``                  fragments -> fragments
compile     ``run.compile_program``                      Partition -> MpmdExecutable
==========  ===========================================  =======================================

Every equation's facts travel in its ``trace.Equation`` record: colouring fills ``label``,
planning ``microbatch``, ``unit`` and ``mixed``, placement ``place``. ``fragment.make_partition``
records where each value lives between *fuse* and *compile*. *Compile* makes one cached
program (a ``jax.jit``) per distinct fragment and the op list over them; XLA compiles each
program at its first dispatch, when the shardings of its arguments are known (``run._ops``),
and ``MpmdExecutable.describe`` reports both. A program without tasks stops after *colour*:
it runs as one ``jax.jit`` (:class:`FastPath`).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.core

from multimesh_flax.core.declare import get_flag
from multimesh_flax.core.fragment import (
    Partition,
    arrange_fragments,
    cut_fragments,
    fuse_fragments,
    make_partition,
    place_program,
)
from multimesh_flax.core.plan import plan_program
from multimesh_flax.core.run import compile_program
from multimesh_flax.core.trace import TracedProgram, capture_program, colour_program
from multimesh_flax.distributed._dispatch import HAND_OFF

PASSES = ("trace", "colour", "plan", "place", "cut", "arrange", "fuse", "compile")


class Build(NamedTuple):
    """What :func:`build_program` made for one call signature."""

    run: Any  # an ``MpmdExecutable``, or a ``FastPath`` for a program without tasks
    traced: TracedProgram  # the program as coloured (before planning)
    seconds: dict[str, float]  # "trace" (trace, colour), "partition" (plan .. compile)


def build_program(fun: Any, leaves: Sequence[Any], devices: Any, donate: tuple[int, ...]) -> Build:
    """Runs the passes on ``fun(*leaves)`` (arrays or ``ShapeDtypeStruct``\\ s), with Python's
    cyclic garbage collector paused (:func:`collector_paused`).

    ``devices``: the device list that ``TaskMesh`` positions index (``None``: the current
    one); ``donate``: the positions of the leaves the program may consume.
    """
    with collector_paused():
        start = time.perf_counter()
        captured = capture_program(fun, leaves, devices)  # trace
        traced = colour_program(captured)  # colour
        traced_at = time.perf_counter()
        if not traced.tasks and get_flag("enable_fast_path"):
            run: Any = FastPath(traced, donate)
        else:
            part = partition_program(traced, devices)  # plan, place, cut, arrange, fuse
            processes = HAND_OFF if jax.process_count() > 1 else None  # who dispatches
            run = compile_program(part, donate, processes)  # compile
        seconds = {"trace": traced_at - start, "partition": time.perf_counter() - traced_at}
    return Build(run, traced, seconds)


def partition_program(traced: TracedProgram, devices: Any = None) -> Partition:
    """The passes between colouring and compiling: the coloured program planned, placed and
    cut into fragments in dispatch order (also for a program that runs on the fast path, to
    say where its inputs go)."""
    traced, plan = plan_program(traced)  # plan
    placed = place_program(traced, plan, devices)  # place
    fragments = cut_fragments(placed)  # cut
    fragments = arrange_fragments(placed, fragments)  # arrange
    fragments = fuse_fragments(placed, fragments)  # fuse
    return make_partition(placed, fragments)


class FastPath:
    """A program without tasks: one ``jax.jit`` of the program as traced (not traced again)."""

    def __init__(self, traced: TracedProgram, donate: tuple[int, ...]) -> None:
        # Not ``jaxpr_as_fun``, which turns ``jax_debug_nans`` off: under that flag, jit's own
        # op-by-op re-run must see the NaN to name its primitive and source line.
        jaxpr, consts = traced.jaxpr, traced.consts

        def run(*leaves: Any) -> tuple[Any, ...]:
            return tuple(jax.core.eval_jaxpr(jaxpr, consts, *leaves))

        self.jitted = jax.jit(run, donate_argnums=donate)

    def __call__(self, leaves: Sequence[Any]) -> Any:
        return list(self.jitted(*leaves))


class _CollectorPause:
    """Counts the builds under way in this process; the collector runs again after the last.

    The collector is process-wide, so a per-thread pause would let the first build to finish
    re-enable it under another thread's build. Only a collector that was running when the
    first build began is restarted (a caller's own ``gc.disable()`` is left alone).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._builds = 0
        self._restart = False

    def enter(self) -> None:
        with self._lock:
            if self._builds == 0:
                self._restart = gc.isenabled()
                gc.disable()
            self._builds += 1

    def exit(self) -> None:
        with self._lock:
            self._builds -= 1
            if self._builds == 0 and self._restart:
                gc.enable()


_COLLECTOR = _CollectorPause()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector while a program is built and first called.

    A build allocates hundreds of thousands of small objects (equations, variables, name
    stacks) that all live until it ends; every full collection during the build re-scans
    them, which made up about half of trace + partition time at 32 microbatches. The first
    call traces and lowers every fragment (about a sixth of its time went to collections).
    Cycles that become garbage meanwhile are collected once the collector runs again. Builds
    may nest and overlap across threads: the collector runs again when the last one ends,
    if it was running when the first began.

    Example:
        >>> import gc
        >>> with collector_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    _COLLECTOR.enter()
    try:
        yield
    finally:
        _COLLECTOR.exit()
