"""``parallelize_step``: one call from a Flax model and an optax optimizer to a placed,
compiled training step.

The step is ``loss, grads = value_and_grad(loss)(params)`` followed by the optimizer update,
compiled by ``multimesh_flax.jit`` as one MPMD program; with ``microbatches=m`` it is the mean
over microbatches of each one's ``value_and_grad``, pipelined by ``microbatch``. Placement:

* a parameter of a ``Task[Module]`` sits on that task's submesh, sharded by its logical
  names (``shard_axes``) through the task's rules; optimizer-state leaves that mirror a
  parameter (Adam's moments, momentum) sit exactly like it;
* everything else (step counter, optimizer counters, parameters outside every task) sits
  where the program first uses it.

The state is created in those shardings (``core.front._initializer``: one program for all
submeshes, then each leaf moved to its own), and the step constrains its outputs to the same
shardings, so the next call moves nothing.

**The loss.** ``loss_fn(model_fn, batch) -> scalar``: ``model_fn(*args, **kwargs)`` applies
the model with the current parameters, rngs and mutable collections. Without ``loss_fn`` the
model's output is the loss: ``model_fn(*batch)`` for a tuple batch, else ``model_fn(batch)``.
The same ``loss_fn`` initializes the model (``model_fn`` then runs ``init``), so no separate
example input is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import flax
import jax
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    MultiMesh,
    PipelineOptions,
    Recompute,
    active_contexts,
    get_multi_mesh,
    ignore_transforms,
    make_auto_mesh,
    make_recompute,
    pipeline_options,
    step_policy,
    use_device_list,
)
from multimesh_flax.core.declare import context as flag_context
from multimesh_flax.core.front import MpmdJit, jit, shape_structs, sharded_initializer
from multimesh_flax.core.run import CompileAhead
from multimesh_flax.core.trace import microbatch, shape_only_trace
from multimesh_flax.layers import _nonfinite, _placement, _precision

LossFn = Callable[[Callable[..., Any], Any], Any]

# ``parallelize_step`` compiles the step's fragments in a thread while the initializer of
# the state compiles (``MpmdJit.compile_ahead``); False: at the first call (tests compare)
COMPILE_AHEAD = True


class TrainState(train_state.TrainState):
    """Flax's ``TrainState`` plus the model's non-parameter collections (e.g. ``batch_stats``).

    ``model_state`` is ``{}`` for models with parameters only.
    """

    model_state: Any = flax.struct.field(default_factory=dict)


def default_loss(model_fn: Callable[..., Any], batch: Any) -> Any:
    """The model's output is the loss: ``model_fn(*batch)`` for tuples, else ``model_fn(batch)``."""
    return model_fn(*batch) if isinstance(batch, tuple) else model_fn(batch)


def _root_key(rng: Any) -> Any:
    """``rng`` as a typed PRNG key, checked (``None`` stays ``None``: seed 0, see
    :func:`_split_key`). Raw key data, as from the legacy ``jax.random.PRNGKey(0)``, is
    wrapped."""
    if rng is None or jax.dtypes.issubdtype(getattr(rng, "dtype", None), jax.dtypes.prng_key):
        return rng
    try:
        return jax.random.wrap_key_data(np.asarray(rng, dtype=np.uint32))
    except (TypeError, ValueError) as e:
        raise errors.ParallelizeArgumentError(
            f"Expected `rng` to be a PRNG key such as `jax.random.key(0)`, got "
            f"{type(rng).__name__}: {rng!r}. For an integer seed pass "
            f"`rng=jax.random.key({rng!r})`."
        ) from e


def _split_key(key: Any) -> tuple[Any, Any]:
    """``(params_key, dropout_key) = split(key)`` (``None``: ``jax.random.key(0)``).

    Called inside the programs that use the keys (the initializer's trace, the step's), so
    the split is part of them: done eagerly, each of ``key``, ``split`` and the unpacking is
    a small XLA program of its own, compiled before anything else can start.
    """
    params_key, dropout_key = jax.random.split(jax.random.key(0) if key is None else key)
    return params_key, dropout_key


def dropout_key_of(step_key: Any, microbatch: Any) -> Any:
    """The dropout key of one microbatch: ``fold_in(step_key, microbatch)``.

    ``step_key`` is ``fold_in(dropout_key, step)``; ``microbatch`` is ``None`` (no
    microbatching: the step key itself) or the microbatch's index.
    """
    return step_key if microbatch is None else jax.random.fold_in(step_key, microbatch)


