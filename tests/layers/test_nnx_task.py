"""``task`` on NNX module classes: Task[Block], born on the submesh, calls as the task."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import multimesh_flax as mm
from multimesh_flax import errors, layers
from tests.layers._nnx_models import (
    RULES,
    TOL,
    Block,
    Net,
    assert_states_close,
    device_ids,
    multi_mesh,
    partitioned,
    plain_net,
)


def _linear(**options):
    return mm.task(nnx.Linear, **options)


def test_class_is_a_named_subclass_with_the_same_constructor():
    cls = mm.task(
        Block,
        mesh=mm.TaskMesh(devices=[0, 1], axis_names=("model",)),
        logical_axes=[("mlp", "model"), ("embed", None)],
    )
    model = cls(8, rngs=nnx.Rngs(0))
    assert cls.__name__ == "Task[Block]" and issubclass(cls, Block) and isinstance(model, Block)
    assert layers.task(Block, mesh=mm.TaskMesh(devices=[0])).__name__ == "Task[Block]"


def test_variables_are_named_and_valued_as_the_plain_module():
    cls = mm.task(
        Block,
        mesh=mm.TaskMesh(devices=[4, 5], axis_names=("model",)),
        logical_axes=[("mlp", "model"), ("embed", None)],
    )
    wrapped = cls(8, rngs=nnx.Rngs(3))
    with nnx.use_eager_sharding(False):
        plain = Block(8, rngs=nnx.Rngs(3))
    assert_states_close(wrapped, plain, dict(rtol=0, atol=0))
    # state moves both ways with nnx.state / nnx.update
    with nnx.use_eager_sharding(False):
        other = Block(8, rngs=nnx.Rngs(9))
    nnx.update(other, nnx.state(wrapped))
    assert_states_close(other, wrapped, dict(rtol=0, atol=0))


def test_born_on_the_submesh_sharded_through_the_task_rules():
    cls = _linear(
        mesh=mm.TaskMesh(devices=[2, 3, 4, 5], axis_sizes=(2, 2), axis_names=("x", "y")),
        logical_axes=[("out", "y"), ("in", "x")],
    )
    layer = cls(4, 6, kernel_init=partitioned("in", "out"), rngs=nnx.Rngs(0))
    kernel = layer.kernel.get_value()
    assert device_ids(kernel) == [2, 3, 4, 5]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("x", "y")
    assert device_ids(layer.bias.get_value()) == [2, 3, 4, 5]


def test_eval_shape_gives_the_abstract_model_and_its_shardings():
    with multi_mesh():
        abstract = nnx.eval_shape(lambda: Net(16, rngs=nnx.Rngs(0)))
    kernel = abstract.blocks[1].up.kernel
    assert isinstance(kernel.get_value(), jax.ShapeDtypeStruct)
    sharding = kernel.get_metadata()["task_sharding"]
    assert sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert sorted(d.id for d in sharding.device_set) == [4, 5, 6, 7]


def test_shard_axes_works_as_an_nnx_kernel_init():
    cls = _linear(mesh=mm.TaskMesh(devices=[0, 1], axis_names=("x",)), logical_axes=[("out", "x")])
    layer = cls(3, 4, kernel_init=mm.shard_axes(None, "out"), rngs=nnx.Rngs(0))
    assert layer.kernel.get_metadata()["out_sharding"] == (None, "out")
    assert layer.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "x")


def test_eager_call_runs_the_plain_module_on_the_submesh():
    with multi_mesh():
        model = Net(16, rngs=nnx.Rngs(0))
        x = jnp.ones((4, 16))
        out = model(x)
    np.testing.assert_allclose(out, plain_net()(x), **TOL)
    assert device_ids(out) == [4] and not out.committed  # released from the last submesh


def test_calls_inside_jit_run_as_the_task_forward_and_backward():
    with multi_mesh():
        model = Net(16, rngs=nnx.Rngs(0))
        x = jnp.ones((4, 16))
        graphdef, state = nnx.split(model)

        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

        value, grads = mm.jit(jax.value_and_grad(loss))(state, x)
        text = mm.jit(jax.value_and_grad(loss)).describe(state, x)
    ref_graphdef, ref_state = nnx.split(plain_net())
    with mm.ignore_transforms():
        ref_value, ref_grads = jax.value_and_grad(
            lambda s, x: jnp.sum(nnx.merge(ref_graphdef, s)(x) ** 2)
        )(ref_state, x)
    np.testing.assert_allclose(value, ref_value, **TOL)
    jax.tree_util.tree_map(  # gradients up to ~10: absolute error against their scale
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5),
        grads.to_pure_dict(),
        ref_grads.to_pure_dict(),
    )
    for fragment in ("Block.fwd", "Block.bwd", "devices [0, 1, 2, 3]", "devices [4, 5, 6, 7]"):
        assert fragment in text
    assert device_ids(grads["blocks"][1]["up"]["kernel"].get_value()) == [4, 5, 6, 7]


def test_under_ignore_transforms_it_is_the_plain_module():
    with mm.ignore_transforms():
        layer = _linear(mesh=mm.TaskMesh(devices=[3]))(3, 2, rngs=nnx.Rngs(0))
        out = layer(jnp.ones((1, 3)))
    assert device_ids(out) == [0]


@pytest.mark.parametrize(
    "bad", [nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 3, "Block"], ids=["instance", "int", "str"]
)
def test_non_classes_raise_a_typed_error(bad):
    with pytest.raises(errors.TaskTypeError, match="NNX module class"):
        layers._nnx_task.task(bad, mesh=mm.TaskMesh(devices=[0]))


def test_instance_to_front_door_names_the_class():
    with pytest.raises(errors.TaskTypeError, match="instance of Linear"):
        mm.task(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), mesh=mm.TaskMesh(devices=[0]))


def test_logical_name_without_a_rule_is_a_typed_error_and_changes_nothing():
    rngs = nnx.Rngs(0)
    cls = _linear(mesh=mm.TaskMesh(devices=[0, 1], axis_names=("x",)), logical_axes=[("out", "x")])
    with pytest.raises(errors.UnmappedLogicalAxisError, match="'embd'"):
        cls(3, 4, kernel_init=partitioned("embd", "out"), rngs=rngs)
    assert int(rngs.params.count.get_value()) == 0


def test_logical_axes_without_a_mesh_is_a_typed_error():
    with pytest.raises(errors.InvalidTaskError, match="logical_axes"):
        mm.task(Block, logical_axes=RULES)


def test_variable_asking_for_eager_sharding_without_a_mesh_is_a_typed_error():
    class Eager(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.ones, ("x",), eager_sharding=True)
            self.w = nnx.Param(init(rngs.params(), (4,)))

    rngs = nnx.Rngs(0)
    with pytest.raises(errors.UnplacedVariableError, match="eager_sharding=True"):
        mm.task(Eager, mesh=mm.TaskMesh(devices=[0, 1], axis_names=("x",)))(rngs)
