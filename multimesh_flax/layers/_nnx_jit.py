"""``jit`` for functions that take Flax NNX graph objects (modules, optimizers, ``Rngs``).

The front door's :func:`jit` behaves like ``nnx.jit``: NNX graph objects may be passed as
arguments, and whatever the function changes in them (parameters, ``nnx.Optimizer`` state,
``Rngs`` counters) is written back in place. It is a wrapper around the core
:func:`multimesh_flax.core.jit`:

1. outside the program, the graph objects among the arguments are split together
   (``nnx.split``: shared references stay shared) into a static ``GraphDef`` and a ``State``;
2. the core ``jit`` compiles a pure function that merges them, pins every variable born on a
   task's submesh (metadata ``task_sharding``, also copied into optimizer state) to its
   placement, runs the function, splits the graph objects again and pins the new state the
   same way, so it stays where it was;
3. the caller's objects get the new state with ``nnx.update``.

The state is donated: a step updates its model and optimizer in place, and the arrays read
from them before the call are deleted. Calls without graph objects go to the core ``jit``
unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.core import Tracer

from multimesh_flax import errors
from multimesh_flax.core.declare import get_flag
from multimesh_flax.core.front import MpmdJit
from multimesh_flax.core.front import jit as core_jit
from multimesh_flax.core.trace import microbatch as core_microbatch
from multimesh_flax.layers import _nnx_task


def _is_graph_object(x: Any) -> bool:
    return isinstance(x, nnx.Pytree)


def has_graph_objects(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether any argument (or an element of a top-level tuple, list or dict) is an NNX
    graph object."""
    for a in (*args, *kwargs.values()):
        if _is_graph_object(a):
            return True
        inner = a.values() if isinstance(a, dict) else a if isinstance(a, (list, tuple)) else ()
        if any(_is_graph_object(x) for x in inner):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class _Static:
    """The compile-time part of a call: argument structure, graph definition, statics."""

    treedef: Any
    node_positions: tuple[int, ...]
    graphdef: Any
    statics: tuple[tuple[int, Hashable], ...]


def pin(state: Any) -> Any:
    """Constrains (in place) every variable of ``state`` that has a ``task_sharding`` to it."""
    variables = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for variable in variables:
        sharding = variable.get_metadata().get(_nnx_task.TASK_SHARDING)
        if sharding is not None and hasattr(variable.get_value(), "shape"):
            variable.set_value(jax.lax.with_sharding_constraint(variable.get_value(), sharding))
    return state


def placed_unowned(variable: nnx.Variable, sharding: Any) -> nnx.Variable:
    """``variable`` moved to ``sharding`` when no task owns it (a task's variables stay
    where they were born); the same variable when it is there already, owned, or not a
    concrete array (abstract state, a tracer)."""
    value = variable.get_value()
    owned = variable.get_metadata().get(_nnx_task.TASK_SHARDING) is not None
    concrete = isinstance(value, jax.Array) and not isinstance(value, Tracer)
    if owned or not concrete or sharding is None or value.sharding == sharding:
        return variable
    return variable.replace(jax.device_put(value, sharding))


