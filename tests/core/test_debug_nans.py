"""``jax_debug_nans`` / ``jax_debug_infs`` in an MPMD program (``run/_debug_nans``).

A fragment whose output holds a NaN (inf) raises JAX's public ``FloatingPointError`` naming
the fragment, its task, phase and devices, and the first operation that produced the value
with its source line in this file. With the flags off nothing changes: the NaN comes back,
compiled and dispatched as before. Each test sets a flag with JAX's context managers, so it
does not leak into other tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh_flax as mm
from multimesh_flax.core.run import MpmdExecutable, OpKind


def _logs(x):
    return jnp.log(x)


def _masked_log(x):
    safe = jnp.where(x > 0, jnp.log(x), 0.0)  # the NaN of log(-1) never leaves this line
    return safe + jnp.sqrt(x)


def _roots(x):
    return jnp.sqrt(x) * 0.0  # at 0: inf in the forward (sqrt's derivative), 0 * inf backward


def _line(fun, offset=1):
    """``file:line`` of the line ``offset`` lines below ``fun``'s ``def``."""
    code = fun.__code__
    return f"{code.co_filename}:{code.co_firstlineno + offset}:"


def _program(fun, name, **jit_options):
    f = mm.task(fun, mesh=mm.TaskMesh(devices=[0]), name=name)
    g = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[1]))
    return mm.jit(lambda x: g(f(x)), **jit_options)


@pytest.mark.parametrize(
    ("fun", "primitive", "line"),
    [(_logs, "log", _line(_logs)), (_masked_log, "sqrt", _line(_masked_log, 2))],
    ids=["log", "masked-log"],
)
def test_a_forward_nan_names_the_operation_task_devices_and_line(fun, primitive, line):
    step = _program(fun, "logs")
    with jax.debug_nans(True), pytest.raises(FloatingPointError) as caught:
        step(jnp.array([-1.0, 1.0]))
    message = str(caught.value)
    assert "invalid value (nan)" in message
    assert "fragment `logs.fwd#0` (task `logs`, forward) on devices [0]" in message
    assert f"first operation to produce it is `{primitive}` at {line}" in message


@pytest.mark.parametrize(
    ("debug", "phase", "primitive"),
    [(jax.debug_nans, "backward", "mul"), (jax.debug_infs, "forward", "div")],
    ids=["nans", "infs"],
)
def test_a_gradient_names_its_phase(debug, phase, primitive):
    f = mm.task(_roots, mesh=mm.TaskMesh(devices=[0]), name="roots")
    g = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[1]))
    step = mm.jit(jax.grad(lambda x: g(f(x)).sum()))
    with debug(True), pytest.raises(FloatingPointError) as caught:
        step(jnp.array([0.0, 1.0]))
    message = str(caught.value)
    assert f"(task `roots`, {phase}) on devices [0]" in message
    assert f"`{primitive}` at {_line(_roots)}" in message


def test_programs_without_tasks_get_jax_own_op_by_op_rerun():
    step = mm.jit(_logs)  # the fast path: one jax.jit
    with jax.debug_nans(True), pytest.raises(FloatingPointError, match=r"encountered in log\b"):
        step(jnp.array([-1.0, 1.0]))


def test_donated_inputs_still_name_the_fragment():
    step = _program(_logs, "logs", donate_argnums=0)
    step(jnp.array([1.0, 2.0]))  # compiled with the flag off: the input is donated
    with jax.debug_nans(True), pytest.raises(FloatingPointError) as caught:
        step(jnp.array([-1.0, 1.0]))
    assert "fragment `logs.fwd#0` (task `logs`, forward) on devices [0]" in str(caught.value)


def test_with_the_flag_off_the_nan_comes_back_as_before(monkeypatch):
    def never(*args):
        raise AssertionError("the NaN path ran with the flag off")

    monkeypatch.setattr(MpmdExecutable, "floating_point_error", never)
    step = _program(_logs, "logs")
    x = jnp.array([-1.0, 1.0])
    exe = step.executable(x)
    for _ in range(2):
        out = step(x)
        assert np.isnan(np.asarray(out)[0])
        assert exe.compile_count() == sum(op.kind is OpKind.RUN for op in exe.ops) == 2
