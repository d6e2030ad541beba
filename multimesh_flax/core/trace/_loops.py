"""The microbatch loop: one ``lax.scan`` for JAX, unrolled by our tracer.

``microbatch`` hands JAX its ``m`` chunks as one ``lax.scan`` whose body runs under the scope
``mmmb<uid>_loop`` (:func:`loop_scope`). JAX then traces, differentiates and transposes the
body once, whatever ``m`` is: the forward scan stacks each iteration's residuals, the backward
scan (``reverse=True``) reads them back and sums each parameter's gradient in its carry. The
inliner (``_trace``) unrolls every such scan into ``m`` iterations, each under the scope
``mmmb<uid>_<k>`` of its microbatch, so the rest of the compiler sees the same per-microbatch
program a Python loop would give:

* a loop input sliced per iteration is the chunk's own slice of the batch (:func:`slice_of`);
* a stacked loop output (a residual) read by the other loop is its iteration's value
  (:class:`Stacked`); it is only concatenated for another reader;
* what JAX hoisted out of the loop because it depends on loop constants alone (a parameter
  reshaped, cast or broadcast) is recomputed in each iteration that reads it
  (:class:`Hoisted`), as each call of the body would compute it: every microbatch keeps the
  same program, so its stages keep sharing one executable.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence
from typing import Any

import jax.extend.core as jex
from jax import lax

LOOP_RE = re.compile(r"mmmb(\d+)_loop")


def loop_scope(uid: int) -> str:
    """The named scope of the body of ``microbatch`` call ``uid``'s scan."""
    return f"mmmb{uid}_loop"


def loop_uid(eqn: Any) -> int | None:
    """The ``microbatch`` uid of a ``scan`` equation that is a microbatch loop, else ``None``."""
    if eqn.primitive.name != "scan":
        return None
    for inner in eqn.params["jaxpr"].jaxpr.eqns:
        found = LOOP_RE.search(str(inner.source_info.name_stack))
        if found:
            return int(found.group(1))
    return None


def hoisted_uid(stack: str) -> int | None:
    """The uid of the loop scope in a name stack outside every iteration: JAX hoisted the
    equation out of that loop (see module doc)."""
    found = LOOP_RE.search(stack)
    return int(found.group(1)) if found else None


def in_iteration(stack: str, uid: int, k: int) -> str:
    """``stack`` with loop ``uid``'s scope replaced by microbatch ``k``'s.

    >>> in_iteration("transpose(jvp())/mmmb3_loop/GPT", 3, 5)
    'transpose(jvp())/mmmb3_5/GPT'
    """
    return stack.replace(loop_scope(uid), f"mmmb{uid}_{k}")


def outside(stack: str, uid: int) -> str:
    """``stack`` without loop ``uid``'s scope (a value computed once for all iterations).

    >>> outside("jvp()/mmmb3_loop/GPT", 3)
    'jvp()/GPT'
    """
    return stack.replace(f"/{loop_scope(uid)}", "").replace(loop_scope(uid), "").lstrip("/")


@dataclasses.dataclass(eq=False)
class Stacked:
    """A stacked output of an unrolled loop: one variable per iteration."""

    parts: list[Any]
    aval: Any
    stack: str  # where the concatenation goes, if a reader needs the whole stack
    loop: Any  # the loop equation
    whole: Any = None  # the concatenated variable, once made


@dataclasses.dataclass(eq=False)
class Hoisted:
    """An equation JAX hoisted out of loop ``uid``, replayed per iteration that reads it."""

    eqn: Any
    invars: list[Any]  # variables, literals or tokens
    stack: str
    uid: int
    per_iteration: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    once: list[Any] | None = None  # outputs computed outside every iteration, if needed


@dataclasses.dataclass(eq=False)
class HoistedOut:
    """Output ``index`` of a :class:`Hoisted` equation."""

    source: Hoisted
    index: int


@dataclasses.dataclass(eq=False)
class Zero:
    """A loop's initial carry that is all zeros (``var``): the start of a sum."""

    var: Any


def is_zero(value: Any) -> bool:
    """Whether ``value`` is a literal zero."""
    return isinstance(value, jex.Literal) and not isinstance(value.val, bool) and value.val == 0


def is_zeros(eqn: Any) -> bool:
    """Whether ``eqn`` broadcasts a literal zero (``jnp.zeros``)."""
    return eqn.primitive is lax.broadcast_in_dim_p and is_zero(eqn.invars[0])


def plus_zero(eqn: Any, values: list[Any]) -> Any:
    """For ``zero + x`` with ``zero`` a :class:`Zero` carry and ``x`` of the result's type,
    ``x`` (a sum started at zero needs no first addition); else ``None``.

    ``0 + x`` is ``x`` exactly (but for the sign of a zero ``x``), as after a Python loop,
    whose sum starts at its first term.
    """
    if eqn.primitive.name not in ("add", "add_any") or len(values) != 2:
        return None
    a, b = values
    other = b if isinstance(a, Zero) else a if isinstance(b, Zero) else None
    if other is None or isinstance(other, Zero) or not hasattr(other, "aval"):
        return None
    same = other.aval.shape == eqn.outvars[0].aval.shape
    return other if same and other.aval.dtype == eqn.outvars[0].aval.dtype else None


