"""Recomputation: which activations a task's backward pass keeps, and the one wrapper that
applies it to every kind of task.

A task's forward normally hands every activation its backward needs to the backward unit,
and a pipeline keeps them alive until that unit runs. With recomputation the task's body is
wrapped in ``jax.checkpoint``: the backward receives only what the *policy* saves (at least
the task's inputs) and recomputes the rest.

**Policies** (:func:`make_recompute` turns a user's value into a :class:`Recompute`):

* ``None`` -- unset: inherit (see the precedence below);
* ``False`` or ``"none"`` -- off, even where an outer setting turns it on;
* ``True`` or ``"full"`` -- keep only the task's inputs, recompute everything else;
* ``"dots"`` -- also keep the outputs of matrix products without batch dimensions
  (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``): a dense layer's ``x @ w``
  is kept, while the attention scores ``q @ k`` (batched over heads) and every elementwise
  result are recomputed. It trades less compute than ``"full"`` for more memory;
* any ``jax.checkpoint_policies`` callable (``checkpoint_dots``, ``save_only_these_names(...)``).

**Precedence**, most specific first (:func:`effective`):

1. the task's own ``recompute`` (``task(..., recompute=...)``, ``Task(recompute=...)``,
   including a registered task's), ``False`` included;
2. the step-wide policy of ``parallelize_step(..., recompute=...)`` (:func:`step_policy`);
3. the ``enable_recomputation()`` switch, which means ``"full"``;
4. off.

**One wrapper.** Function tasks, Linen ``Task[Module]`` and NNX ``Task[Block]`` all run
their body through :func:`call_recomputed`, which closes over the arguments that are not arrays and
hands the rest to a *transform*: ``jax.checkpoint`` for functions (:func:`jax_transform`),
Flax's lifted ``nn.checkpoint`` for Linen modules (:func:`linen_transform`, the module's
variables become inputs of the checkpointed body) and ``jax.checkpoint`` over the module's
state, split and merged, for NNX (:func:`nnx_transform`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax import nnx

from multimesh_flax import errors
from multimesh_flax.core.declare import _config, _thread

Policy = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Recompute:
    """A recomputation policy: ``name`` for display, ``policy`` for ``jax.checkpoint``.

    ``policy=None`` with ``name="full"`` saves nothing but the inputs; ``name="none"`` is off.
    """

    name: str
    policy: Policy | None = None

    @property
    def enabled(self) -> bool:
        """Whether the task's body is wrapped in a checkpoint."""
        return self.name != "none"


