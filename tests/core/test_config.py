"""Tests for compiler contexts (``multimesh_flax.core.declare._config``)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm

DEFAULTS = {
    "autoshard": False,
    "enable_fast_path": True,
    "enable_recomputation": False,
    "ignore_transforms": False,
}
MANAGERS = {
    "autoshard": mm.autoshard,
    "enable_fast_path": mm.enable_fast_path,
    "enable_recomputation": mm.enable_recomputation,
    "ignore_transforms": mm.ignore_transforms,
}


def _flags():
    return {name: mm.core.get_flag(name) for name in DEFAULTS}


def test_defaults():
    assert _flags() == DEFAULTS


@pytest.mark.parametrize("name", sorted(MANAGERS))
@pytest.mark.parametrize("value", [True, False])
def test_context_sets_and_restores(name, value):
    with MANAGERS[name](value):
        assert mm.core.get_flag(name) is value
        others = {k: v for k, v in _flags().items() if k != name}
        assert others == {k: v for k, v in DEFAULTS.items() if k != name}
    assert _flags() == DEFAULTS


@pytest.mark.parametrize("name", sorted(MANAGERS))
def test_context_default_argument_turns_flag_on(name):
    with MANAGERS[name]():
        assert mm.core.get_flag(name) is True
    assert _flags() == DEFAULTS


@pytest.mark.parametrize("name", sorted(MANAGERS))
def test_context_restores_on_exception(name):
    value = not DEFAULTS[name]
    with pytest.raises(KeyError, match="inside"), MANAGERS[name](value):
        assert mm.core.get_flag(name) is value
        raise KeyError("inside")
    assert _flags() == DEFAULTS


@pytest.mark.parametrize("name", sorted(MANAGERS))
def test_contexts_nest(name):
    manager, default = MANAGERS[name], DEFAULTS[name]
    with manager(not default):
        assert mm.core.get_flag(name) is (not default)
        with manager(default):
            assert mm.core.get_flag(name) is default
            with manager(not default):
                assert mm.core.get_flag(name) is (not default)
            assert mm.core.get_flag(name) is default
        assert mm.core.get_flag(name) is (not default)
    assert mm.core.get_flag(name) is default


def test_different_contexts_nest():
    with mm.autoshard():
        with mm.enable_recomputation():
            with mm.enable_fast_path(False):
                assert _flags() == {
                    **DEFAULTS,
                    "autoshard": True,
                    "enable_recomputation": True,
                    "enable_fast_path": False,
                }
            assert _flags() == {**DEFAULTS, "autoshard": True, "enable_recomputation": True}
        assert _flags() == {**DEFAULTS, "autoshard": True}
    assert _flags() == DEFAULTS


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"autoshard": True},
        {"autoshard": True, "ignore_transforms": True},
        {"enable_fast_path": False, "enable_recomputation": True},
        {
            "autoshard": True,
            "enable_fast_path": False,
            "enable_recomputation": True,
            "ignore_transforms": True,
        },
    ],
)
def test_context_sets_several_and_leaves_none_alone(kwargs):
    with mm.context(**kwargs):
        assert _flags() == {**DEFAULTS, **kwargs}
    assert _flags() == DEFAULTS


def test_context_none_keeps_an_outer_value():
    with mm.autoshard(), mm.context(autoshard=None, enable_recomputation=True):
        assert mm.core.get_flag("autoshard") is True
        assert mm.core.get_flag("enable_recomputation") is True
    assert _flags() == DEFAULTS


def test_combined_context_restores_on_exception():
    with (
        pytest.raises(ValueError, match="body"),
        mm.context(autoshard=True, enable_fast_path=False, ignore_transforms=True),
    ):
        raise ValueError("body")
    assert _flags() == DEFAULTS


def test_flags_are_per_thread():
    seen = {}

    def worker():
        seen.update(_flags())

    with mm.context(autoshard=True, ignore_transforms=True):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert seen == DEFAULTS


# --- ignore_transforms makes every transform the identity -----------------------------------


def _model(w, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    return jnp.tanh(x @ mm.with_sharding_constraint(w, P(None, "model")))


MESH = mm.TaskMesh(devices=[2, 3], axis_names=("x",))
RULES = (("batch", "x"), ("model", "x"))


def _inputs():
    w = jax.random.normal(jax.random.key(0), (4, 6))
    x = jax.random.normal(jax.random.key(1), (8, 4))
    return w, x


def _reference(w, x):
    return np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64))


def test_ignore_transforms_task_is_identity():
    w, x = _inputs()
    model = mm.task(_model, mesh=MESH, logical_axes=RULES)
    with mm.ignore_transforms():
        y = model(w, x)
    assert y.devices() == {jax.devices()[0]}
    assert y.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(y), _reference(w, x), rtol=1e-5, atol=1e-6)


def test_ignore_transforms_with_sharding_constraint_is_identity():
    x = jnp.ones((3, 5))
    with mm.ignore_transforms():
        assert mm.with_sharding_constraint(x, P("anything", "at", "all")) is x
        assert mm.with_sharding_constraint({"a": x}, {"a": P("b")})["a"] is x
        with mm.autoshard():
            assert mm.with_sharding_constraint(x, P("batch")) is x


def test_ignore_transforms_jit_calls_the_function_eagerly():
    calls = []

    def f(x):
        calls.append(isinstance(x, jax.core.Tracer))
        return x * 3

    jitted = mm.jit(f)
    with mm.ignore_transforms():
        y1 = jitted(jnp.arange(4.0))
        y2 = jitted(jnp.arange(4.0))
    assert calls == [False, False]
    np.testing.assert_allclose(np.asarray(y1), [0.0, 3.0, 6.0, 9.0], rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y1), rtol=0, atol=0)


def test_ignore_transforms_parallelize_computes_the_same_values():
    w, x = _inputs()
    model = mm.task(_model, mesh=MESH, logical_axes=RULES)
    with mm.ignore_transforms():
        sharded_fun, init_w, get_x = mm.parallelize(
            model, init_params=lambda: _inputs()[0], get_input_batch=lambda: _inputs()[1]
        )
        y = sharded_fun(init_w(), get_x())
        reference = _model(w, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y), _reference(w, x), rtol=1e-5, atol=1e-6)


def test_ignore_transforms_matches_the_transformed_program():
    w, x = _inputs()
    model = mm.task(_model, mesh=MESH, logical_axes=RULES)
    transformed = mm.jit(model)(w, x)
    with mm.ignore_transforms():
        reference = mm.jit(model)(w, x)
    assert {d.id for d in transformed.devices()} == {2, 3}
    np.testing.assert_allclose(np.asarray(transformed), np.asarray(reference), rtol=1e-5, atol=1e-6)
