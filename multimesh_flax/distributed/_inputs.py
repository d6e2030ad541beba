"""Checking that the processes of a job feed a program the same host values.

An input that is not already one array of the job (a numpy batch, a Python scalar, an array
a process made on its own devices) is placed by each process from its own copy: every device
gets its shard from the process that owns it. If the copies differ (a global batch drawn with
a per-process data seed), nothing fails: a pipeline's first stage, on process 0's devices,
computes with process 0's inputs while its last stage, on process 1's devices, compares with
process 1's targets. So, on a program's first call, each process publishes a fingerprint of
every such input (shape, dtype and a hash of at most ``SAMPLE`` evenly spaced elements) and
compares it with every other process's; a difference raises ``InputMismatchError`` naming the
input and both processes. Later calls are not checked (a new batch shape is a new program, so
it is checked again): the cost is one exchange through the coordinator per program.

Inputs that are one array of the job (not fully addressable here: ``prepare_batch``'s
``jax.make_array_from_process_local_data``, a training state) are skipped: each process
holds its own shards of the same array by construction.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from multimesh_flax import errors
from multimesh_flax.distributed import _exchange

SAMPLE = 1 << 16  # elements hashed per input at most
_GLOBAL = "one array of the job"


def fingerprint(x: Any) -> str:
    """``dtype[shape]#hash`` of a host value, or ``_GLOBAL`` for an array of the job."""
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            return _GLOBAL
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
    if x is None:
        return "None"
    value = np.asarray(x)
    flat = value.reshape(-1)
    if flat.size > SAMPLE:
        flat = flat[:: -(-flat.size // SAMPLE)]
    digest = hashlib.sha256(np.ascontiguousarray(flat).tobytes()).hexdigest()[:16]
    return f"{value.dtype}{list(value.shape)}#{digest}"


def _mismatch(i: int, here: str, there: str, rank: int, other: int) -> errors.InputMismatchError:
    what = here.split("#")[0]
    return errors.InputMismatchError(
        f"Expected the same value of input {i} ({what}; leaf {i} of the flattened arguments) "
        f"in every process, got fingerprint {here} in process {rank} and {there} "
        f"in process {other}. Each device takes its shard from its own process's copy, so "
        "the stages would compute on different batches (per-process data seeds pair process "
        "0's inputs with process 1's targets). Use the same seed for a global batch in every "
        "process, or pass each process's part as one array of the job "
        "(`jax.make_array_from_process_local_data`, `parallelize_step(local_batch=...)`'s "
        "`prepare_batch`)."
    )


def check_same_inputs(key: str, args: Sequence[Any], shardings: Sequence[Any]) -> None:
    """Raises ``InputMismatchError`` unless every process passed the same host inputs.

    ``key``: the program's prefix in the coordinator's store; ``shardings``: the program's
    input shardings (an input with none is not placed, so not compared).
    """
    mine = [
        _GLOBAL if want is None else fingerprint(x) for x, want in zip(args, shardings, strict=True)
    ]
    if all(f == _GLOBAL for f in mine):
        return
    rank = jax.process_index()
    _exchange.publish(f"{key}/{rank}", json.dumps(mine))
    for other in range(jax.process_count()):
        if other == rank:
            continue
        theirs = json.loads(_exchange.fetch(f"{key}/{other}", f"process {other}'s inputs"))
        for i, (here, there) in enumerate(zip(mine, theirs, strict=False)):
            if _GLOBAL not in (here, there) and here != there:
                raise _mismatch(i, here, there, rank, other)
