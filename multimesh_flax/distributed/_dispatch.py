"""Dispatching an MPMD program in one process of a multi-process job.

DESIGN. Every process traces, places and fragments the same program (deterministically) and
builds the same op list (``multimesh_flax.core.run``: ``RunOp``, ``PutOp``, read through the
``OpProgram`` methods); ``ProcessDispatch`` then walks that list and, in each process:

* runs a fragment (``RunOp``) if the process owns at least one of its submesh's devices. A
  submesh that spans processes is therefore run by each of its owners together, as any
  multi-controller ``jax.jit`` on a global mesh; a submesh of another process is skipped, so no
  process blocks on work it does not own.
* moves a value (``PutOp``): within the process with ``jax.device_put`` when every source and
  destination device is its own; otherwise through a collective program over the union of the
  source and destination devices (``_wire.transfer``), run by every process owning one of
  them. The global op order is the same in every process, so collectives meet in order.
* returns every output in every process: where it was computed here, the array itself; else
  a global array with the same shape and sharding but no local buffers (as ``jax.jit``
  returns in multi-controller JAX), so a training state can be passed to the next step
  unchanged. ``multimesh_flax.distributed.host_values`` reads values (a loss) everywhere.

Waiting. Each fragment is waited for before the next op is dispatched. Measured on the 2-core
host (jax 0.10.2, gloo CPU collectives, 2 processes x 4 devices): with fully asynchronous
dispatch, 3 of 4 runs of the two-submesh MLP step hung in their second step inside a local
fragment's call while a cross-process collective was queued behind it; waiting for every
fragment, 8 of 8 runs passed. Cross-process transfers are collectives and already meet in the
same order everywhere. The cost is dispatch-ahead within a process, not overlap between
processes: each process still runs its own stages while the others run theirs. Measured with
B8's gpt-tiny step (2 stages, 1F1B, 4 microbatches): 1.18 s a step; waiting only before and
after each cross-process transfer gave 0.77 s and passed 12 of 12 runs here, but it is not
what the suite has exercised, so every fragment is waited for.

Shardings that only the computing process knows (a fragment's outputs) are published once, at
the first call, through the coordinator's key-value store; the program itself is compared
across processes before its first dispatch (``_exchange.check_program``). What this process
learns of its transfers lives here, in one ``_Move`` per value moved; executables are shared
with the executable's ``DispatchState``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.api_util import InternalFloatingPointError  # jax_debug_nans; no public name
from jax.sharding import NamedSharding

from multimesh_flax.core.run import OpProgram, ProcessHandOff, PutOp, RunOp
from multimesh_flax.distributed import _exchange, _inputs, _sequence, _watchdog, _wire

logger = logging.getLogger(__name__)


class _Move:
    """One value of a ``PutOp`` as this process sees it: ``source`` and ``target`` of a
    cross-process move, ``local`` the target of a move within this process (each known after
    the first call)."""

    def __init__(self, source_place: tuple[int, ...], dest_place: tuple[int, ...], aval: Any):
        self.source_place = source_place
        self.dest_place = dest_place
        self.aval = aval
        self.source: NamedSharding | None = None  # known after the first call
        self.target: NamedSharding | None = None
        self.local: jax.sharding.Sharding | None = None


class ProcessDispatch:
    """Runs an ``MpmdExecutable`` in one process of a ``jax.distributed`` job."""

    def __init__(self, exe: OpProgram) -> None:
        self.exe = exe
        self.rank = jax.process_index()
        self._by_id = {d.id: d for d in jax.devices()}
        _sequence.enter("building an MPMD program")
        self.prefix = _exchange.check_program(exe)
        self.calls = 0
        self._slot_home = exe.slot_homes()
        self._constants = exe.constant_slots()
        self.output_shardings: list[Any] = [None] * len(exe.output_slots)
        self.moves = {i: self._moves(op) for i, op in enumerate(exe.ops) if isinstance(op, PutOp)}
        self.first_call = True
        # Inputs whose sharding has none of this process's devices: never read here.
        self.unread = frozenset(
            i
            for i, want in enumerate(exe.input_shardings)
            if want is not None and self.rank not in _wire.owners(list(want.device_set))
        )

    # --- ownership ---

    def owners(self, place: Sequence[int] | None) -> frozenset[int]:
        if place is None:
            return frozenset()
        return _wire.owners([self._by_id[i] for i in place])

    def mine(self, place: Sequence[int] | None) -> bool:
        return self.rank in self.owners(place)

    def _moves(self, op: PutOp) -> list[_Move]:
        moves = []
        for slot in op.ins:
            var, place = self._slot_home[slot]
            moves.append(_Move(place, op.place, var.aval))
        return moves

    # --- the call ---

    def __call__(self, args: Sequence[Any]) -> list[Any]:
        exe = self.exe
        self.calls += 1
        _sequence.enter(f"call {self.calls} of MPMD {self.prefix.rsplit('/', 1)[-1]}")
        if self.first_call:  # see _inputs: a per-process batch where one is expected
            _inputs.check_same_inputs(f"{self.prefix}/inputs", args, exe.input_shardings)
        env = exe.make_env(args, self.unread)
        try:
            self._dispatch(env)
        except jax.errors.JaxRuntimeError:
            _watchdog.await_loss()  # a lost peer: the watchdog names it and ends the process
            raise
        outs = [self._output(i, env[s]) for i, s in enumerate(exe.output_slots)]
        self.first_call = False
        return outs

    def _dispatch(self, env: list[Any]) -> None:
        fns = self.exe.state.fns
        for index, op in enumerate(self.exe.ops):
            if isinstance(op, RunOp):
                if self.mine(op.place):
                    try:
                        results = fns[index](*[env[s] for s in op.ins])  # pyright: ignore[reportOptionalCall]
                    except InternalFloatingPointError as error:  # names the fragment instead
                        values = [env[s] for s in op.ins]
                        raise self.exe.floating_point_error(op, values, error) from None
                    for s, r in zip(op.outs, results, strict=True):
                        env[s] = r
                    jax.block_until_ready(results)  # see "Waiting" in the module docstring
            else:
                self._put(index, op, env)
            for s in op.frees:
                env[s] = None

    # --- transfers ---

    def _put(self, index: int, op: PutOp, env: list[Any]) -> None:
        local = []
        for j, (move, src, dst) in enumerate(zip(self.moves[index], op.ins, op.outs, strict=True)):
            involved = self.owners(move.source_place) | self.owners(move.dest_place)
            if self.rank not in involved:
                continue
            x = env[src]
            if involved == {self.rank}:
                if move.local is None:  # fixed once, as in one process
                    move.local = op.target(j, x)
                local.append((move.local, x, dst))
                continue
            if move.target is None:
                self._learn_shardings(f"{self.prefix}/put{index}.{j}", op, j, move, x)
            source, target = move.source, move.target
            assert source is not None and target is not None  # set by _learn_shardings
            env[dst] = _wire.transfer(x, source, target, move.aval)
        if local:
            moved = jax.device_put([x for _, x, _ in local], [t for t, _, _ in local])
            for (_, _, dst), m in zip(local, moved, strict=True):
                env[dst] = m

    def _learn_shardings(self, key: str, op: PutOp, j: int, move: _Move, x: Any) -> None:
        """The source and target shardings of a cross-process move (published by the
        lowest-ranked process holding the source)."""
        holders = self.owners(move.source_place)
        if self.rank == min(holders):
            move.source = _as_named(x.sharding)
            _exchange.publish(key, _exchange.encode_sharding(move.source))
        elif self.rank in holders:
            move.source = _as_named(x.sharding)
        else:
            move.source = _exchange.decode_sharding(_exchange.fetch(key, "a value's sharding"))
        probe = jax.ShapeDtypeStruct(move.aval.shape, move.aval.dtype, sharding=move.source)
        move.target = _as_named(op.target(j, probe))

    # --- inspection ---

    def cross_process_bytes(self) -> int:
        """Bytes this process's cross-process transfers move per call (after the first call;
        see ``_wire.wire_bytes``)."""
        return sum(
            _wire.wire_bytes(m.source, m.target, m.aval)
            for moves in self.moves.values()
            for m in moves
            if m.source is not None and m.target is not None
        )

    # --- outputs ---

    def _output(self, i: int, value: Any) -> Any:
        slot = self.exe.output_slots[i]
        var, place = self._slot_home[slot]
        if self.first_call and slot not in self._constants and place is not None:
            key = f"{self.prefix}/out{i}"
            holders = self.owners(place)
            if self.rank == min(holders) and holders != set(range(jax.process_count())):
                _exchange.publish(key, _exchange.encode_sharding(_as_named(value.sharding)))
            if self.rank not in holders:
                self.output_shardings[i] = _exchange.decode_sharding(
                    _exchange.fetch(key, f"output {i}'s sharding")
                )
        if value is not None and not (place is not None and not self.mine(place)):
            return value
        sharding = self.output_shardings[i]
        if sharding is None:  # an input passed through, held elsewhere
            return value
        return _wire.assemble(var.aval, sharding, [])


def place(value: Any, sharding: Any) -> Any:
    """``jax.device_put(value, sharding)`` of a traced constant, in a multi-process job too.

    A process owning none of the devices keeps no copy (``None``: no op of its own reads it);
    one owning only some of them places its shards from host data (``device_put`` of a
    process's own array onto other processes' devices is refused).
    """
    if jax.process_count() == 1 or not isinstance(value, jax.Array):
        return jax.device_put(value, sharding)
    holders = _wire.owners(list(sharding.device_set))
    if jax.process_index() not in holders:
        return None
    if holders == {jax.process_index()}:
        return jax.device_put(value, sharding)
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = jax.device_put(np.asarray(jax.random.key_data(value)), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    return jax.device_put(np.asarray(value), sharding)


def _as_named(sharding: Any) -> NamedSharding:
    if isinstance(sharding, NamedSharding):
        return sharding
    return _exchange.decode_sharding(_exchange.encode_sharding(sharding))


# What the build hands ``compile_program`` in a multi-process job (``core.front._build``).
HAND_OFF = ProcessHandOff(place=place, dispatcher=ProcessDispatch)
