"""Checkpoints of states spread over submeshes: layout-independent restore, resume, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import checkpoint, errors
from multimesh_flax.core.declare._devices import make_auto_mesh

NUM_LAYERS = 4

# Submeshes as (device positions, (data, model) sizes); layer i goes to submesh
# i * len(layout) // NUM_LAYERS. The checkpoints below are saved from "two_stages_2x2".
LAYOUTS = {
    "two_stages_2x2": [([0, 1, 2, 3], (2, 2)), ([4, 5, 6, 7], (2, 2))],
    "four_stages_1x2": [([0, 1], (1, 2)), ([2, 3], (1, 2)), ([4, 5], (1, 2)), ([6, 7], (1, 2))],
    "two_stages_4x1_swapped": [([4, 5, 6, 7], (4, 1)), ([0, 1, 2, 3], (4, 1))],
    "one_stage_2x4": [(list(range(8)), (2, 4))],
    "one_device": [([3], (1, 1))],
}
SPECS = {"w": P("data", "model"), "b": P("model")}


def _sharding(path, leaf, layout):
    """Layer leaves go to their layer's submesh; scalars to the first device of the layout."""
    devices = np.array(jax.devices())
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if np.ndim(leaf) == 0:
        return SingleDeviceSharding(devices[layout[0][0][0]])
    layer = next(int(k.split("_")[1]) for k in keys if str(k).startswith("layer_"))
    positions, sizes = layout[layer * len(layout) // NUM_LAYERS]
    mesh = make_auto_mesh(devices[positions].reshape(sizes), ("data", "model"))
    return NamedSharding(mesh, SPECS[keys[-1]])


def _make_state(layout_name, seed, widths=(8, 16)):
    """A TrainState with adam moments, every leaf random and placed as `layout_name` says."""
    din, dout = widths
    params = {
        f"layer_{i}": {"w": np.zeros((din, dout), np.float32), "b": np.zeros(dout, np.float32)}
        for i in range(NUM_LAYERS)
    }
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if np.issubdtype(np.asarray(leaf).dtype, np.floating):
            value = rng.standard_normal(np.shape(leaf)).astype(np.float32)
        else:
            value = np.asarray(rng.integers(1, 100), np.int32)
        return jax.device_put(value, _sharding(path, value, LAYOUTS[layout_name]))

    return jax.tree_util.tree_map_with_path(fill, state)


def _abstract(state, layout_name):
    def spec(path, leaf):
        sharding = _sharding(path, leaf, LAYOUTS[layout_name])
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(spec, state)


def _device_ids(array):
    return sorted(d.id for d in array.devices())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A state over two 2x2 submeshes, saved as step 5 with metadata."""
    directory = tmp_path_factory.mktemp("ckpt")
    state = _make_state("two_stages_2x2", seed=0)
    assert _device_ids(state.params["layer_0"]["w"]) == [0, 1, 2, 3]
    assert _device_ids(state.params["layer_3"]["w"]) == [4, 5, 6, 7]
    assert _device_ids(state.opt_state[0].mu["layer_3"]["w"]) == [4, 5, 6, 7]
    checkpoint.save_checkpoint(directory, 5, state, metadata={"layout": "two_stages_2x2"})
    return directory, state


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("target_kind", ["arrays", "abstract"])
def test_restore_onto_any_layout_gives_identical_values(saved, layout_name, target_kind):
    directory, state = saved
    target = _make_state(layout_name, seed=1)
    if target_kind == "abstract":
        target = _abstract(state, layout_name)
    restored = checkpoint.restore_checkpoint(directory, target)
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    leaves = zip(*(jax.tree.leaves(t) for t in (restored, state, target)), strict=True)
    for got, expected, want in leaves:
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
        assert got.sharding == want.sharding


def test_restored_layer_lives_on_the_target_devices(saved):
    directory, state = saved
    restored = checkpoint.restore_checkpoint(directory, _abstract(state, "four_stages_1x2"))
    assert _device_ids(restored.params["layer_1"]["w"]) == [2, 3]
    assert _device_ids(restored.opt_state[0].nu["layer_3"]["b"]) == [6, 7]
    assert restored.params["layer_1"]["w"].addressable_shards[0].data.shape == (8, 8)


def test_metadata_and_latest_step(saved):
    directory, _ = saved
    assert checkpoint.latest_step(directory) == 5
    assert checkpoint.restore_metadata(directory) == {"layout": "two_stages_2x2"}
    assert checkpoint.restore_metadata(directory, step=5) == {"layout": "two_stages_2x2"}


def test_restore_without_target_returns_raw_tree_as_saved(saved):
    directory, state = saved
    raw = checkpoint.restore_checkpoint(directory)
    np.testing.assert_array_equal(
        np.asarray(raw["opt_state"][0]["mu"]["layer_2"]["b"]),
        np.asarray(state.opt_state[0].mu["layer_2"]["b"]),
    )
    assert raw["params"]["layer_3"]["w"].sharding.is_equivalent_to(
        state.params["layer_3"]["w"].sharding, 2
    )


def test_checkpointer_keeps_newest_steps_and_saves_asynchronously(tmp_path):
    with checkpoint.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": jnp.full(3, float(step))}, metadata={"step": step})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [2, 3]
        assert ckpt.latest_step() == 3
        assert ckpt.metadata(2) == {"step": 2}
        restored = ckpt.restore(2, target={"w": jnp.zeros(3)})
    np.testing.assert_array_equal(np.asarray(restored["w"]), [2.0, 2.0, 2.0])
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]


# --- resume ---------------------------------------------------------------------------------

RESUME_LAYOUTS = {
    "same": [([0, 1, 2, 3], (2, 2)), ([4, 5, 6, 7], (2, 2))],
    "other_submeshes": [([4, 5, 6, 7], (4, 1)), ([0, 1], (1, 2))],
}
RULES = (("batch", "data"), ("model", "model"))
STEPS = 3


def _stage(w, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    return jnp.tanh(x @ mm.with_sharding_constraint(w, P(None, "model")))


def _make_train_step(layout_name):
    """`(state, batch) -> (loss, state)` with one task per stage; a fresh function each call."""
    stages = [
        mm.task(
            _stage,
            name=f"stage{i}",
            mesh=mm.TaskMesh(devices=pos, axis_sizes=sizes, axis_names=("data", "model")),
            logical_axes=RULES,
        )
        for i, (pos, sizes) in enumerate(RESUME_LAYOUTS.get(layout_name, []))
    ]

    def loss_fn(params, batch):
        x, y = batch
        for i, stage in enumerate(stages or [_stage, _stage]):
            x = stage(params[f"stage{i}"], x)
        return jnp.mean((x - y) ** 2)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return loss, state.apply_gradients(grads=grads)

    if stages:
        return mm.jit(train_step)
    jitted = jax.jit(lambda state, batch: train_step(state, batch))

    def one_device_step(state, batch):  # plain jax.jit with every transform off
        with mm.ignore_transforms():
            return jitted(state, batch)

    return one_device_step


def _initial_state(layout_name):
    k0, k1 = jax.random.split(jax.random.key(0))
    params = {
        "stage0": jax.random.normal(k0, (8, 16)) / 3,
        "stage1": jax.random.normal(k1, (16, 8)) / 3,
    }
    if layout_name == "one_device":
        params = jax.device_put(params, jax.devices()[0])
    else:
        devices = np.array(jax.devices())
        for i, (pos, sizes) in enumerate(RESUME_LAYOUTS[layout_name]):
            mesh = make_auto_mesh(devices[pos].reshape(sizes), ("data", "model"))
            params[f"stage{i}"] = jax.device_put(params[f"stage{i}"], NamedSharding(mesh, P()))
    return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-2))


def _batches():
    """A new batch every step; targets come from a fixed teacher, so the loss can fall."""
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((8, 8), np.float32)
    xs = [rng.standard_normal((8, 8), np.float32) for _ in range(2 * STEPS)]
    return [(x, np.tanh(x @ teacher) / 2) for x in xs]


def _train(step_fn, state, batches):
    losses = []
    for batch in batches:
        loss, state = step_fn(state, batch)
        jax.block_until_ready((loss, state))  # XLA CPU collectives deadlock if too much queues
        losses.append(np.asarray(loss))
    return np.array(losses), state


@pytest.fixture(scope="module")
def uninterrupted():
    """2N steps on the "same" layout without a break, and the state after the first N."""
    step_fn, batches = _make_train_step("same"), _batches()
    first_losses, half_state = _train(step_fn, _initial_state("same"), batches[:STEPS])
    last_losses, final_state = _train(step_fn, half_state, batches[STEPS:])
    return np.concatenate([first_losses, last_losses]), half_state, final_state


@pytest.mark.parametrize("layout_name", ["same", "other_submeshes", "one_device"])
def test_resume_matches_uninterrupted_training(uninterrupted, tmp_path, layout_name):
    losses, half_state, final_state = uninterrupted
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(STEPS, half_state, metadata={"steps": STEPS})

    # A "new process": fresh state on the resume layout, fresh step function.
    with checkpoint.Checkpointer(tmp_path, read_only=True) as ckpt:
        state = ckpt.restore(target=_initial_state(layout_name))
    assert int(state.step) == STEPS
    resumed_losses, resumed_state = _train(_make_train_step(layout_name), state, _batches()[STEPS:])

    got = (resumed_losses, jax.tree.leaves(resumed_state.params))
    expected = (losses[STEPS:], jax.tree.leaves(final_state.params))
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        if layout_name == "same":
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
        else:  # another summation order: rounding, relative to entries of size ~0.3
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-7)
    assert losses[-1] < losses[0], "the loop must actually train"
    first_devices = RESUME_LAYOUTS.get(layout_name, [([0], ())])[0][0]
    assert _device_ids(resumed_state.params["stage0"]) == sorted(first_devices)


# --- errors ---------------------------------------------------------------------------------


def test_restore_from_empty_or_missing_directory(tmp_path):
    assert checkpoint.latest_step(tmp_path) is None
    assert checkpoint.latest_step(tmp_path / "nowhere") is None
    with pytest.raises(errors.CheckpointNotFoundError, match="found none"):
        checkpoint.restore_checkpoint(tmp_path)
    with pytest.raises(errors.CheckpointNotFoundError, match="does not exist"):
        checkpoint.restore_checkpoint(tmp_path / "nowhere")
    with checkpoint.Checkpointer(tmp_path) as ckpt, pytest.raises(errors.CheckpointNotFoundError):
        ckpt.metadata()


def test_restore_of_a_missing_step_lists_saved_steps(saved):
    directory, state = saved
    with pytest.raises(errors.CheckpointNotFoundError, match=r"saved steps \[5\].*got 7"):
        checkpoint.restore_checkpoint(directory, state, step=7)


def _replace_layer0(state, **leaves):
    params = dict(state.params)
    params["layer_0"] = leaves
    return state.replace(params=params)


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(jax.devices()[0]))


@pytest.mark.parametrize(
    ("layer0", "message"),
    [
        (
            {"w": _sds((8, 8)), "b": _sds((16,))},
            r"first at `params.layer_0.w`: expected shape \(8, 16\) float32 \(as saved\), "
            r"received shape \(8, 8\) float32",
        ),
        (
            {"w": _sds((8, 16), jnp.bfloat16), "b": _sds((16,))},
            r"`params.layer_0.w`: expected shape \(8, 16\) float32.*received .* bfloat16",
        ),
        (
            {"w": _sds((8, 16))},
            r"`params.layer_0.b`: expected shape \(16,\) float32 \(as saved\), received missing",
        ),
        (
            {"w": _sds((8, 16)), "b": _sds((16,)), "extra": _sds((2,))},
            r"`params.layer_0.extra`: expected missing \(as saved\), received shape \(2,\)",
        ),
    ],
    ids=["shape", "dtype", "missing_leaf", "extra_leaf"],
)
def test_mismatching_target_names_first_bad_path(saved, layer0, message):
    directory, state = saved
    target = _replace_layer0(_abstract(state, "one_device"), **layer0)
    with pytest.raises(errors.CheckpointMismatchError, match=message):
        checkpoint.restore_checkpoint(directory, target)


def test_target_of_another_model_size_is_rejected(saved):
    directory, _ = saved
    other = _make_state("one_device", seed=0, widths=(8, 32))
    with pytest.raises(errors.CheckpointMismatchError, match=r"at 24 path\(s\)"):
        checkpoint.restore_checkpoint(directory, other)


@pytest.mark.parametrize("step", [2, 3, -1, 1.5, True])
def test_save_under_an_old_or_invalid_step_is_rejected(tmp_path, step):
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, {"w": jnp.ones(2)})
        with pytest.raises(errors.CheckpointStepError, match="`step`"):
            ckpt.save(step, {"w": jnp.ones(2)})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [3]


def test_read_only_checkpointer_restores_but_does_not_save(saved):
    directory, state = saved
    before = sorted(os.listdir(directory))
    with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
        assert ckpt.latest_step() == 5
        with pytest.raises(errors.CheckpointReadOnlyError, match="read_only"):
            ckpt.save(6, state)
    assert sorted(os.listdir(directory)) == before
    with pytest.raises(errors.CheckpointNotFoundError, match="does not exist"):
        checkpoint.Checkpointer(directory / "nowhere", read_only=True)
    assert not (directory / "nowhere").exists()


@pytest.mark.parametrize("metadata", [{"w": np.ones(2)}, ["not", "a", "dict"]])
def test_metadata_must_be_a_json_dict(tmp_path, metadata):
    with pytest.raises(errors.CheckpointMetadataError, match="`metadata`"):
        checkpoint.save_checkpoint(tmp_path, 1, {"w": jnp.ones(2)}, metadata=metadata)
    assert checkpoint.latest_step(tmp_path) is None


# --- interrupted save -----------------------------------------------------------------------

_CRASHING_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from multimesh_flax import checkpoint

    with checkpoint.Checkpointer(sys.argv[1]) as ckpt:
        ckpt.save(1, {"w": jnp.full(4, 1.0)}, metadata={"step": 1})
        ckpt.wait_until_finished()

        async def die(*args, **kwargs):  # the process is killed right before the rename
            os.kill(os.getpid(), signal.SIGKILL)

        ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = die
        ckpt.save(2, {"w": jnp.full(4, 2.0)}, metadata={"step": 2})
        ckpt.wait_until_finished()
    print("save 2 finished")
    """
)


