"""Fragments of tasks with Explicit axes: run with the types they were traced with.

A task whose submesh has ``AxisType.Explicit`` axes (sharding in types) is traced with that
submesh as the ambient abstract mesh, so its values carry their sharding in their type, and
the program's inputs are traced with no mesh in their type (``trace._trace``). When ``jax.jit``
traces a fragment again to compile it, its arguments are real arrays on the submesh's
concrete mesh, typed on Auto axes (or, for arrays a task made, on Explicit ones). JAX
refuses to mix the two kinds of mesh in one operation, so a fragment that holds an
Explicit-typed value, or an equation traced under an Explicit mesh, is evaluated here equation
by equation (blocks and nested ``jit`` calls inlined), each operand given the kind of type it
had when traced:

* an operand traced without a mesh (or on Auto axes) that meets Explicit-typed values, or an
  Explicit ambient mesh, is typed replicated on that Explicit mesh (the role "no mesh"
  played while tracing; the data does not move);
* an operand traced on the Explicit mesh is given exactly its traced type;
* an operand typed on Explicit axes where nothing Explicit was traced is typed on the same
  mesh's Auto axes.

This runs when ``jax.jit`` traces the fragment, not per call; fragments with nothing Explicit
in them keep ``jax.extend.core.jaxpr_as_fun``, their arguments typed on Auto axes
(:func:`untyped`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
from jax._src import source_info_util
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

_EMPTY_MESH = AbstractMesh((), ())
_INLINED = ("closed_call", "pjit", "jit")  # call primitives whose bodies run here


def _explicit(mesh: Any) -> bool:
    return isinstance(mesh, AbstractMesh) and not mesh.empty and not mesh.are_all_axes_auto


def _mesh_of(aval: Any) -> Any:
    sharding = getattr(aval, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def _body(eqn: Any) -> Any:
    """The closed jaxpr an inlined call equation runs, or ``None``."""
    if eqn.primitive.name not in _INLINED:
        return None
    return eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))


def _equations(jaxpr: jex.Jaxpr) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        yield eqn
        body = _body(eqn)
        if body is not None:
            yield from _equations(body.jaxpr)


def has_explicit_axes(jaxpr: jex.Jaxpr) -> bool:
    """Whether a value or an equation of ``jaxpr`` was traced on Explicit axes."""
    if any(_explicit(_mesh_of(v.aval)) for v in jaxpr.invars):
        return True
    for eqn in _equations(jaxpr):
        if _explicit(getattr(eqn.ctx, "cur_abstract_mesh", None)):
            return True
        if any(_explicit(_mesh_of(v.aval)) for v in eqn.outvars):
            return True
    return False


def explicit_fun(jaxpr: jex.Jaxpr) -> Callable[..., tuple[Any, ...]]:
    """``jaxpr`` as a function that gives each operand the kind of type it was traced with
    (see the module docstring)."""

    def fragment(*args: Any) -> tuple[Any, ...]:
        return tuple(_eval(jaxpr, [], args))

    return fragment


def jaxpr_as_auto_fun(closed: jex.ClosedJaxpr) -> Callable[..., list[Any]]:
    """``jax.extend.core.jaxpr_as_fun(closed)``, whose results are typed on Auto axes even
    where tasks with Explicit axes made them (a model's initialiser: the arrays then go to
    ``out_shardings`` of any mesh).

    Example:
        >>> run = jaxpr_as_auto_fun(jax.make_jaxpr(lambda x: x + 1)(1.0))
        >>> [float(y) for y in run(1.0)]
        [2.0]
    """
    if not has_explicit_axes(closed.jaxpr):
        return jex.jaxpr_as_fun(closed)

    def run(*args: Any) -> list[Any]:
        return [untyped(y) for y in _eval(closed.jaxpr, closed.consts, args)]

    return run


def untyped(x: Any) -> Any:
    """An argument of a fragment with nothing Explicit in it, typed on Auto axes (an array
    a task with Explicit axes made arrives typed on them)."""
    return _typed(x, None, None)


def _eval(jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = _typed(x, v.aval, _target([(x, v)], None))
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, _run(eqn, [read(v) for v in eqn.invars]), strict=True))
    return [read(v) for v in jaxpr.outvars]


def _run(eqn: Any, values: list[Any]) -> list[Any]:
    ambient = getattr(eqn.ctx, "cur_abstract_mesh", None)
    pairs = [(x, v) for x, v in zip(values, eqn.invars, strict=True)]
    target = _target(pairs, ambient if _explicit(ambient) else None)
    typed = [x if isinstance(v, jex.Literal) else _typed(x, v.aval, target) for x, v in pairs]
    body = _body(eqn)
    if body is not None:
        return _eval(body.jaxpr, body.consts, typed)
    stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*typed, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _target(pairs: Sequence[tuple[Any, Any]], ambient: AbstractMesh | None) -> Any:
    """The Explicit mesh an equation's operands must share: the one it was traced under, or
    the one an operand was traced on."""
    if ambient is not None:
        return ambient
    for _, v in pairs:
        mesh = None if isinstance(v, jex.Literal) else _mesh_of(v.aval)
        if _explicit(mesh):
            return mesh
    return None


def _typed(x: Any, traced: Any, target: AbstractMesh | None) -> Any:
    have = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(have, NamedSharding):
        return x
    if target is None:
        if not _explicit(have.mesh):
            return x
        auto = have.mesh.update_axis_types({n: AxisType.Auto for n in have.mesh.axis_names})
        return _reshard(x, NamedSharding(auto, PartitionSpec()))
    want = traced.sharding if _mesh_of(traced) == target else None
    if want is None:
        if have.mesh == target:
            return x
        want = NamedSharding(target, PartitionSpec())
    return x if have == want else _reshard(x, want)


def _reshard(x: Any, sharding: NamedSharding) -> Any:
    with (
        jax.sharding.use_abstract_mesh(_EMPTY_MESH),
        jax.sharding.use_abstract_mesh(sharding.mesh),
    ):
        return jax.sharding.reshard(x, sharding)
