"""The op list an MPMD program dispatches, and what dispatching it learns.

``_dispatch.MpmdExecutable`` builds a program's ops once, as an immutable tuple of records
over numbered value slots:

* ``RunOp`` -- call a fragment's program on its input slots, fill its output slots;
* ``PutOp`` -- move a group of values to another submesh: ``jax.device_put`` at the first
  call, then one C++ copy (``Move``).

Two dispatchers walk the same tuple: ``MpmdExecutable.__call__`` in one process, and
``multimesh_flax.distributed._dispatch.ProcessDispatch`` in each process of a multi-process
job. What a call learns (each fragment's executable for its argument shardings, each
transfer's target shardings, the last input sharding that fitted) goes into the
executable's ``DispatchState``, never into the ops. ``OpProgram`` is everything a dispatcher
reads from an executable; ``ProcessHandOff`` is what a multi-process job hands the compile
pass (``multimesh_flax.distributed`` makes one; the build passes it when
``jax.process_count() > 1``), so the core never imports the multi-process dispatcher.

This module imports nothing from ``multimesh_flax`` but a named marker (``Sentinel``, from the
``declare`` stage), so both the core's runtime and ``multimesh_flax.distributed`` import it
without a cycle.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax.core.declare import Sentinel

try:  # JAX's private modules: the PJRT client, result handlers, its array (see Move)
    from jax._src.array import ArrayImpl as _ArrayImpl
    from jax._src.interpreters import pxla as _pxla
    from jax._src.lib import xla_client as _xc
except ImportError:  # pragma: no cover -- depends on the installed JAX: jax.device_put
    _ArrayImpl = _pxla = _xc = None


class OpKind(enum.IntEnum):
    """What an op does. An ``IntEnum``, so ``op.kind == 0`` still reads as ``RUN``."""

    RUN = 0
    PUT = 1


class OpUnit(NamedTuple):
    """The pipeline unit a ``RunOp`` executes, as timelines record it (``None``: not a unit)."""

    stage: int | None
    microbatch: int | None
    phase: str | None


_NO_UNIT = OpUnit(None, None, None)
_SHARDING = operator.attrgetter("sharding")
UNSEEN = Sentinel("no input sharding checked yet")  # see DispatchState.fitting


@dataclasses.dataclass(frozen=True, slots=True)
class RunOp:
    """Call one fragment (or several fused ones) on the values in ``ins``.

    ``program`` is the fragment's ``run._compile.FragmentProgram``, shared by identical
    fragments; ``frees`` are the slots this op reads last (cleared after it), ``deps`` the
    indices of the ops whose outputs it reads. ``unit`` is what a timeline records of it,
    ``units`` every unit it runs (several when ``fused``).
    """

    kind: ClassVar[OpKind] = OpKind.RUN
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    place: tuple[int, ...]
    name: str
    program: Any
    unit: OpUnit = _NO_UNIT
    units: tuple[OpUnit, ...] = ()
    fused: bool = False
    frees: tuple[int, ...] = ()
    deps: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class PutOp:
    """Move the values in ``ins`` to submesh ``place``, into ``outs``.

    ``hints`` holds, per value, its known target sharding or the destination mesh (the value
    then keeps its partition spec there where it fits; see ``target``).
    """

    kind: ClassVar[OpKind] = OpKind.PUT
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    place: tuple[int, ...]
    name: str
    hints: tuple[Any, ...]
    frees: tuple[int, ...] = ()
    deps: tuple[int, ...] = ()

    def target(self, j: int, value: Any) -> jax.sharding.Sharding:
        """The sharding value ``j`` moves to, given the ``value`` (an array, or a
        ``jax.ShapeDtypeStruct`` with a sharding) it has at the source.

        A sharding hint is the target; a mesh hint gives the value's partition spec on that
        mesh if it divides the value's shape, else the value replicated over the mesh.

        Example:
            >>> from jax.sharding import AxisType, NamedSharding
            >>> mesh = jax.make_mesh((2,), ("x",), (AxisType.Auto,), devices=jax.devices()[2:4])
            >>> op = PutOp(ins=(0,), outs=(1,), place=(2, 3), name="to[2, 3]", hints=(mesh,))
            >>> here = NamedSharding(jax.make_mesh((2,), ("x",), (AxisType.Auto,)), P("x"))
            >>> op.target(0, jax.ShapeDtypeStruct((4,), jnp.float32, sharding=here)).spec
            P('x',)
            >>> op.target(0, jax.ShapeDtypeStruct((3,), jnp.float32)).spec  # no sharding yet
            P()
        """
        hint = self.hints[j]
        if isinstance(hint, jax.sharding.Sharding):
            return hint
        spec = getattr(value.sharding, "spec", None)
        try:
            target = NamedSharding(hint, spec) if spec is not None else None
            if target is not None:
                target.shard_shape(value.shape)  # raises if it does not fit
        except (ValueError, KeyError, TypeError):
            target = None
        return target or NamedSharding(hint, PartitionSpec())

    def targets(self, values: Sequence[Any]) -> list[jax.sharding.Sharding]:
        """``target`` of every value, in order."""
        return [self.target(j, value) for j, value in enumerate(values)]


# --- moving values: one C++ copy per transfer -----------------------------------------------

# A transfer's move between submeshes, fixed at its first call: one C++ copy per call.
#
# ``jax.device_put`` of a list spends tens of microseconds of Python per array before the one
# C++ call that copies them (flattening, abstract values, source shardings, checks, a result
# handler per array). A pipeline transfer needs none of it after its first call: its values
# arrive every call in the same shardings (fragment outputs and placed inputs reuse their
# sharding objects), and their target shardings are fixed. Where each value's target lays
# its shards out as its source does -- a ``NamedSharding`` on an equally shaped mesh with the
# same axes and the same partition spec, on other devices, or both on one device -- shard
# ``k`` of the source is shard ``k`` of the target, and JAX's own ``device_put`` ends in
# exactly one call: ``batched_copy_array_to_devices_with_sharding`` (``xla_client``: JAX's
# private module for the PJRT client; ``_relocate`` uses it too). ``Move`` makes that call
# directly, and falls back to ``jax.device_put`` for a transfer any of whose values does
# not fit the rule, for a call whose values arrive in other sharding objects than the
# first call's, and whenever JAX's private modules are missing.


def _layout(spec: PartitionSpec) -> tuple[Any, ...]:
    """``spec`` as a comparable layout: each entry a tuple of mesh axes (``None``: ``()``),
    trailing unsharded dimensions dropped (``P("data")`` lays out a 3-D array as
    ``P("data", None, None)`` does), with its unreduced and reduced axes."""
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    while entries and not entries[-1]:
        entries.pop()
    return (tuple(entries), spec.unreduced, spec.reduced)


def _one_to_one(source: Any, target: Any) -> bool:
    """Whether an array's shards under ``source`` copy one to one, in order, onto other
    devices under ``target``: both on one device, or ``NamedSharding``s laying the shards out
    alike (equally shaped meshes with the same axes, partition specs that shard alike)."""
    if source.memory_kind != target.memory_kind:
        return False
    if source.num_devices == 1 and target.num_devices == 1:
        return source.device_set != target.device_set
    if not (isinstance(source, NamedSharding) and isinstance(target, NamedSharding)):
        return False
    a, b = source.mesh, target.mesh
    return (
        a.axis_names == b.axis_names
        and a.devices.shape == b.devices.shape
        and a.axis_types == b.axis_types
        and _layout(source.spec) == _layout(target.spec)
        and not set(a.devices.flat) & set(b.devices.flat)
    )


class Move:
    """Moves values arriving like ``values`` into ``shardings``, as ``jax.device_put`` moved
    them into ``moved`` at the first call: ``move(values)`` returns the moved arrays.

    ``direct``: whether calls whose values arrive in the first call's sharding objects make
    one C++ copy (see the comment above); otherwise, and for any other call,
    ``jax.device_put``. A copy keeps its source's abstract value and commitment, so where
    ``device_put`` gave a value others (a one-device output typed on no mesh, or not
    committed), JAX's result handler for ``device_put``'s abstract value and the target
    re-labels the copy, committed.

    Example:
        >>> from jax.sharding import AxisType, NamedSharding
        >>> a, b = (jax.make_mesh((2,), ("x",), (AxisType.Auto,), devices=jax.devices()[i:i + 2])
        ...         for i in (0, 2))
        >>> x = jax.device_put(jnp.arange(4.0), NamedSharding(a, P("x")))
        >>> to_b = [NamedSharding(b, P("x"))]
        >>> move = Move([x], to_b, jax.device_put([x], to_b))
        >>> move.direct, sorted(d.id for d in move([x])[0].devices())
        (True, [2, 3])
    """

    __slots__ = ("avals", "devices", "direct", "handlers", "semantics", "shardings", "sources")

    def __init__(
        self, values: Sequence[Any], shardings: Sequence[Any], moved: Sequence[Any]
    ) -> None:
        self.shardings = list(shardings)
        self.sources = [getattr(x, "sharding", None) for x in values]
        self.avals = [getattr(x, "aval", None) for x in values]
        self.direct = (
            _xc is not None
            and _pxla is not None
            and jax.process_count() == 1
            and all(type(x) is _ArrayImpl for x in values)  # not PRNG key arrays
            and all(map(_one_to_one, self.sources, self.shardings))
        )
        self.devices: list[Any] = []
        self.semantics: list[Any] = []
        self.handlers: list[Any] | None = None
        if self.direct:
            try:
                self._fix(values, moved)
            except AttributeError:  # JAX's internals moved: stay on jax.device_put
                self.direct = False

    def _fix(self, values: Sequence[Any], moved: Sequence[Any]) -> None:
        self.devices = [
            s._internal_device_list.addressable_device_list  # noqa: SLF001
            for s in self.shardings
        ]
        self.semantics = [_xc.ArrayCopySemantics.REUSE_INPUT] * len(values)  # pyright: ignore[reportOptionalMemberAccess]
        _xc.batched_copy_array_to_devices_with_sharding  # noqa: B018 -- present?  # pyright: ignore[reportOptionalMemberAccess]
        relabel = _pxla.global_aval_to_result_handler  # pyright: ignore[reportOptionalMemberAccess]
        handlers = [
            None if x.aval == y.aval and x.committed == y.committed else relabel(y.aval, s, True)
            for x, y, s in zip(values, moved, self.shardings, strict=True)
        ]
        if any(h is not None for h in handlers):
            self.handlers = handlers

    def __call__(self, values: Sequence[Any]) -> Any:
        if self.direct:
            try:
                same = all(map(operator.is_, map(_SHARDING, values), self.sources))
            except AttributeError:  # not an array
                same = False
            if not same and self._adopt(values):
                same = True
            if same:
                copies = _xc.batched_copy_array_to_devices_with_sharding(  # pyright: ignore[reportOptionalMemberAccess]
                    values, self.devices, self.shardings, self.semantics
                )
                if self.handlers is None:
                    return copies
                return [
                    y if h is None else h(y) for h, y in zip(self.handlers, copies, strict=True)
                ]
        return jax.device_put(list(values), self.shardings)

    def _adopt(self, values: Sequence[Any]) -> bool:
        """Whether ``values`` arrive typed and sharded as at the first call, in other
        sharding objects (a step's inputs come from the caller at the first call, from the
        previous step's outputs after it): then later calls compare against these objects."""
        if not all(type(x) is _ArrayImpl for x in values):
            return False
        have = list(map(_SHARDING, values))
        avals = [x.aval for x in values]
        if avals != self.avals or have != self.sources:
            return False
        self.sources = have
        return True


Op = RunOp | PutOp


class _FirstCall:
    """Op ``index``'s callable until its first call, which takes the executable for its
    arguments from the fragment's program (compiled, or relocated from another submesh) and
    puts it in the op's place in ``state.fns``: later calls go straight to the executable.

    Every call of a program gives an op arguments in the same shardings (inputs are moved
    into their input shardings, transfers keep the targets of their first call).
    """

    def __init__(self, state: DispatchState, index: int, program: Any) -> None:
        self.state = state
        self.index = index
        self.program = program

    def __call__(self, *args: Any) -> Any:
        compiled = self.program.executable(args)
        self.state.fns[self.index] = compiled
        return compiled(*args)


class _FirstPut:
    """Op ``index``'s (a ``PutOp``'s) callable until its first call, which fixes the
    transfer's target shardings (``PutOp.targets``), moves the values with
    ``jax.device_put`` and puts a :class:`Move` for later calls in ``state.fns``."""

    def __init__(self, state: DispatchState, index: int, op: PutOp) -> None:
        self.state = state
        self.index = index
        self.op = op

    def __call__(self, values: Sequence[Any]) -> Any:
        values = list(values)
        shardings = self.op.targets(values)
        self.state.put_shardings[self.index] = shardings
        moved = jax.device_put(values, shardings)
        self.state.fns[self.index] = Move(values, shardings, moved)
        return moved


class DispatchState:
    """What dispatching an op list learns at its first call, one object per executable.

    Attributes:
        fns: per op index, what it calls: for a ``RunOp`` its program's executable once
            known (a dispatcher calls ``fns[i](*values)``), for a ``PutOp`` its
            :class:`Move` once known (``fns[i](values)``, a list, returns the moved
            values; the one-process dispatcher's; ``multimesh_flax.distributed`` moves
            values itself).
        put_shardings: per op index, a ``PutOp``'s target shardings once its first call
            fixed them (``None`` before, and for a ``RunOp``).
        fitting: per program input, the last sharding an argument arrived in that fitted its
            input sharding (an identity test on later calls; ``UNSEEN`` before the first).
    """

    def __init__(self, ops: Sequence[Op], num_inputs: int) -> None:
        self.fns: list[Callable[..., Any]] = [
            _FirstCall(self, i, op.program) if isinstance(op, RunOp) else _FirstPut(self, i, op)
            for i, op in enumerate(ops)
        ]
        self.put_shardings: list[list[Any] | None] = [None] * len(ops)
        self.fitting: list[Any] = [UNSEEN] * num_inputs


class OpProgram(Protocol):
    """What a dispatcher reads from an executable (``_dispatch.MpmdExecutable``)."""

    @property
    def ops(self) -> tuple[Op, ...]: ...

    @property
    def state(self) -> DispatchState: ...

    @property
    def input_shardings(self) -> list[Any]: ...

    @property
    def output_slots(self) -> list[int]: ...

    def make_env(self, args: Sequence[Any], unread: frozenset[int] = ...) -> list[Any]: ...

    def slot_homes(self) -> dict[int, tuple[Any, Any]]: ...

    def constant_slots(self) -> frozenset[int]: ...

    def floating_point_error(
        self, op: RunOp, values: Sequence[Any], error: Exception
    ) -> FloatingPointError: ...


@dataclasses.dataclass(frozen=True)
class ProcessHandOff:
    """How each process of a multi-process job runs a program.

    ``place(value, sharding)`` puts a traced constant on its devices (``None`` in a process
    owning none of them); ``dispatcher(program)`` returns the callable that runs this
    process's share of the program's ops on its arguments.
    """

    place: Callable[[Any, Any], Any]
    dispatcher: Callable[[OpProgram], Callable[[Sequence[Any]], Any]]
