"""Name-based tasks (``register_task``, ``Context``) on ``jax.named_scope`` scopes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.core.declare import forget_warnings

TOL = {"rtol": 2e-5, "atol": 2e-6}


def _ids(array) -> set[int]:
    return {d.id for d in array.devices()}


def _spec(array) -> P:
    """The array's ``PartitionSpec`` with one entry per dimension (trailing ``None``s kept)."""
    spec = tuple(array.sharding.spec)
    return P(*spec, *([None] * (array.ndim - len(spec))))


def _on(*positions: int, names=("devices",), sizes=None) -> mm.Task:
    return mm.Task(mesh=mm.TaskMesh(devices=positions, axis_names=names, axis_sizes=sizes))


def _two_scopes(w, x):
    """``stage_0`` then ``stage_1``, glue (the mean) outside both."""
    with jax.named_scope("stage_0"):
        h = jnp.tanh(x @ w)
    with jax.named_scope("stage_1"):
        h = jnp.sin(h) * 2.0
    return jnp.mean(h**2)


def _inputs():
    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (8, 8))
    return w, x


def _reference(fun, *args):
    with mm.ignore_transforms():
        return fun(*args)


def _assert_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)


_PHASE_NAMES = {"F": "fwd", "B": "bwd"}  # as fragment names spell them


def _task_names(jitted, *args) -> list[str]:
    """``name.phase`` of every task fragment of the compiled program, in program order."""
    part = jitted.executable(*args).partition
    return [
        f"{part.traced.tasks[f.label.task].name}.{_PHASE_NAMES[f.label.phase]}"
        for f in part.fragments
        if f.label is not None
    ]


# --- matching -------------------------------------------------------------------------------


def test_exact_name_runs_the_scope_on_its_task():
    w, x = _inputs()
    fun = mm.jit(_two_scopes)
    with mm.Context():
        mm.register_task("stage_1", task=_on(3))
        out = fun(w, x)
        assert _task_names(fun, w, x) == ["stage_1.fwd"]
    assert _ids(out) == {3}  # the glue after stage_1 stays where its input lives
    _assert_close(out, _reference(_two_scopes, w, x))


def test_matcher_must_match_the_whole_scope_name():
    w, x = _inputs()
    fun = mm.jit(_two_scopes)
    forget_warnings()
    with (
        mm.context(strict=False),
        mm.Context(),
        pytest.warns(errors.PlacementWarning, match="'stage' matched no name"),
    ):
        mm.register_task("stage", task=_on(3))
        assert fun.describe(w, x).startswith("fast path")


def test_regex_capture_group_is_the_matched_name():
    calls = []

    def callback(name, backprop):
        calls.append((name, backprop))
        return _on(int(name) + 4)

    w, x = _inputs()
    step = mm.jit(jax.value_and_grad(_two_scopes))
    with mm.Context():
        mm.register_task(r"stage_(\d)", callback=callback)
        loss, grad = step(w, x)
        assert _task_names(step, w, x) == ["0.fwd", "1.fwd", "1.bwd", "0.bwd"]
    # Once per (matched name, pass) and trace; the backward reuses the equal forward task.
    assert sorted(set(calls)) == [("0", False), ("0", True), ("1", False), ("1", True)]
    assert _ids(grad) == {4}
    _assert_close((loss, grad), _reference(jax.value_and_grad(_two_scopes), w, x))


def test_matcher_without_group_passes_the_whole_name():
    seen = []

    def callback(name, backprop):
        seen.append(name)
        return _on(1)

    w, x = _inputs()
    with mm.Context():
        mm.register_task(re.compile(r"stage_\d"), callback=callback)
        mm.jit(_two_scopes)(w, x)
    assert set(seen) == {"stage_0", "stage_1"}


@pytest.mark.parametrize(
    ("backward", "expected_spec"),
    [((4, 5), P(None, "m")), ((4, 5, 6, 7), P(None, None))],  # same mesh shape / another
)
def test_callback_places_the_backward_elsewhere(backward, expected_spec):
    def blk(w, x):
        with jax.named_scope("blk"):
            w = mm.with_sharding_constraint(w, P(None, "m"))
            return jnp.sum(jnp.tanh(x @ w))

    def callback(name, backprop):
        devices = backward if backprop else (0, 1)
        return mm.Task(
            name=f"{name}_{'bwd' if backprop else 'fwd'}",
            mesh=mm.TaskMesh(devices=devices, axis_names=("m",)),
        )

    w, x = _inputs()
    step = mm.jit(jax.value_and_grad(blk))
    with mm.Context():
        mm.register_task("blk", callback=callback)
        loss, grad = step(w, x)
        assert _task_names(step, w, x) == ["blk_fwd.fwd", "blk_bwd.bwd"]
    assert _ids(loss) == {0, 1}
    assert _ids(grad) == set(backward)
    assert _spec(grad) == expected_spec
    _assert_close((loss, grad), _reference(jax.value_and_grad(blk), w, x))