class _Model:
    """Initializes and applies ``model`` for ``loss_fn`` (``model_fn`` is what it sees)."""

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, rng: Any, pipeline: PipelineOptions | None = None
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.key = _root_key(rng)  # split where the keys are used (``_split_key``)
        self.pipeline = pipeline  # microbatch options, or None for one full-batch pass

    @property
    def dropout_key(self) -> Any:
        """The root of every step's dropout keys (traced where it is used)."""
        return _split_key(self.key)[1]

    def _microbatched(self, fun: Callable[[Any], Any], batch: Any, trace_once: bool) -> Any:
        """The mean of ``fun((chunk, index))`` over the batch's pipelined microbatches.

        ``index`` holds each example's microbatch index (it rides along as an extra batch
        leaf, so a body traced once still sees each microbatch's own index).
        ``trace_once=False`` traces ``fun`` once per microbatch: needed when the model hands
        mutable collections out through a side effect (see ``microbatch``).
        """
        count = self.pipeline.microbatches
        length = jax.tree_util.tree_leaves(batch)[0].shape[0]
        if length % count:
            raise errors.UnevenMicrobatchError(
                f"The step was built with `microbatches`={count}, but got a batch of {length} "
                f"examples, which {count} microbatches do not divide ({length % count} left "
                f"over). Pass batches whose leading size is a multiple of {count}."
            )
        chunked = microbatch(fun, 0, pipeline=self.pipeline, reduce="mean", trace_once=trace_once)
        index = jax.numpy.arange(length) // (length // count)  # example -> its microbatch
        return chunked((batch, index))

    def init_variables(self, batch: Any) -> Any:
        captured: dict[str, Any] = {}

        def model_fn(*args: Any, **kwargs: Any) -> Any:
            params_key, dropout_key = _split_key(self.key)
            rngs = {"params": params_key, "dropout": dropout_key}
            out, variables = self.model.init_with_output(rngs, *args, **kwargs)
            captured.setdefault("variables", variables)
            return out

        self.loss_fn(model_fn, batch)
        if "variables" not in captured:
            raise errors.ParallelizeArgumentError(
                "Expected `loss_fn(model_fn, batch)` to call `model_fn` (the model) at least "
                "once, but it never did. Call `model_fn(inputs)` inside it."
            )
        return captured["variables"]

    def _model_fn(
        self, params: Any, model_state: Any, step_key: Any, microbatch: Any, updates: dict
    ) -> Callable[..., Any]:
        """The model applied to ``params`` with microbatch ``microbatch``'s dropout key (``None``
        for the full batch); new values of ``model_state``'s collections go to ``updates``."""
        rngs = {"dropout": dropout_key_of(step_key, microbatch)}

        def model_fn(*args: Any, **kwargs: Any) -> Any:
            variables = {"params": params, **model_state}
            if not model_state:
                return self.model.apply(variables, *args, rngs=rngs, **kwargs)
            out, new = self.model.apply(
                variables, *args, rngs=rngs, mutable=list(model_state), **kwargs
            )
            updates.update(new)
            return out

        return model_fn

    def _step_key(self, step: Any) -> Any:
        """The dropout key of training step ``step`` (each microbatch folds in its index)."""
        return jax.random.fold_in(self.dropout_key, step)

    def loss(self, params: Any, model_state: Any, batch: Any, step: Any) -> Any:
        """``(loss, new model_state)`` over the whole batch (its microbatches' mean)."""
        step_key = self._step_key(step)
        updates: dict[str, Any] = {}

        def model_fn_at(microbatch: Any) -> Callable[..., Any]:
            return self._model_fn(params, model_state, step_key, microbatch, updates)

        if self.pipeline is None:
            loss = self.loss_fn(model_fn_at(None), batch)
        else:
            loss = self._microbatched(
                lambda b: self.loss_fn(model_fn_at(b[1][0]), b[0]), batch, not model_state
            )
        return loss, {**model_state, **updates}

    def value_and_grad(
        self, params: Any, model_state: Any, batch: Any, step: Any, cast: Any = None
    ) -> Any:
        """``((loss, new model_state), grads)`` of :meth:`loss` with respect to ``params``;
        ``cast(grads)`` (if given) is applied to each microbatch's gradients before the mean.

        Microbatched, each microbatch's gradient is taken inside the loop and the step
        averages them: JAX then differentiates one microbatch's body, traced once, instead
        of a loop over microbatches (whose partial evaluation and transpose add a fixed
        cost to every trace with ``m >= 2``). A model with mutable collections (batch
        statistics) is differentiated as a whole: its microbatches are traced one by one.
        """
        cast = cast or (lambda grads: grads)
        if self.pipeline is None or model_state:
            grad_fn = jax.value_and_grad(_checked_loss(self.loss), has_aux=True)
            value, grads = grad_fn(params, model_state, batch, step)
            return value, cast(grads)
        step_key = self._step_key(step)

        def one(chunk: Any) -> Any:
            def loss_of(p: Any) -> Any:
                model_fn = self._model_fn(p, model_state, step_key, chunk[1][0], {})
                return self.loss_fn(model_fn, chunk[0]), None

            (value, _), grads = jax.value_and_grad(_checked_loss(loss_of), has_aux=True)(params)
            return value, cast(grads)

        loss, grads = self._microbatched(one, batch, trace_once=True)
        return (loss, model_state), grads


