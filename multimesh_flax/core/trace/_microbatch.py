"""``microbatch``: run a function over slices of its batch, optionally pipelined.

``microbatch(fun, dim, size)`` returns a function that splits one argument (a pytree) along
``dim`` into ``m = length // size`` chunks, calls ``fun`` on each chunk and reduces the
outputs (sum or mean). Under our ``jit`` the chunks reach JAX as one ``lax.scan`` whose body
runs ``fun`` under the reserved named scope ``mmmb<uid>_loop``, so JAX traces, differentiates
and transposes ``fun`` once for any ``m``; the tracer (``_trace``, ``_loops``) then unrolls
the scan, putting chunk ``k``'s equations under the scope ``mmmb<uid>_<k>`` -- also those of
a ``jax.grad`` taken outside. The partitioner (``_pipeline``) reads these scopes to cut the
program into one fragment per (stage, microbatch, phase) and to dispatch them in the order of
the schedule registered here under ``uid``. A task whose mesh depends on the microbatch index
(``loop_dependent_mesh_slice``) makes the chunks differ: they are then traced one by one, as
a Python loop, each under its own scope. Outside ``jit`` -- plain JAX, eager,
``ignore_transforms`` -- the loop computes the same values and the schedule plays no part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    SCHEDULE_NAMES,
    PipelineOptions,
    ScheduleOp,
    ignore_transforms,
    pipeline_options,
)
from multimesh_flax.core.trace import _constraints, _loops, _session

_REDUCTIONS = ("sum", "mean")


def _register(options: PipelineOptions, num_microbatches: int) -> int:
    session = _session.current_session()
    if session is None:  # plain JAX or eager: nothing will read the scopes
        return 0
    return session.add_microbatch_call(options, num_microbatches)


# --- argument checks ------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_positive(**values: Any) -> None:
    for name, value in values.items():
        if value is not None and (not _is_int(value) or value < 1):
            raise errors.MicrobatchArgumentError(
                f"Expected `{name}` to be a positive integer, got {value!r}. Pass an int >= 1."
            )


def _check_custom_entry(entry: Any) -> None:
    if isinstance(entry, (ScheduleOp, str)):
        if isinstance(entry, str):
            ScheduleOp.parse(entry)
        return
    if isinstance(entry, (tuple, list)) and len(entry) == 3:
        stage, microbatch, phase = entry
        named = _is_int(stage) or isinstance(stage, str)
        if named and _is_int(microbatch) and phase in ("F", "B", "W"):
            return
    raise errors.InvalidScheduleError(
        "Expected each `custom_schedule` entry to be a ScheduleOp, a string like 'F0.3' or "
        f"a tuple (stage index or task name, microbatch, phase in 'F'/'B'/'W'), got {entry!r}."
    )


def _normalise_custom(custom: Any) -> tuple[tuple[Any, ...], ...]:
    if isinstance(custom, (str, bytes)) or not isinstance(custom, Sequence):
        raise errors.InvalidScheduleError(
            "Expected `custom_schedule` as one sequence of ops per submesh, got "
            f"{type(custom).__name__}: {custom!r}."
        )
    rows = []
    for row in custom:
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise errors.InvalidScheduleError(
                f"Expected each row of `custom_schedule` to be a sequence of ops, got {row!r}."
            )
        for entry in row:
            _check_custom_entry(entry)
        rows.append(tuple(tuple(e) if isinstance(e, list) else e for e in row))
    return tuple(rows)


def _make_options(options: PipelineOptions) -> PipelineOptions:
    """``options`` checked, with ``"custom"`` implied by a custom order and that order in its
    normal form."""
    schedule, custom_schedule = options.schedule, options.custom_schedule
    if custom_schedule is not None and schedule is None:
        schedule = "custom"
    if schedule is not None and schedule not in SCHEDULE_NAMES:
        raise errors.InvalidScheduleError(
            f"Unknown `schedule`={schedule!r}. Use one of {list(SCHEDULE_NAMES)}, or None for "
            "program order."
        )
    if (schedule == "custom") != (custom_schedule is not None):
        raise errors.MicrobatchArgumentError(
            f"`custom_schedule` goes with `schedule`='custom' and only with it; got "
            f"`schedule`={schedule!r} and `custom_schedule` "
            f"{'given' if custom_schedule is not None else 'missing'}."
        )
    shaped = ("zero-bubble-auto", "zero-bubble-v")
    tuning = (options.costs, options.max_in_flight, options.w_memory)
    if any(value is not None for value in tuning) and schedule not in shaped:
        raise errors.MicrobatchArgumentError(
            f"`costs`, `max_in_flight` and `w_memory` shape the orders of {list(shaped)} "
            f"only, got `schedule`={schedule!r}. Drop them, or choose one of those schedules."
        )
    _check_positive(
        microbatches=options.microbatches,
        num_stages=options.num_stages,
        interleave=options.interleave,
        max_in_flight=options.max_in_flight,
    )
    custom = None if custom_schedule is None else _normalise_custom(custom_schedule)
    return dataclasses.replace(options, schedule=schedule, custom_schedule=custom)


# --- splitting and reducing -----------------------------------------------------------------


def _leaf_axis(leaf: Any, dim: int, path: str) -> int:
    ndim = np.ndim(leaf)
    if not -ndim <= dim < ndim:
        raise errors.MicrobatchAxisError(
            f"Expected `dim`={dim} to be an axis of every leaf of the split argument, but "
            f"leaf {path or '<root>'} has shape {tuple(np.shape(leaf))}. Use a `dim` in "
            f"[-{ndim}, {ndim}) for it, or split another argument (`argnum`)."
        )
    return dim % ndim


def _num_microbatches(batch: Any, dim: int, size: int) -> int:
    length = _split_length(batch, dim)
    if length % size:
        raise errors.UnevenMicrobatchError(
            f"`size`={size} does not divide the batch length {length} along `dim`={dim} "
            f"({length % size} example(s) would be left over). Use a `size` that divides "
            f"{length}, or pad or trim the batch to a multiple of {size}."
        )
    return length // size


def _split_length(batch: Any, dim: int) -> int:
    """The split argument's one length along ``dim``."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise errors.MicrobatchAxisError(
            "Expected the split argument to hold at least one array, got an empty pytree "
            f"({batch!r}). Check `argnum`."
        )
    lengths = {}
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        lengths[name] = np.shape(leaf)[_leaf_axis(leaf, dim, name)]
    if len(set(lengths.values())) > 1:
        raise errors.UnevenMicrobatchError(
            f"Expected every leaf of the split argument to have the same length along "
            f"`dim`={dim}, got {lengths}. Split arguments of one batch size only."
        )
    return next(iter(lengths.values()))


