"""What a unit is, and how the units of a Flax model are found.

A *unit* is a submodule that the planner costs on its own: for the reference models
(`models.GPT`, `models.Llama`) the embedding stem, one transformer block and the head; for
any other Linen model, the submodules whose paths match ``register_task``-style patterns
(regular expressions, ``re.fullmatch``-ed against module paths such as ``layer_0`` or
``encoder/proj``; the outermost match wins).

`find_units` traces ``model.init`` abstractly (``jax.eval_shape``: nothing is compiled or
allocated) under ``nn.intercept_methods`` and records, for every matched submodule call in
call order, an `Instance`: its path, a parentless clone of the module, its arguments (arrays
as ``ShapeDtypeStruct``s, everything else as given) and its boxed parameter shapes with
their logical names. Instances with the same *structure* -- module class, module fields,
parameter shapes/dtypes/logical names and argument shapes/dtypes -- share one `Unit`, so
identical blocks are profiled once.

Each instance has a *role*: ``"stem"`` (always on the first pipeline stage), ``"layer"``
(split over stages by ``layers_per_stage``) or ``"head"`` (always on the last stage). The
reference models' stem and head get those roles; every instance matched by user patterns is
a layer.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn

from multimesh_flax import errors

REFERENCE_PATTERNS = (("stem", "stem"), ("layer", r"blocks_\d+"), ("head", "head"))
"""``(role, pattern)`` of the reference models' units (`models.GPT`, `models.Llama`)."""

ROLES = ("stem", "layer", "head")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One distinct unit: a module and the arguments of one call, shared by its instances.

    Attributes:
        name: The first instance's path, e.g. ``"blocks_0"``.
        module: A parentless clone of the module; ``module.apply({"params": p}, ...)`` runs it.
        args: The call's positional and keyword arguments ``(args, kwargs)``: arrays as
            ``jax.ShapeDtypeStruct``, other values as given (static).
        params: The module's parameters, boxed as ``init`` makes them (``ShapeDtypeStruct``
            leaves; ``flax.linen.Partitioned`` boxes carry the logical names).
    """

    name: str
    module: nn.Module
    args: Any
    params: Any

    @property
    def kind(self) -> str:
        """The module's class name, e.g. ``"GPTBlock"``."""
        return type(self.module).__name__


@dataclasses.dataclass(frozen=True)
class Instance:
    """One matched submodule call of the model, in call order.

    Attributes:
        path: The module path, ``"blocks_3"`` or ``"encoder/proj"``.
        role: ``"stem"``, ``"layer"`` or ``"head"``.
        unit: Index into the distinct units (`UnitSet.units`).
    """

    path: str
    role: str
    unit: int


@dataclasses.dataclass(frozen=True)
class UnitSet:
    """The units of a model: distinct `Unit` records and the `Instance` sequence.

    Example:
        >>> from models import GPT, get_config
        >>> from multimesh_flax.planner import find_units
        >>> found = find_units(GPT(get_config("gpt-tiny", num_layers=4)), jnp.zeros((2, 8), int))
        >>> [(i.path, i.role, i.unit) for i in found.instances]  # doctest: +NORMALIZE_WHITESPACE
        [('stem', 'stem', 0), ('blocks_0', 'layer', 1), ('blocks_1', 'layer', 1),
         ('blocks_2', 'layer', 1), ('blocks_3', 'layer', 1), ('head', 'head', 2)]
        >>> [u.kind for u in found.units]
        ['GPTEmbed', 'GPTBlock', 'GPTHead']
    """

    units: tuple[Unit, ...]
    instances: tuple[Instance, ...]

    @property
    def layers(self) -> tuple[Instance, ...]:
        """The instances a pipeline split distributes (role ``"layer"``)."""
        return tuple(i for i in self.instances if i.role == "layer")


def _abstract(tree: Any) -> Any:
    """Arrays as ``ShapeDtypeStruct`` (no sharding), everything else unchanged."""

    def one(x: Any) -> Any:
        if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
        return x

    return jax.tree_util.tree_map(one, tree)


def default_patterns(model: nn.Module) -> tuple[tuple[str, str], ...] | None:
    """The reference models' ``(role, pattern)`` pairs, or ``None`` for another model."""
    if all(hasattr(model, a) for a in ("stem_cls", "block_cls", "head_cls")):
        return REFERENCE_PATTERNS
    return None


def normalise_patterns(model: nn.Module, patterns: Any) -> tuple[tuple[str, re.Pattern], ...]:
    """``patterns`` (strings, or ``(role, pattern)`` pairs) as compiled ``(role, regex)``."""
    if patterns is None:
        patterns = default_patterns(model)
        if patterns is None:
            raise errors.UnitPatternError(
                f"Expected `patterns` naming the units of {type(model).__name__} (regular "
                "expressions over module paths, as for `register_task`, e.g. "
                "[r'layer_\\d+']), got None. Only the reference models (GPT, Llama) have "
                "default units."
            )
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    out = []
    for entry in patterns:
        role, pattern = ("layer", entry) if isinstance(entry, (str, re.Pattern)) else entry
        if role not in ROLES:
            raise errors.UnitPatternError(
                f"Expected a role in {ROLES} for pattern {pattern!r}, got {role!r}. Pass a "
                "pattern alone (a layer) or a `(role, pattern)` pair."
            )
        try:
            out.append((role, re.compile(pattern)))
        except (re.error, TypeError) as e:
            raise errors.UnitPatternError(
                f"Expected `patterns` to hold regular expressions, got {pattern!r} ({e}). "
                "Fix the pattern, or `re.escape` a literal name."
            ) from e
    return tuple(out)


