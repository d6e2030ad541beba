"""Where a Flax model's parameters live: task ownership, shardings, bytes per device.

A parameter belongs to the innermost ``Task[Module]`` whose module path is a prefix of the
parameter's path (``layer_0/Dense_0/kernel`` belongs to the task module at ``layer_0``). Its
sharding is its logical names (``shard_axes``/``nn.with_logical_partitioning``) resolved by
that task's rules on that task's submesh. Parameters outside every task have no owner: the
MPMD program places them on the submesh of their first consumer, replicated.

``trace_variables`` finds owners and logical names by tracing ``init`` abstractly (nothing is
compiled or allocated); ``owner_shardings`` turns them into ``NamedSharding``s; ``constrain``
applies those shardings inside a traced step so the program keeps every parameter (and the
optimizer state that mirrors it) where its task is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    Task,
    find_match,
    get_flag,
    logical_to_mesh_spec,
    use_device_list,
)
from multimesh_flax.core.fragment import canonical_sharding
from multimesh_flax.core.trace import (
    enter_task,
    module_names,
    resolve_task,
    shape_only_trace,
    task_for,
)
from multimesh_flax.layers import _task as _flax_task

ModulePath = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Owner:
    """The task a parameter belongs to, resolved to a mesh and rules."""

    name: str
    mesh: jax.sharding.Mesh
    rules: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class ParamPlacement:
    """One parameter: its path, shape, logical spec, task and sharding."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    logical: PartitionSpec | None
    task: str | None
    sharding: NamedSharding
    problem: str | None = None  # why the logical spec could not be applied, if it could not

    @property
    def mesh_spec(self) -> PartitionSpec:
        return self.sharding.spec

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(sorted(d.id for d in self.sharding.device_set))

    @property
    def bytes_per_device(self) -> int:
        shard = self.sharding.shard_shape(self.shape)
        return int(math.prod(shard)) * np.dtype(self.dtype).itemsize


def path_keys(path: Sequence[Any]) -> tuple[str, ...]:
    """``('layer_0', 'kernel')`` from a ``tree_flatten_with_path`` key path."""
    out = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                out.append(str(getattr(key, attr)))
                break
        else:
            out.append(str(key))
    return tuple(out)