def _chunk(batch: Any, k: int, dim: int, size: int) -> Any:
    def take(leaf: Any) -> Any:
        axis = dim % np.ndim(leaf)
        return jax.lax.slice_in_dim(leaf, k * size, (k + 1) * size, axis=axis)

    return jax.tree_util.tree_map(take, batch)


def _divided(x: Any, m: int) -> Any:
    """``x / m``; a float ``x`` is its own mean over one microbatch (no extra glue op)."""
    if m == 1 and jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return x
    return x / m


@dataclasses.dataclass(frozen=True)
class _Split:
    dim: int
    size: int
    argnum: int
    arg_shardings: Any
    reduce: str
    trace_once: bool = True


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity (``jax.jit`` of a method)
class _Call:
    """One call of a microbatched function: ``fun``, its arguments and the split."""

    fun: Callable[..., Any]
    split: _Split
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    m: int  # the number of microbatches

    @property
    def batch(self) -> Any:
        return self.args[self.split.argnum]

    def apply(self, chunk: Any) -> Any:
        """``fun`` on one chunk in place of the split argument."""
        at = self.split.argnum
        return self.fun(*self.args[:at], chunk, *self.args[at + 1 :], **self.kwargs)

    def constrained(self, chunk: Any) -> Any:
        if self.split.arg_shardings is None:
            return chunk
        return _constraints.with_sharding_constraint(chunk, self.split.arg_shardings)

    def explaining(self) -> contextlib.AbstractContextManager[None]:
        return _explaining_split(self.fun, self.split, self.args, self.kwargs, self.m)


def _chunk_type(leaf: Any, split: _Split) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(leaf)
    shape = list(aval.shape)
    shape[split.dim % len(shape)] = split.size
    return jax.ShapeDtypeStruct(tuple(shape), aval.dtype, weak_type=aval.weak_type)


def _stacked_chunks(leaf: Any, split: _Split, m: int) -> Any:
    """``leaf`` as ``m`` chunks stacked on a new leading axis."""
    shape = jnp.shape(leaf)
    axis = split.dim % len(shape)
    chunks = jnp.reshape(leaf, (*shape[:axis], m, split.size, *shape[axis + 1 :]))
    return jnp.moveaxis(chunks, axis, 0) if axis else chunks


