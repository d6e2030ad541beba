"""plan.apply(): a user's model placed by name trains as planned and computes what one device
computes; a reference model gets its split, mesh and step arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import multimesh_flax as mm
from models import GPT, get_config
from multimesh_flax import errors
from tests.planner._planning_models import MLP, tokens

pytestmark = pytest.mark.xdist_group("planner")


def _loss(model_fn, batch):
    return jnp.mean(model_fn(batch) ** 2)


def test_a_users_model_trains_where_the_plan_says(mlp_profile):
    plans = mm.plan(
        MLP(),
        optax.sgd(0.1),
        jnp.ones((8, 16)),
        devices=4,
        profile=mlp_profile,
        schedules="1f1b",
        microbatches=2,
        recompute=None,
    )
    applied = plans.best.apply()
    assert applied.mesh_axes == (("stage", 4), ("data", 1))
    assert [(path, stage) for path, stage, _ in applied.tasks] == [
        (f"layer_{i}", i) for i in range(4)
    ]
    multi = applied.make_mesh()
    applied.register(multi)
    x = jax.random.normal(jax.random.key(1), (8, 16))
    with multi:
        built = mm.parallelize_step(
            MLP(), optax.sgd(0.1), multi, x, loss_fn=_loss, **applied.step_kwargs
        )
    params = built.state.params
    for i in range(4):  # layer i on stage i's device
        assert {d.id for d in params[f"layer_{i}"]["kernel"].devices()} == {i}
    host = jax.device_get(params)
    loss, _ = built.step(built.state, x)
    reference = jax.jit(lambda p: _loss(lambda b: MLP().apply({"params": p}, b), x))(host)
    np.testing.assert_allclose(float(loss), float(reference), rtol=1e-6, atol=1e-7)


def test_a_reference_model_gets_its_split_mesh_and_step_arguments(gpt_profile):
    plans = mm.plan(
        None,
        None,
        tokens(16),
        devices=8,
        profile=gpt_profile,
        stages=(2, 4),
        schedules=("1f1b", "gpipe"),
        microbatches=4,
        per_stage_recompute=False,
    )
    for prediction in plans[:3]:
        applied = prediction.apply()
        plan = prediction.plan
        model = applied.configure(GPT(get_config("gpt-tiny", num_layers=4)))
        assert model.layers_per_stage == plan.layers_per_stage
        mesh = applied.make_mesh()
        assert dict(mesh.shape) == {"stage": plan.num_stages, **plan.stage_meshes()[0]}
        assert applied.step_kwargs == {
            "microbatches": 4,
            "schedule": plan.schedule,
            "recompute": plan.policies()[0],
        }


def test_mixed_recomputation_cannot_configure_a_reference_model(gpt_profile):
    plan = mm.Plan((2, 2), microbatches=2, recompute=(None, "full"))
    applied = mm.predict(plan, gpt_profile).apply()
    with pytest.raises(errors.PlanMismatchError, match="per_stage_recompute=False"):
        applied.configure(GPT(get_config("gpt-tiny", num_layers=4)))
    assert [p for _, _, p in applied.tasks] == [None] * 3 + ["full"] * 3
