"""Argument donation for ``jit``: which leaves a call may consume, checked before it runs.

A donated array's buffer is reused for the call's outputs, so the array is deleted by the
call. Three mistakes would hand XLA a buffer that is already gone and can crash the
process; each is refused with a ``multimesh_flax.errors`` error before anything runs:

* at ``jit(...)``: an argument both static and donated (``check_argnums``);
* at a call: ``donate_argnums`` beyond the call's positional arguments, or one array passed
  both in a donated position and in another (donated or not) position of the same call
  (``Donation.claim``);
* across threads: two calls consuming the same arrays at once (one state stepped from two
  threads). Each call *claims* its donated arrays under one process-wide lock before it
  dispatches and releases them once dispatched (by then XLA has deleted them). A call
  finding one of them claimed raises ``ConsumedArrayError``; one coming later finds them
  deleted (``jit``'s own check).

A ``Donation`` is built once per compiled signature; a call costs one C-level pass over its
donated array leaves (a ``set`` of their ids, about 0.1 us a leaf) and a lock, not a
Python loop.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from multimesh_flax import errors

_LOCK = threading.Lock()
# Per call in flight, the ids of the arrays it is consuming. A list of sets, not one set: with
# no other call in flight, claiming and releasing cost O(1), not a pass over the leaves.
_CLAIMS: list[set[int]] = []


def check_argnums(static: tuple[int, ...], donate: tuple[int, ...]) -> None:
    """Refuses an argument both static and donated.

    Raises:
        DonationError: ``static_argnums`` and ``donate_argnums`` share a position.
    """
    both = sorted(set(static) & set(donate))
    if both:
        raise errors.DonationError(
            f"Argument {both[0]} is in both `static_argnums`={static} and "
            f"`donate_argnums`={donate}. A static argument is a compile-time constant, not a "
            "buffer the call can consume: remove it from `donate_argnums`."
        )


def check_count(donate: tuple[int, ...], num_args: int) -> None:
    """Refuses ``donate_argnums`` beyond a call's ``num_args`` positional arguments.

    Raises:
        DonationError: an index in ``donate`` is not below ``num_args``.
    """
    beyond = [i for i in donate if i >= num_args]
    if beyond:
        raise errors.DonationError(
            f"`donate_argnums`={donate} names argument {beyond[0]}, but the call has "
            f"{num_args} positional arguments. Donate only arguments the call passes "
            "positionally, or fix `donate_argnums`."
        )


def _getter(indices: tuple[int, ...]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    if len(indices) == 1:
        index = indices[0]
        return lambda leaves: (leaves[index],)
    return operator.itemgetter(*indices)


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


class Donation:
    """The donated leaves of one compiled signature, and the checks a call makes on them.

    Args:
        donated: positions (in the flat dynamic leaves) of the donated leaves.
        leaves: the leaves of the call the program was built for (Python scalars, which
            are never donated, are left out of the checks).
    """

    def __init__(self, donated: tuple[int, ...], leaves: Sequence[Any]) -> None:
        donated_set = set(donated)
        shaped = [i for i, x in enumerate(leaves) if hasattr(x, "shape")]
        self.donated = donated
        self._arrays = tuple(i for i in shaped if i in donated_set)
        self._plain = tuple(i for i in shaped if i not in donated_set)
        self._get_arrays = _getter(self._arrays) if self._arrays else None
        self._get_plain = _getter(self._plain) if self._plain else None

    def claim(self, leaves: Sequence[Any], describe: Callable[[int], str]) -> set[int]:
        """Claims this call's donated arrays; returns what to pass to ``release``.

        ``describe(i)`` names flat leaf ``i`` in messages, e.g. ``args[0]['w']``.

        Raises:
            DonationError: one array is passed in a donated and in another position.
            ConsumedArrayError: a call in another thread is consuming one of them now.
        """
        if self._get_arrays is None:
            return set()
        mine = self._get_arrays(leaves)
        ids = set(map(id, mine))
        if len(ids) < len(mine) or (
            self._get_plain is not None and not ids.isdisjoint(map(id, self._get_plain(leaves)))
        ):
            self._check_aliases(leaves, describe)  # raises unless only non-jax values repeat
        with _LOCK:
            busy = not all(map(ids.isdisjoint, _CLAIMS))
            if not busy:
                _CLAIMS.append(ids)
        if busy:
            raise self._busy_error(leaves, describe)
        return ids

    @staticmethod
    def release(ids: set[int]) -> None:
        """Ends a claim: the call has dispatched (its donated arrays are deleted)."""
        if ids:
            with _LOCK:
                for i, claim in enumerate(_CLAIMS):
                    if claim is ids:
                        del _CLAIMS[i]
                        break

    def _check_aliases(self, leaves: Sequence[Any], describe: Callable[[int], str]) -> None:
        donated = set(self._arrays)
        first: dict[int, int] = {}
        for i in sorted(self._arrays + self._plain):
            x = leaves[i]
            if not _is_array(x):
                continue
            j = first.setdefault(id(x), i)
            if j != i and (i in donated or j in donated):
                raise errors.DonationError(
                    f"The same array ({x.dtype}{list(x.shape)}) is passed as "
                    f"`{describe(j)}` and as `{describe(i)}`, and "
                    f"{'both are' if i in donated and j in donated else 'one is'} "
                    "donated: the call would consume it while still reading it. Pass a copy "
                    "(`jnp.copy(x)`) in one of the places, or leave that argument out of "
                    "`donate_argnums`."
                )

    def _busy_error(
        self, leaves: Sequence[Any], describe: Callable[[int], str]
    ) -> errors.ConsumedArrayError:
        with _LOCK:
            claimed = set().union(*_CLAIMS)
        index = next((i for i in self._arrays if id(leaves[i]) in claimed), self._arrays[0])
        x = leaves[index]
        return errors.ConsumedArrayError(
            f"Argument leaf `{describe(index)}` ({x.dtype}{list(x.shape)}) is being "
            "consumed right now by a call in another thread that donated it: two threads "
            "are stepping the same state. Step one state from one thread (rebind it, "
            "`loss, state = step_fn(state, batch)`), or give each thread its own copy."
        )