def _check_batches(global_batch: Any, local_batch: Any) -> Any:
    if (global_batch is None) == (local_batch is None):
        got = "both" if global_batch is not None else "neither"
        raise errors.ParallelizeArgumentError(
            f"Expected exactly one of `global_batch` or `local_batch` (an example batch), got "
            f"{got}. Pass `global_batch` for single-process training."
        )
    name, batch = (
        ("global_batch", global_batch) if local_batch is None else ("local_batch", local_batch)
    )
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise errors.ParallelizeArgumentError(
                f"Expected every leaf of `{name}` to be an array or jax.ShapeDtypeStruct, got "
                f"{type(leaf).__name__}: {leaf!r} at {jax.tree_util.keystr(path) or '<root>'}. "
                "Convert Python values with `jnp.asarray`."
            )
    if local_batch is None:
        return global_batch
    count = jax.process_count()
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] * count, *np.shape(x)[1:]), x.dtype),
        local_batch,
    )


_abstract = shape_structs


def _devices_of(mesh: Any) -> tuple[Any, Any, jax.sharding.Mesh]:
    """``(device list, MultiMesh or None, the mesh to return)`` for the ``mesh`` argument."""
    if mesh is None:
        mesh = get_multi_mesh()
    if mesh is None:
        pool = np.array(jax.devices(), dtype=object)
        return None, None, make_auto_mesh(pool, ("devices",))
    if isinstance(mesh, MultiMesh):
        return list(mesh.devices.flat), mesh, mesh.mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return list(mesh.devices.flat), None, mesh
    raise errors.ParallelizeArgumentError(
        f"Expected `mesh` to be None, a jax.sharding.Mesh or a MultiMesh, got "
        f"{type(mesh).__name__}: {mesh!r}. Build one with `MultiMesh(axis_sizes=..., "
        "axis_names=...)`, or omit it to use all devices."
    )


def _check_loss_fn(loss_fn: Any) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise errors.ParallelizeArgumentError(
            f"Expected `loss_fn` to be a function `loss_fn(model_fn, batch) -> scalar`, got "
            f"{type(loss_fn).__name__}: {loss_fn!r}. For a model whose output is the loss, "
            "omit it."
        )


def _check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise errors.ParallelizeArgumentError(
            f"Expected `model` to be a Flax module instance (e.g. `MLP(features=16)`), got "
            f"{model!r}. Instantiate the class first."
        )
    if not isinstance(optimizer, optax.GradientTransformation):
        raise errors.ParallelizeArgumentError(
            f"Expected `optimizer` to be an optax GradientTransformation (e.g. "
            f"`optax.adamw(1e-3)`), got {type(optimizer).__name__}: {optimizer!r}."
        )


def _microbatching(pipeline: PipelineOptions, batch_shape: Any) -> PipelineOptions | None:
    """``pipeline`` if the step pipelines (``microbatches`` given), checked against the
    batch; ``None`` for one full-batch pass."""
    microbatches = pipeline.microbatches
    if microbatches is None:
        if pipeline != PipelineOptions():
            raise errors.ParallelizeArgumentError(
                f"Got `schedule`={pipeline.schedule!r} / `interleave`={pipeline.interleave!r} "
                "(or other pipeline options) without `microbatches`. A schedule orders "
                "microbatches: pass `microbatches=m`."
            )
        return None
    leading = {
        np.shape(x)[0] if np.ndim(x) else None for x in jax.tree_util.tree_leaves(batch_shape)
    }
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise errors.ParallelizeArgumentError(
            f"Expected `microbatches` to be a positive int, got {microbatches!r}. Pass a "
            "count such as `microbatches=4`."
        )
    if len(leading) != 1 or None in leading or next(iter(leading)) % microbatches:
        raise errors.ParallelizeArgumentError(
            f"Expected every batch leaf to have one leading size divisible by "
            f"`microbatches`={microbatches}, got leading sizes {sorted(map(str, leading))}. "
            "Choose a microbatch count that divides the batch size."
        )
    return pipeline


def _zeros(shapes: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)


def _checked_loss(loss: Callable[..., Any]) -> Callable[..., Any]:
    """``loss`` raising a clear error, while the step is traced, unless it is a float scalar."""

    def checked(*args: Any) -> Any:
        value, aux = loss(*args)
        if value.shape != () or not jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
            raise errors.ParallelizeArgumentError(
                f"Expected the loss to be a float scalar, got {value.dtype}{list(value.shape)}. "
                "Reduce it (e.g. `.mean()`) in the model or in `loss_fn`."
            )
        return value, aux

    return checked


