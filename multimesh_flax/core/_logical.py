"""Logical sharding: mapping logical axis names onto a task's mesh axes.

Users annotate arrays with *logical* names (``P("batch", "embed")``); each task maps them to
its own mesh axes through priority-ordered rules ``(logical_name, mesh_axis)``.
:func:`logical_to_mesh_spec` implements the resolution; :func:`with_sharding_constraint`
applies it to arrays, inside a task, and does what the current contexts say elsewhere.

Resolution, for one array:

1. Rules apply in priority order. A rule ``(name, axis)`` shards every dimension whose
   logical entry contains ``name`` over ``axis``; several rules for one name accumulate
   (``("batch", "data"), ("batch", "fsdp")`` shards batch over both).
2. A mesh axis is used at most once per array: a rule whose axis is taken is skipped.
3. A rule is skipped if the dimension's accumulated shard count would exceed its size.
4. A dimension the accumulated count does not divide raises ``UnevenShardingError``.
5. Logical names no rule maps are replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax._src import source_info_util
from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax import errors
from multimesh_flax.core import _config, _named_tasks, _task, _warnings


def _entry_names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _rule_axes(axes: Any) -> tuple[str, ...]:
    return _entry_names(axes)


def logical_to_mesh_spec(
    logical: PartitionSpec,
    shape: Sequence[int],
    mesh_shape: Mapping[str, int],
    rules: Sequence[tuple[str, Any]],
) -> PartitionSpec:
    """Resolves a logical ``PartitionSpec`` for an array of ``shape`` on a mesh.

    Args:
        logical: one entry per leading dimension: ``None``, a logical name, or a tuple.
        shape: the array's shape.
        mesh_shape: ``{mesh_axis: size}`` of the target mesh.
        rules: priority-ordered ``(logical_name, mesh_axis)`` pairs; ``mesh_axis`` may be
            ``None`` (replicate) or a tuple of axes.

    Returns:
        A ``PartitionSpec`` over mesh axis names, one entry per dimension.

    Raises:
        PartitionSpecError: ``logical`` is not a ``PartitionSpec``, or has more entries than
            dimensions.
        LogicalRulesError: malformed ``rules``, or a rule names an axis ``mesh_shape`` lacks.
        UnevenShardingError: a dimension does not divide its shard count.

    Example:
        >>> rules = [("batch", "x"), ("model", "x")]
        >>> logical_to_mesh_spec(P("batch", "model"), (16, 8), {"x": 8}, rules)
        P('x', None)
        >>> logical_to_mesh_spec(P(None, "model"), (16, 8), {"x": 8}, rules)
        P(None, 'x')
    """
    if not isinstance(logical, (PartitionSpec, tuple, list)):
        raise errors.PartitionSpecError(
            f"Expected `logical` as a PartitionSpec over logical names, got "
            f"{type(logical).__name__}: {logical!r}. Write P({logical!r}) for one dimension."
        )
    rules = _task.normalise_rules(rules, "rules")
    entries = tuple(logical)
    if len(entries) > len(shape):
        raise errors.PartitionSpecError(
            f"Expected at most {len(shape)} entries for an array of shape {tuple(shape)}, "
            f"got {logical}. Drop the extra entries."
        )
    dims = [_entry_names(e) for e in entries] + [()] * (len(shape) - len(entries))
    _check_rule_axes(rules, mesh_shape)
    assigned: list[list[str]] = [[] for _ in shape]
    used: set[str] = set()
    for name, axes in rules:
        axes = _rule_axes(axes)
        if not axes or any(a in used for a in axes):
            continue
        for d, names in enumerate(dims):
            if name not in names or any(a in used for a in axes):
                continue
            count = math.prod(mesh_shape[a] for a in assigned[d] + list(axes))
            if count > shape[d]:
                continue
            assigned[d].extend(axes)
            used.update(axes)
    for d, axes in enumerate(assigned):
        count = math.prod(mesh_shape[a] for a in axes)
        if axes and shape[d] % count:
            raise errors.UnevenShardingError(
                f"Dimension {d} of size {shape[d]} (logical {entries[d]!r}) does not divide "
                f"evenly over mesh axes {tuple(axes)} ({count} shards). Pad it to a multiple "
                f"of {count} or map {entries[d]!r} to a smaller mesh axis."
            )
    return PartitionSpec(*(_spec_entry(a) for a in assigned))


def _check_rule_axes(rules: Sequence[tuple[str, Any]], mesh_shape: Mapping[str, int]) -> None:
    for name, axes in rules:
        unknown = [a for a in _rule_axes(axes) if a not in mesh_shape]
        if unknown:
            raise errors.LogicalRulesError(
                f"Rule ({name!r}, {axes!r}) names mesh axis {unknown[0]!r}, but the mesh has "
                f"axes {tuple(mesh_shape)}. Map logical names onto those axes."
            )


def _spec_entry(axes: list[str]) -> Any:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _check_specs(axis_resources: Any) -> None:
    leaves = jax.tree_util.tree_leaves(axis_resources, is_leaf=_is_spec)
    bad = [leaf for leaf in leaves if not _is_spec(leaf)]
    if bad:
        raise errors.PartitionSpecError(
            f"Expected `axis_resources` as a PartitionSpec over logical names (or a pytree "
            f"prefix of them), got {axis_resources!r} (it holds {type(bad[0]).__name__}: "
            f"{bad[0]!r}). Write P('batch', None) instead of a tuple or string of names."
        )


def warn_unmapped_names(logical: PartitionSpec, resolved: _task.ResolvedTask) -> None:
    """Warns for each logical name in ``logical`` that no rule of ``resolved`` names.

    Only for tasks given explicit, non-empty ``logical_axes``: with the default identity rules
    (or none, as ``task(devices=...)`` without ``device_axes`` has), names that are not mesh
    axes replicate by design.
    """
    known = {name for name, _ in resolved.rules}
    if resolved.task.logical_axes is None or not known:
        return
    for entry in logical:
        for name in _entry_names(entry):
            if name not in known:
                _warn_unmapped(name, known, resolved)


def _warn_unmapped(name: str, known: set[str], resolved: _task.ResolvedTask) -> None:
    axes = tuple(resolved.mesh.axis_names)
    if name in axes:
        what = (
            f"is a mesh axis name of task {resolved.name!r} (axes {axes}), not a logical name "
            "its rules map"
        )
    else:
        what = f"has no rule in task {resolved.name!r}"
    _warnings.warn_placement(
        ("logical-name", name, resolved.name),
        f"Logical axis name {name!r} {what}, so that dimension is replicated. Closest rule "
        f"names: {_warnings.closest(name, known)}; rules: {list(resolved.rules)}. Fix the "
        f"name, add a rule ({name!r}, <mesh axis>) to `logical_axes`, or ({name!r}, None) to "
        "replicate on purpose.",
    )


def _microbatch_note(index: int) -> str:
    """Why a microbatch's dimension is what it is, with the microbatch count when known."""
    from multimesh_flax.core import _microbatch  # imports this module

    # The innermost ``microbatch`` call being traced: named by the scope, else (inside the
    # body's own trace, where outer scopes are not visible) the latest one registered.
    found = re.findall(r"mmmb(\d+)_\d+", str(source_info_util.current_name_stack()))
    uid = int(found[-1]) if found else max(_microbatch._CALLS, default=None)
    call = _microbatch._CALLS.get(uid) if uid is not None else None
    count = f"{call.num_microbatches} " if call is not None else ""
    return (
        f"The array is microbatch {index} of {count}microbatches (`microbatch` or "
        "`parallelize_step(..., microbatches=m)`): its batch dimension is the batch divided "
        "by the number of microbatches. Use fewer microbatches, or a batch that the "
        "microbatch count times the shard count divides."
    )


