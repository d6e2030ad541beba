"""Compiling a program's fragments ahead of its first call, in a thread (``run._ahead``).

A two-stage MLP on two data-parallel devices a stage, microbatched under 1F1B, trained with
SGD and momentum through ``mm.jit``. Compiled ahead from abstract arguments, its first call
must compile nothing more (the walk predicted every fragment's argument shardings) and train
like the unparallelized step; ``mm.parallelize`` starts the same walk for its function
while the caller initializes; Python scalars and NumPy arrays are walked as a call places
them. A walk stopped early leaves a program whose first call compiles the rest; a first
call racing the walk compiles nothing twice, nor does a walk of one or of several compiles
at once; a compile that fails ends the walk with its error. In a process's counts, a
thread's compiles are its own (``compilation_counter(this_thread=True)``): that is how a
compile tells whether it may serve as a relocation source while another thread compiles.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import multimesh_flax as mm
from multimesh_flax._compilation_cache import compilation_counter
from multimesh_flax.core.front import shape_structs
from multimesh_flax.core.run import RunOp, _ahead, _compile
from multimesh_flax.core.trace import BoundedCache
from tests.core._chain import TOL, train, train_step
from tests.core.test_packed_values import _data, _loss

OPTIMIZER = optax.sgd(0.1, momentum=0.9)
M = 4


@pytest.fixture(autouse=True)
def _own_programs(monkeypatch):
    """Programs of this test's own: executables are counted from none."""
    monkeypatch.setattr(_compile, "_FRAGMENT_CACHE", BoundedCache(capacity=64))


def _step():
    """A fresh ``mm.jit`` of the microbatched training step (its own program cache)."""
    mb_loss = mm.microbatch(_loss(2), 0, M, argnum=1, schedule="1f1b", reduce="mean")
    return mm.jit(train_step(mb_loss, OPTIMIZER))


def _arguments():
    params, x = _data()
    return params, OPTIMIZER.init(params), x


def test_first_call_compiles_nothing_more_and_trains_like_the_unparallelized_step():
    step, args = _step(), _arguments()
    ahead = step.compile_ahead(*shape_structs(args))
    assert ahead.wait(timeout=300) and ahead.error is None
    program = step.executable(*args)
    assert ahead.walked == len(program.ops)
    made = program.compile_count()
    assert made > 0
    got = train(step, OPTIMIZER, _data())
    assert program.compile_count() == made
    want = train(_loss(2), OPTIMIZER, _data(), unparallelized=True)
    for mine, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(mine, ref, **TOL)


def test_parallelize_compiles_the_function_while_the_caller_initializes():
    mb_loss = mm.microbatch(_loss(2), 0, M, argnum=1, schedule="gpipe", reduce="mean")
    params, x = _data()
    sharded, init = mm.parallelize(
        jax.value_and_grad(mb_loss), init_params=lambda: params, initial_batch=x
    )
    assert sharded.ahead.width == 1  # beside the caller's initializer: one compile at once
    placed = init()
    assert sharded.ahead.width == _ahead.WORKERS
    assert sharded.ahead.wait(timeout=300) and sharded.ahead.error is None
    program = sharded.executable(placed, x)
    made = program.compile_count()
    assert made > 0
    value, grads = sharded(placed, x)
    assert program.compile_count() == made
    with mm.ignore_transforms():
        want_value, want_grads = jax.value_and_grad(_loss(2))(params, x)
    np.testing.assert_allclose(value, want_value, **TOL)
    for mine, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(mine, ref, **TOL)


def test_python_scalars_and_numpy_arrays_are_walked_as_a_call_places_them():
    shift = mm.task(lambda x, s: jnp.tanh(x) + s, name="shift", mesh=mm.TaskMesh(devices=[0]))
    scale = mm.task(lambda x: x * 3, name="scale", mesh=mm.TaskMesh(devices=[1, 2]))
    f = mm.jit(lambda x, s: scale(shift(x, s)))
    x = np.arange(8, dtype=np.float32)
    ahead = f.compile_ahead(x, 0.5)
    assert ahead.wait(timeout=300) and ahead.error is None
    program = f.executable(x, 0.5)
    assert ahead.walked == len(program.ops)
    made = program.compile_count()
    np.testing.assert_allclose(f(x, 0.5), (np.tanh(x) + 0.5) * 3, **TOL)
    assert program.compile_count() == made


