"""Sharded initializers of MPMD programs: one program creates every leaf, then each moves to
its submesh; values exactly those of the unsharded initializer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh_flax._compilation_cache import compilation_counter
from multimesh_flax.core.front import _initializer, sharded_initializer

AUTO = (AxisType.Auto, AxisType.Auto)


def _stage_mesh(first: int) -> jax.sharding.Mesh:
    devices = jax.devices()[first : first + 4]
    return jax.make_mesh((2, 2), ("data", "model"), devices=devices, axis_types=AUTO)


def _init() -> dict[str, jax.Array]:
    """Two identical "blocks" (one per stage), a small leaf, and one no dimension of which
    splits over 8 devices."""
    key = jax.random.key(0)
    blocks = {
        f"block{i}": jax.random.normal(jax.random.fold_in(key, i), (64, 32)) for i in range(2)
    }
    return {
        **blocks,
        "bias": jnp.arange(16.0),
        "odd": jax.random.uniform(jax.random.fold_in(key, 9), (6, 10)),
    }


def _shardings() -> dict[str, NamedSharding]:
    first, second = _stage_mesh(0), _stage_mesh(4)
    return {
        "block0": NamedSharding(first, P(None, "model")),
        "block1": NamedSharding(second, P(None, "model")),
        "bias": NamedSharding(first, P()),
        "odd": NamedSharding(second, P("model")),
    }


def _check_exact(tree: dict[str, jax.Array]) -> None:
    reference = jax.jit(_init)()
    shardings = _shardings()
    for name, leaf in tree.items():
        assert leaf.sharding == shardings[name], name
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(reference[name]), rtol=0, atol=0)


def test_several_device_sets_compile_one_program():
    init = sharded_initializer(_init, _shardings())
    read = compilation_counter(this_thread=True)  # not another test's step compiling ahead
    tree = init()
    # Not one program per submesh: the two blocks' kernels compile once (or load once from
    # the suite's persistent compilation cache).
    counts = read()
    assert counts["compiles"] + counts["cache_hits"] == 1
    _check_exact(tree)


def _staged_specs() -> tuple[dict[str, P], list[str]]:
    """The staging specs of the staged leaves, and the names of those created in place."""
    flat, _ = jax.tree_util.tree_flatten(_shardings())
    avals, _ = jax.tree_util.tree_flatten(jax.eval_shape(_init))
    names = sorted(_init())  # the flattening order of a dict
    specs, in_place = {}, []
    for group in _initializer._groups(flat, avals):
        if group.created is group.final:
            in_place += [names[i] for i in group.indices]
            continue
        assert all(len(s.device_set) == 8 for s in group.created)
        specs.update({names[i]: s.spec for i, s in zip(group.indices, group.created, strict=True)})
    return specs, in_place


def test_small_leaves_are_replicated_while_staged():
    specs, in_place = _staged_specs()
    assert specs == {name: P() for name in ("bias", "block0", "block1", "odd")}
    assert in_place == []


def test_leaves_past_the_budget_are_split_while_staged(monkeypatch):
    # Room for the smallest leaf (16 floats) only: the others are split 8 ways, or created
    # in place when no dimension splits (6 x 10).
    monkeypatch.setattr(_initializer, "REPLICATE_BYTES", 16 * 4)
    specs, in_place = _staged_specs()
    assert specs == {"bias": P(), "block0": P("staging"), "block1": P("staging")}
    assert in_place == ["odd"]
    _check_exact(sharded_initializer(_init, _shardings())())


def test_one_device_set_creates_leaves_in_place():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO)
    shardings = {k: NamedSharding(mesh, P()) for k in ("block0", "block1", "bias", "odd")}
    flat, _ = jax.tree_util.tree_flatten(shardings)
    avals, _ = jax.tree_util.tree_flatten(jax.eval_shape(_init))
    (group,) = _initializer._groups(flat, avals)
    assert group.created is group.final


@pytest.mark.parametrize("replicate_bytes", [0, 64 << 20])
def test_staged_values_match_the_unsharded_initializer(monkeypatch, replicate_bytes):
    monkeypatch.setattr(_initializer, "REPLICATE_BYTES", replicate_bytes)
    _check_exact(sharded_initializer(_init, _shardings())())