def _constrain_leaf(x: Any, spec: PartitionSpec | None, resolved: _task.ResolvedTask) -> Any:
    logical = PartitionSpec() if spec is None else spec
    try:
        mesh_spec = logical_to_mesh_spec(
            logical, x.shape, dict(resolved.mesh.shape), resolved.rules
        )
    except errors.UnevenShardingError as e:
        index = _task.current_microbatch_index()
        if index is None:
            raise
        raise errors.UnevenShardingError(f"{e} {_microbatch_note(index)}") from e
    warn_unmapped_names(logical, resolved)
    return jax.lax.with_sharding_constraint(x, NamedSharding(resolved.mesh, mesh_spec))


def _mesh_given(axis_resources: Any) -> bool:
    """Whether a mesh is set (``jax.set_mesh``) or ``axis_resources`` names one itself."""
    if not jax.sharding.get_abstract_mesh().empty:
        return True
    leaves = jax.tree_util.tree_leaves(axis_resources, is_leaf=_is_spec)
    return any(isinstance(leaf, jax.sharding.Sharding) for leaf in leaves)


def with_sharding_constraint(x: Any, axis_resources: Any) -> Any:
    """Applies logical sharding annotations to ``x`` (an array or pytree).

    Inside a task (explicit, or registered with ``register_task`` and matched by a named
    scope or Flax module), logical names resolve through the task's rules against its submesh.
    Under ``autoshard`` outside every task, ``x`` is returned unchanged (replicated
    placement is decided by the program). Under ``ignore_transforms`` it is the identity.
    With no task, no ``autoshard`` and no mesh (neither ``jax.set_mesh`` nor a
    ``NamedSharding`` in ``axis_resources``) -- a model called eagerly -- it is the identity
    too, as ``flax.linen.with_logical_constraint`` is without a mesh. Otherwise (a mesh set
    with ``jax.set_mesh``) it is ``jax.lax.with_sharding_constraint``.

    Args:
        x: an array or pytree of arrays.
        axis_resources: a ``PartitionSpec`` over logical names, or a pytree prefix of them.

    Returns:
        ``x``, constrained.

    Example:
        >>> import multimesh_flax as mm
        >>> mesh = mm.TaskMesh(devices=range(8), axis_names=("x",))
        >>> def f(x):
        ...     return mm.with_sharding_constraint(x, P("batch", None)) * 2
        >>> f_task = mm.task(f, mesh=mesh, logical_axes=[("batch", "x")])
        >>> mm.jit(f_task)(jnp.ones((8, 2))).sharding.spec
        P('x',)
    """
    if _config.get_flag("ignore_transforms"):
        return x
    resolved = _named_tasks.current_task()
    if resolved is None:
        if _config.get_flag("autoshard") or not _mesh_given(axis_resources):
            return x
        return jax.lax.with_sharding_constraint(x, axis_resources)
    _check_specs(axis_resources)
    return jax.tree_util.tree_map(
        lambda spec, sub: jax.tree_util.tree_map(
            lambda leaf: _constrain_leaf(leaf, spec, resolved), sub
        ),
        axis_resources,
        x,
        is_leaf=_is_spec,
    )
