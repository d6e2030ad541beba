"""``jit``: compile a function whose tasks sit on different submeshes as one MPMD program.

Per distinct call signature (argument tree, shapes, dtypes, static arguments, device list,
contexts) the function is traced once. If it contains no tasks and the fast path is on, the
result is exactly ``jax.jit``. Otherwise the trace is planned, placed, fragmented and compiled
into an ``MpmdExecutable`` (the passes of ``_build``); later calls with the same signature
only dispatch. The programs of the `PROGRAMS_PER_FUNCTION` most recently used signatures are
kept, as ``jax.jit`` keeps its own.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    DeviceListScope,
    as_device_array,
    check_unique,
    get_device_list,
    get_flag,
    get_multi_mesh,
    no_ambient_mesh,
    registrations_fingerprint,
)
from multimesh_flax.core.fragment import Partition, input_sharding
from multimesh_flax.core.front import _donation
from multimesh_flax.core.front._build import (
    Build,
    FastPath,
    build_program,
    collector_paused,
    partition_program,
)
from multimesh_flax.core.run import CompileAhead, MpmdExecutable
from multimesh_flax.core.trace import BoundedCache, TracedProgram

# Programs one jitted function keeps (each holds its compiled fragments and op list).
PROGRAMS_PER_FUNCTION = 64

# A number per ``MultiMesh`` for cache keys. ``id`` is reused once an object dies, so a new
# MultiMesh at a dead one's address would be served the dead one's program; these never are.
_MESH_SERIALS = itertools.count()
_MESH_TOKENS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _mesh_token(multimesh: Any) -> int | None:
    """The never-reused number of ``multimesh`` (``None`` for no current MultiMesh).

    Example:
        >>> import multimesh_flax as mm
        >>> first = mm.MultiMesh(axis_sizes=(8,), axis_names=("x",))
        >>> token = _mesh_token(first)
        >>> del first  # its id may now be reused; its token is not
        >>> _mesh_token(mm.MultiMesh(axis_sizes=(8,), axis_names=("x",))) == token
        False
    """
    if multimesh is None:
        return None
    token = _MESH_TOKENS.get(multimesh)
    if token is None:
        token = _MESH_TOKENS[multimesh] = next(_MESH_SERIALS)
    return token


def _normalise_argnums(argnums: int | Sequence[int], argument: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if any(not isinstance(n, int) or n < 0 for n in nums):
        raise errors.StaticArgumentError(
            f"Expected `{argument}` as non-negative ints, got {argnums!r}. Index positional "
            f"arguments from 0, e.g. `{argument}=(1,)`."
        )
    return nums


def _leaf_key(x: Any) -> Hashable:
    shape = getattr(x, "shape", None)
    if shape is None:
        return ("py", type(x))
    return (tuple(shape), x.dtype, bool(getattr(x, "weak_type", False)))


class _LeafKeys:
    """The ``_leaf_key`` of every leaf of a call, hashed once.

    A call signature is looked up by hashing its key, two or three times a call; hashing
    hundreds of ``(shape, dtype, weak type)`` tuples costs more than the rest of the key.
    ``_leaf_keys`` interns them (one object per content), so lookups hash a stored number and
    compare by identity (by content only for keys made before the table was last cleared).

    Example:
        >>> a, b = _LeafKeys((((2,), "f4", False),)), _LeafKeys((((2,), "f4", False),))
        >>> a == b, hash(a) == hash(b), a == _LeafKeys(())
        (True, True, False)
    """

    __slots__ = ("keys", "_hash")

    def __init__(self, keys: tuple[Hashable, ...]) -> None:
        self.keys = keys
        self._hash = hash(keys)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _LeafKeys):
            return NotImplemented
        return self._hash == other._hash and self.keys == other.keys


_KEYS_BY_AVALS: dict[tuple[Any, ...], _LeafKeys] = {}
_INTERNED: dict[_LeafKeys, _LeafKeys] = {}  # one object per content: equal means identical
_MAX_REMEMBERED = 256


def _interned(keys: tuple[Hashable, ...]) -> _LeafKeys:
    """The one ``_LeafKeys`` of this content (a new one once the table was cleared)."""
    if len(_INTERNED) >= _MAX_REMEMBERED:
        _INTERNED.clear()
    made = _LeafKeys(keys)
    return _INTERNED.setdefault(made, made)


def _leaf_keys(leaves: Sequence[Any]) -> _LeafKeys:
    """``_leaf_key`` of every leaf, remembered per tuple of avals.

    A training step's state has hundreds of leaves; building their keys attribute by
    attribute costs about a microsecond each, every call. Arrays carry a cached ``aval``
    (shape, dtype, weak type and abstract sharding) that hashes fast, so keys are built once
    per distinct tuple of avals. The abstract sharding only makes that memo finer than the
    keys themselves: arrays that differ only in placement still share one program.
    """
    try:
        avals = tuple([x.aval for x in leaves])
    except AttributeError:  # numpy arrays, Python scalars
        return _interned(tuple(map(_leaf_key, leaves)))
    keys = _KEYS_BY_AVALS.get(avals)
    if keys is None:
        if len(_KEYS_BY_AVALS) >= _MAX_REMEMBERED:
            _KEYS_BY_AVALS.clear()
        keys = _KEYS_BY_AVALS[avals] = _interned(tuple(map(_leaf_key, leaves)))
    return keys


def _deleted(x: Any) -> bool:
    is_deleted = getattr(x, "is_deleted", None)
    return bool(is_deleted()) if is_deleted is not None else False


def _any_deleted(leaves: Sequence[Any], indices: tuple[int, ...]) -> bool:
    """Whether a leaf at ``indices`` is an array deleted by donation (0.1-0.3 us a leaf)."""
    try:
        for i in indices:  # a plain loop: faster than map/methodcaller over pybind methods
            if leaves[i].is_deleted():
                return True
    except AttributeError:  # numpy arrays and Python scalars are never deleted
        return any(_deleted(leaves[i]) for i in indices)
    return False


class _Entry:
    """The program built for one signature (``_build.build_program``): what was traced, and
    how it runs.

    ``run`` is an ``MpmdExecutable``, or a ``FastPath`` when the program has no tasks.
    """

    def __init__(self, build: Build, devices: Any) -> None:
        self.run = build.run
        self.traced = build.traced
        self.devices = devices
        self.out_tree = build.traced.out_tree
        self.warm = False
        self.donation: _donation.Donation | None = None  # None: the program consumes nothing
        self.build_seconds = build.seconds  # "trace", "partition": wall time spent
        self._input_shardings: list[Any] | None = None

    def partition(self) -> Partition:
        """The placed program (on the fast path placed now, from the same trace)."""
        if isinstance(self.run, MpmdExecutable):
            return self.run.partition
        return partition_program(self.traced, self.devices)

    def input_shardings(self) -> list[Any]:
        """Per input leaf, the sharding it should arrive in (see ``_inputs.input_sharding``);
        an unused input: replicated on the default submesh. Worked out once."""
        if self._input_shardings is None:
            self._input_shardings = self._find_input_shardings()
        return self._input_shardings

    def _find_input_shardings(self) -> list[Any]:
        part = self.partition()
        fallback = NamedSharding(part.place_meshes[part.default_place], PartitionSpec())
        wanted = [input_sharding(part, v) for v in self.traced.jaxpr.invars]
        return [fallback if s is None else s for s in wanted]

    def __call__(self, leaves: Sequence[Any]) -> Any:
        if self.warm:
            outs = self.run(leaves)
        else:
            with warnings.catch_warnings(), collector_paused():  # the first call compiles
                # CPU may refuse donation
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                outs = self.run(leaves)
            self.warm = True
        return jax.tree_util.tree_unflatten(self.out_tree, outs)


class MpmdJit:
    """The callable that :func:`jit` returns."""

    def __init__(
        self,
        fun: Callable[..., Any],
        devices: Any,
        static_argnums: tuple[int, ...],
        donate_argnums: tuple[int, ...],
    ) -> None:
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.devices = None if devices is None else tuple(np.asarray(devices).reshape(-1))
        # ``jit`` checked the devices: a call only pushes them (``use_device_list`` would
        # convert and check them again, every call).
        self._device_list = DeviceListScope(self.devices)
        self.static_argnums = static_argnums
        self.donate_argnums = donate_argnums
        self._cache = BoundedCache(capacity=PROGRAMS_PER_FUNCTION)
        self.ahead: CompileAhead | None = None  # the last ``compile_ahead`` started

    def _split(self, args: tuple[Any, ...]) -> tuple[list[Any], tuple[Any, ...]]:
        bad = [i for i in self.static_argnums if i >= len(args)]
        if bad:
            raise errors.StaticArgumentError(
                f"`static_argnums` names argument {bad[0]}, but the call has {len(args)} "
                "positional arguments. Pass it, or fix `static_argnums`."
            )
        statics = tuple(args[i] for i in self.static_argnums)
        try:
            hash(statics)
        except TypeError as e:
            raise errors.StaticArgumentError(
                f"Static arguments must be hashable, got {statics!r}. Pass arrays as "
                "dynamic arguments or convert lists to tuples."
            ) from e
        dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]
        return dynamic, statics

    def _signature(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        dynamic, statics = self._split(args)
        leaves, in_tree = jax.tree_util.tree_flatten((dynamic, kwargs))
        key = (
            in_tree,
            _leaf_keys(leaves),
            statics,
            self.devices or get_device_list(),
            _mesh_token(get_multi_mesh()),
            registrations_fingerprint(),  # registered tasks change the program
            get_flag("enable_recomputation"),
            get_flag("enable_fast_path"),
        )
        return leaves, in_tree, statics, key

    def _flat_fun(self, in_tree: Any, statics: tuple[Any, ...]) -> Callable[..., Any]:
        def flat_fun(*leaves: Any) -> Any:
            dynamic, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
            args, it_dyn, it_st = [], iter(dynamic), iter(statics)
            for i in range(len(dynamic) + len(statics)):
                args.append(next(it_st) if i in self.static_argnums else next(it_dyn))
            return self.fun(*args, **kwargs)

        return flat_fun

    def _donated_leaves(self, args: tuple[Any, ...]) -> tuple[int, ...]:
        flat, pos = [], 0
        for i, a in enumerate(args):
            if i in self.static_argnums:
                continue
            n = len(jax.tree_util.tree_leaves(a))
            if i in self.donate_argnums:
                flat.extend(range(pos, pos + n))
            pos += n
        return tuple(flat)

    def _build(
        self, leaves: list[Any], in_tree: Any, statics: tuple[Any, ...], donate: tuple[int, ...]
    ) -> _Entry:
        """The program for one signature: the passes of ``_build.build_program``."""
        flat_fun = self._flat_fun(in_tree, statics)
        return _Entry(build_program(flat_fun, leaves, self.devices, donate), self.devices)

    def _entry(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Entry, list[Any]]:
        with no_ambient_mesh():
            return self._entry_here(args, kwargs)

    def _entry_here(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Entry, list[Any]]:
        leaves, in_tree, statics, key = self._signature(args, kwargs)

        def build(_: Hashable) -> _Entry:
            if self.donate_argnums:
                _donation.check_count(self.donate_argnums, len(args))
            donated = self._donated_leaves(args)
            entry = self._build(leaves, in_tree, statics, donated)
            if donated:
                entry.donation = _donation.Donation(donated, leaves)
            return entry

        return self._cache.get_or_make(key, build), leaves

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if get_flag("ignore_transforms"):
            return self.fun(*args, **kwargs)
        with no_ambient_mesh():
            return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        entry, leaves = self._entry_here(args, kwargs)  # __call__ set the ambient mesh aside
        donation = entry.donation
        if donation is None:
            with self._device_list:
                return entry(leaves)
        # Claimed before the deleted check: no other thread can consume them in between.
        claimed = donation.claim(leaves, lambda i: self._leaf_name(args, kwargs, i))
        try:
            if _any_deleted(leaves, donation.donated):
                raise self._consumed_error(args, kwargs, donation.donated)
            with self._device_list:
                return entry(leaves)
        finally:
            donation.release(claimed)

    def _leaf_name(self, args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> str:
        """How a user names flat dynamic leaf ``index``: ``args[0]['w']``, ``kwargs['x']``."""
        positions = [i for i in range(len(args)) if i not in self.static_argnums]
        dynamic = [args[i] for i in positions]
        path, _ = jax.tree_util.tree_leaves_with_path((dynamic, kwargs))[index]
        if path[0].idx == 1:
            return "kwargs" + jax.tree_util.keystr(path[1:])
        return f"args[{positions[path[1].idx]}]" + jax.tree_util.keystr(path[2:])

    def _consumed_error(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], donated: tuple[int, ...]
    ) -> errors.ConsumedArrayError:
        dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]
        leaves = jax.tree_util.tree_leaves((dynamic, kwargs))
        index = next(i for i in donated if _deleted(leaves[i]))
        leaf = leaves[index]
        return errors.ConsumedArrayError(
            f"Argument leaf `{self._leaf_name(args, kwargs, index)}` "
            f"({leaf.dtype}{list(leaf.shape)}) was consumed by an "
            f"earlier call that donated it (`donate_argnums`={self.donate_argnums}): its "
            "buffer is deleted. Pass what that call returned instead: for a training step, "
            "`loss, state = step_fn(state, batch)` -- rebind `state` every step."
        )

    def input_shardings(self, *args: Any, **kwargs: Any) -> Any:
        """Where the program wants its arguments: a sharding per dynamic argument leaf.

        Builds the program for these arguments (arrays or ``ShapeDtypeStruct``\\ s) as the
        first call would -- traced and placed once, nothing compiled -- and keeps it, so
        the first call with arrays of these shapes only dispatches (as
        ``jax.jit(f).lower(...)`` then ``.compile()``). Returns the pytree of the dynamic
        arguments (static ones left out) as ``(args, kwargs)``, a sharding at every leaf:
        the first constraint applied to it, else replicated on its first consumer's submesh.
        """
        entry, _ = self._entry(args, kwargs)
        dynamic, _ = self._split(args)
        tree = jax.tree_util.tree_structure((dynamic, kwargs))
        return jax.tree_util.tree_unflatten(tree, entry.input_shardings())

    def compile_ahead(self, *args: Any, **kwargs: Any) -> CompileAhead | None:
        """Starts compiling the program for these arguments (arrays or
        ``ShapeDtypeStruct``\\ s) in a thread, and returns at once.

        Builds the program as ``input_shardings`` does, then makes the executable of each
        fragment in a thread of its own (``run._ahead``): for arguments in the program's
        input shardings, each fragment's inputs in the shardings the fragments and
        transfers before it give them. Whatever the caller does meanwhile (compiling and
        running an initializer) overlaps with it; the first call with arrays of these
        shapes takes the executables made, waits for one being made, or makes one the
        thread has not reached; dropping this function ends the walk after the compile
        under way. Pass the arguments the first call will get where their
        shardings fit the input shardings (a one-device array for a one-device submesh, which
        the call then uses as it is); a ``ShapeDtypeStruct`` stands for an argument the
        call moves into its input sharding. Returns the ``CompileAhead`` (``wait()``, ``walked``,
        ``error``), or ``None`` where nothing is compiled ahead: the fast path (one
        ``jax.jit``) and a multi-process job (each process compiles its own fragments).

        Example:
            >>> import multimesh_flax as mm
            >>> def f(x):
            ...     y = mm.task(jnp.sin, mesh=mm.TaskMesh(devices=[0]))(x)
            ...     return mm.task(jnp.cos, mesh=mm.TaskMesh(devices=[1]))(y)
            >>> g = mm.jit(f)
            >>> ahead = g.compile_ahead(jax.ShapeDtypeStruct((4,), jnp.float32))
            >>> ahead.wait(), ahead.walked, ahead.error  # two fragments, one transfer
            (True, 3, None)
            >>> x = np.ones(4, np.float32)  # the call places it in its input sharding
            >>> made = g.executable(x).compile_count()
            >>> _ = g(x)  # takes the executables made ahead: none more
            >>> g.executable(x).compile_count() == made
            True
        """
        entry, leaves = self._entry(args, kwargs)
        run = entry.run
        if not isinstance(run, MpmdExecutable) or run.processes is not None:
            return None
        self.ahead = CompileAhead(run, leaves)
        weakref.finalize(self, self.ahead.cancel)  # dropped before its first call: stop
        return self.ahead

    def build_seconds(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Seconds spent on the passes of ``_build`` for these arguments, when the program
        was built (built now if it was not): ``"trace"`` for tracing and colouring,
        ``"partition"`` for planning, placing, fragmenting and compiling (its programs and
        op list; XLA compiles at the first call)."""
        return dict(self._entry(args, kwargs)[0].build_seconds)

    def clear_cache(self) -> None:
        """Forgets every program built so far (as ``jax.jit``'s ``clear_cache``)."""
        self._cache.clear()

    def cache_size(self) -> int:
        """How many programs (one per call signature) are kept, at most
        `PROGRAMS_PER_FUNCTION` (as ``jax.jit``'s ``_cache_size``)."""
        return len(self._cache)

    def traced(self, *args: Any, **kwargs: Any) -> TracedProgram:
        """The traced program built for these arguments (built now if it was not)."""
        return self._entry(args, kwargs)[0].traced

    def executable(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled program for these arguments (arrays or ``ShapeDtypeStruct``s).

        An ``MpmdExecutable`` (with ``describe()``, ``input_shardings``, ...) or, on the
        fast path, the plain ``jax.jit`` wrapper.
        """
        return self._entry(args, kwargs)[0].run

    def describe(self, *args: Any, **kwargs: Any) -> str:
        """A readable dump of the MPMD program built for these arguments."""
        run = self.executable(*args, **kwargs)
        if isinstance(run, FastPath):
            return "fast path: one jax.jit (no tasks on distinct submeshes)"
        return run.describe()


def jit(
    fun: Callable[..., Any],
    *,
    devices: Sequence[jax.Device] | np.ndarray | None = None,
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
) -> MpmdJit:
    """Like ``jax.jit``, but the tasks inside ``fun`` run on their own submeshes.

    The forward and backward of every task (also of a ``jax.grad`` taken inside ``fun``) run
    on the task's submesh; glue runs where its inputs live; values move between submeshes
    once per destination. Outputs stay where they were produced. After the first call with
    given shapes, calls compile nothing. With no tasks it is exactly ``jax.jit``.

    Args:
        fun: the function to compile.
        devices: the device list that ``TaskMesh`` positions index, as jax devices or
            integer positions in ``jax.devices()`` (default: the current ``MultiMesh``'s
            devices, else ``jax.devices()``).
        static_argnums: positional arguments treated as compile-time constants.
        donate_argnums: positional arguments whose buffers the program may reuse.

    Returns:
        A callable with ``fun``'s signature; ``.describe(*args)`` dumps its program.

    Raises:
        ParallelizeArgumentError: ``fun`` is not callable, or ``devices`` is empty.
        StaticArgumentError: ``static_argnums``/``donate_argnums`` are not non-negative
            ints (at call time also: an index beyond the arguments, an unhashable static).
        DonationError: an argument both static and donated (at call time also: a donated
            index beyond the positional arguments, one array passed in a donated and in
            another position).
        ConsumedArrayError: at call time, a donated array was consumed by an earlier call,
            or is being consumed by a call in another thread.

    Example:
        >>> import multimesh_flax as mm
        >>> f = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[0]))
        >>> g = mm.task(lambda x: x + 1, mesh=mm.TaskMesh(devices=[1]))
        >>> out = mm.jit(lambda x: g(f(x)))(jnp.arange(3.0))
        >>> out.tolist(), [d.id for d in out.devices()]
        ([1.0, 3.0, 5.0], [1])
    """
    if not callable(fun):
        raise errors.ParallelizeArgumentError(
            f"Expected `fun` to be a function, got {type(fun).__name__}: {fun!r}. Pass the "
            "function itself, not its result."
        )
    static = _normalise_argnums(static_argnums, "static_argnums")
    donate = _normalise_argnums(donate_argnums, "donate_argnums")
    _donation.check_argnums(static, donate)
    if devices is not None:
        devices = as_device_array(devices, "devices")
        if devices.size == 0:
            raise errors.ParallelizeArgumentError(
                "Expected at least one device in `devices`, got none. Pass a list of jax "
                "devices, or omit `devices` for the current MultiMesh or all devices."
            )
        check_unique(list(np.asarray(devices, dtype=object).reshape(-1)), "devices")
    return MpmdJit(fun, devices, static, donate)