def test_save_killed_midway_leaves_previous_checkpoint_intact(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.run(
        [sys.executable, "-c", _CRASHING_SAVE, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "save 2 finished" not in child.stdout
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith("2.")]
    assert leftovers and "orbax-checkpoint-tmp" in leftovers[0], os.listdir(tmp_path)
    assert os.listdir(tmp_path / leftovers[0]), "step 2 was partly written"

    assert checkpoint.latest_step(tmp_path) == 1
    target = {"w": jnp.zeros(4)}
    np.testing.assert_array_equal(
        np.asarray(checkpoint.restore_checkpoint(tmp_path, target)["w"]), 1.0
    )
    with checkpoint.Checkpointer(tmp_path) as ckpt:  # opening for writing cleans up
        assert ckpt.all_steps() == [1]
        assert ckpt.metadata() == {"step": 1}
        ckpt.save(2, {"w": jnp.full(4, 2.0)})
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]
    np.testing.assert_array_equal(
        np.asarray(checkpoint.restore_checkpoint(tmp_path, target)["w"]), 2.0
    )


# --- a script that ends right after an asynchronous save (issue 17, item 2) ----------------

_SAVE_AND_EXIT = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp
    from multimesh_flax.checkpoint import Checkpointer

    Checkpointer(sys.argv[1]).save(0, {"w": jnp.arange(4096.0), "step": 0})
    with Checkpointer(sys.argv[2]) as ckpt:
        ckpt.save(5, {"w": jnp.arange(4096.0) * 2})
    print("script ended")
    """
)


def test_background_save_finishes_when_the_script_exits(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    dropped, scoped = tmp_path / "dropped", tmp_path / "scoped"
    child = subprocess.run(
        [sys.executable, "-c", _SAVE_AND_EXIT, str(dropped), str(scoped)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert "script ended" in child.stdout
    assert "ERROR" not in child.stderr, child.stderr
    assert sorted(os.listdir(dropped)) == ["0"]  # finalized: no orbax-checkpoint-tmp left
    restored = checkpoint.restore_checkpoint(dropped, {"w": jnp.zeros(4096), "step": 1})
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4096.0))
    assert restored["step"] == 0
    restored = checkpoint.restore_checkpoint(scoped, {"w": jnp.zeros(4096)})
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4096.0) * 2)