def _eqn(primitive: Any, invars: list[Any], aval: Any, params: dict[str, Any], like: Any) -> Any:
    out = jex.Var(aval)
    return jex.new_jaxpr_eqn(invars, [out], primitive, params, frozenset(), like.source_info)


def _rows(var: Any, aval: Any, start: int, stop: int, out_aval: Any, like: Any) -> Any:
    """``var[start:stop]`` along axis 0 as a ``slice`` equation with output ``out_aval``."""
    starts = (start,) + (0,) * (len(aval.shape) - 1)
    limits = (stop, *aval.shape[1:])
    params = {"start_indices": starts, "limit_indices": limits, "strides": (1,) * len(starts)}
    return _eqn(lax.slice_p, [var], out_aval, params, like)


def slice_of(var: Any, k: int, reshape: Any, like: Any) -> list[Any]:
    """Equations reading iteration ``k``'s slice of loop input ``var`` (the last equation's
    output). ``reshape`` is the equation that made ``var`` by splitting a batch's axis 0 into
    ``(length, chunk)``, if it did: then the slice reads the batch itself, as the chunk's own
    slice (so the reshape of the whole batch is dead code).
    """
    aval = var.aval
    chunk = aval.update(shape=aval.shape[1:])
    if reshape is not None:
        size = aval.shape[1]
        source = reshape.invars[0]
        return [_rows(source, source.aval, k * size, (k + 1) * size, chunk, like)]
    row = aval.update(shape=(1, *aval.shape[1:]))
    first = _rows(var, aval, k, k + 1, row, like)
    squeeze = _eqn(lax.squeeze_p, [first.outvars[0]], chunk, {"dimensions": (0,)}, like)
    return [first, squeeze]


def splits_leading_axis(eqn: Any) -> bool:
    """Whether ``eqn`` reshapes ``(n * c, *rest)`` into ``(n, c, *rest)`` (a batch into its
    stacked chunks)."""
    if eqn.primitive is not lax.reshape_p or eqn.params.get("dimensions") is not None:
        return False
    before, after = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    return (
        len(after) == len(before) + 1
        and after[2:] == before[1:]
        and after[0] * after[1] == before[0]
    )


def stack_of(parts: list[Any], aval: Any, like: Any) -> list[Any]:
    """Equations concatenating ``parts`` (one per iteration) into one array of ``aval``."""
    eqns, rows = [], []
    row = aval.update(shape=(1, *aval.shape[1:]))
    for part in parts:
        dims = tuple(range(1, len(aval.shape)))
        params = {"shape": row.shape, "broadcast_dimensions": dims, "sharding": None}
        eqns.append(_eqn(lax.broadcast_in_dim_p, [part], row, params, like))
        rows.append(eqns[-1].outvars[0])
    eqns.append(_eqn(lax.concatenate_p, rows, aval, {"dimension": 0}, like))
    return eqns


def at_first_use(
    eqns: list[Any], stacks: list[str], labels: list[Any], late: list[bool]
) -> tuple[list[Any], list[str], list[Any]]:
    """``eqns``, ``stacks`` and ``labels`` in :func:`first_use_order` (``late[i]``: whether
    equation ``i`` recomputes a hoisted value)."""
    order = first_use_order(eqns, {i for i, flag in enumerate(late) if flag})
    return [eqns[i] for i in order], [stacks[i] for i in order], [labels[i] for i in order]


def first_use_order(eqns: Sequence[Any], late: Collection[int]) -> list[int]:
    """The program order with each equation at a position in ``late`` moved to just before
    its first reader (positions into ``eqns``).

    A hoisted value is recomputed in each iteration before that iteration's body, but the
    body holds every stage: a later stage's parameter reshape would come before the first
    stage's work, and stages are ordered by first forward use (``_pipeline``). At its
    reader, it comes where the body's own call would have computed it.
    """
    pending: dict[Any, int] = {}  # output variable -> index of the late equation making it
    order: list[int] = []

    def release(root: int) -> None:
        """Appends ``root`` after the pending equations it reads, transitively (depth first
        with an explicit stack: a chain of hoisted values can be thousands long)."""
        stack = [(root, False)]
        while stack:
            i, ready = stack.pop()
            if ready:
                order.append(i)
                continue
            if not any(v in pending for v in eqns[i].outvars):
                continue  # released meanwhile, through another reader
            for v in eqns[i].outvars:
                pending.pop(v, None)
            stack.append((i, True))
            reads = [v for v in eqns[i].invars if not isinstance(v, jex.Literal)]
            stack.extend((pending[v], False) for v in reversed(reads) if v in pending)

    for i, eqn in enumerate(eqns):
        if i in late:
            pending.update((v, i) for v in eqn.outvars)
            continue
        for v in eqn.invars:
            if not isinstance(v, jex.Literal) and v in pending:
                release(pending[v])
        order.append(i)
    for i in sorted(set(pending.values())):
        if any(v in pending for v in eqns[i].outvars):
            release(i)
    return order