def _probe(call: _Call, shared: Callable[..., Any]) -> Any:
    """The output type of ``shared`` (``call.apply`` under ``jax.jit``), or ``None`` when a
    task resolved its mesh from the microbatch index (the chunks then differ).

    This is the body's one trace; the scan (or chunk 0 of the loop) reuses it from
    ``jax.jit``'s cache.
    """
    chunk = jax.tree_util.tree_map(lambda leaf: _chunk_type(leaf, call.split), call.batch)
    session = _session.current_session()
    before, session.loop_dependent = session.loop_dependent, False
    try:
        with _session.microbatch_iteration(0), call.explaining():
            out = jax.eval_shape(shared, chunk)
        dependent = session.loop_dependent
    finally:
        session.loop_dependent = before or session.loop_dependent
    return None if dependent else out


def _scanned(call: _Call, shared: Callable[..., Any], out: Any, uid: int) -> Any:
    """The sum of ``shared`` over the chunks as one ``lax.scan`` (``_loops``): JAX traces,
    differentiates and transposes its body once for any number of microbatches."""

    def step(total: Any, chunk: Any) -> tuple[Any, None]:
        with jax.named_scope(_loops.loop_scope(uid)):
            out = shared(call.constrained(chunk))
        # The sum over microbatches is outside every microbatch, as after a Python loop.
        return jax.tree_util.tree_map(operator.add, total, out), None

    zeros = jax.tree_util.tree_map(lambda o: jnp.zeros(o.shape, o.dtype), out)
    stacked = jax.tree_util.tree_map(
        lambda leaf: _stacked_chunks(leaf, call.split, call.m), call.batch
    )
    total, _ = jax.lax.scan(step, zeros, stacked)
    return total


def _unrolled(call: _Call, uid: int, first: Callable[..., Any] | None = None) -> Any:
    """The sum of ``call.apply`` over the chunks, traced once per chunk (a Python loop);
    ``first`` (``call.apply`` under ``jax.jit``, already traced) runs chunk 0."""
    split, outs = call.split, []
    for k in range(call.m):
        with jax.named_scope(f"mmmb{uid}_{k}"), _session.microbatch_iteration(k):
            chunk = call.constrained(_chunk(call.batch, k, split.dim, split.size))
            with call.explaining():
                outs.append(first(chunk) if k == 0 and first else call.apply(chunk))
    return functools.reduce(lambda a, b: jax.tree_util.tree_map(operator.add, a, b), outs)