def test_constraints_in_a_matched_scope_use_the_task_rules():
    def fun(x):
        with jax.named_scope("head"):
            return mm.with_sharding_constraint(x * 2, P("rows", None))

    task = mm.Task(
        mesh=mm.TaskMesh(devices=[4, 5, 6, 7], axis_names=("y",)), logical_axes=[("rows", "y")]
    )
    with mm.Context():
        mm.register_task("head", task=task)
        out = mm.jit(fun)(jnp.ones((8, 2)))
    assert _spec(out) == P("y", None)
    assert {s.data.shape for s in out.addressable_shards} == {(2, 2)}
    assert _ids(out) == {4, 5, 6, 7}


def test_glue_stays_with_the_tasks_not_on_all_devices():
    w, x = _inputs()
    step = mm.jit(jax.value_and_grad(_two_scopes))
    with mm.Context():
        mm.register_task(r"stage_(\d)", callback=lambda n, b: _on(2 * int(n), 2 * int(n) + 1))
        step(w, x)
        part = step.executable(w, x).partition
    assert {f.place for f in part.fragments} == {(0, 1), (2, 3)}


def test_ignore_transforms_ignores_registrations():
    w, x = _inputs()
    with mm.Context():
        mm.register_task(r"stage_(\d)", callback=lambda n, b: _on(int(n) + 6))
        with mm.ignore_transforms():
            out = mm.jit(_two_scopes)(w, x)
    assert _ids(out) == {0}


# --- contexts -------------------------------------------------------------------------------


def test_inner_context_wins_and_outer_applies_again_after_it():
    w, x = _inputs()
    fun = mm.jit(_two_scopes)
    outer, inner = mm.Context(), mm.Context()
    outer.register_task(r"stage_\d", task=_on(1))
    inner.register_task("stage_1", task=_on(2))
    with outer:
        with inner:
            in_inner = fun(w, x)
            places = [f.place for f in fun.executable(w, x).partition.fragments]
        in_outer = fun(w, x)
    assert places[0] == (1,)  # stage_0: only the outer context matches it
    assert _ids(in_inner) == {2}
    assert _ids(in_outer) == {1}
    # Both were entered before, so outside their `with` they are simply inactive: no tasks,
    # and no warning (strict mode, on in every test, would raise it).
    assert fun.describe(w, x).startswith("fast path")


def test_later_registration_in_one_context_wins():
    w, x = _inputs()
    with mm.Context():
        mm.register_task(r"stage_\d", task=_on(1))
        mm.register_task("stage_1", task=_on(5))
        out = mm.jit(_two_scopes)(w, x)
    assert _ids(out) == {5}


def test_register_task_adds_to_the_innermost_context():
    with mm.Context() as outer, mm.Context() as inner:
        mm.register_task("a", task=_on(1))
    assert len(inner.registrations) == 1
    assert outer.registrations == ()
    assert inner.registrations[0].pattern.pattern == "a"


def test_a_registration_after_a_call_retraces():
    w, x = _inputs()
    fun = mm.jit(_two_scopes)
    with mm.Context() as ctx:
        before = fun(w, x)
        ctx.register_task("stage_1", task=_on(6))
        after = fun(w, x)
    assert _ids(before) == {0}
    assert _ids(after) == {6}


# --- nesting with explicit tasks ------------------------------------------------------------


