"""Agreeing on a few yes/no flags across the processes of a job, without touching the devices.

A training loop must stop after the same step in every process (the next step is a
collective), but a signal reaches the processes between different steps, and a check may fail
in one process only. `any_process` ORs a short list of flags over all processes through the
coordinator's key-value store. It deliberately uses no device collective: one queued behind a
step's cross-process transfers, in a different order on different devices, can deadlock the
CPU backend (seen with ``multihost_utils.process_allgather`` between two training steps).

Each call is one round: every process publishes its flags under the round's number and reads
the others'; a process deletes its key of the previous round once it has read everyone's key
of this one (by then every process has finished reading the previous round).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax

from multimesh_flax import errors
from multimesh_flax.distributed import _exchange, _sequence

TIMEOUT_S = 120  # how long a process waits for another's flags
_ROUNDS = itertools.count()


def any_process(flags: Sequence[bool]) -> list[bool]:
    """Element-wise "any process" of ``flags``: in one process, ``flags`` unchanged.

    A collective call: every process calls it with as many flags, in the same order of calls.

    Raises:
        CallSequenceError: another process did not make the same call within `TIMEOUT_S`.

    Example:
        >>> from multimesh_flax.distributed import any_process
        >>> any_process([True, False])
        [True, False]
    """
    mine = [bool(f) for f in flags]
    if jax.process_count() == 1:
        return mine
    _sequence.collective_call("any_process")
    round_ = next(_ROUNDS)
    me = jax.process_index()
    _exchange.publish(_key(round_, me), "".join("1" if f else "0" for f in mine))
    agreed = list(mine)
    for other in range(jax.process_count()):
        if other != me:
            theirs = _fetch(round_, other)
            agreed = [a or b == "1" for a, b in zip(agreed, theirs, strict=True)]
    if round_:
        _exchange.forget(_key(round_ - 1, me))
    return agreed


def _key(round_: int, process: int) -> str:
    return f"mmflax/any_process/{round_}/{process}"


def _fetch(round_: int, other: int) -> str:
    try:
        return _exchange.client().blocking_key_value_get(_key(round_, other), TIMEOUT_S * 1000)
    except Exception as e:  # the store reports a timeout as a generic runtime error
        raise errors.CallSequenceError(
            f"Process {jax.process_index()} waited {TIMEOUT_S} s for process {other} to make "
            f"its call {round_ + 1} of `any_process` (which stops every process's training "
            "loop after the same step) and got nothing. Every process must run the same "
            "steps; see that process's output for its own error."
        ) from e
