"""Structural keys of jaxprs, and the bounded cache of compiled fragments keyed by them.

Two fragments that compute the same thing -- the same stage for each of 32 microbatches, or
identical transformer blocks on different submeshes -- should share one ``jax.jit``: traced
and lowered once, compiled once (``run/_relocate`` moves it to the other device sets).
Printing each fragment's jaxpr to compare them (``str(jaxpr)``) cost more than half of
partitioning a 32-microbatch program, so fragments are compared by :func:`structural_key`
instead: the equations' primitives, parameters and types, with variables numbered by first
appearance. Two jaxprs with equal keys are the same program up to variable names.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Any

import jax.extend.core as jex
import numpy as np


def _aval_key(aval: Any) -> Hashable:
    """Shape, dtype and weak type: what printing a jaxpr shows of a variable's type.

    The rest of an aval (its sharding on the traced mesh, say) is left out: the fragment's
    ``jax.jit`` specialises on the arrays it is called with anyway.
    """
    shape = getattr(aval, "shape", None)
    if shape is None:
        return aval
    return (shape, aval.dtype, getattr(aval, "weak_type", False))


def _literal_key(lit: Any) -> Hashable:
    value = np.asarray(lit.val)
    return ("literal", _aval_key(lit.aval), value.dtype.str, value.shape, value.tobytes())


def _param_key(value: Any) -> Hashable:
    """A hashable stand-in for an equation parameter (equal values, equal keys)."""
    if isinstance(value, jex.ClosedJaxpr) and not value.consts:
        value = value.jaxpr
    if isinstance(value, jex.Jaxpr):
        return ("jaxpr", structural_key(value))  # blocks, loop and branch bodies
    if isinstance(value, jex.ClosedJaxpr):
        return ("jaxpr", str(value))  # with constants: rare, and printed only here
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_param_key(x) for x in value))
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    try:
        hash(value)
    except TypeError:
        return ("repr", type(value), repr(value))
    return (type(value), value)


def _params_key(params: dict[str, Any], memo: dict[int, Any] | None) -> Hashable:
    if memo is not None and id(params) in memo:
        return memo[id(params)][1]
    key = tuple(sorted((k, _param_key(p)) for k, p in params.items()))
    if memo is not None:
        memo[id(params)] = (params, key)  # the dict itself pins its id while memo lives
    return key


def equation_key(eqn: Any, memo: dict[int, Any] | None = None) -> Hashable:
    """A key equal for equations that compute the same thing on possibly other variables:
    primitive, parameters, literal operands and result types (``memo``: as in
    :func:`structural_key`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> a, b, c = jax.make_jaxpr(lambda x, y: (x * 2, y * 2, x * 3))(1.0, 2.0).jaxpr.eqns
        >>> equation_key(a) == equation_key(b), equation_key(a) == equation_key(c)
        (True, False)
    """
    ins = tuple(_literal_key(v) if type(v) is jex.Literal else None for v in eqn.invars)
    outs = tuple(_aval_key(v.aval) for v in eqn.outvars)
    return (eqn.primitive, ins, outs, _params_key(eqn.params, memo))


class StructuralKey:
    """A jaxpr's structure as a hashable value whose hash is computed once: the fragment
    cache looks keys up by hash, and these tuples are large."""

    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple[Hashable, ...]) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StructuralKey)
            and self._hash == other._hash
            and self.parts == other.parts
        )


def structural_key(jaxpr: jex.Jaxpr, memo: dict[int, Any] | None = None) -> StructuralKey:
    """A key equal for jaxprs that differ only in their variables' names.

    ``memo`` (a dict kept across calls) remembers each equation parameter dict's key by
    identity: the copies of a body traced once share their parameter dicts.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0).jaxpr
        >>> g = jax.make_jaxpr(lambda y: jnp.sin(y) * 2)(1.0).jaxpr
        >>> h = jax.make_jaxpr(lambda x: jnp.sin(x) * 3)(1.0).jaxpr
        >>> structural_key(f) == structural_key(g), structural_key(f) == structural_key(h)
        (True, False)
    """
    number: dict[Any, int] = {}
    aval_keys: dict[int, Hashable] = {}  # by id: the jaxpr's variables pin their avals
    literal = jex.Literal

    def aval_key(aval: Any) -> Hashable:
        key = aval_keys.get(id(aval))
        if key is None:
            key = aval_keys[id(aval)] = _aval_key(aval)
        return key

    for v in [*jaxpr.constvars, *jaxpr.invars]:
        number[v] = len(number)
    parts: list[Hashable] = [tuple(aval_key(v.aval) for v in (*jaxpr.constvars, *jaxpr.invars))]
    for eqn in jaxpr.eqns:
        ins = tuple([_literal_key(v) if type(v) is literal else number[v] for v in eqn.invars])
        for v in eqn.outvars:
            number[v] = len(number)
        params = _params_key(eqn.params, memo)
        outs = tuple([aval_key(v.aval) for v in eqn.outvars])
        parts.append((eqn.primitive, ins, outs, params))
    parts.append(tuple(_literal_key(v) if type(v) is literal else number[v] for v in jaxpr.outvars))
    return StructuralKey(tuple(parts))


_ABSENT = object()  # what ``BoundedCache`` finds under a key it does not hold


class BoundedCache:
    """A dict that forgets its least recently used entries beyond ``capacity``.

    Entries only save work: a forgotten compiled fragment is still held by the programs
    that use it, and a new program with the same fragment builds its own.

    Example:
        >>> cache = BoundedCache(capacity=2)
        >>> for k in "abc":
        ...     _ = cache.get_or_make(k, str.upper)
        >>> list(cache)
        ['b', 'c']
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._newest: Any = _ABSENT  # the value at the end of ``_items`` (the latest used)

    def get_or_make(self, key: Hashable, make: Callable[[Hashable], Any]) -> Any:
        """The value under ``key``, made with ``make(key)`` if absent.

        A hit on the entry used last moves nothing: a step called again and again looks
        its key up once (hashing and comparing a key whose pytree structure has hundreds of
        nodes costs about 20 us each time).
        """
        value = self._items.get(key, _ABSENT)
        if value is not _ABSENT:
            if value is not self._newest:
                self._items.move_to_end(key)
                self._newest = value
            return value
        value = self._items[key] = self._newest = make(key)
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value

    def clear(self) -> None:
        self._items.clear()
        self._newest = _ABSENT

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


RETURNED = "out"  # what ``equation_readers`` lists for a variable the jaxpr returns


def equation_readers(eqns: Any, outvars: Any = ()) -> dict[Any, list[Any]]:
    """Per variable, the index in ``eqns`` of each equation reading it (once per operand)
    and ``RETURNED`` where ``outvars`` holds it; literals are left out.

    >>> import jax
    >>> jaxpr = jax.make_jaxpr(lambda x: (x * 2, x + 1))(1.0).jaxpr
    >>> x = jaxpr.invars[0]
    >>> equation_readers(jaxpr.eqns, jaxpr.outvars)[x]
    [0, 1]
    >>> equation_readers(jaxpr.eqns, jaxpr.outvars)[jaxpr.eqns[0].outvars[0]]
    ['out']
    """
    readers: dict[Any, list[Any]] = {
        v: [RETURNED] for v in outvars if not isinstance(v, jex.Literal)
    }
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, jex.Literal):
                readers.setdefault(v, []).append(i)
    return readers
