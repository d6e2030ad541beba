"""Compiling a program's fragments before its first call, in threads of their own.

XLA compiles a fragment at its first dispatch, when the shardings of its arguments are known
(``_ops``): a step's first call compiles its distinct fragments one after another, and
only once the caller gets there -- in ``parallelize_step``, after the initializer of the
training state compiled and ran. But those shardings are known before any array exists.
A program's inputs arrive in its input shardings (``MpmdExecutable`` moves them there),
its constants are placed, each fragment's outputs come out in its executable's output
shardings and each transfer's in its targets (``PutOp.target``). :func:`compile_ahead`
walks the op list with abstract values (``jax.ShapeDtypeStruct``\\ s) that follow these
rules, and asks each fragment's program for the executable for its arguments there: the
program compiles it (or relocates it) as the first call would, and keeps it for it. Only a
fragment's outputs wait for its compile; fragments of other submeshes, reached through
transfers, do not, so the walk keeps ``workers`` compiles going at once, in op order.

:class:`CompileAhead` runs the walk in a thread (``WORKERS`` compiles at once), so it
overlaps what the caller does meanwhile: ``parallelize_step`` starts it before compiling the
initializer, and all compile at once (XLA releases the interpreter while it compiles). A
first call that comes while the walk is still going waits for a program the walk is
compiling (each ``FragmentProgram`` compiles under a lock) and compiles by itself what the
walk has not reached; neither compiles what the other made. A value whose sharding the walk
cannot know (an input without an input sharding) leaves the ops that depend on it to the
first call. Whatever the walk gets wrong costs a compile more, never a wrong result: the
first call takes executables by the signature of its actual arguments.

The threads are daemons that an ``atexit`` hook stops after their current compiles, so a
process that ends (or is interrupted) before the walk finishes waits for at most those
(``WORKERS``), not for the rest of the walk. They lower the fragments under the process's
JAX configuration, as a call would outside any configuration context; the program's types
were fixed when it was traced.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import jax

from multimesh_flax.core.declare import no_ambient_mesh
from multimesh_flax.core.run._dispatch import fits_input
from multimesh_flax.core.run._ops import RunOp


class _Stopped(Exception):
    """The walk was cancelled (its step was dropped, or the process exits)."""


# Compiles a walk runs at once once widened (``CompileAhead.widen``), one before: beside the
# caller's own compile (an initializer's) one keeps 2 cores busy; alone it keeps ~1.65 of
# them busy, two keep both (design notes, "The step compiles while the state initializes").
WORKERS = 2


def compile_ahead(
    program: Any,
    args: Sequence[Any],
    stop: threading.Event | None = None,
    workers: int = 1,
    slots: Slots | None = None,
) -> int:
    """Makes the executable of every fragment of ``program`` (an ``MpmdExecutable``) for
    arguments like ``args`` (one array or ``jax.ShapeDtypeStruct`` per program input),
    walking its ops in dispatch order (module doc), ``workers`` compiles at a time (at most
    ``slots``' count, where given: another thread may raise it while the walk runs). An
    argument stays in its own sharding where that fits its input sharding, as a call leaves
    it (a one-device array for a one-device submesh); else it is in its input sharding,
    where a call moves it. Returns how many ops it walked: all of them, or those before the
    first whose arguments' shardings it cannot know (the ops after it that do not depend on
    it are walked too).

    Example:
        >>> import multimesh_flax as mm
        >>> def f(x):
        ...     y = mm.task(jnp.tanh, mesh=mm.TaskMesh(devices=[0]))(x)
        ...     return mm.task(jnp.exp, mesh=mm.TaskMesh(devices=[1]))(y)
        >>> x = jax.ShapeDtypeStruct((3,), jnp.float32)
        >>> program = mm.jit(f).executable(x)
        >>> [type(op).__name__ for op in program.ops]
        ['RunOp', 'PutOp', 'RunOp']
        >>> compile_ahead(program, [x], workers=2) == len(program.ops)
        True
        >>> made = program.compile_count()
        >>> _ = mm.jit(f)(np.ones(3, np.float32))  # runs on the executables made ahead
        >>> program.compile_count() == made
        True
    """
    env: dict[int, Any] = dict(program.constants())
    for slot, x, want in zip(program.input_slots, args, program.input_shardings, strict=True):
        have = getattr(x, "sharding", None)
        placed = have if want is None or fits_input(have, want, x) else want
        env[slot] = _abstract(x, placed)
    slots = slots if slots is not None else Slots(workers)
    with _Compiles(workers, stop or threading.Event(), slots) as compiles:
        return _Walk(program, env, compiles).run()


class _Walk:
    """The abstract values of ``program``'s slots (``env``), op by op. An op waits until its
    arguments are known; a fragment's outputs are known once its executable is
    (``_Compiles``), so fragments on other submeshes, reached through transfers, compile
    meanwhile."""

    def __init__(self, program: Any, env: dict[int, Any], compiles: _Compiles) -> None:
        self.ops, self.homes = program.ops, program.slot_homes()
        self.env, self.compiles = env, compiles
        self.asked: dict[int, Any] = {}  # op index -> its compile (``_Compiles.ask``)
        self.unknown = len(self.ops)  # the first op whose arguments' shardings are unknown

    def run(self) -> int:
        waiting = list(range(len(self.ops)))
        while waiting:
            ended = self.compiles.ended  # before the pass: a compile ending during it counts
            waiting = [i for i in waiting if not self._advance(i)]
            if waiting:
                self.compiles.wait_past(ended)
        return self.unknown

    def _advance(self, index: int) -> bool:
        """Sets op ``index``'s outputs if its arguments are known and, for a fragment, its
        executable is made (whether it did); asks for that compile the first time."""
        op = self.ops[index]
        if index in self.asked:
            executable = self.compiles.made.get(self.asked[index])
            if executable is None:
                return False
            shardings = executable.output_shardings
        elif any(s not in self.env for s in op.ins):
            return False
        else:
            values = [self.env[s] for s in op.ins]
            if any(getattr(v, "sharding", None) is None for v in values):
                self.unknown = min(self.unknown, index)
                shardings = [None] * len(op.outs)  # and so are its dependents'
            elif isinstance(op, RunOp):
                self.asked[index] = self.compiles.ask(op.program, values)
                return self._advance(index)
            else:
                shardings = op.targets(values)
        for slot, sharding in zip(op.outs, shardings, strict=True):
            self.env[slot] = _abstract(self.homes[slot][0], sharding)
        return True


class Slots:
    """How many compiles may run at once (``count``); ``widen`` raises it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = threading.Semaphore(count)
        self._lock = threading.Lock()

    def widen(self, count: int) -> None:
        with self._lock:
            for _ in range(count - self.count):
                self._free.release()
            self.count = max(count, self.count)

    def __enter__(self) -> None:
        self._free.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._free.release()


