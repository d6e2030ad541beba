"""Placement-aware ``tabulate``: Flax's table plus where every parameter lives.

``get_placement(model, rngs, *args)`` traces the model (``init`` abstractly, then the forward
pass through the MPMD partitioner) without compiling or allocating anything, and returns a
:class:`Placement`: for every parameter its logical spec, its mesh-axis spec, its task and
device ids and its bytes per device, with totals per task and per device. Parameters of a
``Task[Module]`` sit on the task's submesh; parameters outside every task sit where the
program first uses them -- exactly what ``parallelize_step`` will do.

``tabulate`` returns Flax's own summary followed by that placement table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn

from multimesh_flax import errors
from multimesh_flax.core.front import derive_shardings, shape_structs
from multimesh_flax.core.trace import shape_only_trace
from multimesh_flax.layers import _nnx_tabulate, _placement, _placement_report
from multimesh_flax.layers._placement_report import Placement

# Keyword arguments of ``flax.linen.Module.tabulate`` (everything else goes to the model).
_FLAX_TABULATE_OPTIONS = frozenset(
    {
        "depth",
        "show_repeated",
        "mutable",
        "console_kwargs",
        "table_kwargs",
        "column_kwargs",
        "compute_flops",
        "compute_vjp_flops",
    }
)


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    flax_options = {k: v for k, v in kwargs.items() if k in _FLAX_TABULATE_OPTIONS}
    model_kwargs = {k: v for k, v in kwargs.items() if k not in _FLAX_TABULATE_OPTIONS}
    return flax_options, model_kwargs


def _apply_rngs(rngs: Any) -> Any:
    return rngs if isinstance(rngs, dict) else {"dropout": rngs}


def get_placement(model: nn.Module, rngs: Any, *args: Any, **kwargs: Any) -> Placement:
    """Traces ``model`` and reports where each parameter lives; compiles nothing.

    Args:
        model: a Flax module instance.
        rngs: a PRNG key or a dict of keys, as for ``model.init``.
        *args: example inputs (arrays or ``jax.ShapeDtypeStruct``s).
        **kwargs: keyword arguments of the model's ``__call__``.

    Returns:
        A :class:`Placement`.

    Example:
        >>> from flax import linen as nn
        >>> import multimesh_flax as mm
        >>> Dense = mm.layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[2, 3], axis_names=("x",)))
        >>> model = Dense(features=8, kernel_init=mm.shard_axes(None, "x"))
        >>> placement = mm.layers.get_placement(model, jax.random.key(0), jnp.ones((4, 3)))
        >>> [(p.path, p.mesh_spec, p.device_ids, p.bytes_per_device) for p in placement.params]
        [('bias', P(), (2, 3), 32), ('kernel', P(None, 'x'), (2, 3), 48)]
    """
    if _is_nnx(model):  # an NNX model takes no rngs: ``rngs`` is its first input
        return _nnx_tabulate.get_placement(model, rngs, *args, **kwargs)
    boxed, owners, registered = _placement.trace_variables(model.init, rngs, *args, **kwargs)
    boxed_params = boxed.get("params", {})
    problems: dict[tuple[str, ...], str] = {}
    task_sh, found = _placement.owner_shardings(
        boxed_params, owners, None, problems, registered=registered
    )
    every_owner = {**registered, **owners}
    params = nn.meta.unbox(boxed_params)
    others = nn.meta.unbox({k: v for k, v in boxed.items() if k != "params"})

    def forward(p: Any, collections: Any, inputs: Any) -> Any:
        # The other collections (``batch_stats``, ``cache``) are inputs too, not constants:
        # they are abstract here, and a layer such as BatchNorm computes with them. They
        # are mutable, as ``parallelize_step`` applies the model in training.
        p = _placement.constrain(p, task_sh, found)
        return model.apply(
            {"params": p, **collections},
            *inputs,
            rngs=_apply_rngs(rngs),
            mutable=sorted(collections),
            **kwargs,
        )

    abstract_args = shape_structs(args)
    derived = derive_shardings(forward, (params, others, abstract_args), None)
    flat_params, _ = jax.tree_util.tree_flatten_with_path(params)
    rows = []
    for (path, leaf), sharding in zip(flat_params, derived[: len(flat_params)], strict=True):
        owner = _placement.owner_of(_placement.path_keys(path), every_owner)
        box = _box_at(boxed_params, path)
        rows.append(
            _placement.ParamPlacement(
                path="/".join(_placement.path_keys(path)),
                shape=tuple(leaf.shape),
                dtype=np.dtype(leaf.dtype),
                logical=_placement.logical_spec(box),
                task=None if owner is None else (owner[1].name or "task"),
                sharding=sharding,
                problem=problems.get(_placement.path_keys(path)),
            )
        )
    return Placement(params=tuple(rows))


def _box_at(tree: Any, path: Sequence[Any]) -> Any:
    for key in _placement.path_keys(path):
        tree = tree[key]
    return tree


def _is_nnx(model: Any) -> bool:
    """An NNX module instance or class (``tabulate`` takes the NNX form for both)."""
    from flax import nnx

    cls = model if isinstance(model, type) else type(model)
    return issubclass(cls, nnx.Module)


def tabulate(model: nn.Module, rngs: Any, *args: Any, **kwargs: Any) -> str:
    """Flax's ``model.tabulate`` table followed by the placement of every parameter.

    Only traces: nothing is compiled or allocated on the devices.

    Args:
        model: a Flax module instance.
        rngs: a PRNG key or a dict of keys, as for ``model.init``.
        *args: example inputs (arrays or ``jax.ShapeDtypeStruct``s).
        **kwargs: keyword arguments of the model's ``__call__``, and ``Module.tabulate``
            options (``depth``, ``console_kwargs``, ...); ``console_kwargs={"width": 200}``
            widens both tables (default 120 characters; paths wrap, never cut).

    Returns:
        The tables as one string.

    Raises:
        TaskTypeError: ``model`` is a module class or anything else but a module instance.

    Example:
        >>> from flax import linen as nn
        >>> import multimesh_flax as mm
        >>> Dense = mm.layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[2, 3], axis_names=("x",)))
        >>> text = mm.layers.tabulate(Dense(8), jax.random.key(0), jnp.ones((4, 3)))
        >>> "Task[Dense] Summary" in text and "Parameter placement" in text
        True
    """
    if _is_nnx(model):  # ``tabulate(nnx_model, *inputs)``: ``rngs`` is the first input
        return _nnx_tabulate.tabulate(model, rngs, *args, **kwargs)
    if not isinstance(model, nn.Module):
        raise errors.TaskTypeError(
            f"Expected `model` to be a Flax module instance such as `MLP(features=16)`, got "
            f"{_placement_report.describe_value(model)}. Instantiate the class first."
        )
    flax_options, model_kwargs = _split_kwargs(kwargs)
    console = {"force_terminal": False, "width": 120, **flax_options.get("console_kwargs", {})}
    flax_options["console_kwargs"] = console
    with shape_only_trace():  # Flax's table traces the model; nothing is placed there
        summary = model.tabulate(rngs, *args, **flax_options, **model_kwargs)
    placement = get_placement(model, rngs, *args, **model_kwargs)
    return summary + "\n" + placement.render(console["width"])