def test_a_stopped_walk_leaves_a_program_the_first_call_completes():
    step, args = _step(), _arguments()
    program = step.executable(*args)
    stop = threading.Event()
    stop.set()
    with pytest.raises(_ahead._Stopped):
        _ahead.compile_ahead(program, jax.tree.leaves(shape_structs(args)), stop)
    assert program.compile_count() == 0
    loss, _, _ = step(*args)
    assert np.isfinite(loss) and program.compile_count() > 0


def test_a_first_call_racing_the_walk_compiles_nothing_twice():
    step, args = _step(), _arguments()
    for other in list(_ahead._RUNNING):  # an earlier test's walk would count here too
        other.stop()
    read = compilation_counter()
    ahead = step.compile_ahead(*shape_structs(args))
    step(*args)  # while the walk runs: each fragment's executable is made once, by either
    assert ahead.wait(timeout=300) and ahead.error is None
    program = step.executable(*args)
    counts = read()
    made = counts["compiles"] + counts["cache_hits"]
    assert made == program.compile_count() - program.relocation_count()


@pytest.mark.parametrize(("workers", "slots"), [(1, 1), (3, 3), (3, 1)])
def test_a_walk_makes_each_executable_once_with_any_number_of_workers(workers, slots):
    step, args = _step(), _arguments()
    program = step.executable(*args)
    for other in list(_ahead._RUNNING):  # an earlier test's walk would count here too
        other.stop()
    read = compilation_counter()
    structs = jax.tree.leaves(shape_structs(args))
    walked = _ahead.compile_ahead(program, structs, workers=workers, slots=_ahead.Slots(slots))
    assert walked == len(program.ops)
    counts = read()
    made = program.compile_count()
    assert counts["compiles"] + counts["cache_hits"] == made - program.relocation_count()
    step(*args)
    assert program.compile_count() == made


def test_slots_let_as_many_in_as_their_count_and_widen_raises_it():
    slots, inside, most = _ahead.Slots(1), [], []
    lock = threading.Lock()

    def one_at_a_time():
        with slots:
            with lock:
                inside.append(1)
                most.append(len(inside))
            time.sleep(0.05)
            with lock:
                inside.pop()

    all_three = threading.Barrier(3, timeout=30)  # broken unless all three are in at once

    def three_at_once():
        with slots:
            all_three.wait()

    for target in (one_at_a_time, three_at_once):
        threads = [threading.Thread(target=target) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if target is one_at_a_time:
            assert max(most) == 1
            slots.widen(3)
    assert not all_three.broken and slots.count == 3


def test_a_compile_that_fails_ends_the_walk_with_its_error(monkeypatch):
    step, args = _step(), _arguments()
    program = step.executable(*args)
    last = [op.program for op in program.ops if isinstance(op, RunOp)][-1]

    def fail(values):
        raise RuntimeError("this fragment does not compile")

    monkeypatch.setattr(last, "executable", fail)
    ahead = _ahead.CompileAhead(program, jax.tree.leaves(shape_structs(args)))
    assert ahead.wait(timeout=300) and ahead.walked is None
    assert isinstance(ahead.error, RuntimeError) and "does not compile" in str(ahead.error)


def test_a_compile_that_ends_while_the_walk_looks_elsewhere_is_not_missed(monkeypatch):
    """The walk finds an op's compile under way, and the compile ends before the walk waits:
    the wait must count it (a walk that waited for the next compile would wait forever)."""
    step, args = _step(), _arguments()
    program = step.executable(*args)
    wait_past = _ahead._Compiles.wait_past

    def late(self, ended):
        time.sleep(0.1)  # the compiles under way end meanwhile
        return wait_past(self, ended)

    monkeypatch.setattr(_ahead._Compiles, "wait_past", late)
    ahead = _ahead.CompileAhead(program, jax.tree.leaves(shape_structs(args)))
    assert ahead.wait(timeout=60), "the walk waits for a compile that already ended"
    assert ahead.error is None and ahead.walked == len(program.ops)


def test_a_threads_compiles_are_counted_apart_from_the_process():
    process, mine = compilation_counter(), compilation_counter(this_thread=True)
    other = threading.Thread(target=lambda: jax.jit(lambda v: v * 7 - 3).lower(2.0).compile())
    other.start()
    other.join()
    assert process()["compiles"] + process()["cache_hits"] >= 1
    assert mine() == {"compiles": 0, "compile_seconds": 0.0, "cache_hits": 0}
