"""``microbatch`` without pipelining: splitting, reducing, autodiff, contexts and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors
from multimesh_flax.core.trace import trace_program

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _sum_loss(w, batch):
    return jnp.sum((batch["x"] @ w - batch["y"]) ** 2)


def _mean_loss(w, batch):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def _data(n=12):
    kx, ky, kw = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(kx, (n, 3)), "y": jax.random.normal(ky, (n, 2))}
    return jax.random.normal(kw, (3, 2)), batch


def _close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)


@pytest.mark.parametrize(("loss", "reduce"), [(_sum_loss, "sum"), (_mean_loss, "mean")])
@pytest.mark.parametrize("size", [3, 12])
def test_reduction_matches_full_batch(loss, reduce, size):
    w, batch = _data()
    fn = mm.microbatch(loss, 0, size, argnum=1, reduce=reduce)
    _close(fn(w, batch), loss(w, batch))
    _close(jax.jit(fn)(w, batch), loss(w, batch))


def test_sum_of_means_is_m_times_the_mean():
    w, batch = _data()
    fn = mm.microbatch(_mean_loss, 0, 3, argnum=1)  # 4 chunks, sum of per-chunk means
    _close(fn(w, batch), 4 * _mean_loss(w, batch))


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_value_and_grad_inside_or_outside(where):
    w, batch = _data()
    if where == "inside":
        fn = mm.microbatch(jax.value_and_grad(_mean_loss), 0, 4, argnum=1, reduce="mean")
    else:
        fn = jax.value_and_grad(mm.microbatch(_mean_loss, 0, 4, argnum=1, reduce="mean"))
    _close(fn(w, batch), jax.value_and_grad(_mean_loss)(w, batch))


def test_pytree_outputs_and_split_along_another_axis():
    x = jnp.arange(24.0).reshape(2, 12)

    def stats(x):
        return {"sum": x.sum(axis=1), "count": jnp.array(x.shape[1], jnp.float32)}

    out = mm.microbatch(stats, 1, 4)(x)
    _close(out, {"sum": x.sum(axis=1), "count": jnp.float32(12)})
    _close(mm.microbatch(stats, -1, 6)(x), out)


def test_pre_and_post_ops_under_jit_without_tasks():
    w, batch = _data()

    def step(w, batch):
        batch = {"x": batch["x"] * 2.0, "y": batch["y"]}  # pre op
        loss = mm.microbatch(_mean_loss, 0, 6, argnum=1, reduce="mean")(w, batch)
        return jnp.sqrt(loss)  # post op

    expected = jnp.sqrt(_mean_loss(w, {"x": batch["x"] * 2.0, "y": batch["y"]}))
    program = mm.jit(jax.value_and_grad(step))
    _close(
        program(w, batch),
        jax.value_and_grad(
            lambda w: jnp.sqrt(_mean_loss(w, {"x": batch["x"] * 2.0, "y": batch["y"]}))
        )(w),
    )
    _close(program(w, batch)[0], expected)
    assert program.describe(w, batch).startswith("fast path"), "no tasks: one jax.jit"
    with mm.ignore_transforms():
        _close(step(w, batch), expected)


def test_unrolls_one_scope_per_microbatch():
    w, batch = _data()
    fn = jax.grad(mm.microbatch(_mean_loss, 0, 3, argnum=1))
    traced = trace_program(fn, (w, batch))
    scopes = {s.split("mmmb")[1].split(")")[0].split("/")[0] for s in traced.stacks if "mmmb" in s}
    assert len(scopes) == 4 and len({s.split("_")[0] for s in scopes}) == 1
    backward = [s for s in traced.stacks if "transpose(" in s and "mmmb" in s]
    assert backward, "the backward keeps the microbatch scope"


def test_arg_shardings_constrain_every_chunk_inside_a_task():
    mesh = mm.TaskMesh(devices=range(4), axis_names=("x",))

    def body(x):
        return mm.microbatch(jnp.sum, 0, 4, arg_shardings=P("batch", None))(x)

    fn = mm.task(body, mesh=mesh, logical_axes=[("batch", "x")])
    traced = trace_program(fn, (jnp.ones((16, 2)),))
    specs = [
        e.params["sharding"].spec
        for e in traced.jaxpr.eqns
        if e.primitive.name == "sharding_constraint"
    ]
    assert specs == [P("x", None)] * 4
    np.testing.assert_allclose(mm.jit(fn)(jnp.ones((16, 2))), 32.0)


def test_arg_shardings_under_plain_jit_with_a_mesh():
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    fn = jax.jit(mm.microbatch(lambda x: jnp.sum(x, axis=0), 0, 8, arg_shardings=P("batch")))
    x = jnp.arange(32.0).reshape(16, 2)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(fn)(x)
        out = fn(jax.device_put(x, NamedSharding(mesh, P("batch"))))
    text = str(jaxpr)
    assert text.count("sharding_constraint") == 2 and "batch" in text
    _close(out, x.sum(axis=0))


@pytest.mark.parametrize(
    ("kwargs", "call", "error", "match"),
    [
        ({"size": 5}, None, errors.UnevenMicrobatchError, r"`size`=5 does not divide .* 12"),
        ({"size": 0}, None, errors.MicrobatchArgumentError, "positive integer"),
        ({"dim": 2}, None, errors.MicrobatchAxisError, r"`dim`=2 .* shape \(12, 3\)"),
        ({"dim": 0.5}, None, errors.MicrobatchAxisError, "`dim` to be an int"),
        ({"argnum": 3}, None, errors.MicrobatchAxisError, "`argnum`=3"),
        ({"reduce": "max"}, None, errors.MicrobatchArgumentError, "`reduce`"),
        ({"schedule": "pipedream"}, None, errors.InvalidScheduleError, "Unknown `schedule`"),
        ({"schedule": "custom"}, None, errors.MicrobatchArgumentError, "`custom_schedule`"),
        ({"custom_schedule": [["Q0.0"]]}, None, errors.InvalidScheduleError, "op written"),
        ({"custom_schedule": "F0.0"}, None, errors.InvalidScheduleError, "one sequence"),
        ({"custom_schedule": [[(0, 0, "X")]]}, None, errors.InvalidScheduleError, "entry"),
        ({"num_stages": -1}, None, errors.MicrobatchArgumentError, "`num_stages`"),
        (
            {},
            {"x": jnp.ones((12, 3)), "y": jnp.ones((10, 2))},
            errors.UnevenMicrobatchError,
            "same length",
        ),
    ],
)
def test_bad_arguments_raise(kwargs, call, error, match):
    w, batch = _data()
    options = {"dim": 0, "size": 4, "argnum": 1, **kwargs}
    with pytest.raises(error, match=match):
        fn = mm.microbatch(_sum_loss, options.pop("dim"), options.pop("size"), **options)
        fn(w, batch if call is None else call)


def test_non_dividing_batch_raises_under_jit_too():
    w, batch = _data(10)
    with pytest.raises(errors.UnevenMicrobatchError, match="2 example"):
        mm.jit(mm.microbatch(_sum_loss, 0, 4, argnum=1))(w, batch)