def _shard_leading(sharding: Any, shape: tuple[int, ...]) -> Any:
    """``sharding``'s mesh, leading dimension split over all its axes (data parallel)."""
    mesh = sharding.mesh
    if sharding.spec != jax.sharding.PartitionSpec() or not shape:
        return sharding
    if shape[0] % mesh.size:
        raise errors.ParallelizeArgumentError(
            f"`replicate_inputs=False` splits each batch leaf's leading dimension over the "
            f"{mesh.size} devices of its submesh, but a leaf has shape {shape}. Use a batch "
            f"size that is a multiple of {mesh.size}, or `replicate_inputs=True`."
        )
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))


class _Setup:
    """Everything ``parallelize_step`` derives before the first step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        loss_fn: LossFn,
        rng: Any,
        pipeline: PipelineOptions | None = None,
        nonfinite: _nonfinite.NonFinite | None = None,
        recompute: Recompute | None = None,
        precision: _precision.Precision = _precision.Precision.FP32,
    ) -> None:
        self.runner = _Model(model, loss_fn, rng, pipeline)
        self.model, self.optimizer = model, optimizer
        self.nonfinite = nonfinite  # None: no check; else the step also returns a StepCheck
        self.recompute = recompute  # every task's policy unless it sets its own
        self.precision = precision
        self.state_constraints: Any = None
        self.state_owners: Any = None
        self.state_shapes: Any = None  # the state's tree of ShapeDtypeStruct
        self.batch_constraints: Any = None
        self.state_program: Any = None  # the state initializer, traced (derive_constraints)

    def make_state(self, batch_shape: Any, boxed: dict[str, Any] | None = None) -> Any:
        """The train state; ``boxed`` (a dict) gets the variables' abstract boxed tree
        (``"variables"``: shapes and logical names) on the way."""
        with ignore_transforms():
            made = self.runner.init_variables(_zeros(batch_shape))
        if boxed is not None:
            boxed["variables"] = _placement.abstract(made)
        variables = dict(nn.meta.unbox(made))
        params = _precision.stored(self.precision, variables.pop("params", {}))
        return TrainState.create(
            apply_fn=self.model.apply, params=params, tx=self.optimizer, model_state=variables
        )

    def derive_constraints(self, batch_shape: Any, devices: Any) -> Any:
        # The model's init traced once: the tasks that own each parameter and its logical
        # names on the way, the state's shapes, and the program the sharded initializer
        # replays.
        boxed: dict[str, Any] = {}
        with (
            _placement.recording_owners() as (owners, registered),
            shape_only_trace(),  # initialising for shapes: tasks are not placed here
        ):
            self.state_program, state = jax.make_jaxpr(
                lambda: self.make_state(batch_shape, boxed), return_shape=True
            )()
        param_sh, param_owners = _placement.owner_shardings(
            boxed["variables"].get("params", {}), owners, devices, registered=registered
        )
        nothing = jax.tree_util.tree_map(lambda _: None, state.model_state)

        def per_leaf(per_param: Any) -> Any:
            mirrored = _placement.mirror(state.opt_state, state.params, per_param)
            return state.replace(
                step=None, params=per_param, opt_state=mirrored, model_state=nothing
            )

        self.state_constraints = per_leaf(param_sh)
        self.state_owners = per_leaf(param_owners)
        self.state_shapes = state  # abstract: ShapeDtypeStructs
        return state

    def pin_state(self, shardings: Any) -> bool:
        """Constrains the leaves no task owns to ``shardings`` (where the step reads them).

        Without it the non-finite check's ``where(ok, new, old)`` of a scalar counter
        (``step``, an optimizer's ``count``) is placed with ``ok`` -- where the loss is --
        instead of with the counter, and every step would move the counter back. Returns
        whether any constraint was added (then the step must be traced again).
        """
        flat, treedef = jax.tree_util.tree_flatten(shardings)
        current = treedef.flatten_up_to(self.state_constraints)
        pinned = [c if c is not None else s for c, s in zip(current, flat, strict=True)]
        self.state_constraints = treedef.unflatten(pinned)
        return any(c is None for c in current)

    def check_state(self, state: Any) -> None:
        """Raises unless ``state`` has the tree, shapes and dtypes of the state
        ``parallelize_step`` made (runs while tracing only)."""
        if self.state_shapes is None:
            return
        differences = _state_differences(self.state_shapes, state)
        if differences:
            shown = "; ".join(differences[:3])
            more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
            raise errors.ParallelizeArgumentError(
                f"Expected `state` to be the TrainState that `parallelize_step` returned (or "
                f"the one the previous step returned), got a {type(state).__name__} that "
                f"differs in {len(differences)} leaves: {shown}{more}. It was made for another "
                "model or optimizer. Call `step_fn(state, batch)` with that state; to change "
                "parameters use `state.replace(params=...)` with the same tree."
                f"{_restore_hint(state)}"
            )

    def step(self, state: Any, batch: Any) -> tuple[Any, ...]:
        self.check_state(state)  # runs while tracing only: free on later calls
        _check_not_empty(batch)
        state = _placement.constrain(state, self.state_constraints, self.state_owners)
        if self.batch_constraints is not None:
            batch = _placement.constrain(batch, self.batch_constraints)
        with step_policy(self.recompute):
            (loss, model_state), grads = self._value_and_grad(state, batch)
        new_state = state.apply_gradients(grads=grads, model_state=model_state)
        if self.nonfinite is None:
            return loss, _placement.constrain(new_state, self.state_constraints)
        new_state, checked = _nonfinite.guard(loss, grads, new_state, state)
        return loss, _placement.constrain(new_state, self.state_constraints), checked

    def _value_and_grad(self, state: Any, batch: Any) -> Any:
        """The runner's ``value_and_grad`` in the step's precision (``_precision``), each
        microbatch's gradients laid out as their parameters (:meth:`_grads_like_params`)."""
        laid_out = self._grads_like_params
        if self.precision is _precision.Precision.FP32:
            return self.runner.value_and_grad(
                state.params, state.model_state, batch, state.step, laid_out
            )
        params, cast = state.params, laid_out
        if self.precision is _precision.Precision.BF16:
            params = _precision.to_compute(state.params)
            cast = lambda grads: laid_out(_precision.like(grads, state.params))  # noqa: E731
        (loss, model_state), grads = self.runner.value_and_grad(
            params, state.model_state, _precision.to_compute(batch), state.step, cast
        )
        return (loss.astype(jax.numpy.float32), model_state), grads

    def _grads_like_params(self, grads: Any) -> Any:
        """``grads`` constrained to their parameters' shardings on every submesh that splits
        some parameter (a tensor-parallel stage); elsewhere left alone.

        XLA chooses a gradient's layout where nothing says it (a replicated bias's running
        sum came out split over the data axis). Saying it lets a chain of running sums start
        from zeros in the layout the sums keep (``core.fragment._sums``), so a stage's first
        backward runs the program its later ones run instead of compiling its own (gpt-tiny
        S=2 m=16, data 2 x tensor 2 stages: two backward programs of 0.6-1.0 s each), and
        it is what lets each gradient's running sum be kept per ``data`` row shard in that
        layout until the step's one all-reduce (``core.fragment._stacked_sums``). A submesh
        of replicated parameters only (data parallel) is left alone: its gradients are
        summed per device into one flat running sum, whatever their layout.
        """
        constraints = self.state_constraints
        if constraints is None:
            return grads
        is_leaf = lambda x: x is None  # noqa: E731
        shardings = jax.tree_util.tree_leaves(constraints.params, is_leaf=is_leaf)
        split = {s.mesh for s in shardings if s is not None and not s.is_fully_replicated}
        laid_out = jax.tree_util.tree_map(
            lambda s: s if s is not None and s.mesh in split else None,
            constraints.params,
            is_leaf=is_leaf,
        )
        return _placement.constrain(grads, laid_out)


def _check_not_empty(batch: Any) -> None:
    """Refuses a batch with a leaf of no examples (its mean loss would be NaN)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if np.ndim(leaf) and np.shape(leaf)[0] == 0:
            raise errors.ParallelizeArgumentError(
                f"Expected a batch of at least one example, but `batch{jax.tree_util.keystr(path)}`"
                f" has shape {tuple(np.shape(leaf))}: no examples. A data loader that ran dry "
                "or a last partial batch filtered to nothing gives this; skip empty batches."
            )


def _state_differences(expected: Any, state: Any) -> list[str]:
    """How ``state`` differs from the tree of ``ShapeDtypeStruct`` ``expected``, leaf by leaf:
    ``"`.params['w']` missing"``, ``"`.step` unexpected"``, ``"`.params['w']`: float32[4, 2]
    where the step expects float32[4, 4]"``."""

    def by_path(tree: Any) -> dict[str, Any]:
        return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}

    def spec(x: Any) -> tuple[tuple[int, ...], str]:
        dtype = x.dtype if hasattr(x, "dtype") else jax.numpy.result_type(x)
        return tuple(np.shape(x)), str(dtype)

    want, got = by_path(expected), by_path(state)
    out = [f"`{p}` missing" for p in want if p not in got]
    out += [f"`{p}` unexpected" for p in got if p not in want]
    for path in [p for p in want if p in got]:
        (shape, dtype), (shape_wanted, dtype_wanted) = spec(got[path]), spec(want[path])
        if (shape, dtype) != (shape_wanted, dtype_wanted):
            out.append(f"`{path}`: {dtype}{list(shape)} where the step expects "
                       f"{dtype_wanted}{list(shape_wanted)}")  # fmt: skip
    if not out and jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(expected):
        out.append(f"its tree type {type(state).__name__} (the same paths, other containers)")
    return out