class _Compiles:
    """``workers`` daemon threads making fragments' executables, each once, in the order
    asked (``ask``), as many at once as ``slots`` allows. Once ``stop`` is set, or
    the ``with`` is left, none starts another compile; leaving the ``with`` waits for those
    under way."""

    def __init__(self, workers: int, stop: threading.Event, slots: Slots) -> None:
        self.stop, self._slots = stop, slots
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.made: dict[Any, Any] = {}  # (program, argument types) -> executable
        self._asked: set[Any] = set()
        self._error: BaseException | None = None
        self._closed = False
        self.ended = 0  # jobs ended (made, failed or dropped once stopped)
        self._done = threading.Condition()
        self._threads = [
            threading.Thread(target=self._work, name="mmflax-compile-ahead", daemon=True)
            for _ in range(max(1, workers))
        ]

    def __enter__(self) -> _Compiles:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closed = True  # the walk has ended: compiles still queued are not needed
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def ask(self, program: Any, values: list[Any]) -> Any:
        """Queues the compile of ``program`` for ``values`` unless asked before; returns its
        key in ``made``, which holds the executable once it is made."""
        key = (program, tuple(_abstract(v, v.sharding) for v in values))  # constants: arrays
        if key not in self._asked:
            self._asked.add(key)
            self._queue.put((key, program, values))
        return key

    def wait_past(self, ended: int) -> None:
        """Waits until more than ``ended`` jobs have ended; raises what ended one with an
        error, or ``_Stopped``."""
        with self._done:
            self._done.wait_for(lambda: self.ended > ended or self.stop.is_set())
        if self._error is not None:
            raise self._error
        if self.stop.is_set():
            raise _Stopped

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            key, program, values = job
            executable = None
            with self._slots:
                if not (self.stop.is_set() or self._closed):
                    try:
                        executable = program.executable(values)
                    except Exception as error:  # noqa: BLE001 -- the walk raises it
                        self._error = error
            with self._done:
                if executable is not None:
                    self.made[key] = executable
                self.ended += 1
                self._done.notify_all()


def _abstract(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    """``x``'s type (an array's, a traced variable's, a ``ShapeDtypeStruct``'s, a Python
    scalar's) in ``sharding``."""
    if hasattr(x, "aval"):
        aval = x.aval
    else:
        aval = x if hasattr(x, "shape") and hasattr(x, "dtype") else jax.typeof(x)
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, sharding=sharding, weak_type=getattr(aval, "weak_type", False)
    )


class CompileAhead:
    """:func:`compile_ahead` of ``program`` on ``args``, running in a thread (module doc).

    ``wait(timeout)`` returns whether the walk has ended; ``walked`` is how many ops it
    walked (``None`` while it runs, or if it was stopped) and ``error`` the exception that
    ended it early, if any (the first call meets the same one where it is real: it compiles
    those fragments itself). ``cancel()`` and ``stop()`` end it after the compiles under
    way, ``stop()`` waiting for those. It compiles one fragment at a time, next to whatever
    the caller compiles meanwhile, until ``widen()`` lets it compile ``WORKERS`` at once
    (``parallelize_step`` widens it once the initializer has run).
    """

    def __init__(self, program: Any, args: Sequence[Any]) -> None:
        self.walked: int | None = None
        self.error: BaseException | None = None
        self._slots = Slots(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(program, list(args)), name="mmflax-compile-ahead", daemon=True
        )
        _RUNNING.add(self)
        self._thread.start()

    def _run(self, program: Any, args: list[Any]) -> None:
        try:
            with no_ambient_mesh():  # as a call runs the program (``front._jit``)
                self.walked = compile_ahead(program, args, self._stop, WORKERS, self._slots)
        except _Stopped:
            pass
        except Exception as error:  # noqa: BLE001 -- the first call compiles it and raises
            self.error = error
        finally:
            _RUNNING.discard(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the walk (at most ``timeout`` seconds); whether it has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def widen(self) -> None:
        """Lets the walk compile ``WORKERS`` fragments at once from now on (the caller has
        stopped compiling: the cores are the walk's)."""
        self._slots.widen(WORKERS)

    @property
    def width(self) -> int:
        """How many fragments it may compile at once now."""
        return self._slots.count

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` or ``stop`` was called."""
        return self._stop.is_set()

    def cancel(self) -> None:
        """Ends the walk after the compiles under way (returns at once)."""
        self._stop.set()

    def stop(self) -> None:
        """Ends the walk after the compiles under way, and waits for those."""
        self.cancel()
        self._thread.join()


_RUNNING: weakref.WeakSet[CompileAhead] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for ahead in list(_RUNNING):
        ahead.stop()
