"""The handler multi-process checkpoints save through, checked in this one process.

``multimesh_flax.distributed._orbax.state_handler`` shows orbax every array as a shard set of
a global array (what lets each process of a job write its own shards; the 2-process job in
``test_multiprocess.py`` checks that). Here: it writes the files orbax's standard handler
writes, which that handler restores onto another layout, and it refuses what it cannot save.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh_flax import errors
from multimesh_flax.distributed import _orbax


def _keys(directory) -> set[str]:
    kvstore = {"driver": "ocdbt", "base": f"file://{directory}/"}
    return {k.decode() for k in ts.KvStore.open(kvstore).result().list().result()}


def _state():
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    return {
        "w": jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x"))),
        "r": jax.device_put(np.arange(8.0), NamedSharding(mesh, P())),  # replicated
        "n": np.ones(3, np.float32),
        "s": 3,
    }


def test_writes_the_files_of_orbax_standard_handler(tmp_path):
    state = _state()
    with ocp.Checkpointer(_orbax.state_handler()) as ckpt:
        ckpt.save(tmp_path / "ours", args=ocp.args.PyTreeSave(state))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "standard", state)
    ours, standard = tmp_path / "ours", tmp_path / "standard"
    assert (ours / "_sharding").read_text() == (standard / "_sharding").read_text()
    # Orbax's standard handler on CPU splits a replicated array's writing among its replicas
    # (4 chunks of `r`); ours writes it from one replica as one chunk. Readers take either.
    assert _keys(ours) - {"r/0"} == _keys(standard) - {f"r/{i}" for i in range(4)}
    meta = [json.loads((d / "_METADATA").read_text())["tree_metadata"] for d in (ours, standard)]
    assert meta[0]["('r',)"]["value_metadata"].pop("write_shape") == [8]
    assert meta[1]["('r',)"]["value_metadata"].pop("write_shape") == [2]
    assert meta[0] == meta[1]


def test_standard_handler_restores_what_it_wrote_onto_another_layout(tmp_path):
    state = _state()
    with ocp.Checkpointer(_orbax.state_handler()) as ckpt:
        ckpt.save(tmp_path / "ours", args=ocp.args.PyTreeSave(state))
    mesh = jax.make_mesh((2,), ("y",), axis_types=(AxisType.Auto,), devices=jax.devices()[6:])
    target = {
        "w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P(None, "y"))),
        "r": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P("y"))),
        "n": np.zeros(3, np.float32),
        "s": 0,
    }
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ours", target)
    assert restored["w"].sharding == target["w"].sharding
    for name in ("w", "r", "n"):
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(state[name]))
    assert restored["s"] == 3


def test_refuses_a_prng_key_held_by_one_process():
    key = jax.device_put(jax.random.key(0), jax.devices()[1])
    with pytest.raises(errors.CheckpointArgumentError, match=r"\['key'\].*key_data"):
        _orbax.check_savable({"w": np.ones(2), "key": key})
    _orbax.check_savable({"w": jax.numpy.ones(2), "data": jax.random.key_data(key)})
