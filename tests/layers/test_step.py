"""``parallelize_step``: placement of parameters and optimizer state, and training numerics
against plain Flax + optax on one device."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import errors, layers
from multimesh_flax.core.fragment import _sums
from multimesh_flax.core.plan import _accumulate
from multimesh_flax.core.run import OpKind, _ahead, _compile
from multimesh_flax.core.trace import BoundedCache
from tests.core._chain import backward_all_reduce_operands
from tests.layers._models import RULES, STAGE0, STAGE1, MLPBlock, Pipeline, device_ids

TOL = dict(rtol=2e-5, atol=2e-6)
X = jax.random.normal(jax.random.key(1), (8, 16))
Y = jax.random.normal(jax.random.key(2), (8, 16))


def _reference_run(model, optimizer, params, batches, loss_fn=None):
    """Plain Flax + optax under ``jax.jit`` on one device: losses and final parameters."""
    device = jax.devices()[0]
    params = jax.device_put(jax.tree_util.tree_map(np.asarray, params), device)
    opt_state = optimizer.init(params)

    def loss_of(p, batch):
        if loss_fn is None:
            return model.apply({"params": p}, *batch)
        return loss_fn(lambda *a, **k: model.apply({"params": p}, *a, **k), batch)

    def step(p, o, batch):
        with mm.ignore_transforms():
            loss, grads = jax.value_and_grad(loss_of)(p, batch)
        updates, o = optimizer.update(grads, o, p)
        return loss, optax.apply_updates(p, updates), o

    step = jax.jit(step)  # a fresh function object per call: no stale jax trace cache
    losses = []
    for batch in batches:
        loss, params, opt_state = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params


def _train(step, state, batches):
    losses = []
    for batch in batches:
        loss, state = step(state, batch)
        losses.append(float(loss))  # blocks every step
    return losses, state


def _initial_params(state):
    return jax.tree_util.tree_map(np.asarray, state.params)


def test_seed_mlp_pipeline_trains_like_plain_flax():
    step, state, mesh = layers.parallelize_step(Pipeline(), optax.sgd(0.02), global_batch=(X, Y))
    assert mesh.size == 8
    for name, devices in (("layer_0", [0, 1, 2, 3]), ("layer_1", [4, 5, 6, 7])):
        for leaf in jax.tree_util.tree_leaves(state.params[name]):
            assert device_ids(leaf) == devices
    kernel = state.params["layer_0"]["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("x", "y")  # data->x, model->y
    start = _initial_params(state)
    losses, state = _train(step, state, [(X, Y)] * 4)
    ref_losses, ref_params = _reference_run(
        Pipeline(wrap=False), optax.sgd(0.02), start, [(X, Y)] * 4
    )
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOL), state.params, ref_params
    )
    assert device_ids(state.params["layer_1"]["Dense_1"]["kernel"]) == [4, 5, 6, 7]


OPTIMIZERS = {
    "sgd-momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip-chain": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    "schedule": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optax_transformations_match_plain_flax(name):
    step, state, _ = layers.parallelize_step(Pipeline(), OPTIMIZERS[name](), global_batch=(X, Y))
    start = _initial_params(state)
    batches = [(X * (1 + i / 10), Y) for i in range(3)]
    losses, state = _train(step, state, batches)
    ref_losses, ref_params = _reference_run(
        Pipeline(wrap=False), OPTIMIZERS[name](), start, batches
    )
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOL), state.params, ref_params
    )


def test_optimizer_state_sits_with_its_parameters():
    _, state, _ = layers.parallelize_step(Pipeline(), optax.adam(1e-3), global_batch=(X, Y))
    adam = state.opt_state[0]
    for moments in (adam.mu, adam.nu):
        for name in ("layer_0", "layer_1"):
            for path in (("Dense_0", "kernel"), ("Dense_1", "bias")):
                param = state.params[name][path[0]][path[1]]
                moment = moments[name][path[0]][path[1]]
                assert moment.sharding.is_equivalent_to(param.sharding, param.ndim)


def test_later_steps_compile_nothing_and_move_no_state():
    step, state, _ = layers.parallelize_step(Pipeline(), optax.adam(1e-3), global_batch=(X, Y))
    shardings = jax.tree_util.tree_map(lambda a: a.sharding, state.params)
    _, state = step(state, (X, Y))
    executable = step.executable(state, (X, Y))
    compiled = executable.compile_count()
    for _ in range(3):
        loss, state = step(state, (X, Y))
        loss.block_until_ready()
    assert executable.compile_count() == compiled
    jax.tree_util.tree_map(
        lambda a, s: a.sharding.is_equivalent_to(s, a.ndim) or pytest.fail(str(a.sharding)),
        state.params,
        shardings,
    )


def _own_programs(monkeypatch):
    """A fragment cache of the test's own: no executable made by an earlier test."""
    monkeypatch.setattr(_compile, "_FRAGMENT_CACHE", BoundedCache(capacity=64))