def test_innermost_of_explicit_and_registered_tasks_wins():
    inner_explicit = mm.task(lambda h: h + 1, name="explicit", mesh=mm.TaskMesh(devices=[7]))

    def fun(x):
        with jax.named_scope("outer"):
            h = inner_explicit(x * 2)  # explicit inside registered
            with jax.named_scope("inner"):
                return h * 3

    wrapped = mm.jit(mm.task(fun, name="around", mesh=mm.TaskMesh(devices=[0])))
    x = jnp.arange(4.0)
    with mm.Context():
        mm.register_task("outer", task=_on(5))
        mm.register_task("inner", task=_on(6))
        out = wrapped(x)
        assert _task_names(wrapped, x) == ["outer.fwd", "explicit.fwd", "inner.fwd"]
    assert _ids(out) == {6}
    np.testing.assert_allclose(np.asarray(out), (np.arange(4.0) * 2 + 1) * 3)


# --- control flow ---------------------------------------------------------------------------


def _scanned(x):
    def body(carry, _):
        with jax.named_scope("step"):
            return jnp.sin(carry), None

    with jax.named_scope("loop"):
        return jax.lax.scan(body, x, None, length=3)[0]


def test_registered_scope_inside_a_loop_is_rejected():
    with mm.Context():
        mm.register_task("step", task=_on(1))
        with pytest.raises(errors.TaskInControlFlowError, match=r"'step'.*`scan`"):
            mm.jit(_scanned)(jnp.ones(3))


def test_loop_inside_a_registered_scope_is_one_task():
    with mm.Context():
        mm.register_task("loop", task=_on(2))
        out = mm.jit(_scanned)(jnp.ones(3))
    assert _ids(out) == {2}
    _assert_close(out, _reference(_scanned, jnp.ones(3)))


# --- bad inputs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (dict(matcher="layer_(\\d"), errors.InvalidMatcherError, "'layer_(\\\\d'"),
        (dict(matcher=3), errors.InvalidMatcherError, "int: 3"),
        (dict(matcher="a", callback=None, task=None), errors.TaskRegistrationError, "neither"),
        (dict(matcher="a", callback=print, task=mm.Task()), errors.TaskRegistrationError, "both"),
        (dict(matcher="a", callback="nope"), errors.TaskCallbackError, "'nope'"),
        (dict(matcher="a", task="nope"), errors.TaskTypeError, "'nope'"),
    ],
)
def test_bad_registrations(kwargs, error, fragment):
    matcher = kwargs.pop("matcher")
    with mm.Context() as ctx, pytest.raises(error, match=re.escape(fragment)):
        mm.register_task(matcher, **kwargs)
    assert ctx.registrations == ()


def test_callback_returning_a_non_task_names_the_matcher():
    w, x = _inputs()
    with mm.Context():
        mm.register_task(r"stage_(\d)", callback=lambda name, backprop: [0, 1])
        with pytest.raises(errors.TaskCallbackError) as info:
            mm.jit(_two_scopes)(w, x)
    message = str(info.value)
    assert "matcher 'stage_(" in message
    assert "returned list: [0, 1] for matched name '0'" in message


def test_callback_exceptions_propagate():
    def callback(name, backprop):
        raise KeyError(name)

    w, x = _inputs()
    with mm.Context():
        mm.register_task("stage_0", callback=callback)
        with pytest.raises(KeyError, match="stage_0"):
            mm.jit(_two_scopes)(w, x)


def test_registered_scopes_under_microbatch_match_the_reference():
    w, x = _inputs()
    step = mm.jit(jax.value_and_grad(mm.microbatch(_two_scopes, 0, 2, argnum=1, reduce="mean")))
    with mm.Context():
        mm.register_task(r"stage_(\d)", callback=lambda n, b: _on(4 * int(n), 4 * int(n) + 1))
        loss, grad = step(w, x)
        names = _task_names(step, w, x)
    assert names.count("0.fwd") == names.count("1.bwd") == 4  # one per microbatch
    assert _ids(grad) == {0, 1}
    _assert_close((loss, grad), _reference(jax.value_and_grad(_two_scopes), w, x))


def test_a_default_task_places_glue_that_nothing_else_places():
    work = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[0, 1]))

    def program(x):
        return work(x), jnp.arange(4.0) + 1  # the second output has no placed neighbour

    first = mm.jit(program)(jnp.ones(4))
    assert {d.id for d in first[1].devices()} == {0, 1}  # fallback: the first task's submesh
    with mm.Context() as ctx:
        ctx.register_task("default", task=mm.Task(name="rest", mesh=mm.TaskMesh(devices=[6, 7])))
        out = mm.jit(program)(jnp.ones(4))
    assert {d.id for d in out[1].devices()} == {6, 7}
    np.testing.assert_allclose(out[1], np.arange(4.0) + 1)