def _restore_hint(state: Any) -> str:
    """For a plain dict or list: how to restore a checkpoint as a ``TrainState``."""
    if not isinstance(state, (dict, list, tuple)):
        return ""
    return (
        " A checkpoint restored without `target=` comes back as plain dicts: restore it "
        "with `ckpt.restore(target=state)`, passing the state `parallelize_step` returned."
    )


class StepFn:
    """The training step ``parallelize_step`` returns: ``step_fn(state, batch)``.

    ``describe``/``executable`` show the compiled MPMD program. Every method runs inside the
    ``MultiMesh`` and the registries (``Context``) that were active when the step was built,
    so where it is later called does not change what it does.

    Attributes:
        nonfinite: the ``NonFinite`` mode the step was built with, or ``None``.
        last_check: with ``nonfinite``, the last call's ``StepCheck`` (device scalars
            ``loss``, ``grad_norm``, ``applied``); ``None`` before the first call.
    """

    def __init__(
        self,
        jitted: MpmdJit,
        multi: MultiMesh | None,
        nonfinite: _nonfinite.NonFinite | None = None,
    ) -> None:
        self.jitted = jitted
        self.nonfinite = nonfinite
        self.last_check: _nonfinite.StepCheck | None = None
        # The registries active when the step was built, outermost first (the process-wide
        # default is always active); the MultiMesh goes outside them unless it is one.
        captured = list(reversed(active_contexts()[:-1]))
        if multi is not None and not any(c is multi for c in captured):
            captured.insert(0, multi)
        self._contexts = captured

    def _context(self) -> Any:
        stack = contextlib.ExitStack()
        for context in self._contexts:
            stack.enter_context(context)
        return stack

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        """One training step: ``(loss, new_state)``; ``state`` is donated.

        Raises:
            NonFiniteError: built with ``nonfinite="raise"``, the loss or the gradient norm
                was NaN or inf; ``error.state`` is the unchanged state.
        """
        with self._context():
            out = self.jitted(state, batch)
        if self.nonfinite is None:
            return out
        loss, new_state, checked = out
        self.last_check = checked
        _nonfinite.check(self.nonfinite, new_state, checked)
        return loss, new_state

    @property
    def ahead(self) -> CompileAhead | None:
        """The compile of the step's fragments that ``parallelize_step`` started in a thread
        (``MpmdJit.compile_ahead``: ``ahead.wait()`` waits for it), or ``None``."""
        return self.jitted.ahead

    def executable(self, state: Any, batch: Any) -> Any:
        """The ``MpmdExecutable`` for these argument shapes (compiled on first use)."""
        with self._context():
            return self.jitted.executable(state, batch)

    def build_seconds(self, state: Any, batch: Any) -> dict[str, float]:
        """Seconds spent tracing and partitioning the program for these argument shapes."""
        with self._context():
            return self.jitted.build_seconds(state, batch)

    def describe(self, state: Any, batch: Any) -> str:
        """A readable dump of the program: fragments, transfers, compiles."""
        with self._context():
            return self.jitted.describe(state, batch)