def test_the_step_compiles_while_the_state_initializes_and_trains_the_same(monkeypatch):
    """``parallelize_step`` compiles the step's fragments in a thread (``step.ahead``) while
    the state's initializer compiles, one at a time, then ``WORKERS`` at a time: the first
    step then compiles nothing, and trains bit for bit as a step compiled at its first
    call."""
    _own_programs(monkeypatch)
    built = layers.parallelize_step(Pipeline(), optax.adam(1e-3), global_batch=(X, Y))
    assert built.step.ahead.width == _ahead.WORKERS  # widened once the state was made
    assert built.step.ahead.wait(timeout=300) and built.step.ahead.error is None
    executable = built.step.executable(built.state, (X, Y))
    assert built.step.ahead.walked == len(executable.ops)
    made = executable.compile_count()
    assert made > 0
    losses, state = _train(built.step, built.state, [(X, Y)] * 2)
    assert executable.compile_count() == made
    _own_programs(monkeypatch)
    monkeypatch.setattr(layers._step, "COMPILE_AHEAD", False)
    plain = layers.parallelize_step(Pipeline(), optax.adam(1e-3), global_batch=(X, Y))
    assert plain.step.ahead is None
    plain_losses, plain_state = _train(plain.step, plain.state, [(X, Y)] * 2)
    assert losses == plain_losses
    jax.tree_util.tree_map(np.testing.assert_array_equal, state.params, plain_state.params)


def test_a_step_dropped_before_its_first_call_stops_compiling_ahead(monkeypatch):
    _own_programs(monkeypatch)
    built = layers.parallelize_step(Pipeline(), optax.sgd(0.1), global_batch=(X, Y))
    ahead = built.step.ahead
    del built
    gc.collect()
    assert ahead.cancelled
    assert ahead.wait(timeout=120)  # after the compile under way, if any


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = layers.task(
            MLPBlock,
            mesh=mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("x", "y")),
            logical_axes=RULES,
        )(name="body")(x)
        return layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[4, 5]))(3, name="head")(x)


def _xent(model_fn, batch):
    logits = model_fn(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def test_loss_fn_receives_the_model_and_a_dict_batch():
    batch = {"x": X, "label": jnp.arange(8) % 3}
    step, state, _ = layers.parallelize_step(
        Classifier(), optax.adam(1e-2), global_batch=batch, loss_fn=_xent
    )
    assert device_ids(state.params["head"]["kernel"]) == [4, 5]
    start = _initial_params(state)
    losses, state = _train(step, state, [batch] * 3)
    reference = Classifier()
    ref_losses, ref_params = _reference_run(reference, optax.adam(1e-2), start, [batch] * 3, _xent)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOL), state.params, ref_params
    )


def test_local_batch_returns_prepare_batch():
    built = layers.parallelize_step(
        Pipeline(), optax.sgd(0.1), local_batch=(np.asarray(X), np.asarray(Y))
    )
    assert isinstance(built, layers.ParallelStep) and repr(built).endswith("prepare_batch)")
    step, state, mesh, prepare = built  # unpacks as in earlier versions: 4 values here
    assert prepare is built.prepare_batch and step is built.step and state is built.state
    batch = prepare((np.asarray(X), np.asarray(Y)))
    assert device_ids(batch[0]) == [0, 1, 2, 3]
    np.testing.assert_array_equal(batch[0], X)
    loss, _ = step(state, batch)
    assert np.isfinite(float(loss))


