"""Compiling a program's fragments before its first call, in a thread of their own.

XLA compiles a fragment at its first dispatch, when the shardings of its arguments are known
(``_ops``): a step's first call compiles its distinct fragments one after another, and
only once the caller gets there -- in ``parallelize_step``, after the initializer of the
training state compiled and ran. But those shardings are known before any array exists.
A program's inputs arrive in its input shardings (``MpmdExecutable`` moves them there),
its constants are placed, each fragment's outputs come out in its executable's output
shardings and each transfer's in its targets (``PutOp.target``). :func:`compile_ahead`
walks the op list once with abstract values (``jax.ShapeDtypeStruct``\\ s) that follow these
rules, and asks each fragment's program for the executable for its arguments there: the
program compiles it (or relocates it) as the first call would, and keeps it for it.

:class:`CompileAhead` runs the walk in a thread, so it overlaps what the caller does
meanwhile: ``parallelize_step`` starts it before compiling the initializer, and both
compile at once (XLA releases the interpreter while it compiles). A first call that comes
while the walk is still going waits for a program the walk is compiling (each
``FragmentProgram`` compiles under a lock) and compiles by itself what the walk has not
reached; neither compiles what the other made, and a value whose sharding the walk cannot
know (an input without an input sharding) ends the walk there. Whatever the walk gets
wrong costs a compile more, never a wrong result: the first call takes executables by the
signature of its actual arguments.

The thread is a daemon that an ``atexit`` hook stops after its current compile, so a
process that ends (or is interrupted) before the walk finishes waits for at most one
fragment's compile, not for the rest of the walk. It lowers the fragments under the
process's JAX configuration, as a call would outside any configuration context; the
program's types were fixed when it was traced.
"""

from __future__ import annotations

import atexit
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


def compile_ahead(program: Any, args: Sequence[Any], stop: threading.Event | None = None) -> int:
    """Makes the executable of every fragment of ``program`` (an ``MpmdExecutable``) for
    arguments like ``args`` (one array or ``jax.ShapeDtypeStruct`` per program input),
    walking its ops in dispatch order (module doc). An argument stays in its own sharding
    where that fits its input sharding, as a call leaves it (a one-device array for a
    one-device submesh); else it is in its input sharding, where a call moves it. Returns
    how many ops it walked: all of them, or those before the first whose arguments'
    shardings it cannot know.

    Example:
        >>> import multimesh_flax as mm
        >>> def f(x):
        ...     y = mm.task(jnp.tanh, mesh=mm.TaskMesh(devices=[0]))(x)
        ...     return mm.task(jnp.exp, mesh=mm.TaskMesh(devices=[1]))(y)
        >>> x = jax.ShapeDtypeStruct((3,), jnp.float32)
        >>> program = mm.jit(f).executable(x)
        >>> [type(op).__name__ for op in program.ops]
        ['RunOp', 'PutOp', 'RunOp']
        >>> compile_ahead(program, [x]) == len(program.ops)
        True
        >>> made = program.compile_count()
        >>> _ = mm.jit(f)(np.ones(3, np.float32))  # runs on the executables made ahead
        >>> program.compile_count() == made
        True
    """
    homes = program.slot_homes()
    env: dict[int, Any] = dict(program.constants())
    for slot, x, want in zip(program.input_slots, args, program.input_shardings, strict=True):
        have = getattr(x, "sharding", None)
        placed = have if want is None or fits_input(have, want, x) else want
        env[slot] = _abstract(x, placed)
    for walked, op in enumerate(program.ops):
        if stop is not None and stop.is_set():
            raise _Stopped
        values = [env[s] for s in op.ins]
        if any(getattr(v, "sharding", None) is None for v in values):
            return walked
        if isinstance(op, RunOp):
            shardings = op.program.executable(values).output_shardings
        else:
            shardings = op.targets(values)
        for slot, sharding in zip(op.outs, shardings, strict=True):
            env[slot] = _abstract(homes[slot][0], sharding)
    return len(program.ops)


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
    those fragments itself). ``cancel()`` and ``stop()`` end it after the compile under
    way, ``stop()`` waiting for that one.
    """

    def __init__(self, program: Any, args: Sequence[Any]) -> None:
        self.walked: int | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(program, list(args)), name="mmflax-compile-ahead", daemon=True
        )
        _RUNNING.add(self)
        self._thread.start()

    def _run(self, program: Any, args: list[Any]) -> None:
        try:
            with no_ambient_mesh():  # as a call runs the program (``front._jit``)
                self.walked = compile_ahead(program, args, self._stop)
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

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` or ``stop`` was called."""
        return self._stop.is_set()

    def cancel(self) -> None:
        """Ends the walk after the compile under way (returns at once)."""
        self._stop.set()

    def stop(self) -> None:
        """Ends the walk after the compile under way, and waits for that."""
        self.cancel()
        self._thread.join()


_RUNNING: weakref.WeakSet[CompileAhead] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for ahead in list(_RUNNING):
        ahead.stop()