def _derive(jitted: MpmdJit, state: Any, batch_shape: Any) -> tuple[Any, Any]:
    """The state's and the batch's shardings, read from the program the first step runs
    (built here, once: the first call then only compiles and dispatches)."""
    (state_sh, batch_sh), _ = jitted.input_shardings(state, batch_shape)
    return state_sh, batch_sh


@dataclasses.dataclass(frozen=True, repr=False)
class ParallelStep:
    """What `parallelize_step` returns: the compiled step, its placed state, the mesh.

    Attributes:
        step: ``step(state, batch) -> (loss, new_state)`` (a :class:`StepFn`; donates
            ``state``).
        state: the initial :class:`TrainState`, already on its submeshes.
        mesh: the ``MultiMesh`` or ``jax.sharding.Mesh`` the step runs on.
        prepare_batch: with ``local_batch``, ``prepare_batch(local)`` assembles the global
            batch from this process's part in the step's input shardings; else ``None``.

    Unpacking and indexing work as in earlier versions: ``step, state, mesh = ...``, with a
    fourth value, ``prepare_batch``, only when it is not ``None``.
    """

    step: StepFn
    state: Any
    mesh: Any
    prepare_batch: Callable[[Any], Any] | None = None

    def _values(self) -> tuple[Any, ...]:
        values = (self.step, self.state, self.mesh)
        return values if self.prepare_batch is None else (*values, self.prepare_batch)

    def __iter__(self) -> Any:
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())

    def __getitem__(self, index: int | slice) -> Any:
        return self._values()[index]

    def __repr__(self) -> str:
        extra = ", prepare_batch" if self.prepare_batch is not None else ""
        return f"ParallelStep(step, state at step {int(self.state.step)}, mesh{extra})"