def test_the_result_is_a_named_record_that_unpacks_to_three_without_local_batch():
    built = layers.parallelize_step(Pipeline(), optax.sgd(0.1), global_batch=(X, Y))
    assert built.prepare_batch is None
    assert repr(built) == "ParallelStep(step, state at step 0, mesh)"
    step, state, mesh = built
    assert step is built.step and state is built.state and mesh is built.mesh
    assert len(built) == 3 and built[0] is step and built[:2] == (step, state)


def test_replicate_inputs_false_splits_the_batch_over_the_submesh():
    _, _, _, prepare = layers.parallelize_step(
        Classifier(),
        optax.sgd(0.1),
        local_batch={"x": X, "label": jnp.arange(8) % 3},
        replicate_inputs=False,
        loss_fn=_xent,
    )
    batch = prepare({"x": np.asarray(X), "label": np.arange(8) % 3})
    # The labels are first used by the loss, next to the head's logits on devices 4-5.
    assert device_ids(batch["label"]) == [4, 5]
    assert batch["label"].addressable_shards[0].data.shape == (4,)
    # The inputs keep the body's own constraint: batch -> x on devices 0-3.
    assert batch["x"].sharding.spec == P("x")


class Dropper(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[6, 7]))
        x = nn.Dropout(0.5, deterministic=False)(block(16, name="dense")(x))
        return (x**2).mean()


def test_dropout_uses_rng_folded_with_the_step():
    key = jax.random.key(42)
    step, state, _ = layers.parallelize_step(Dropper(), optax.sgd(0.1), global_batch=X, rng=key)
    start = _initial_params(state)
    loss, state = step(state, X)
    _, dropout_key = jax.random.split(key)
    with mm.ignore_transforms():
        expected = Dropper().apply(
            {"params": start}, X, rngs={"dropout": jax.random.fold_in(dropout_key, 0)}
        )
    np.testing.assert_allclose(loss, expected, **TOL)


def _initial(rng):
    _, state, _ = layers.parallelize_step(Dropper(), optax.sgd(0.1), global_batch=X, rng=rng)
    return _initial_params(state)


def test_rng_default_typed_and_raw_keys_initialize_alike():
    """``None`` means ``key(0)``; raw key data (``PRNGKey``) is the same key; the parameters
    come from ``split(rng)[0]``, as ``parallelize_step`` documents."""
    params_key, dropout_key = jax.random.split(jax.random.key(7))
    with mm.ignore_transforms():
        expected = Dropper().init({"params": params_key, "dropout": dropout_key}, X)["params"]
    got = _initial(jax.random.key(7))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), got, expected)
    raw = _initial(jax.random.PRNGKey(7))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), raw, expected)
    default, seed0 = _initial(None), _initial(jax.random.key(0))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), default, seed0)


def test_setup_compiles_no_key_programs_of_its_own():
    """The key split is traced into the initializer and the step: eagerly, making and
    splitting the key would compile three small programs before anything else."""
    from multimesh_flax._compilation_cache import compilation_counter

    key = jax.random.key(3)
    jax.clear_caches()  # programs compiled earlier in this process would not count
    # this thread's: an earlier test's step may still compile ahead in a thread of its own
    read = compilation_counter(this_thread=True)
    layers.parallelize_step(Dropper(), optax.sgd(0.1), global_batch=X, rng=key)
    counted = read()
    assert counted["compiles"] + counted["cache_hits"] == 1  # the state initializer only


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = layers.task(nn.BatchNorm, mesh=mm.TaskMesh(devices=[0, 1]))
        return (block(use_running_average=False, name="bn")(x) ** 2).mean()


def test_mutable_collections_live_in_model_state():
    step, state, _ = layers.parallelize_step(Normed(), optax.sgd(0.1), global_batch=X)
    assert set(state.model_state) == {"batch_stats"}
    _, state = step(state, X * 3 + 1)
    mean = state.model_state["batch_stats"]["bn"]["mean"]
    np.testing.assert_allclose(mean, 0.01 * np.mean(np.asarray(X) * 3 + 1, axis=0), **TOL)


