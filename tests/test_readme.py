"""The README's Python examples run as written and do what their comments promise.

The blocks run once, in order, in one namespace (later blocks use names from earlier ones);
each block's stdout and a shallow copy of the namespace right after it are kept. Promises are
checked per block found by a marker (a snippet of its source), not by position, so new README
sections do not shift them; numbers are compared with the same code run under
``mm.ignore_transforms()`` (every transform the identity: plain JAX on one device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm

# One worker runs these tests (dev.py's --dist loadgroup): they share the README programs.
pytestmark = pytest.mark.xdist_group("test_readme")

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@dataclasses.dataclass
class Ran:
    """One README block after it ran: its stdout, the namespace then, and any error."""

    source: str
    stdout: str
    namespace: dict[str, Any]
    error: BaseException | None


@pytest.fixture(scope="module")
def ran() -> list[Ran]:
    namespace: dict[str, Any] = {}
    results: list[Ran] = []
    for index, block in enumerate(BLOCKS):
        out, error = io.StringIO(), None
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(block, f"README block {index}", "exec"), namespace)
        except Exception as e:  # reported by the test of this block
            error = e
        results.append(Ran(block, out.getvalue(), dict(namespace), error))
        if error is not None:
            break  # later blocks depend on this one
    return results


def _devices(array: jax.Array) -> set[int]:
    return {d.id for d in array.devices()}


def _first_program(r: Ran) -> None:
    # print(out, out.devices())  # [1. 3. 5.] {CpuDevice(id=1)} -- lives on device 1 only
    out = r.namespace["out"]
    np.testing.assert_array_equal(np.asarray(out), np.arange(3.0) * 2 + 1)
    assert _devices(out) == {1}
    assert r.stdout.splitlines()[0] == "[1. 3. 5.] {CpuDevice(id=1)}"
    assert "2 fragments" in r.stdout  # the describe() dump: one fragment per device


def _logical_sharding(r: Ran) -> None:
    # param 1 row-sharded on devices 0-3, param 2 column-sharded on 4-7
    ns, params = r.namespace, r.namespace["params"]
    assert _devices(params[0]) == {0, 1, 2, 3} and params[0].sharding.spec == P("x", None)
    assert _devices(params[1]) == {4, 5, 6, 7} and params[1].sharding.spec == P(None, "x")
    with mm.ignore_transforms():
        loss, expected = ns["step"]((jnp.ones((16, 16)), jnp.ones((16, 8))), jnp.ones((8, 16)))
    np.testing.assert_allclose(float(ns["loss"]), float(loss), rtol=1e-5, atol=1e-6)
    for got, want in zip(params, expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _flax_step(r: Ran) -> None:
    # print(float(loss), ...sharding.spec)  # P('x', 'y')
    ns, params = r.namespace, r.namespace["state"].params
    kernel = params["layer_1"]["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("x", "y") and _devices(kernel) == {4, 5, 6, 7}
    assert _devices(params["layer_0"]["Dense_0"]["kernel"]) == {0, 1, 2, 3}
    assert int(ns["state"].step) == 3
    assert r.stdout.splitlines()[-1] == f"{float(ns['loss'])} P('x', 'y')"
    assert "Pipeline Summary" in r.stdout  # the tabulate table came first


def _name_based(r: Ran) -> None:
    # w[0] on stage 0 (devices 0-3), w[1] on stage 1 (devices 4-7)
    ns = r.namespace
    assert _devices(ns["w"][0]) == {0, 1, 2, 3} and _devices(ns["w"][1]) == {4, 5, 6, 7}
    with mm.ignore_transforms():
        expected = jax.grad(ns["program"])((jnp.ones((8, 8)), jnp.ones((8, 8))), jnp.ones((4, 8)))
    for got, want in zip(ns["grads"], expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _nnx_step(r: Ran) -> None:
    # print(...sharding.spec)  # P(None, 'model') on devices 4-7
    ns = r.namespace
    model, optimizer = ns["model"], ns["optimizer"]
    kernel = model.blocks[1].up.kernel.get_value()
    assert kernel.sharding.spec == P(None, "model") and _devices(kernel) == {4, 5, 6, 7}
    assert _devices(model.blocks[0].up.kernel.get_value()) == {0, 1, 2, 3}
    mu = optimizer.opt_state[0].mu["blocks"][1]["up"]["kernel"].get_value()
    assert _devices(mu) == {4, 5, 6, 7}
    assert r.stdout.splitlines()[-1] == "P(None, 'model')"
    with mm.ignore_transforms():  # the same three steps, plain NNX on one device
        plain = ns["Model"](16, rngs=ns["nnx"].Rngs(0))
        plain_optimizer = ns["nnx"].Optimizer(plain, ns["optax"].adam(1e-2), wrt=ns["nnx"].Param)
        for _ in range(3):
            loss = ns["train_step"](plain, plain_optimizer, jnp.ones((8, 16)), jnp.zeros((8, 16)))
    np.testing.assert_allclose(float(ns["nnx_loss"]), float(loss), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(kernel), np.asarray(plain.blocks[1].up.kernel.get_value()), rtol=1e-5, atol=1e-6
    )


def _explicit_sharding(r: Ran) -> None:
    # print(typed_multi.axis_types, typed_out.sharding.spec)   # (Explicit, ...) P('data',)
    ns = r.namespace
    explicit = jax.sharding.AxisType.Explicit
    assert ns["typed_multi"].axis_types == (explicit,) * 3
    out = ns["typed_out"]
    assert out.sharding.spec == P("data") and _devices(out) == {4, 5, 6, 7}
    one = jax.make_mesh((1, 1, 1), ("stage", "data", "model"), devices=jax.devices()[:1])
    with jax.set_mesh(one):  # the same block, plain NNX on one device
        plain = ns["TypedBlock"](16, rngs=ns["nnx"].Rngs(0))
        expected = plain(jnp.ones((8, 16)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-6)


def _pipeline_options(r: Ran) -> None:
    # chain_grads: as jax.grad of chain_loss on the whole batch, ordered for the given costs
    ns = r.namespace
    with mm.ignore_transforms():
        expected = jax.grad(ns["chain_loss"])(ns["chain_ws"], ns["chain_x"])
    for got, want in zip(ns["chain_grads"], expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    built = ns["chain_grad"].executable(ns["chain_ws"], ns["chain_x"]).schedule
    costs = {"F": 1.0, "B": 2.0, "W": 0.5}
    assert built == mm.make_schedule("zero-bubble-auto", 2, 4, costs=costs, max_in_flight=4)


def _planning(r: Ran) -> None:
    # three distinct units; 1F1B keeps 2 and 1 microbatches in flight; wide plans derived
    ns = r.namespace
    assert r.stdout.splitlines()[0] == "['GPTEmbed', 'GPTBlock', 'GPTHead'] 34"
    prediction = ns["prediction"]
    assert prediction.peak_in_flight == (2, 1)
    stages = prediction.stages

    def cost(stage, phase):  # 1F1B: the whole backward and one accumulation per B op
        if phase == "transfer":
            return stages[stage].transfer
        s = stages[stage]
        backward = s.backward.seconds + s.accumulate.seconds
        apart = s.forward.seconds + s.backward.seconds  # the last stage's F and B: one program
        fused = min(s.fused.seconds, apart) + s.accumulate.seconds
        return {"F": s.forward.seconds, "B": backward, "W": 0.0, "F+B": fused}[phase]

    reference = mm.simulate(mm.make_schedule("1f1b", 2, 4), costs=cost, fused=True)
    assert prediction.bubble == pytest.approx(reference.bubble_fraction)
    assert str(ns["wide"].sources["unit times"]) == "derived"


def _searching(r: Ran) -> None:
    # ranked, fitting plans; the best one's arguments add up to the model and the devices
    plans, applied = r.namespace["plans"], r.namespace["applied"]
    times = [p.step_time for p in plans]
    assert times == sorted(times) and all(p.max_peak_bytes <= 24 * 2**20 for p in plans)
    assert sum(applied.layers_per_stage) == 4 and applied.device_count == 8
    assert r.namespace["figure"].axes


# A snippet that identifies the block -> the check of what that block promises.
PROMISES = {
    "mm.task(lambda x: x * 2": _first_program,
    "l2 = mm.task(layer2": _logical_sharding,
    "class Pipeline(nn.Module)": _flax_step,
    "multi.register_task(": _name_based,
    "options = mm.PipelineOptions(": _pipeline_options,
    "def train_step(model, optimizer, x, y)": _nnx_step,
    "class TypedBlock(nnx.Module)": _explicit_sharding,
    "mm.profile_units(": _planning,
    "plans = mm.plan(": _searching,
}


def test_readme_has_examples():
    assert len(BLOCKS) >= len(PROMISES)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, ran):
    assert index < len(ran), f"README block {index} did not run: an earlier block raised"
    if ran[index].error is not None:
        raise ran[index].error


@pytest.mark.parametrize("marker", list(PROMISES))
def test_readme_example_keeps_its_promise(marker, ran):
    found = [r for r in ran if marker in r.source]
    in_readme = sum(marker in block for block in BLOCKS)
    assert in_readme == 1, (
        f"Expected exactly one README block containing {marker!r}, found {in_readme}; "
        "update PROMISES in tests/test_readme.py to the README's current examples."
    )
    assert found and found[0].error is None, f"the block with {marker!r} did not run cleanly"
    PROMISES[marker](found[0])