def _registered_owner(owners: dict[ModulePath, Task]) -> Callable[..., Any]:
    """A Flax interceptor recording modules that ``register_task`` matches."""

    def intercept(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        match = find_match(*module_names(module), module_class=type(module))
        if match is not None and module.scope is not None:
            spec = task_for(match, False)
            named = spec if spec.name else dataclasses.replace(spec, name=match.name)
            owners.setdefault(tuple(module.path), named)
        return next_fun(*args, **kwargs)

    return intercept


@contextlib.contextmanager
def recording_owners() -> Iterator[tuple[dict[ModulePath, Task], dict[ModulePath, Task]]]:
    """``(owners, registered)``, filled by the modules called in the block: ``Task[Module]``
    modules by path, and modules that ``register_task`` places (under ``ignore_transforms``
    too: the tasks are recorded, not run as tasks)."""
    registered: dict[ModulePath, Task] = {}
    with (
        _flax_task.record_task_paths() as owners,
        nn.intercept_methods(_registered_owner(registered)),
    ):
        yield owners, registered


def abstract(tree: Any) -> Any:
    """``tree`` with each array (a tracer, too) as a ``ShapeDtypeStruct``, boxes kept."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def trace_variables(
    init: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[Any, dict[ModulePath, Task], dict[ModulePath, Task]]:
    """Abstract (boxed) variables of ``init(*args, **kwargs)`` and the task module paths:
    ``Task[Module]`` modules, and modules placed by ``register_task``."""
    with (
        recording_owners() as (owners, registered),
        shape_only_trace(),  # tasks are not placed here, by design
    ):
        variables = jax.eval_shape(lambda *a: init(*a, **kwargs), *args)
    return variables, owners, registered


def owner_of(
    param_path: ModulePath, owners: Mapping[ModulePath, Task]
) -> tuple[ModulePath, Task] | None:
    """``(module path, Task)`` of the innermost task module containing ``param_path``."""
    best: tuple[ModulePath, Task] | None = None
    for module_path, spec in owners.items():
        n = len(module_path)
        if param_path[:n] == module_path and (best is None or n > len(best[0])):
            best = (module_path, spec)
    return best


def resolve_owners(owners: Mapping[ModulePath, Task], devices: Any) -> dict[Any, Owner]:
    """Resolves each distinct ``Task`` to its mesh and rules for the device list."""
    resolved: dict[Any, Owner] = {}
    with use_device_list(devices):
        for spec in owners.values():
            if id(spec) not in resolved:
                r = resolve_task(spec, spec.name or "task")
                resolved[id(spec)] = Owner(name=r.name, mesh=r.mesh, rules=r.rules)
    return resolved


def logical_spec(leaf: Any) -> PartitionSpec | None:
    if isinstance(leaf, nn.LogicallyPartitioned):
        return PartitionSpec(*leaf.names)
    return None


def owner_shardings(
    boxed_params: Any,
    owners: Mapping[ModulePath, Task],
    devices: Any,
    problems: dict[tuple[str, ...], str] | None = None,
    registered: Mapping[ModulePath, Task] | None = None,
) -> tuple[Any, Any]:
    """Per parameter leaf: its owner's ``NamedSharding``, and its owner ``(path, Task)``.

    Both are ``None`` for parameters outside every task. Returns two trees with the
    structure of the *unboxed* parameters. A logical spec that cannot be applied raises,
    unless ``problems`` is given: then the message is stored there under the parameter's
    path and the parameter is left unconstrained.
    """
    registered = registered or {}
    resolved = resolve_owners({**registered, **owners}, devices)
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(boxed_params, is_leaf=is_box)
    shardings, found = [], []
    for path, leaf in flat:
        hit = owner_of(path_keys(path), {**registered, **owners})
        # A registered task's constraint is traced as glue (it lands at its first use).
        found.append(None if hit is None or hit[0] not in owners else hit)
        if hit is None:
            shardings.append(None)
            continue
        owner = resolved[id(hit[1])]
        value = leaf.value if is_box(leaf) else leaf
        logical = logical_spec(leaf) or PartitionSpec()
        try:
            mesh_spec = logical_to_mesh_spec(
                logical, value.shape, dict(owner.mesh.shape), owner.rules
            )
        except errors.MultiMeshError as error:
            if problems is None:
                raise
            problems[path_keys(path)] = str(error)
            shardings.append(None)
            continue
        shardings.append(canonical_sharding(NamedSharding(owner.mesh, mesh_spec)))
    return treedef.unflatten(shardings), treedef.unflatten(found)


def mirror(tree: Any, params: Any, per_param: Any) -> Any:
    """Per-parameter values (shardings, owners) carried over to leaves that mirror them.

    A leaf of ``tree`` (e.g. optimizer state) whose key path ends with a parameter's key
    path and has its shape (Adam's ``mu`` and ``nu``, momentum, ...) gets that parameter's
    entry of ``per_param``; other leaves get ``None``.
    """
    by_path: dict[tuple[str, ...], tuple[tuple[int, ...], Any]] = {}
    flat_params, treedef = jax.tree_util.tree_flatten_with_path(params)
    for (path, leaf), value in zip(flat_params, treedef.flatten_up_to(per_param), strict=True):
        by_path[path_keys(path)] = (tuple(np.shape(leaf)), value)

    def match(path: Any, leaf: Any) -> Any:
        keys = path_keys(path)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and hit[0] == tuple(np.shape(leaf)):
                return hit[1]
        return None

    return jax.tree_util.tree_map_with_path(match, tree)


def _is_owner(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], Task))


def constrain(tree: Any, shardings: Any, owners: Any = None) -> Any:
    """Applies ``shardings`` (a tree of ``NamedSharding`` or ``None``) inside a trace.

    With ``owners`` (a tree of ``(module path, Task)`` or ``None``, as from
    ``owner_shardings``), each constraint is traced inside its owner's task, so it runs in
    that task's first fragment instead of a separate one.
    """
    if get_flag("ignore_transforms"):
        return tree
    flat, treedef = jax.tree_util.tree_flatten(tree)
    flat_shardings = treedef.flatten_up_to(shardings)
    flat_owners = [None] * len(flat) if owners is None else treedef.flatten_up_to(owners)
    out = []
    for x, sharding, owner in zip(flat, flat_shardings, flat_owners, strict=True):
        if sharding is None:
            out.append(x)
        elif owner is None:
            out.append(jax.lax.with_sharding_constraint(x, sharding))
        else:
            with enter_task(_flax_task.resolve_path(owner[1], owner[0])):
                out.append(jax.lax.with_sharding_constraint(x, sharding))
    return treedef.unflatten(out)