def parallelize_step(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh | MultiMesh | None = None,
    global_batch: Any = None,
    local_batch: Any = None,
    replicate_inputs: bool = True,
    *,
    loss_fn: LossFn | None = None,
    rng: jax.Array | None = None,
    pipeline: PipelineOptions | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    interleave: int | None = None,
    custom_schedule: Any = None,
    nonfinite: _nonfinite.NonFinite | str | None = None,
    recompute: Any = None,
    precision: _precision.Precision | str | None = None,
) -> ParallelStep:
    """Builds a placed training state and a compiled MPMD training step.

    Args:
        model: a Flax module instance; its ``Task[Module]`` submodules decide placement.
        optimizer: any optax ``GradientTransformation`` (sgd, adamw, chains, schedules).
        mesh: the devices to run on: a ``jax.sharding.Mesh`` (``TaskMesh`` positions index
            its devices), a ``MultiMesh`` (also made current while tracing, for
            ``mesh_slice`` tasks), or ``None`` (the current ``MultiMesh``, else all devices).
        global_batch: an example global batch (arrays or ``jax.ShapeDtypeStruct``s).
        local_batch: instead of ``global_batch``, this process's part of a batch; the global
            batch stacks every process's part along the leading dimension.
        replicate_inputs: ``True``: batch leaves that the model does not constrain are
            replicated on the submesh that first uses them. ``False``: their leading
            dimension is split over that submesh's devices.
        loss_fn: ``loss_fn(model_fn, batch) -> scalar``; ``model_fn(*args, **kwargs)`` runs
            the model. Default: the model's output is the loss.
        rng: a PRNG key for initialization and dropout (default ``jax.random.key(0)``).
            ``params_key, dropout_key = jax.random.split(rng)``; step ``i`` applies the
            model with the dropout rng ``step_key = fold_in(dropout_key, i)``, and with
            ``microbatches`` microbatch ``k`` of step ``i`` uses ``fold_in(step_key, k)``:
            every step and every microbatch draws its own masks.
        pipeline: the pipeline options as one record (``mm.PipelineOptions``, as
            ``microbatch`` takes it), instead of ``microbatches`` .. ``custom_schedule``
            one by one; it also carries ``costs`` and ``max_in_flight`` for
            ``"zero-bubble-auto"`` and ``"zero-bubble-v"``.
        microbatches: split each batch along its leading dimension into this many
            microbatches and pipeline them (``multimesh_flax.microbatch``); the loss is the
            mean over microbatches, which equals the full-batch mean for mean losses. With
            mutable collections (batch statistics) the last microbatch's update is kept.
        schedule: the pipeline schedule for ``microbatches`` (``"gpipe"``, ``"1f1b"``,
            ``"interleaved-1f1b"``, ``"zero-bubble-h1"``, ``"zero-bubble-h2"``,
            ``"zero-bubble-auto"``, ``"zero-bubble-v"`` (stage s and 2R-1-s on one
            submesh), ``"custom"``; see ``microbatch``; default: program order).
        interleave: stages per submesh for ``"interleaved-1f1b"``.
        custom_schedule: for ``"custom"`` (implies it), one sequence of ops per submesh, as
            ``microbatch``'s ``custom_schedule``.
        nonfinite: ``None`` (default: no check), ``"skip"`` or ``"raise"`` (or a
            ``NonFinite``). The step then computes the global gradient norm and applies the
            update only if it and the loss are finite; otherwise it returns the state it was
            given, unchanged (``state.step`` included: it counts applied updates). With
            ``"skip"`` it returns ``(loss, state)`` as usual (the loss shows the NaN/inf);
            with ``"raise"`` it reads one scalar after each step and raises
            ``NonFiniteError`` (``error.state``: the unchanged state). Either way
            ``step_fn.last_check`` holds the last step's ``StepCheck(loss, grad_norm,
            applied)`` as device scalars. Same program for both modes, compiled once.
        recompute: the recomputation policy of every task of the model that sets none
            itself (``task(..., recompute=...)`` wins; this wins over the
            ``enable_recomputation`` switch): ``None`` (unset), ``False``/``"none"``,
            ``True``/``"full"`` (the backward keeps only each task's inputs), ``"dots"``
            (also matrix products without batch dimensions,
            ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``) or a
            ``jax.checkpoint_policies`` callable. Values and gradients are unchanged; each
            stage keeps fewer activations between its forward and backward units.
        precision: ``"fp32"`` (default, no casts), ``"bf16"`` (float32 parameters and
            optimizer state; parameters and float batch leaves cast to bfloat16 at the
            step's entry, so activations and transfers between stages are bfloat16;
            gradients cast back to float32 per microbatch; float32 loss) or
            ``"pure-bf16"`` (``parallelize_step`` casts the initial parameters to bfloat16
            and builds the optimizer state from them; the step casts float batch leaves;
            float32 loss). A :class:`Precision` works too. Modules that fix their compute
            dtype keep it (see ``multimesh_flax.layers._precision``).

    Returns:
        A :class:`ParallelStep`: ``.step`` (``step(state, batch) -> (loss, new_state)``,
        donates ``state``), ``.state`` (a :class:`TrainState`, a Flax ``TrainState``, already
        on its submeshes), ``.mesh``, and ``.prepare_batch`` with ``local_batch``
        (``prepare_batch(local)`` assembles the global batch in the step's input shardings;
        ``None`` without). It unpacks as ``step, state, mesh`` (``..., prepare_batch`` with
        ``local_batch``), as in earlier versions.

    Raises:
        ParallelizeArgumentError: a model, optimizer, ``loss_fn`` or ``rng`` of the wrong
            kind, neither or both batches, a batch leaf that is not an array, a non-scalar
            loss, a ``microbatches`` count that does not divide the batch, a ``schedule``
            without ``microbatches``, a batch ``replicate_inputs=False`` cannot split, or a
            ``nonfinite`` other than ``None``, ``"skip"``, ``"raise"``, or a ``precision``
            other than ``"fp32"``, ``"bf16"``, ``"pure-bf16"``. The step raises it when
            called with a state of another tree.
        RecomputePolicyError: ``recompute`` is not a policy.
        NonFiniteError: raised by the step (``nonfinite="raise"``), see above.

    Example:
        >>> import optax
        >>> from flax import linen as nn
        >>> import multimesh_flax as mm
        >>> class Net(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         x = mm.layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[0, 1]))(4)(x)
        ...         x = mm.layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[2, 3]))(1)(x)
        ...         return (x ** 2).mean()
        >>> built = mm.layers.parallelize_step(Net(), optax.sgd(0.1), global_batch=jnp.ones((8, 3)))
        >>> built
        ParallelStep(step, state at step 0, mesh)
        >>> sorted(d.id for d in built.state.params["Dense_1"]["kernel"].devices())
        [2, 3]
        >>> loss, state = built.step(built.state, jnp.ones((8, 3)))
        >>> int(state.step)
        1

        Mixed precision with recomputation: bfloat16 compute, float32 state and loss.

        >>> step16, state16, _ = mm.layers.parallelize_step(
        ...     Net(), optax.sgd(0.1), global_batch=jnp.ones((8, 3)), precision="bf16",
        ...     recompute="full")
        >>> loss16, state16 = step16(state16, jnp.ones((8, 3)))
        >>> str(loss16.dtype), str(state16.params["Dense_1"]["kernel"].dtype)
        ('float32', 'float32')
    """
    _check_model_and_optimizer(model, optimizer)
    _check_loss_fn(loss_fn)
    mode = _nonfinite.normalize(nonfinite)
    policy = make_recompute(recompute)
    dtype = _precision.normalize(precision)
    batch = _check_batches(global_batch, local_batch)
    batch_shape = _abstract(batch)
    keywords = {
        "microbatches": microbatches,
        "schedule": schedule,
        "interleave": interleave,
        "custom_schedule": custom_schedule,
    }
    options = pipeline_options(
        pipeline, keywords, "`parallelize_step`", errors.ParallelizeArgumentError
    )
    microbatching = _microbatching(options, batch_shape)
    devices, multi, result_mesh = _devices_of(mesh)
    setup = _Setup(
        model, optimizer, loss_fn or default_loss, rng, microbatching, mode, policy, dtype
    )
    with multi if multi is not None else flag_context(), use_device_list(devices):
        abstract_state = setup.derive_constraints(batch_shape, devices)
        jitted = jit(setup.step, devices=devices, donate_argnums=(0,))
        state_sh, batch_sh = _derive(jitted, abstract_state, batch_shape)
        if not replicate_inputs:
            batch_sh = jax.tree_util.tree_map(
                lambda s, x: _shard_leading(s, x.shape), batch_sh, batch_shape
            )
            setup.batch_constraints = batch_sh
            jitted.clear_cache()  # the step now constrains its batch: a new program
            state_sh, batch_sh = _derive(jitted, abstract_state, batch_shape)
        if mode is not None and setup.pin_state(state_sh):
            jitted.clear_cache()  # the step now keeps every leaf where it came in
            state_sh, batch_sh = _derive(jitted, abstract_state, batch_shape)
        # The step's fragments compile in a thread while the state's initializer compiles
        # and runs here (``MpmdJit.compile_ahead``), the batch in its example's shardings.
        if COMPILE_AHEAD:
            jitted.compile_ahead(abstract_state, batch)
        state = sharded_initializer(
            lambda: setup.make_state(batch_shape), state_sh, program=setup.state_program
        )()
        if jitted.ahead is not None:
            jitted.ahead.widen()  # the initializer has run: the cores are the walk's
    step_fn = StepFn(jitted, multi, mode)
    if local_batch is None:
        return ParallelStep(step_fn, state, result_mesh)

    def prepare_batch(local: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda s, x: jax.make_array_from_process_local_data(s, np.asarray(x)), batch_sh, local
        )

    return ParallelStep(step_fn, state, result_mesh, prepare_batch)
