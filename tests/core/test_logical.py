"""Tests for logical sharding (``multimesh_flax.core.declare._rules``).

One test per resolution rule of ``logical_to_mesh_spec`` (API.md, "Sharding"), then the
behaviour of ``with_sharding_constraint`` inside a task, under ``autoshard``, under
``ignore_transforms`` and with none of these.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors

resolve = mm.logical_to_mesh_spec


def _same_spec(actual, expected):
    """Compares specs entry by entry, padding trailing ``None``s (P('x') == P('x', None))."""
    a, e = tuple(actual), tuple(expected)
    n = max(len(a), len(e))
    return a + (None,) * (n - len(a)) == e + (None,) * (n - len(e))


# --- logical_to_mesh_spec: one rule per test ------------------------------------------------


@pytest.mark.parametrize(
    ("rules", "expected"),
    [
        ((("batch", "x"), ("model", "x")), P("x", None)),
        ((("model", "x"), ("batch", "x")), P(None, "x")),
    ],
)
def test_rules_apply_in_priority_order(rules, expected):
    assert resolve(P("batch", "model"), (16, 8), {"x": 8}, rules) == expected


def test_rules_for_one_name_accumulate_in_order():
    rules = (("batch", "data"), ("batch", "fsdp"))
    spec = resolve(P("batch", None), (8, 3), {"data": 2, "fsdp": 4}, rules)
    assert spec == P(("data", "fsdp"), None)
    rules = (("batch", "fsdp"), ("batch", "data"))
    spec = resolve(P("batch", None), (8, 3), {"data": 2, "fsdp": 4}, rules)
    assert spec == P(("fsdp", "data"), None)


def test_a_mesh_axis_is_used_at_most_once_per_tensor():
    rules = (("a", "x"), ("b", "x"), ("b", "y"))
    spec = resolve(P("a", "b"), (8, 8), {"x": 2, "y": 4}, rules)
    assert spec == P("x", "y")
    # The same logical name on two dimensions: only the first gets the axis.
    assert resolve(P("a", "a"), (8, 8), {"x": 2}, (("a", "x"),)) == P("x", None)


def test_multi_axis_rule_is_skipped_if_any_axis_is_taken():
    rules = (("a", "x"), ("b", ("x", "y")), ("b", "y"))
    assert resolve(P("a", "b"), (8, 8), {"x": 2, "y": 4}, rules) == P("x", "y")


def test_rule_is_skipped_if_it_would_exceed_the_dimension():
    # x (4 shards) exceeds the dimension of size 2; y (2 shards) fits.
    rules = (("a", "x"), ("a", "y"))
    assert resolve(P("a"), (2,), {"x": 4, "y": 2}, rules) == P("y")
    # The accumulated count counts: 2 * 4 = 8 > 4, so only y stays.
    rules = (("a", "y"), ("a", "x"))
    assert resolve(P("a"), (4,), {"x": 4, "y": 2}, rules) == P("y")
    # A skipped axis stays free for a later dimension.
    rules = (("a", "x"), ("b", "x"))
    assert resolve(P("a", "b"), (2, 8), {"x": 4}, rules) == P(None, "x")


@pytest.mark.parametrize(("size", "shards"), [(6, 4), (12, 8), (10, 4)])
def test_uneven_split_raises(size, shards):
    with pytest.raises(errors.UnevenShardingError, match=re.escape(f"size {size}")) as info:
        resolve(P("a"), (size,), {"x": shards}, (("a", "x"),))
    assert isinstance(info.value, ValueError)
    assert f"({shards} shards)" in str(info.value)


def test_unmapped_names_are_replicated():
    rules = (("batch", "x"),)
    assert resolve(P("embed", "vocab"), (8, 8), {"x": 8}, rules) == P(None, None)
    assert resolve(P(None, "batch"), (8, 8), {"x": 8}, rules) == P(None, "x")
    assert resolve(P("a"), (8,), {"x": 8}, (("a", None),)) == P(None)


def test_tuple_entries_and_tuple_rules():
    rules = (("a", "x"), ("b", "y"))
    assert resolve(P(("a", "b")), (8,), {"x": 2, "y": 4}, rules) == P(("x", "y"))
    assert resolve(P("a"), (8,), {"x": 2, "y": 4}, (("a", ("x", "y")),)) == P(("x", "y"))


def test_short_spec_is_padded_with_replicated_dimensions():
    spec = resolve(P("a"), (8, 4, 2), {"x": 8}, (("a", "x"),))
    assert spec == P("x", None, None)
    assert resolve(P(), (8, 4), {"x": 8}, (("a", "x"),)) == P(None, None)


def test_rule_naming_a_missing_mesh_axis_in_logical_to_mesh_spec():
    with pytest.raises(errors.LogicalRulesError, match=re.escape("'zz'")):
        resolve(P("a"), (8,), {"x": 8}, (("a", "zz"),))


def test_too_many_spec_entries():
    with pytest.raises(errors.PartitionSpecError, match=re.escape("(8, 4)")):
        resolve(P("a", "b", "c"), (8, 4), {"x": 8}, (("a", "x"),))


# --- with_sharding_constraint ---------------------------------------------------------------

MESH = mm.TaskMesh(devices=range(8), axis_sizes=(2, 4), axis_names=("x", "y"))


def _constrained(spec, rules, shape=(8, 8)):
    fun = mm.task(lambda a: mm.with_sharding_constraint(a, spec) + 1, mesh=MESH, logical_axes=rules)
    return mm.jit(fun)(jnp.zeros(shape))


@pytest.mark.parametrize(
    ("spec", "rules", "expected"),
    [
        (P("batch", "model"), (("batch", "x"), ("model", "y")), P("x", "y")),
        (P("batch", "model"), (("model", "x"), ("batch", "x"), ("batch", "y")), P("y", "x")),
        (P("batch", "embed"), (("batch", "x"), ("embed", None)), P("x", None)),
        (P("batch", None), (("batch", "x"), ("batch", "y")), P(("x", "y"), None)),
    ],
)
def test_with_sharding_constraint_in_a_task_resolves_rules(spec, rules, expected):
    y = _constrained(spec, rules)
    assert isinstance(y.sharding, NamedSharding)
    assert _same_spec(y.sharding.spec, expected), y.sharding.spec
    np.testing.assert_allclose(np.asarray(y), np.ones((8, 8)), rtol=0, atol=0)


def test_with_sharding_constraint_default_rules_are_the_identity():
    fun = mm.task(lambda a: mm.with_sharding_constraint(a, P("y", "x")) * 2, mesh=MESH)
    y = mm.jit(fun)(jnp.ones((8, 8)))
    assert _same_spec(y.sharding.spec, P("y", "x"))


def test_with_sharding_constraint_pytree_prefix():
    spec = {"a": P("batch"), "b": (P(None, "batch"), None)}
    fun = mm.task(
        lambda t: mm.with_sharding_constraint(t, spec), mesh=MESH, logical_axes=(("batch", "x"),)
    )
    tree = {"a": jnp.ones((8, 2)), "b": (jnp.ones((2, 16)), jnp.ones((8,)))}
    out = mm.jit(fun)(tree)
    assert _same_spec(out["a"].sharding.spec, P("x"))
    assert _same_spec(out["b"][0].sharding.spec, P(None, "x"))
    assert out["b"][1].sharding.is_fully_replicated
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=0)


def test_with_sharding_constraint_uneven_inside_a_task():
    with pytest.raises(errors.UnevenShardingError, match=re.escape("size 6")):
        _constrained(P("batch"), (("batch", "y"),), shape=(6, 8))


def test_with_sharding_constraint_too_many_entries_inside_a_task():
    with pytest.raises(errors.PartitionSpecError, match=re.escape("P('a', 'b', 'c')")):
        _constrained(P("a", "b", "c"), (("a", "x"),))


def test_rule_naming_a_missing_mesh_axis_raises_when_traced():
    fun = mm.task(
        lambda a: mm.with_sharding_constraint(a, P("a")),
        mesh=MESH,
        logical_axes=(("a", "model"),),
    )
    with pytest.raises(errors.LogicalRulesError, match=re.escape("'model'")):
        mm.jit(fun)(jnp.zeros((8, 8)))


def test_extra_axes_name_a_missing_mesh_axis():
    fun = mm.task(lambda a: a, mesh=MESH, extra_axes=(("a", "z"),))
    with pytest.raises(errors.LogicalRulesError, match=re.escape("'z'")):
        fun(jnp.zeros(2))


def test_autoshard_without_a_task_replicates():
    x = jnp.ones((8, 4))
    with mm.autoshard():
        assert mm.with_sharding_constraint(x, P("batch", "model")) is x
        assert mm.with_sharding_constraint(x, P("not", "even", "valid")) is x
        y = jax.jit(lambda a: mm.with_sharding_constraint(a, P("batch")) * 2)(x)
    assert y.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(y), 2 * np.ones((8, 4)), rtol=0, atol=0)


def test_ignore_transforms_is_identity_even_inside_a_task():
    x = jnp.ones((6, 4))
    fun = mm.task(
        lambda a: mm.with_sharding_constraint(a, P("batch", "b", "c")),
        mesh=MESH,
        logical_axes=(("batch", "y"),),
    )
    with mm.ignore_transforms():
        assert mm.with_sharding_constraint(x, P("batch")) is x
        assert fun(x) is x


AUTO_MESH = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def test_plain_with_sharding_constraint_under_set_mesh():
    x = jnp.arange(32.0).reshape(8, 4)
    with jax.set_mesh(AUTO_MESH):
        y = jax.jit(lambda a: mm.with_sharding_constraint(a, P("x", None)) * 2)(x)
    assert isinstance(y.sharding, NamedSharding)
    assert _same_spec(y.sharding.spec, P("x"))
    assert y.sharding.mesh.devices.size == 8
    np.testing.assert_allclose(np.asarray(y), 2 * np.asarray(x), rtol=0, atol=0)


def test_plain_with_sharding_constraint_matches_jax():
    x = jnp.arange(64.0).reshape(8, 8)
    sharding = NamedSharding(AUTO_MESH, P(None, "x"))
    ours = jax.jit(lambda a: mm.with_sharding_constraint(a, sharding))(x)
    theirs = jax.jit(lambda a: jax.lax.with_sharding_constraint(a, sharding))(x)
    assert ours.sharding == theirs.sharding
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=0)


def test_plain_with_sharding_constraint_without_a_mesh_is_the_identity():
    # As flax.linen.with_logical_constraint without a mesh (API.md; it used to raise
    # JAX's "requires a non-empty mesh" here). tests/core/test_logical_eager.py has more.
    out = jax.jit(lambda a: mm.with_sharding_constraint(a, P("x")) * 2)(jnp.ones(8))
    np.testing.assert_array_equal(out, 2 * np.ones(8))
