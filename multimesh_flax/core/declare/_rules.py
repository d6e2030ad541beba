"""Logical rules: mapping logical axis names onto a task's mesh axes.

Users annotate arrays with *logical* names (``P("batch", "embed")``); each task maps them to
its own mesh axes through priority-ordered rules ``(logical_name, mesh_axis)``.
:func:`logical_to_mesh_spec` implements the resolution; ``trace/_constraints``
applies it to arrays while a program is traced.

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
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from multimesh_flax import errors

Rule = tuple[str, "str | tuple[str, ...] | None"]


def normalise_rules(rules: Any, argument: str) -> tuple[Rule, ...]:
    """Checks that ``rules`` are ``(logical_name, mesh_axis)`` pairs and tuples them."""
    if rules is None:
        return ()
    try:
        pairs = [tuple(r) for r in rules]
    except TypeError:
        pairs = None
    bad = pairs is None or any(len(p) != 2 or not isinstance(p[0], str) for p in pairs)
    if not bad:
        bad = any(not (p[1] is None or isinstance(p[1], (str, tuple))) for p in pairs)
    if bad:
        raise errors.LogicalRulesError(
            f"Expected `{argument}` as a sequence of (logical_name, mesh_axis) pairs, got "
            f"{rules!r}. Example: (('batch', 'x'), ('model', 'y'))."
        )
    return tuple(pairs)  # type: ignore[return-value]


def entry_names(entry: Any) -> tuple[str, ...]:
    """The names in one entry of a partition spec (``None``, a name, or a tuple of names).

    >>> entry_names(None), entry_names("embed"), entry_names(("data", "model"))
    ((), ('embed',), ('data', 'model'))
    """
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _rule_axes(axes: Any) -> tuple[str, ...]:
    return entry_names(axes)


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
    rules = normalise_rules(rules, "rules")
    entries = tuple(logical)
    if len(entries) > len(shape):
        raise errors.PartitionSpecError(
            f"Expected at most {len(shape)} entries for an array of shape {tuple(shape)}, "
            f"got {logical}. Drop the extra entries."
        )
    dims = [entry_names(e) for e in entries] + [()] * (len(shape) - len(entries))
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


def is_spec(x: Any) -> bool:
    """Whether ``x`` is a leaf of a spec tree: a ``PartitionSpec`` or ``None``."""
    return x is None or isinstance(x, PartitionSpec)


def check_specs(axis_resources: Any) -> None:
    """Checks that ``axis_resources`` is a pytree of ``PartitionSpec``\\ s (or ``None``).

    Raises:
        PartitionSpecError: a leaf is something else (a tuple or string of names).
    """
    leaves = jax.tree_util.tree_leaves(axis_resources, is_leaf=is_spec)
    bad = [leaf for leaf in leaves if not is_spec(leaf)]
    if bad:
        raise errors.PartitionSpecError(
            f"Expected `axis_resources` as a PartitionSpec over logical names (or a pytree "
            f"prefix of them), got {axis_resources!r} (it holds {type(bad[0]).__name__}: "
            f"{bad[0]!r}). Write P('batch', None) instead of a tuple or string of names."
        )