def _structure(module: nn.Module, args: Any, params: Any) -> Any:
    """A hashable key: equal for submodules that compute the same thing on equal shapes."""
    fields = tuple(
        (f.name, repr(getattr(module, f.name)))
        for f in dataclasses.fields(module)
        if f.name not in ("parent", "name")
    )
    leaves, tree = jax.tree_util.tree_flatten(
        params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )
    shapes = tuple(
        (np.shape(x.value), str(x.value.dtype), tuple(x.names))
        if isinstance(x, nn.Partitioned)
        else (np.shape(x), str(x.dtype), None)
        for x in leaves
    )
    arg_leaves, arg_tree = jax.tree_util.tree_flatten(args)
    arg_key = tuple(
        (x.shape, str(x.dtype)) if isinstance(x, jax.ShapeDtypeStruct) else repr(x)
        for x in arg_leaves
    )
    return (type(module).__qualname__, fields, str(tree), shapes, str(arg_tree), arg_key)


def find_units(model: nn.Module, *inputs: Any, patterns: Sequence[Any] | None = None) -> UnitSet:
    """Finds the units of ``model`` called on ``inputs``, tracing only.

    Args:
        model: A Flax Linen module (unbound).
        *inputs: Example inputs of ``model.__call__`` (arrays or ``ShapeDtypeStruct``s).
        patterns: Regular expressions over module paths (``re.fullmatch``), or ``(role,
            pattern)`` pairs with a role in ``("stem", "layer", "head")``. ``None``: the
            reference models' stem, blocks and head.

    Returns:
        A `UnitSet`: the distinct units and every matched call in order.

    Raises:
        UnitPatternError: no ``patterns`` for a model without default units, an invalid
            pattern or role, a pattern that matches no submodule, or a model whose stems do
            not come first and heads last.

    Example:
        >>> from flax import linen as nn
        >>> from multimesh_flax.planner import find_units
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         for i in range(3):
        ...             x = nn.Dense(16, name=f"layer_{i}")(x)
        ...         return x
        >>> found = find_units(MLP(), jnp.ones((4, 16)), patterns=[r"layer_\\d+"])
        >>> [i.unit for i in found.instances], len(found.units)
        ([0, 0, 0], 1)
    """
    compiled = normalise_patterns(model, patterns)
    calls: list[tuple[str, str, nn.Module, Any]] = []

    def intercept(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        path = "/".join(module.path)
        inside = any(path.startswith(c[0] + "/") for c in calls)
        if context.method_name == "__call__" and path and not inside:
            for role, regex in compiled:
                if regex.fullmatch(path) or regex.fullmatch(module.path[-1]):
                    clone = module.clone(parent=None)
                    calls.append((path, role, clone, _abstract((tuple(args), dict(kwargs)))))
                    break
        return next_fun(*args, **kwargs)

    def init(*xs: Any) -> Any:
        with nn.intercept_methods(intercept):
            return model.init(jax.random.key(0), *xs)

    variables = jax.eval_shape(init, *_abstract(inputs))
    _check_matched(compiled, calls)
    return _group(calls, variables.get("params", {}))


def _check_matched(compiled: Any, calls: list[tuple[str, str, nn.Module, Any]]) -> None:
    for role, regex in compiled:
        if not any(
            c[1] == role and (regex.fullmatch(c[0]) or regex.fullmatch(c[0].split("/")[-1]))
            for c in calls
        ):
            raise errors.UnitPatternError(
                f"Expected pattern {regex.pattern!r} to match a submodule called by the "
                f"model, but it matched none (matched: {[c[0] for c in calls]}). Use the "
                "module paths `model.tabulate` shows, e.g. 'blocks_\\d+'."
            )
    roles = [c[1] for c in calls]
    order = sorted(roles, key=ROLES.index)
    if roles != order:
        raise errors.UnitPatternError(
            f"Expected the stems first and the heads last in call order, got roles {roles} "
            f"for {[c[0] for c in calls]}. Give those units the role 'layer'."
        )


def _subtree(params: Any, path: str) -> Any:
    node = params
    for key in path.split("/"):
        node = node.get(key, {}) if hasattr(node, "get") else {}
    return node


def _group(calls: list[tuple[str, str, nn.Module, Any]], params: Any) -> UnitSet:
    units: list[Unit] = []
    keys: dict[Any, int] = {}
    instances = []
    for path, role, module, args in calls:
        own = _subtree(params, path)
        key = _structure(module, args, own)
        if key not in keys:
            keys[key] = len(units)
            units.append(Unit(path, module, args, own))
        instances.append(Instance(path, role, keys[key]))
    return UnitSet(tuple(units), tuple(instances))
