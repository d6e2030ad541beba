"""What processes tell each other through the coordinator's key-value store.

Two things cross processes outside collectives:

* **Program fingerprints.** Every MPMD program a process builds gets the next number of a
  per-process counter (the same script builds its programs in the same order everywhere) and a
  summary: input and output types, the fragments with their devices, and a hash of the traced
  program. Before the first dispatch each process publishes its summary and compares it with
  every other process's; a difference raises ``ProgramMismatchError`` naming the processes and
  the first thing that differs, instead of a collective that waits forever.
* **Shardings** that only some processes can see: an array's sharding is known to the
  processes that ran the fragment producing it. A transfer's receiver and a process that
  returns an output it does not hold need it; the lowest-ranked holder publishes it once, on
  the first call, and the others read it (see ``encode_sharding``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh_flax import errors

EXCHANGE_TIMEOUT_S = 120  # how long a process waits for another to publish
_PROGRAMS = itertools.count()
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")  # object addresses differ between processes


def client() -> Any:
    """The ``jax.distributed`` client of this process (its key-value store)."""
    from jax._src import distributed  # the store has no public accessor in jax 0.10

    if distributed.global_state.client is None:
        raise errors.DistributedSetupError(
            "Expected a jax.distributed job (jax.process_count() > 1) with a connected "
            "client, got none. Call `multimesh_flax.distributed.initialize()` first."
        )
    return distributed.global_state.client


def publish(key: str, value: str) -> None:
    client().key_value_set(key, value)


def forget(key: str) -> None:
    """Removes ``key`` from the store (a value every reader has read)."""
    client().key_value_delete(key)


def fetch(key: str, what: str) -> str:
    """The value another process published under ``key`` (``what``: for the error)."""
    try:
        return client().blocking_key_value_get(key, EXCHANGE_TIMEOUT_S * 1000)
    except Exception as e:  # the store reports a timeout as a generic runtime error
        raise errors.ProgramMismatchError(
            f"Process {jax.process_index()} waited {EXCHANGE_TIMEOUT_S} s for {what} "
            f"(key {key!r}) and got nothing: another process did not build the same program. "
            "Run the same script with the same arguments in every process."
        ) from e


# --- shardings ------------------------------------------------------------------------------


def _entry(e: Any) -> Any:
    return list(e) if isinstance(e, tuple) else e


def encode_sharding(sharding: Any) -> str:
    """A ``NamedSharding`` (or a one-device sharding) as JSON: device ids, axes, spec."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        sharding = NamedSharding(Mesh(np.array([device]), ("_one",)), PartitionSpec())
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        raise errors.DistributedSetupError(
            f"Expected a NamedSharding on a concrete mesh to send to another process, got "
            f"{sharding!r}. Constrain the value with `with_sharding_constraint` inside its task."
        )
    mesh = sharding.mesh
    return json.dumps(
        {
            "ids": np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices).tolist(),
            "axes": list(mesh.axis_names),
            "types": [t.name for t in mesh.axis_types],
            "spec": [_entry(e) for e in sharding.spec],
            "memory_kind": sharding.memory_kind,
        }
    )


def decode_sharding(text: str) -> NamedSharding:
    data = json.loads(text)
    by_id = {d.id: d for d in jax.devices()}
    ids = np.asarray(data["ids"])
    devices = np.vectorize(lambda i: by_id[int(i)], otypes=[object])(ids)
    types = tuple(jax.sharding.AxisType[t] for t in data["types"])
    mesh = Mesh(devices, tuple(data["axes"]), axis_types=types)
    spec = PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in data["spec"]))
    return NamedSharding(mesh, spec, memory_kind=data["memory_kind"])


# --- program fingerprints -------------------------------------------------------------------


def program_summary(exe: Any) -> dict[str, Any]:
    """What must be equal in every process: types in and out, fragments, the traced program."""
    jaxpr = exe.partition.traced.jaxpr
    text = _ADDRESS.sub("0x", str(jaxpr))
    return {
        "inputs": [str(v.aval) for v in jaxpr.invars],
        "outputs": [str(v.aval) for v in jaxpr.outvars],
        "ops": [f"{op.name}@{list(op.place)}" for op in exe.ops],
        "hash": hashlib.sha256(text.encode()).hexdigest()[:16],
    }


def _first_difference(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    for field, label in (("inputs", "input"), ("outputs", "output"), ("ops", "op")):
        a, b = mine[field], theirs[field]
        if len(a) != len(b):
            return f"{len(a)} {label}s here, {len(b)} there"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return f"{label} {i} is {x} here, {y} there"
    return f"traced program hash {mine['hash']} here, {theirs['hash']} there"


def check_program(exe: Any) -> str:
    """Compares this program with the same-numbered program of every other process.

    Returns the program's key prefix for later exchanges.

    Raises:
        ProgramMismatchError: another process built a different program.
    """
    prefix = f"mmflax/program{next(_PROGRAMS)}"
    mine = program_summary(exe)
    rank = jax.process_index()
    publish(f"{prefix}/summary{rank}", json.dumps(mine))
    for other in range(jax.process_count()):
        if other == rank:
            continue
        theirs = json.loads(fetch(f"{prefix}/summary{other}", f"process {other}'s program"))
        if theirs != mine:
            raise errors.ProgramMismatchError(
                f"Process {rank} and process {other} built different MPMD programs "
                f"({prefix.split('/')[1]}): {_first_difference(mine, theirs)} (here: process "
                f"{rank}). Every process must run the same script with the same arguments "
                "(model config, batch shape, schedule)."
            )
    return prefix
