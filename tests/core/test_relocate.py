"""Relocated executables (``run/_relocate``): a program compiled for one submesh runs on an
equally shaped one without compiling again, with exactly the results of a compile there."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh_flax.core.run import _relocate
from tests.core._chain import assert_matches_unparallelized
from tests.core.test_blocks import _data, _step

AUTO = (AxisType.Auto, AxisType.Auto)


def _mesh(ids):
    devices = [jax.devices()[i] for i in ids]
    return jax.make_mesh((2, 2), ("data", "model"), devices=devices, axis_types=AUTO)


def _f(x, w):
    """A matmul sharded both ways, so partitions exchange data (collectives)."""
    y = jnp.tanh(x @ w)
    return y.sum(axis=0), y


def _args(mesh):
    x = jnp.arange(64.0).reshape(8, 8) / 50
    w = jnp.cos(jnp.arange(64.0)).reshape(8, 8)
    return (
        jax.device_put(x, NamedSharding(mesh, P("data", "model"))),
        jax.device_put(w, NamedSharding(mesh, P("model", None))),
    )


def _mapping(a, b):
    return {d.id: e for d, e in zip(a.devices.flat, b.devices.flat, strict=True)}


def _moved_f(x, w):
    """``_f`` shifted: a program only the next test compiles. A source loaded from the suite's
    persistent cache (had another test compiled it) serializes without its kernels, and its
    relocated copy cannot run; ``_relocate.compile`` tells the two apart (tested below)."""
    y = jnp.tanh(x @ w + 0.5)
    return y.sum(axis=0), y


def test_relocated_executable_runs_on_the_other_devices_exactly():
    a, b = _mesh([0, 1, 2, 3]), _mesh([7, 5, 6, 4])  # another set, in a shuffled order
    compiled = jax.jit(_moved_f).lower(*_args(a)).compile()
    moved = _relocate.relocate(compiled, _mapping(a, b))
    assert moved is not None
    total, y = moved(*_args(b))
    assert {d.id for d in y.devices()} == {4, 5, 6, 7}
    assert y.sharding.mesh.devices.tolist() == b.devices.tolist()
    reference_total, reference_y = jax.jit(_moved_f)(*_args(b))  # compiled for b itself
    np.testing.assert_array_equal(np.asarray(y), np.asarray(reference_y))
    np.testing.assert_array_equal(np.asarray(total), np.asarray(reference_total))


def test_relocation_that_cannot_be_done_returns_none():
    a = _mesh([0, 1, 2, 3])
    compiled = jax.jit(_f).lower(*_args(a)).compile()
    partial = {0: jax.devices()[4]}  # devices 1-3 have no target
    assert _relocate.relocate(compiled, partial) is None


def test_identical_middle_stages_compile_once():
    """Four stages of the same layer: stages 1 and 2 are the same fragments on different
    submeshes, so the second is relocated, not compiled."""
    step, loss = _step("gpipe", stages=4)
    params, batch = _data(stages=4)
    assert_matches_unparallelized(step, loss, params, batch)
    exe = step.executable(params, batch)
    assert exe.relocation_count() >= 2  # the middle stage's forward and backward at least
    runs = [op for op in exe.ops if op.kind == 0 and op.name.startswith(("layer1", "layer2"))]
    assert {op.program.relocations for op in runs} != {0}


def test_only_executables_compiled_here_are_relocation_sources():
    """One loaded from the persistent compilation cache serializes without its kernels: a
    relocated copy would fail when run, so ``compile`` tells the two apart."""
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("the persistent compilation cache is off")
    a = _mesh([0, 1, 2, 3])

    def g(x, w):  # a program no other test compiles
        return jnp.sin(x @ w) * 3.25 + 0.125

    _, compiled_here = _relocate.compile(jax.jit(g).lower(*_args(a)))
    assert compiled_here
    jax.clear_caches()  # the next compile of g reads the persistent cache
    _, compiled_here = _relocate.compile(jax.jit(g).lower(*_args(a)))
    assert not compiled_here