def test_multimesh_slices_as_stages():
    multi = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "x", "y"))

    class Staged(nn.Module):
        @nn.compact
        def __call__(self, x, y):
            for i in range(2):
                rules = RULES + (("stage_unused", "stage"),)
                block = layers.task(MLPBlock, mesh_slice={"stage": i}, logical_axes=rules)
                x = block(name=f"layer_{i}")(x)
            return jnp.mean((x - y) ** 2)

    step, state, mesh = layers.parallelize_step(Staged(), optax.sgd(0.02), multi, (X, Y))
    assert mesh is multi.mesh
    assert device_ids(state.params["layer_1"]["Dense_0"]["kernel"]) == [4, 5, 6, 7]
    start = _initial_params(state)
    losses, _ = _train(step, state, [(X, Y)] * 2)
    ref_losses, _ = _reference_run(Pipeline(wrap=False), optax.sgd(0.02), start, [(X, Y)] * 2)
    np.testing.assert_allclose(losses, ref_losses, **TOL)


def test_tensor_parallel_stages_run_one_program_per_unit_across_microbatches():
    # Each microbatch's gradients are laid out as their split parameters, so a chain of
    # running sums starts from zeros in that layout: a stage's first backward runs the program
    # its later ones run, instead of compiling one of its own for replicated zeros.
    step, state, _ = layers.parallelize_step(
        Pipeline(), optax.adam(0.01), global_batch=(X, Y), microbatches=4, schedule="1f1b"
    )
    start = _initial_params(state)
    losses, state = _train(step, state, [(X, Y)] * 3)
    executable = step.executable(state, (X, Y))
    used: dict[tuple, set] = {}  # per program and submesh: the executables its ops called
    for i, op in enumerate(executable.ops):
        if op.kind is OpKind.RUN:
            used.setdefault((id(op.program), op.place), set()).add(id(executable.state.fns[i]))
    assert all(len(called) == 1 for called in used.values()), used
    kernel = state.params["layer_0"]["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("x", "y")  # the stages split their kernels
    ref_losses, ref_params = _reference_run(Pipeline(wrap=False), optax.adam(0.01), start,
                                            [(X, Y)] * 3)  # fmt: skip
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOL), state.params, ref_params
    )


def _assert_same_training(run, *others):
    """``(losses, params)`` of ``run`` equal each of ``others``' at ``TOL``."""
    losses, params = run
    for other_losses, other_params in others:
        np.testing.assert_allclose(losses, other_losses, **TOL)
        leaves = map(jax.tree.leaves, (params, other_params))
        for got, want in zip(*leaves, strict=True):
            np.testing.assert_allclose(got, want, **TOL)


# Rows over ``x``, each block's kernels split Megatron-style over ``y`` alone.
TENSOR_RULES = (("batch", "x"), ("data", None), ("model", "y"))


class TensorParallel(nn.Module):
    """``Pipeline``'s blocks, each stage data parallel over ``x`` and tensor parallel over
    ``y``."""

    @nn.compact
    def __call__(self, x, y):
        for i, mesh in enumerate((STAGE0, STAGE1)):
            block = layers.task(MLPBlock, mesh=mesh, logical_axes=TENSOR_RULES)
            x = block(name=f"layer_{i}")(x)
        return jnp.mean((x - y) ** 2)


def test_tensor_parallel_stages_keep_each_gradient_sum_per_row_shard(monkeypatch):
    """The step lays each microbatch's gradients out as their parameters in a block of
    constraints after the backward's: each gradient's running sum is then a stack of the
    ``x`` shards' partial sums in that layout (``core.fragment._stacked_sums``, through both
    blocks), so no backward all-reduces a gradient over ``x``; one program per unit still,
    and the training equals plain Flax's and the unstacked step's up to rounding."""
    runs = {}
    for stack in (True, False):
        monkeypatch.setattr(_sums, "STACK", stack)
        step, state, _ = layers.parallelize_step(
            TensorParallel(),
            optax.adam(0.01),
            global_batch=(X, Y),
            microbatches=4,
            schedule="1f1b",
        )
        start = _initial_params(state)
        losses, state = _train(step, state, [(X, Y)] * 2)
        runs[stack] = losses, state.params, step.executable(state, (X, Y))
    (losses, params, executable), (losses_apart, params_apart, executable_apart) = runs.values()
    assert params["layer_0"]["Dense_0"]["kernel"].sharding.spec == P(None, "y")
    ref_losses, ref_params = _reference_run(Pipeline(wrap=False), optax.adam(0.01), start,
                                            [(X, Y)] * 2)  # fmt: skip
    _assert_same_training((losses, params), (ref_losses, ref_params), (losses_apart, params_apart))
    # Four gradients a stage (two kernels, two biases), four microbatches, two stages.
    operands, operands_apart = map(backward_all_reduce_operands, (executable, executable_apart))
    assert operands_apart - operands == 4 * 4 * 2, (operands, operands_apart)
    _programs(executable)


