"""Placement-aware ``tabulate`` for Flax NNX models: ``nnx.tabulate`` plus where every
variable lives.

``get_placement(model, *inputs)`` traces the model's forward pass through the MPMD
partitioner (abstractly: nothing is compiled or allocated) exactly as ``multimesh_flax.jit``
would run it, and reports for every array variable its logical spec (``out_sharding``), its
mesh-axis spec, its task and devices, and its bytes per device. Variables of a ``Task[Block]``
sit on the task's submesh (where they were born); variables outside every task sit where the
program first uses them, and ``get_placement`` moves them there (NNX models have no init
step: making the table places the model, so the table is true before the first step too).
The report is the Linen :class:`~multimesh_flax.layers.Placement`, so the tables and
per-task / per-device totals read the same.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from multimesh_flax import errors
from multimesh_flax.core.declare import find_match, has_registrations
from multimesh_flax.core.front import derive_shardings, shape_structs
from multimesh_flax.core.trace import shape_only_trace, task_for
from multimesh_flax.layers import _nnx_jit, _nnx_task, _placement, _placement_report

# Keyword arguments of ``nnx.tabulate`` (everything else goes to the model's call).
_NNX_TABULATE_OPTIONS = frozenset(
    {
        "depth",
        "method",
        "row_filter",
        "table_kwargs",
        "column_kwargs",
        "console_kwargs",
        "compute_flops",
        "compute_vjp_flops",
    }
)


def _task_names(model: nnx.Module) -> list[tuple[tuple[Any, ...], str]]:
    """``(module path, task name)`` of every ``Task[Block]`` in ``model``, innermost last.

    An unnamed task is shown by its attribute path (``blocks/0``), the name a reader finds
    in the model."""
    found = []
    for path, module in nnx.iter_modules(model):
        spec = _nnx_task.task_spec_of(module)
        if spec is None and path and has_registrations():  # register_task by path
            match = find_match("/".join(map(str, path)), str(path[-1]), module_class=type(module))
            spec = None if match is None else task_for(match, False)
        if spec is not None:
            where = "/".join(map(str, path)) or type(module).wrapped_module.__name__
            found.append((tuple(path), spec.name or where))  # unnamed: its attribute path
    return sorted(found, key=lambda item: len(item[0]))


def _owner(path: tuple[Any, ...], tasks: list[tuple[tuple[Any, ...], str]]) -> str | None:
    owner = None
    for prefix, name in tasks:
        if path[: len(prefix)] == prefix:
            owner = name
    return owner


def _is_array_variable(variable: Any) -> bool:
    value = variable.get_value()
    dtype = getattr(value, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def get_placement(model: nnx.Module, *args: Any, **kwargs: Any) -> _placement_report.Placement:
    """Traces ``model(*args, **kwargs)`` and reports where each variable lives.

    A ``Task[Block]``'s variables were born on its submesh; a variable no task owns is
    moved here to where the program first reads it (as the first ``mm.jit`` call would),
    so the report is the live placement from now on, before and after steps.

    Args:
        model: an NNX module instance.
        *args: example inputs (arrays or ``jax.ShapeDtypeStruct``s).
        **kwargs: keyword arguments of the model's ``__call__``.

    Returns:
        A :class:`~multimesh_flax.layers.Placement`.

    Example:
        >>> from flax import nnx
        >>> import multimesh_flax as mm
        >>> Linear = mm.task(nnx.Linear, mesh=mm.TaskMesh(devices=[2, 3], axis_names=("x",)))
        >>> layer = Linear(3, 8, kernel_init=mm.shard_axes(None, "x"), rngs=nnx.Rngs(0))
        >>> placement = mm.layers.get_placement(layer, jnp.ones((4, 3)))
        >>> [(p.path, p.mesh_spec, p.device_ids, p.bytes_per_device) for p in placement.params]
        [('bias', P(), (2, 3), 32), ('kernel', P(None, 'x'), (2, 3), 48)]
    """
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    abstract, abstract_args = _abstract(state), _abstract(args)

    def forward(state: Any, inputs: Any) -> Any:
        merged = nnx.merge(graphdef, _nnx_jit.pin(state))
        _nnx_task.enter_registered_tasks([merged])
        return merged(*inputs, **kwargs)

    derived = derive_shardings(forward, (abstract, abstract_args), None)[: len(flat)]
    _place_unowned(model, flat, derived)
    tasks = _task_names(model)
    rows = []
    for (path, variable), sharding in zip(flat, derived, strict=True):
        if not _is_array_variable(variable):
            continue
        names = variable.get_metadata().get("out_sharding")
        value = variable.get_value()
        rows.append(
            _placement.ParamPlacement(
                path="/".join(map(str, path)),
                shape=tuple(np.shape(value)),
                dtype=np.dtype(value.dtype),
                logical=None if names is None else PartitionSpec(*names),
                task=_owner(tuple(path), tasks),
                sharding=sharding,
            )
        )
    return _placement_report.Placement(params=tuple(rows))


def _place_unowned(model: nnx.Module, flat: list[Any], shardings: list[Any]) -> None:
    """Moves every variable no task owns to where the program reads it, as ``mm.jit``
    would on its first call: NNX has no init step, so a model is placed when its table
    is made, and what the table says is where the variables live from then on."""
    placed = [
        (path, _nnx_jit.placed_unowned(variable, sharding))
        for (path, variable), sharding in zip(flat, shardings, strict=True)
    ]
    if any(new is not old for (_, new), (_, old) in zip(placed, flat, strict=True)):
        nnx.update(model, nnx.from_flat_state(placed))


def tabulate(model: nnx.Module, *args: Any, **kwargs: Any) -> str:
    """``nnx.tabulate``'s table followed by the placement of every variable.

    Args:
        model: an NNX module instance (a ``Task[Block]`` or a model holding some).
        *args: example inputs (arrays or ``jax.ShapeDtypeStruct``s).
        **kwargs: keyword arguments of the model's ``__call__``, and ``nnx.tabulate``
            options (``depth``, ``console_kwargs``, ...); ``console_kwargs={"width": 200}``
            widens both tables (default 120 characters; paths wrap, never cut).

    Returns:
        The tables as one string: NNX's summary, then per variable its logical spec, mesh
        spec, task, devices and bytes per device, then totals per task and per device.

    Raises:
        TaskTypeError: ``model`` is an NNX module class, not an instance.

    Example:
        >>> from flax import nnx
        >>> import multimesh_flax as mm
        >>> Linear = mm.task(nnx.Linear, mesh=mm.TaskMesh(devices=[2, 3], axis_names=("x",)))
        >>> text = mm.tabulate(Linear(3, 8, rngs=nnx.Rngs(0)), jnp.ones((4, 3)))
        >>> "Linear" in text and "Parameter placement" in text and "Per device" in text
        True
    """
    if not isinstance(model, nnx.Module):
        raise errors.TaskTypeError(
            f"Expected `model` to be an NNX module instance such as `Block(cfg, rngs=rngs)`, "
            f"got {_placement_report.describe_value(model)}. Construct the model first."
        )
    options = {k: v for k, v in kwargs.items() if k in _NNX_TABULATE_OPTIONS}
    call_kwargs = {k: v for k, v in kwargs.items() if k not in _NNX_TABULATE_OPTIONS}
    console = {"force_terminal": False, "width": 120, **options.get("console_kwargs", {})}
    options["console_kwargs"] = console
    placement = get_placement(model, *args, **call_kwargs)
    return f"{_summary(model, args, options, call_kwargs)}\n{placement.render(console['width'])}"


_abstract = shape_structs


def _summary(model: nnx.Module, args: Any, options: Any, call_kwargs: Any) -> str:
    """``nnx.tabulate`` of ``model`` under ``jax.eval_shape``: NNX's table runs the model,
    which cannot mix variables on several submeshes in one ``jax.jit``; traced on abstract
    values it only reads shapes, and nothing is computed."""
    graphdef, state = nnx.split(model)
    tables: list[str] = []

    def run(state: Any, inputs: Any) -> None:
        tables.append(nnx.tabulate(nnx.merge(graphdef, state), *inputs, **options, **call_kwargs))

    with shape_only_trace():  # NNX's table traces the model; nothing is placed there
        jax.eval_shape(run, _abstract(state), _abstract(args))
    return tables[0]