OFF = Recompute("none")
FULL = Recompute("full")
DOTS = Recompute("dots", jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
_NAMED = {"none": OFF, "full": FULL, "dots": DOTS}


def make_recompute(value: Any, argument: str = "recompute") -> Recompute | None:
    """The :class:`Recompute` a user's ``recompute`` value stands for (``None``: unset).

    Raises:
        RecomputePolicyError: ``value`` is none of the accepted forms.

    Example:
        >>> make_recompute(True).name, make_recompute("dots").name, make_recompute(None)
        ('full', 'dots', None)
    """
    if value is None or isinstance(value, Recompute):
        return value
    if isinstance(value, (bool, np.bool_)):
        return FULL if value else OFF
    if isinstance(value, str) and value in _NAMED:
        return _NAMED[value]
    if callable(value) and not isinstance(value, (str, type)):
        return Recompute(getattr(value, "__name__", repr(value)), value)
    raise errors.RecomputePolicyError(
        f"Expected `{argument}` to be None, False/'none', True/'full', 'dots' or a "
        f"jax.checkpoint_policies callable, got {type(value).__name__}: {value!r}. Pass e.g. "
        f"`{argument}='full'` to keep only each task's inputs, or "
        f"`{argument}=jax.checkpoint_policies.checkpoint_dots`."
    )


@contextlib.contextmanager
def step_policy(setting: Recompute | None) -> Iterator[None]:
    """Makes ``setting`` the policy of every task traced inside that sets none itself
    (``parallelize_step``'s ``recompute``); ``None`` changes nothing."""
    _thread.STATE.recompute.append(setting)
    try:
        yield
    finally:
        _thread.STATE.recompute.pop()


def effective(setting: Recompute | None) -> Recompute:
    """The policy a task with its own ``setting`` runs with (the precedence above)."""
    if setting is not None:
        return setting
    for outer in reversed(_thread.STATE.recompute):
        if outer is not None:
            return outer
    return FULL if _config.get_flag("enable_recomputation") else OFF


# --- the one wrapper ----------------------------------------------------------------------

RecomputeTransform = Callable[[Callable[..., Any], Recompute], Callable[..., Any]]


def jax_transform(body: Callable[..., Any], recompute: Recompute) -> Callable[..., Any]:
    """``jax.checkpoint`` of ``body`` (a function task's transform)."""
    return jax.checkpoint(body, policy=recompute.policy, prevent_cse=True)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def call_recomputed(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    setting: Recompute | None,
    transform: RecomputeTransform = jax_transform,
) -> Any:
    """``fun(*args, **kwargs)``, recomputed in the backward pass if the effective policy of
    ``setting`` says so.

    Only array leaves of the arguments and results cross the checkpoint; everything else
    (flags such as ``deterministic=True``, ``None`` results) is closed over, as a plain call
    would see it.

    Example:
        >>> f = lambda x, square: x**2 if square else x
        >>> jaxpr = jax.make_jaxpr(jax.grad(lambda x: call_recomputed(f, (x, True), {}, FULL)))(1.0)
        >>> "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)
        True
    """
    recompute = effective(setting)
    if not recompute.enabled:
        return fun(*args, **kwargs)
    return call_on_arrays(fun, args, kwargs, lambda body: transform(body, recompute))


def call_on_arrays(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    transform: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> Any:
    """``transform(body)(*arrays)`` where ``body(*arrays)`` is ``fun(*args, **kwargs)`` with
    the array leaves of the arguments (and of the result) as its only inputs (and outputs).

    Everything else is closed over, as a plain call would see it. :func:`call_recomputed` hands a
    checkpoint to it.

    Example:
        >>> call_on_arrays(lambda x, n: x * n, (np.ones(2), 3), {}, jax.jit).tolist()
        [3.0, 3.0]
    """
    leaves, tree = jax.tree_util.tree_flatten((tuple(args), kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    results: dict[str, Any] = {}

    def body(*values: Any) -> list[Any]:
        filled = list(leaves)
        for i, value in zip(dynamic, values, strict=True):
            filled[i] = value
        inner_args, inner_kwargs = jax.tree_util.tree_unflatten(tree, filled)
        out_leaves, out_tree = jax.tree_util.tree_flatten(fun(*inner_args, **inner_kwargs))
        results["leaves"], results["tree"] = out_leaves, out_tree  # the static ones are kept
        return [leaf for leaf in out_leaves if _is_array(leaf)]

    arrays = iter(transform(body)(*[leaves[i] for i in dynamic]))
    out = [next(arrays) if _is_array(leaf) else leaf for leaf in results["leaves"]]
    return jax.tree_util.tree_unflatten(results["tree"], out)


def linen_transform(
    module: nn.Module, method: Callable[..., Any]
) -> tuple[Any, RecomputeTransform]:
    """``(fun, transform)`` for :func:`call_recomputed` running ``method(module, ...)`` of a
    Linen module.

    Flax refuses module variables read across a plain ``jax.checkpoint``; its lifted
    ``nn.checkpoint`` passes them in as inputs and hands the body a clone of ``module`` bound
    to the checkpoint's scope, which ``fun`` then calls ``method`` on.
    """
    bound = [module]

    def fun(*args: Any, **kwargs: Any) -> Any:
        return method(bound[-1], *args, **kwargs)

    def transform(body: Callable[..., Any], recompute: Recompute) -> Callable[..., Any]:
        def on_clone(clone: nn.Module, *values: Any) -> Any:
            bound.append(clone)
            try:
                return body(*values)
            finally:
                bound.pop()

        lifted = nn.checkpoint(on_clone, policy=recompute.policy, prevent_cse=True)
        return lambda *values: lifted(module, *values)

    return fun, transform


def nnx_transform(module: nnx.Module, method: Callable[..., Any]) -> tuple[Any, RecomputeTransform]:
    """``(fun, transform)`` for :func:`call_recomputed` running ``method(module, ...)`` of an
    NNX module.

    NNX refuses writes to a variable from another trace level, so the module's state goes
    into the checkpointed body as inputs, where ``method`` runs on a copy merged from it;
    values the body writes (an ``Rngs`` counter, batch statistics) come out as results and
    are written back into ``module`` outside.
    """
    bound = [module]

    def fun(*args: Any, **kwargs: Any) -> Any:
        return method(bound[-1], *args, **kwargs)

    def transform(body: Callable[..., Any], recompute: Recompute) -> Callable[..., Any]:
        graphdef, state = nnx.split(module)
        leaves, tree = jax.tree_util.tree_flatten(state)

        def on_copy(values: list[Any], *inputs: Any) -> tuple[Any, dict[int, Any]]:
            copy = nnx.merge(graphdef, jax.tree_util.tree_unflatten(tree, values))
            bound.append(copy)
            try:
                out = body(*inputs)
            finally:
                bound.pop()
            after = jax.tree_util.tree_leaves(nnx.state(copy))
            written = {
                i: new
                for i, (new, old) in enumerate(zip(after, values, strict=True))
                if new is not old
            }
            return out, written

        checkpointed = jax.checkpoint(on_copy, policy=recompute.policy, prevent_cse=True)

        def run(*inputs: Any) -> Any:
            out, written = checkpointed(leaves, *inputs)
            if written:
                updated = [written.get(i, leaf) for i, leaf in enumerate(leaves)]
                nnx.update(module, jax.tree_util.tree_unflatten(tree, updated))
            return out

        return run

    return fun, transform
