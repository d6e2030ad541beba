"""Sharding constraints while tracing: ``with_sharding_constraint`` inside and outside tasks.

Inside a task, logical specs resolve through the task's rules (``declare/_rules``) onto its
mesh; outside every task they do what the current contexts say. Logical names no rule maps
are replicated with a ``PlacementWarning``.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import jax
from jax._src import source_info_util
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    check_specs,
    closest_names,
    entry_names,
    get_flag,
    is_spec,
    logical_to_mesh_spec,
    warn_placement,
)
from multimesh_flax.core.trace import _colour, _session


def warn_unmapped_names(logical: PartitionSpec, resolved: _session.ResolvedTask) -> None:
    """Warns for each logical name in ``logical`` that no rule of ``resolved`` names.

    Only for tasks given explicit, non-empty ``logical_axes``: with the default identity rules
    (or none, as ``task(devices=...)`` without ``device_axes`` has), names that are not mesh
    axes replicate by design.
    """
    known = {name for name, _ in resolved.rules}
    if resolved.task.logical_axes is None or not known:
        return
    for entry in logical:
        for name in entry_names(entry):
            if name not in known:
                _warn_unmapped(name, known, resolved)


def _warn_unmapped(name: str, known: set[str], resolved: _session.ResolvedTask) -> None:
    axes = tuple(resolved.mesh.axis_names)
    if name in axes:
        what = (
            f"is a mesh axis name of task {resolved.name!r} (axes {axes}), not a logical name "
            "its rules map"
        )
    else:
        what = f"has no rule in task {resolved.name!r}"
    warn_placement(
        ("logical-name", name, resolved.name),
        f"Logical axis name {name!r} {what}, so that dimension is replicated. Closest rule "
        f"names: {closest_names(name, known)}; rules: {list(resolved.rules)}. Fix the "
        f"name, add a rule ({name!r}, <mesh axis>) to `logical_axes`, or ({name!r}, None) to "
        "replicate on purpose.",
    )


def _microbatch_note(index: int) -> str:
    """Why a microbatch's dimension is what it is, with the microbatch count when known."""
    session = _session.current_session()
    calls = session.microbatch_calls if session is not None else {}
    # The innermost ``microbatch`` call being traced: named by the scope, else (inside the
    # body's own trace, where outer scopes are not visible) the latest one registered.
    found = re.findall(r"mmmb(\d+)_\d+", str(source_info_util.current_name_stack()))
    uid = int(found[-1]) if found else max(calls, default=None)
    call = calls.get(uid) if uid is not None else None
    count = f"{call.num_microbatches} " if call is not None else ""
    return (
        f"The array is microbatch {index} of {count}microbatches (`microbatch` or "
        "`parallelize_step(..., microbatches=m)`): its batch dimension is the batch divided "
        "by the number of microbatches. Use fewer microbatches, or a batch that the "
        "microbatch count times the shard count divides."
    )


def _constrain_leaf(x: Any, spec: PartitionSpec | None, resolved: _session.ResolvedTask) -> Any:
    logical = PartitionSpec() if spec is None else spec
    try:
        mesh_spec = logical_to_mesh_spec(
            logical, x.shape, dict(resolved.mesh.shape), resolved.rules
        )
    except errors.UnevenShardingError as e:
        index = _session.current_microbatch_index()
        if index is None:
            raise
        raise errors.UnevenShardingError(f"{e} {_microbatch_note(index)}") from e
    warn_unmapped_names(logical, resolved)
    return constrain_to_task(x, mesh_spec, resolved)


def constrain_to_task(x: Any, spec: PartitionSpec, resolved: _session.ResolvedTask) -> Any:
    """``x`` laid out as ``spec`` (mesh axes) on task ``resolved``'s submesh.

    On Auto axes a ``with_sharding_constraint`` onto the submesh; where the task's axes are
    Explicit (sharding in types) a ``jax.sharding.reshard`` on its ambient mesh, since
    there a constraint only asserts the type the value already has.
    """
    mesh = resolved.ambient_mesh
    if mesh.are_all_axes_auto:
        return jax.lax.with_sharding_constraint(x, NamedSharding(resolved.mesh, spec))
    with _ambient(mesh):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def leave_explicit_axes(tree: Any, resolved: _session.ResolvedTask) -> Any:
    """The results of a task with Explicit axes, typed on its submesh's Auto axes.

    Inside the task values are typed on its Explicit axes (sharding in types); outside it,
    in glue and in other tasks, every value is typed as the program's inputs are, so that
    values from several tasks meet (and each task's inputs arrive) with one kind of type.
    Under ``jax.grad`` the transposed cast types the cotangents back on entry.
    """
    mesh = resolved.ambient_mesh
    if mesh.are_all_axes_auto:
        return tree
    auto = mesh.update_axis_types({name: AxisType.Auto for name in mesh.axis_names})

    def leave(x: Any) -> Any:
        sharding = getattr(_aval(x), "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
            return x
        with _ambient(auto):
            return jax.sharding.reshard(x, NamedSharding(auto, PartitionSpec()))

    return jax.tree_util.tree_map(leave, tree)


def _aval(x: Any) -> Any:
    try:
        return jax.typeof(x)
    except TypeError:
        return None


def _ambient(mesh: jax.sharding.AbstractMesh) -> Any:
    """``mesh`` as the abstract mesh, unless it already is."""
    if jax.sharding.get_abstract_mesh() == mesh:
        return contextlib.nullcontext()
    return _colour.abstract_mesh(mesh)


def _mesh_given(axis_resources: Any) -> bool:
    """Whether a mesh is set (``jax.set_mesh``) or ``axis_resources`` names one itself."""
    if not jax.sharding.get_abstract_mesh().empty:
        return True
    leaves = jax.tree_util.tree_leaves(axis_resources, is_leaf=is_spec)
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
    if get_flag("ignore_transforms"):
        return x
    resolved = _colour.current_task()
    if resolved is None:
        if get_flag("autoshard") or not _mesh_given(axis_resources):
            return x
        return jax.lax.with_sharding_constraint(x, axis_resources)
    check_specs(axis_resources)
    return jax.tree_util.tree_map(
        lambda spec, sub: jax.tree_util.tree_map(
            lambda leaf: _constrain_leaf(leaf, spec, resolved), sub
        ),
        axis_resources,
        x,
        is_leaf=is_spec,
    )


def concrete_constraint(eqn: Any) -> NamedSharding | None:
    """The sharding of a ``sharding_constraint`` equation that names a concrete mesh
    (devices), else ``None`` (another primitive, or an abstract mesh)."""
    if eqn.primitive.name != "sharding_constraint":
        return None
    sharding = eqn.params.get("sharding")
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        return None
    return sharding
