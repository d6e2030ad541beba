"""Programs that run, but not where they say: each gets one ``PlacementWarning`` (issue 17).

Every test reproduces what a user wrote, asserts the warning's category and the fragments of
its message that name the cause and the fix, that it fires once per cause, and that
``context(strict=True)`` turns it into ``StrictModeError``. The values computed are still the
unplaced program's.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.core.declare import forget_warnings


@pytest.fixture(autouse=True)
def _fresh_warnings():
    forget_warnings()
    with mm.context(strict=False):  # the suite runs strict (conftest.py); these test warnings
        yield
    forget_warnings()


def _caught(fun):
    """``(result, [PlacementWarning messages])`` of ``fun()``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fun()
    messages = [str(w.message) for w in caught if issubclass(w.category, errors.PlacementWarning)]
    others = [w for w in caught if not issubclass(w.category, errors.PlacementWarning)]
    assert not others, others
    return result, messages


def _program(w, x):
    with jax.named_scope("layer_0"):
        h = jnp.tanh(x @ w[0])
    with jax.named_scope("layer_1"):
        return jnp.mean((h @ w[1]) ** 2)


W = (jnp.ones((8, 8)) / 8, jnp.ones((8, 8)) / 8)
X = jnp.ones((4, 8))


def _multi(pattern):
    multi = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "batch", "model"))
    multi.register_task(
        pattern, callback=lambda name, backprop: mm.Task(mesh_slice={"stage": int(name)})
    )
    return multi


def _reference():
    with mm.ignore_transforms():
        return jax.grad(_program)(W, X)


# --- item 4: a register_task pattern that matches nothing -----------------------------------


def test_pattern_matching_no_name_warns_with_the_closest_names():
    multi = _multi("layer([0-9])")  # the scopes are layer_0, layer_1

    def run():
        with multi:
            return mm.jit(jax.grad(_program))(W, X)

    grads, messages = _caught(run)
    assert len(messages) == 1, messages
    for fragment in ("'layer([0-9])'", "matched no name", "Closest names: ['layer_0', 'layer_1']",
                     "re.fullmatch", "fix the pattern"):  # fmt: skip
        assert fragment in messages[0], messages[0]
    np.testing.assert_allclose(grads[0], _reference()[0], rtol=1e-6)
    assert {d.id for d in grads[0].devices()} != {0, 1, 2, 3}  # nothing placed on stage 0
    _, again = _caught(run)
    assert again == []  # once per registration


def test_a_matching_pattern_places_and_does_not_warn():
    multi = _multi("layer_([0-9])")

    def run():
        with multi:
            return mm.jit(jax.grad(_program))(W, X)

    grads, messages = _caught(run)
    assert messages == []
    assert {d.id for d in grads[0].devices()} == {0, 1, 2, 3}


def test_registered_multimesh_used_outside_its_with_block_warns():
    multi = _multi("layer_([0-9])")
    grads, messages = _caught(lambda: mm.jit(jax.grad(_program))(W, X))
    assert len(messages) == 1, messages
    for fragment in ("MultiMesh(stage=2, batch=2, model=2)", "'layer_([0-9])'", "'layer_0'",
                     "not active", "with multi_mesh:"):  # fmt: skip
        assert fragment in messages[0], messages[0]
    np.testing.assert_allclose(grads[0], _reference()[0], rtol=1e-6)
    del multi


def test_strict_mode_raises_for_a_pattern_matching_nothing():
    multi = _multi("layer([0-9])")
    with multi, mm.context(strict=True), pytest.raises(errors.StrictModeError, match="matched no"):
        mm.jit(jax.grad(_program))(W, X)


# --- item 5: logical names without a rule ---------------------------------------------------

STAGE = mm.TaskMesh(devices=range(4), axis_names=("x",))


def _constrained(name):
    def body(x):
        return mm.with_sharding_constraint(x, P(name, None)) * 2

    return mm.task(body, mesh=STAGE, logical_axes=[("batch", "x")])


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("btach", ("'btach' has no rule", "Closest rule names: ['batch']", "('btach', None)")),
        ("x", ("'x' is a mesh axis name", "not a logical name", "Closest rule names: ['batch']")),
    ],
)
def test_logical_name_without_a_rule_warns_once(name, fragments):
    y, messages = _caught(lambda: mm.jit(_constrained(name))(jnp.ones((8, 2))))
    assert len(messages) == 1, messages
    for fragment in (*fragments, "replicated", "`logical_axes`"):
        assert fragment in messages[0], messages[0]
    assert y.sharding.spec == P()  # replicated, as documented
    np.testing.assert_array_equal(y, 2 * np.ones((8, 2)))
    _, again = _caught(lambda: mm.jit(_constrained(name))(jnp.ones((8, 2))))
    assert again == []


def test_rule_names_and_explicit_replication_do_not_warn():
    _, messages = _caught(lambda: mm.jit(_constrained("batch"))(jnp.ones((8, 2))))
    assert messages == []
    replicate = mm.task(
        lambda x: mm.with_sharding_constraint(x, P("batch", "embed")),
        mesh=STAGE,
        logical_axes=[("batch", "x"), ("embed", None)],
    )
    _, messages = _caught(lambda: mm.jit(replicate)(jnp.ones((8, 2))))
    assert messages == []


def test_strict_mode_raises_and_restores():
    with mm.context(strict=True):
        assert mm.core.get_flag("strict")
        with pytest.raises(errors.StrictModeError, match="'btach' has no rule"):
            mm.jit(_constrained("btach"))(jnp.ones((8, 2)))
        with pytest.raises(errors.StrictModeError):  # every time, not once
            mm.jit(_constrained("btach"))(jnp.ones((4, 2)))
    assert not mm.core.get_flag("strict")


# --- item 6: tasks traced by jax.jit ----------------------------------------------------------


def test_task_traced_by_jax_jit_warns_naming_our_jit():
    double = mm.task(lambda x: x * 2, name="double", mesh=mm.TaskMesh(devices=[3]))
    y, messages = _caught(lambda: jax.jit(double)(jnp.ones(4)))
    assert len(messages) == 1, messages
    for fragment in ("'double'", "not placed", "`multimesh_flax.jit`", "parallelize"):
        assert fragment in messages[0], messages[0]
    np.testing.assert_array_equal(y, 2 * np.ones(4))
    _, again = _caught(lambda: jax.jit(double)(jnp.ones(3)))
    assert again == []
    z, messages = _caught(lambda: mm.jit(double)(jnp.ones(4)))  # ours: placed, no warning
    assert messages == [] and {d.id for d in z.devices()} == {3}


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)


def test_flax_task_traced_by_jax_jit_warns():
    Block = mm.task(_Block, name="block", mesh=mm.TaskMesh(devices=[1]))
    x = jnp.ones((2, 3))
    params = _Block().init(jax.random.key(0), x)
    y, messages = _caught(lambda: jax.jit(Block().apply)(params, x))
    assert len(messages) == 1 and "'block'" in messages[0], messages
    np.testing.assert_allclose(y, _Block().apply(params, x), rtol=1e-6)


def test_eval_shape_inside_our_tools_does_not_warn():
    Block = mm.task(_Block, mesh=mm.TaskMesh(devices=[1]))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block()(x).sum()

    _, messages = _caught(lambda: mm.tabulate(Net(), jax.random.key(0), jnp.ones((2, 3))))
    assert messages == []
