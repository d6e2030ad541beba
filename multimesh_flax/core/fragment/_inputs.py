"""Where program inputs arrive: the sharding each input of a partitioned program expects.

An input is placed on its first consumer's submesh (``_partition``), in the sharding of the
first constraint applied to it there, else replicated. ``canonical_sharding`` keeps
equivalent specs in one form so that step ``n + 1`` does not recompile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax.core.fragment import _partition
from multimesh_flax.core.trace import block_body, is_block


def first_constraint(eqns: Sequence[Any], var: Any) -> Any:
    """The sharding of the constraint that first reads ``var`` in ``eqns``, looking into a
    block that reads it first (``None``: its first reader is no constraint)."""
    for eqn in eqns:
        if var in eqn.invars:
            if is_block(eqn):
                body = block_body(eqn)
                return first_constraint(body.eqns, body.invars[eqn.invars.index(var)])
            if eqn.primitive.name == "sharding_constraint" and eqn.invars[0] is var:
                return eqn.params["sharding"]
            return None
    return None


def canonical_sharding(sharding: Any) -> Any:
    """``sharding`` with trailing ``None`` entries dropped from its spec.

    ``P('x', None)`` and ``P('x')`` lay an array out identically, but ``jax.jit`` caches
    executables per spec and returns outputs in the short form; giving inputs the short form
    too keeps step ``n + 1`` (fed with step ``n``'s outputs) from compiling again.
    """
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = canonical_spec(sharding.spec)
    if spec is sharding.spec:
        return sharding
    return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


def canonical_spec(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` without trailing ``None`` entries (``spec`` itself if it has none)."""
    entries = list(spec)
    if not entries or entries[-1] is not None:
        return spec
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _same_place(sharding: Any, place: tuple[int, ...]) -> bool:
    return tuple(sorted(d.id for d in sharding.device_set)) == place


def input_sharding(part: _partition.Partition, var: Any) -> Any:
    """The sharding a program input should arrive in (``None``: the input is unused).

    The first sharding constraint applied to the input inside its first consuming fragment,
    else replicated on that fragment's submesh.
    """
    place = part.input_place.get(var)
    if place is None:
        return None
    first = part.first_reader(var, place)
    constraint = first_constraint(first.eqns, var)
    if constraint is not None and _same_place(constraint, place):
        return canonical_sharding(constraint)
    return NamedSharding(part.place_meshes[place], PartitionSpec())