def _run(
    fun: Callable[..., Any],
    split: _Split,
    options: PipelineOptions,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if split.argnum >= len(args):
        raise errors.MicrobatchAxisError(
            f"`argnum`={split.argnum} names the split argument, but the call has "
            f"{len(args)} positional argument(s). Pass the batch positionally."
        )
    if options.microbatches is not None:  # a count: the size follows from the batch
        length = _split_length(args[split.argnum], split.dim)
        if length % options.microbatches:
            raise errors.UnevenMicrobatchError(
                f"`microbatches`={options.microbatches} does not divide the batch length "
                f"{length} along `dim`={split.dim} ({length % options.microbatches} "
                "example(s) would be left over). Use a count that divides it, or pad or trim "
                "the batch."
            )
        split = dataclasses.replace(split, size=length // options.microbatches)
    m = _num_microbatches(args[split.argnum], split.dim, split.size)
    call = _Call(fun, split, args, kwargs, m)
    uid = _register(options, m)
    # Outside our traces (eager, plain JAX) nothing reads the scopes: a plain loop. One
    # microbatch is one call of the body (a loop of one would only add JAX's scan work).
    shared = jax.jit(call.apply) if uid and split.trace_once else None
    out = _probe(call, shared) if shared is not None and m > 1 else None
    total = _scanned(call, shared, out, uid) if out is not None else _unrolled(call, uid, shared)
    if split.reduce == "mean":
        total = jax.tree_util.tree_map(lambda x: _divided(x, m), total)
    return total


@contextlib.contextmanager
def _explaining_split(
    fun: Callable[..., Any], split: _Split, args: tuple[Any, ...], kwargs: dict[str, Any], m: int
) -> Iterator[None]:
    """Turns a shape error that only the split causes into a ``MicrobatchAxisError``.

    Forgetting ``argnum`` splits the parameters instead of the batch, and ``fun`` then fails
    deep inside JAX (``dot_general`` shapes). If ``fun`` accepts the unsplit arguments (one
    abstract evaluation, on this error path only), the split is to blame; otherwise the
    error is ``fun``'s own and propagates unchanged.
    """
    try:
        yield
    except (TypeError, ValueError) as e:
        if isinstance(e, errors.MultiMeshError) or not _fits_unsplit(fun, args, kwargs):
            raise
        leaves = jax.tree_util.tree_leaves(args[split.argnum])
        shapes = [tuple(np.shape(leaf)) for leaf in leaves][:4]
        raise errors.MicrobatchAxisError(
            f"Splitting positional argument `argnum`={split.argnum} (leaf shapes {shapes}"
            f"{' ...' if len(leaves) > 4 else ''}) along `dim`={split.dim} into {m} "
            f"microbatches of {split.size} made `fun` fail: {str(e).splitlines()[0]} The "
            "unsplit arguments work, so the wrong argument was split. Pass the batch's index "
            "as `argnum` (e.g. `argnum=1` for fun(params, batch))."
        ) from e


def _fits_unsplit(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        with ignore_transforms():
            jax.eval_shape(functools.partial(fun, **kwargs), *args)
    except Exception:
        return False
    return True


def microbatch(
    fun: Callable[..., Any],
    dim: int,
    size: int | None = None,
    argnum: int = 0,
    *,
    pipeline: PipelineOptions | None = None,
    schedule: str | None = None,
    num_stages: int | None = None,
    interleave: int | None = None,
    custom_schedule: Sequence[Sequence[Any]] | None = None,
    arg_shardings: Any = None,
    reduce: str = "sum",
    trace_once: bool = True,
) -> Callable[..., Any]:
    """Unrolls ``fun`` over microbatches of one argument and reduces the results.

    The returned function splits argument ``argnum`` (a pytree) along ``dim`` into chunks
    of ``size``, calls ``fun`` on each chunk (other arguments unchanged) and sums the
    outputs (``reduce="mean"``: divides the sum by the number of chunks). It works with
    ``jax.value_and_grad`` inside (``microbatch(value_and_grad(loss))`` accumulates
    gradients) or outside, with or without tasks, under ``jit`` or plain JAX. Inside traces
    faster: JAX then differentiates one microbatch's body, not the loop over them (whose
    partial evaluation and transpose cost a fixed extra trace); ``parallelize_step`` does so.

    Under :func:`jit`, the tasks ``fun`` runs, in order of first forward use, are the
    pipeline stages; ``schedule`` orders the (stage, microbatch, phase) units:

    * ``None``: program order (all forwards, then the backwards; GPipe-like);
    * ``"gpipe"``, ``"1f1b"``: one stage per submesh (GPipe also allows several);
    * ``"interleaved-1f1b"``: ``interleave`` stages per submesh, stage ``s`` on the same
      submesh as stage ``s % num_submeshes``;
    * ``"zero-bubble-h1"``, ``"zero-bubble-h2"``, ``"zero-bubble-auto"``: each task's
      backward is split into its activation-gradient part (what the previous stage waits
      for) and its weight-gradient part, which fills bubbles; ``Task.split_backprop`` names
      the two halves. ZB-H1 keeps 1F1B's memory, ZB-H2 up to ``2 p - 1`` microbatches per
      submesh, ``"zero-bubble-auto"`` is the automatic schedule for unit costs within 1F1B's
      memory (``make_schedule`` builds it for other costs);
    * ``"zero-bubble-v"``: the same split on a V, ``2 p`` stages on ``p`` submeshes, stage
      ``s`` on the submesh of stage ``2 p - 1 - s``; the tasks that meet at the V's turn
      on the last submesh split into two stages, the first half (rounded up) and the rest;
    * ``"custom"``: ``custom_schedule``, one sequence per submesh of ops ``"F0.3"``,
      ``ScheduleOp``\\ s or ``(stage index or task name, microbatch, phase)`` tuples.

    Args:
        fun: the function to run per microbatch.
        dim: the axis of every leaf of the split argument to split along.
        size: the microbatch size; it must divide the length along ``dim``. Or give
            ``pipeline.microbatches``, the count, instead.
        argnum: the position of the argument to split.
        pipeline: the split and schedule options as one record (:class:`PipelineOptions`,
            as ``parallelize_step`` takes it), instead of ``schedule`` .. ``custom_schedule``
            one by one; it also carries ``costs`` and ``max_in_flight`` for
            ``"zero-bubble-auto"`` and ``"zero-bubble-v"``.
        schedule: the pipeline schedule name, or ``None``.
        num_stages: the expected number of stages (checked against the tasks found).
        interleave: stages per submesh, for ``"interleaved-1f1b"``.
        custom_schedule: the per-submesh order for ``"custom"`` (implies it).
        arg_shardings: a logical ``PartitionSpec`` pytree (prefix) applied to each chunk
            with ``with_sharding_constraint``.
        reduce: ``"sum"`` or ``"mean"``.
        trace_once: under :func:`jit`, trace ``fun`` once and run the microbatches as one
            ``jax.lax.scan`` (tracing and differentiating then cost the same for any number
            of microbatches). ``fun`` must then not hand traced values out through side
            effects (e.g. appending to a list it closes over): that raises JAX's
            ``UnexpectedTracerError``. ``False`` traces ``fun`` once per microbatch. Tasks
            with a ``loop_dependent_mesh_slice`` are traced per microbatch either way.

    Returns:
        A function with ``fun``'s signature.

    Raises:
        MicrobatchArgumentError: a malformed option (also when the function is created).
        InvalidScheduleError: an unknown schedule name or a malformed custom schedule; at
            ``jit`` time also a schedule that does not fit the program's stages.
        UnevenMicrobatchError: ``size`` does not divide the batch (raised when called).
        MicrobatchAxisError: ``dim`` or ``argnum`` does not exist (raised when called).

    Example:
        >>> import multimesh_flax as mm
        >>> def loss(w, x):
        ...     return jnp.mean((x @ w) ** 2)
        >>> w, x = jnp.ones((3, 1)), jnp.arange(12.0).reshape(4, 3)
        >>> mb_loss = mm.microbatch(loss, 0, 2, argnum=1, reduce="mean")
        >>> bool(jnp.allclose(mb_loss(w, x), loss(w, x)))
        True

        A two-stage pipeline, run in 1F1B order on devices 0 and 1:

        >>> layer0 = mm.task(lambda w, h: jnp.tanh(h @ w), name="layer0",
        ...                  mesh=mm.TaskMesh(devices=[0]))
        >>> layer1 = mm.task(lambda w, h: h @ w, name="layer1", mesh=mm.TaskMesh(devices=[1]))
        >>> def net(ws, x):
        ...     return jnp.mean(layer1(ws[1], layer0(ws[0], x)) ** 2)
        >>> ws = [jnp.ones((3, 3)) / 3, jnp.ones((3, 1))]
        >>> step = mm.jit(jax.grad(mm.microbatch(net, 0, 1, argnum=1, schedule="1f1b",
        ...                                     reduce="mean")))
        >>> grads = step(ws, x)
        >>> with mm.ignore_transforms():  # the same computation, unplaced
        ...     expected = jax.grad(net)(ws, x)
        >>> bool(jnp.allclose(grads[0], expected[0], atol=1e-5))
        True
    """
    if not callable(fun):
        raise errors.MicrobatchArgumentError(
            f"Expected `fun` to be callable, got {type(fun).__name__}: {fun!r}. Pass the "
            "function to run per microbatch."
        )
    if not _is_int(dim):
        raise errors.MicrobatchAxisError(f"Expected `dim` to be an int, got {dim!r}.")
    options = _make_options(
        pipeline_options(
            pipeline,
            {
                "schedule": schedule,
                "num_stages": num_stages,
                "interleave": interleave,
                "custom_schedule": custom_schedule,
            },
            "`microbatch`",
        )
    )
    if (size is None) == (options.microbatches is None):
        raise errors.MicrobatchArgumentError(
            f"Expected the microbatch `size` or a count in `pipeline.microbatches`, exactly "
            f"one of them; got `size`={size!r} and `microbatches`={options.microbatches!r}."
        )
    _check_positive(size=size)
    if not _is_int(argnum) or argnum < 0:
        raise errors.MicrobatchAxisError(
            f"Expected `argnum` to be a non-negative int, got {argnum!r}. Count positional "
            "arguments from 0."
        )
    if reduce not in _REDUCTIONS:
        raise errors.MicrobatchArgumentError(
            f"Expected `reduce` in {list(_REDUCTIONS)}, got {reduce!r}. Use 'mean' for "
            "averaged losses, 'sum' to add the microbatch results."
        )
    size = 0 if size is None else int(size)  # 0: from `pipeline.microbatches` at each call
    split = _Split(int(dim), size, int(argnum), arg_shardings, reduce, bool(trace_once))

    @functools.wraps(fun)
    def microbatched(*args: Any, **kwargs: Any) -> Any:
        return _run(fun, split, options, args, kwargs)

    return microbatched