class GraphJit:
    """What the front door's :func:`jit` returns: the core ``MpmdJit`` for plain calls, the
    split / run / update wrapper for calls with NNX graph objects."""

    def __init__(
        self,
        fun: Callable[..., Any],
        plain: MpmdJit,
    ) -> None:
        self.fun = fun
        self.plain = plain
        self.static_argnums = plain.static_argnums
        self.graph = core_jit(
            self._pure,
            devices=plain.devices,
            static_argnums=(0,),
            donate_argnums=(1, 2) if plain.donate_argnums else (1,),
        )
        self.__wrapped__ = fun
        self.__name__ = getattr(fun, "__name__", "jitted")
        self.__doc__ = getattr(fun, "__doc__", None)

    def __getattr__(self, name: str) -> Any:  # the core jit's attributes (``_cache``, ...)
        return getattr(self.plain, name)

    # --- splitting the call ---

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Static, Any, list]:
        statics = tuple((i, args[i]) for i in self.static_argnums if i < len(args))
        dynamic = [None if i in self.static_argnums else a for i, a in enumerate(args)]
        leaves, treedef = jax.tree_util.tree_flatten((dynamic, kwargs), is_leaf=_is_graph_object)
        positions = tuple(i for i, leaf in enumerate(leaves) if _is_graph_object(leaf))
        nodes = [leaves[i] for i in positions]
        graphdef, state = nnx.split(nodes)
        others = [leaf for i, leaf in enumerate(leaves) if i not in positions]
        return _Static(treedef, positions, graphdef, statics), state, (nodes, others)

    def _pure(self, static: _Static, state: Any, others: list[Any]) -> tuple[Any, Any]:
        nodes = nnx.merge(static.graphdef, pin(state))
        _check_optimizers(nodes)
        _nnx_task.enter_registered_tasks(nodes)
        leaves, it_nodes, it_others = [], iter(nodes), iter(others)
        for i in range(len(static.node_positions) + len(others)):
            leaves.append(next(it_nodes) if i in static.node_positions else next(it_others))
        dynamic, kwargs = jax.tree_util.tree_unflatten(static.treedef, leaves)
        statics = dict(static.statics)
        args = [statics.get(i, a) for i, a in enumerate(dynamic)]
        out = self.fun(*args, **kwargs)
        if any(
            _is_graph_object(x) for x in jax.tree_util.tree_leaves(out, is_leaf=_is_graph_object)
        ):
            raise errors.GraphArgumentError(
                f"`{self.__name__}` returned an NNX graph object ({_first_graph_object(out)}); "
                "`multimesh_flax.jit` returns arrays only. The graph objects passed in are "
                "updated in place: return arrays (a loss, metrics) and read the model itself."
            )
        return out, pin(nnx.state(nodes))

    # --- calling ---

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if get_flag("ignore_transforms") or not has_graph_objects(args, kwargs):
            return self.plain(*args, **kwargs)
        static, state, (nodes, others) = self._split(args, kwargs)
        out, new_state = self.graph(static, state, others)
        nnx.update(nodes, self._kept_in_place(new_state, static, state, others))
        return out

    def _kept_in_place(self, new_state: Any, static: _Static, state: Any, others: Any) -> Any:
        """``new_state`` with every variable no task owns moved to where the program reads
        it (its first reader's submesh, as ``tabulate`` reports): the update may compute
        it elsewhere (a tied embedding's last use), and the next step would move it back."""
        (wanted, _), _ = self.graph.input_shardings(static, state, others)
        return jax.tree_util.tree_map(
            lambda variable, where: placed_unowned(variable, where.get_value()),
            new_state,
            wanted,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )

    def executable(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled program for these arguments (see ``MpmdJit.executable``)."""
        if not has_graph_objects(args, kwargs):
            return self.plain.executable(*args, **kwargs)
        static, state, (_, others) = self._split(args, kwargs)
        return self.graph.executable(static, state, others)

    def describe(self, *args: Any, **kwargs: Any) -> str:
        """A readable dump of the MPMD program built for these arguments."""
        if not has_graph_objects(args, kwargs):
            return self.plain.describe(*args, **kwargs)
        static, state, (_, others) = self._split(args, kwargs)
        return self.graph.describe(static, state, others)


def _variable_keys(state: Any, kind: Any = nnx.Variable) -> set[tuple[Any, Any]]:
    return {
        (tuple(path), getattr(v.get_value(), "shape", None))
        for path, v in nnx.to_flat_state(state)
        if isinstance(v, kind)
    }


def _optimizes(optimizer: nnx.Optimizer, model: nnx.Module) -> bool:
    """Whether every per-parameter state of ``optimizer`` belongs to a parameter of
    ``model`` (same path, as a suffix of the optimizer state's path, and same shape)."""
    params = _variable_keys(nnx.state(model, optimizer.wrt))
    moments = _variable_keys(nnx.state(optimizer), nnx.training.optimizer.OptVariable)
    return all(
        any((path[i:], shape) in params for i in range(len(path))) for path, shape in moments
    )


def _check_optimizers(nodes: list[Any]) -> None:
    """Raises if an ``nnx.Optimizer`` passed in was built for none of the modules passed."""
    modules = [n for n in nodes if isinstance(n, nnx.Module)]
    for optimizer in (n for n in nodes if isinstance(n, nnx.Optimizer)):
        if modules and not any(_optimizes(optimizer, m) for m in modules):
            names = ", ".join(type(m).__name__ for m in modules)
            raise errors.GraphArgumentError(
                f"The nnx.Optimizer passed in holds state for parameters that none of the "
                f"modules passed ({names}) has: it was built for another model. Build it "
                "from the model you train: `nnx.Optimizer(model, tx, wrt=nnx.Param)`."
            )


def _first_graph_object(tree: Any) -> str:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_graph_object)
    return next(type(x).__name__ for x in leaves if _is_graph_object(x))


def _closes_over_graph_objects(fun: Any) -> bool:
    """Whether ``fun`` (a closure or ``functools.partial``) holds NNX graph objects."""
    cells = [c.cell_contents for c in getattr(fun, "__closure__", None) or () if _filled(c)]
    bound = [*getattr(fun, "args", ()), *getattr(fun, "keywords", {}).values()]
    return has_graph_objects(cells + bound, {})


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 -- an empty cell raises
    except ValueError:
        return False
    return True


def microbatch(
    fun: Callable[..., Any], dim: int, size: int | None = None, argnum: int = 0, **options: Any
) -> Callable[..., Any]:
    """:func:`multimesh_flax.core.microbatch`, also for functions over NNX graph objects.

    The core transform traces the body once, as a ``jax.jit`` closing over the other
    arguments; NNX refuses graph objects (``model``) captured that way from the outer trace.
    Unless ``trace_once`` is given, a function that closes over graph objects, or is called
    with some, is traced once per microbatch instead (same program, same values).

    Example:
        >>> from flax import nnx
        >>> import multimesh_flax as mm
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> def step(model, x):
        ...     grad_fn = lambda b: nnx.value_and_grad(lambda m: (m(b) ** 2).mean())(model)
        ...     return mm.microbatch(grad_fn, 0, 2)(x)  # grad_fn closes over `model`
        >>> loss, grads = mm.jit(step)(model, jnp.ones((4, 3)))
        >>> grads["kernel"].get_value().shape
        (3, 1)
    """
    if "trace_once" in options:
        return core_microbatch(fun, dim, size, argnum, **options)
    once = core_microbatch(fun, dim, size, argnum, **options)
    each = core_microbatch(fun, dim, size, argnum, trace_once=False, **options)
    closes = _closes_over_graph_objects(fun)

    @functools.wraps(fun)
    def microbatched(*args: Any, **kwargs: Any) -> Any:
        if closes or has_graph_objects(args, kwargs):
            return each(*args, **kwargs)
        return once(*args, **kwargs)

    return microbatched


def jit(
    fun: Callable[..., Any],
    *,
    devices: Any = None,
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
) -> GraphJit:
    """Like :func:`multimesh_flax.core.jit`, and NNX graph objects may be arguments.

    Modules, ``nnx.Optimizer`` and ``nnx.Rngs`` passed in (as arguments, or inside a top-level
    tuple, list or dict) are carried through the MPMD program as state and updated in place
    afterwards, like ``nnx.jit``: parameters and optimizer state of ``Task[Block]`` modules
    stay on their tasks' submeshes; their old arrays are donated.

    Args:
        fun: the function to compile.
        devices: the device list that ``TaskMesh`` positions index.
        static_argnums: positional arguments treated as compile-time constants.
        donate_argnums: positional arguments whose buffers the program may reuse (the
            state of graph objects is always donated).

    Returns:
        A callable with ``fun``'s signature; ``.describe(*args)`` dumps its program.

    Raises:
        ParallelizeArgumentError: ``fun`` is not callable, or ``devices`` is empty.
        StaticArgumentError: malformed ``static_argnums``/``donate_argnums``.
        GraphArgumentError: ``fun`` returns an NNX graph object.

    Example:
        >>> import optax
        >>> from flax import nnx
        >>> import multimesh_flax as mm
        >>> model = mm.task(nnx.Linear, mesh=mm.TaskMesh(devices=[1]))(3, 1, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> @mm.jit
        ... def train_step(model, optimizer, x):
        ...     loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        ...     optimizer.update(model, grads)
        ...     return loss
        >>> losses = [float(train_step(model, optimizer, jnp.ones((4, 3)))) for _ in range(3)]
        >>> losses[2] < losses[0], [d.id for d in model.kernel.get_value().devices()]
        (True, [1])
    """
    plain = core_jit(
        fun, devices=devices, static_argnums=static_argnums, donate_argnums=donate_argnums
    )
    return GraphJit(fun, plain)