VOCAB = 12  # splits over the 2 devices of ``y``


class TiedStem(nn.Module):
    """A table split over ``model`` (rows) whose rows the ids look up, plus a position's."""

    @nn.compact
    def __call__(self, ids):
        table = self.param("table", layers.shard_axes("model", None), (VOCAB, 16))
        where = self.param("where", layers.shard_axes(None, None), (ids.shape[-1], 16))
        return mm.with_sharding_constraint(table[ids] + where, P("batch", None, None))


class TiedHead(nn.Module):
    """A dense layer, then logits against the stem's table (tied)."""

    @nn.compact
    def __call__(self, x, table):
        h = nn.Dense(16, kernel_init=layers.shard_axes("data", "model"))(x)
        return mm.with_sharding_constraint(jnp.tanh(h), P("batch", None, None)) @ table.T


class Tied(nn.Module):
    """The stem on devices 0-3 and the head on 4-7, both tensor parallel: the head's
    gradient of the table is a share that adds to the stem's."""

    @nn.compact
    def __call__(self, ids, labels):
        stem = layers.task(TiedStem, mesh=STAGE0, logical_axes=TENSOR_RULES)(name="stem")
        x = stem(ids)
        head = layers.task(TiedHead, mesh=STAGE1, logical_axes=TENSOR_RULES)(name="head")
        logits = head(x, nn.meta.unbox(stem.variables["params"]["table"]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_a_tied_tables_head_share_is_summed_on_its_stage_and_moves_once(monkeypatch):
    """The step lays each microbatch's gradient of a tied table out as the table, on the
    stem's stage, which used to pull the head's share over every microbatch and sum it
    there, all-reduced over the rows on both stages. Each stage now sums its own share, per
    row shard (``plan._accumulate``, ``fragment._stacked_units``): the head's share leaves
    its stage once a step, and neither stage's backward all-reduces the table's gradient.
    Training equals plain Flax's and the step's without it up to rounding."""
    keys = jax.random.split(jax.random.key(3), 2)
    batch = tuple(jax.random.randint(k, (8, 5), 0, VOCAB) for k in keys)
    runs = {}
    for through in (True, False):
        monkeypatch.setattr(_accumulate, "THROUGH_LAYOUTS", through)
        step, state, _ = layers.parallelize_step(
            Tied(), optax.adam(0.01), global_batch=batch, microbatches=4, schedule="1f1b"
        )
        start = _initial_params(state)
        losses, state = _train(step, state, [batch] * 2)
        runs[through] = losses, state.params, step.executable(state, batch)
    (losses, params, executable), (losses_before, params_before, executable_before) = runs.values()
    assert params["stem"]["table"].sharding.spec == P("y")
    ref_losses, ref_params = _reference_run(Tied(), optax.adam(0.01), start, [batch] * 2)
    _assert_same_training(
        (losses, params), (ref_losses, ref_params), (losses_before, params_before)
    )
    moves = [_table_moves(e, STAGE0) for e in (executable, executable_before)]
    assert moves == [1, 4], moves
    operands = [backward_all_reduce_operands(e) for e in (executable, executable_before)]
    assert operands[1] - operands[0] == 2 * 4, operands
    assert _programs(executable) == _programs(executable_before)


def _programs(executable):
    """How many programs a step's ops run; raises unless each runs one executable per
    submesh (every copy of a unit one program)."""
    used: dict[tuple, set] = {}  # per program and submesh: the executables its ops called
    for i, op in enumerate(executable.ops):
        if op.kind is OpKind.RUN:
            used.setdefault((id(op.program), op.place), set()).add(id(executable.state.fns[i]))
    assert all(len(called) == 1 for called in used.values()), used
    return len({program for program, _ in used})


def _table_moves(executable, stage):
    """How many transfers a step makes of a table-shaped value onto ``stage``'s devices."""
    homes = executable.slot_homes()
    return sum(
        op.kind is OpKind.PUT
        and op.place == tuple(stage.devices)
        and any(homes[s][0].aval.shape == (VOCAB, 16) for s in op.outs)
        for op in executable.ops
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), "exactly one of `global_batch` or `local_batch`"),
        (dict(global_batch=(X, Y), local_batch=(X, Y)), "got both"),
        (dict(global_batch=(X, Y), mesh="all"), "`mesh`"),
        (
            dict(global_batch=(X, Y), pipeline=mm.PipelineOptions(microbatches=2), schedule="1f1b"),
            "got `pipeline` and also",
        ),
        (dict(global_batch=(X, Y), pipeline=mm.PipelineOptions(schedule="1f1b")), "without"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(errors.ParallelizeArgumentError, match=match):
        layers.parallelize_step(Pipeline(), optax.sgd(0.1), **kwargs)


def test_wrong_model_optimizer_and_loss_raise():
    with pytest.raises(errors.ParallelizeArgumentError, match="module instance"):
        layers.parallelize_step(Pipeline, optax.sgd(0.1), global_batch=(X, Y))
    with pytest.raises(errors.ParallelizeArgumentError, match="GradientTransformation"):
        layers.parallelize_step(Pipeline(), 0.1, global_batch=(X, Y))
    with pytest.raises(errors.ParallelizeArgumentError, match="float scalar"):
        layers.parallelize_step(
            Classifier(), optax.sgd(0.1), global_batch={"x": X}, loss_fn=lambda f, b: f(b["x"])
        )
    with pytest.raises(errors.ParallelizeArgumentError, match="never did"):
        layers.parallelize_step(
            Classifier(), optax.sgd(0.1), global_batch=X, loss_fn=lambda f, b: b.sum()
        )


class UnmodifiedMLP(nn.Module):
    """Plain Flax: logical names only through Flax's own API, placed by ``register_task``."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.xavier_normal(), ("embed", "mlp"))
        for i in range(2):
            x = nn.relu(nn.Dense(16, kernel_init=init, name=f"layer_{i}")(x))
        return jnp.mean(x**2)


def test_registered_tasks_shard_their_parameters_by_logical_names():
    multi = mm.MultiMesh(axis_sizes=(4, 2), axis_names=("stage", "model"))
    multi.register_task(
        "layer_([0-9])",
        callback=lambda n, _: mm.Task(
            mesh_slice={"stage": int(n)}, logical_axes=[("mlp", "model")]
        ),
    )
    x = X
    with multi:
        rows = {
            p.path: p for p in layers.get_placement(UnmodifiedMLP(), jax.random.key(0), x).params
        }
        step, state, _ = layers.parallelize_step(UnmodifiedMLP(), optax.sgd(0.1), multi, x)
    kernel = state.params["layer_1"]["kernel"]
    assert device_ids(kernel) == [2, 3] and kernel.sharding.spec == P(None, "model")
    assert (
        rows["layer_1/kernel"].mesh_spec == P(None, "model") and rows["layer_1/kernel"].task == "1"
    )
    start = _initial_params(state)
    losses, state = _train(step, state, [x] * 2)
    ref_losses, ref_params = _reference_run(UnmodifiedMLP(), optax.sgd(0.1), start, [(x,)] * 2)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOL), state.params, ref_params
    )


def test_the_step_keeps_the_registries_it_was_built_in():
    ctx = mm.Context()
    ctx.register_task("layer_1", task=mm.Task(mesh=mm.TaskMesh(devices=[6, 7])))
    with ctx:
        step, state, _ = layers.parallelize_step(UnmodifiedMLP(), optax.sgd(0.1), global_batch=X)
    loss, state = step(state, X)  # called outside `with ctx:`: still placed by it
    assert device_ids(state.params["layer_1"]["kernel"]) == [6, 7]
    assert np.isfinite(float(loss))
