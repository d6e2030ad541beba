"""``jit`` with NNX graph objects: the NNX tutorial train step as one MPMD program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import multimesh_flax as mm
from multimesh_flax import errors
from tests.layers._nnx_models import (
    TOL,
    Net,
    assert_states_close,
    batch,
    device_ids,
    loss_fn,
    multi_mesh,
    plain_net,
)

STEPS = 5


def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def microbatched_step(model, optimizer, batch):
    def grad_fn(b):
        return nnx.value_and_grad(loss_fn)(model, b)

    # grad_fn closes over `model`: mm.microbatch traces the microbatches one by one (NNX
    # refuses graph objects captured by the jax.jit that tracing once would use).
    step = mm.microbatch(grad_fn, 0, 2, schedule="1f1b", reduce="mean")
    loss, grads = step(batch)
    optimizer.update(model, grads)
    return loss


def _reference(step, data):
    model = plain_net()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with mm.ignore_transforms():
        losses = [float(nnx.jit(step)(model, optimizer, data)) for _ in range(STEPS)]
    return model, losses


@pytest.mark.parametrize("step", [train_step, microbatched_step], ids=["plain", "1f1b-4mb"])
def test_tutorial_step_matches_one_device_and_keeps_state_on_its_stage(step):
    data = batch()
    with multi_mesh():
        model = Net(16, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        jitted = mm.jit(step)
        losses = [float(jitted(model, optimizer, data)) for _ in range(STEPS)]
    ref_model, ref_losses = _reference(step, data)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_states_close(model, ref_model)
    for stage, devices in ((0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])):
        kernel = model.blocks[stage].up.kernel.get_value()
        mu = optimizer.opt_state[0].mu["blocks"][stage]["up"]["kernel"].get_value()
        assert device_ids(kernel) == devices and device_ids(mu) == devices
        assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
        assert mu.sharding.is_equivalent_to(kernel.sharding, 2)


def test_later_steps_compile_nothing_and_donate_the_old_state():
    data = batch()
    with multi_mesh():
        model = Net(16, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        jitted = mm.jit(train_step)
        jitted(model, optimizer, data)
        executable = jitted.executable(model, optimizer, data)
        compiled = executable.compile_count()
        for _ in range(3):
            old = optimizer.opt_state[0].mu["blocks"][0]["up"]["kernel"].get_value()
            jitted(model, optimizer, data)
        assert executable.compile_count() == compiled
        # The state is donated; the runtime hands a donated buffer to its only reader (the
        # optimizer update of the moments), never to the first of several (parameters).
        assert old.is_deleted(), "the step updates the optimizer in place, donating its state"
        assert jitted.graph.cache_size() == 1


def test_plain_arguments_take_the_core_jit():
    f = mm.task(lambda x: x * 2, mesh=mm.TaskMesh(devices=[1]))
    out = mm.jit(f)(jnp.ones(3))
    np.testing.assert_array_equal(out, 2 * np.ones(3))
    assert device_ids(out) == [1]


def test_under_ignore_transforms_it_is_the_function_itself():
    model = plain_net()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = np.asarray(model.blocks[0].up.kernel.get_value())
    with mm.ignore_transforms():
        mm.jit(train_step)(model, optimizer, batch())
    assert not np.allclose(before, model.blocks[0].up.kernel.get_value())


def test_returning_a_graph_object_is_a_typed_error():
    model = plain_net()
    with pytest.raises(errors.GraphArgumentError, match="returned an NNX graph object"):
        mm.jit(lambda m, x: (m, m(x)))(model, jnp.ones((2, 16)))


def test_optimizer_of_another_model_is_a_typed_error_and_changes_nothing():
    model, other = plain_net(), nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(other, optax.adam(0.1), wrt=nnx.Param)
    before = np.asarray(model.blocks[0].up.kernel.get_value())
    with pytest.raises(errors.GraphArgumentError, match="nnx.Optimizer"):
        mm.jit(train_step)(model, optimizer, batch())
    np.testing.assert_array_equal(model.blocks[0].up.kernel.get_value(), before)


def test_register_task_places_nnx_submodules_by_attribute_path():
    from tests.layers._nnx_models import RULES

    multi = multi_mesh()
    multi.register_task(
        r"blocks/([0-9])",
        callback=lambda name, backprop: mm.Task(
            name=f"block{name}", mesh_slice={"stage": int(name)}, logical_axes=RULES
        ),
    )
    model = plain_net()  # an unmodified NNX model
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    data = batch()
    with multi:
        jitted = mm.jit(train_step)
        losses = [float(jitted(model, optimizer, data)) for _ in range(STEPS)]
        text = jitted.describe(model, optimizer, data)
        placement = mm.layers.get_placement(model, data[0])
    ref_model, ref_losses = _reference(train_step, data)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_states_close(model, ref_model)
    assert "block0.fwd" in text and "block1.bwd" in text
    kernel = model.blocks[1].up.kernel.get_value()
    assert device_ids(kernel) == [4, 5, 6, 7]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert type(model.blocks[1]).__name__ == "Block", "the caller's model keeps its classes"
    rows = {p.path: p for p in placement.params}
    assert rows["blocks/1/up/kernel"].task == "block1"
    assert rows["blocks/1/up/kernel"].device_ids == (4, 5, 6, 7)
