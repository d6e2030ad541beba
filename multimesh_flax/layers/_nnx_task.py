"""``Task[Block]`` for Flax NNX: an ``nnx.Module`` class whose instances run as a task.

``task(Block, mesh=...)`` (``Block`` an ``nnx.Module`` subclass) returns a *subclass* of
``Block`` named ``Task[Block]``. It has ``Block``'s constructor and call signature, and its
variables have exactly ``Block``'s names, so ``nnx.state``/``nnx.update`` move state between a
plain and a task-wrapped model.

**Born on the submesh.** Constructing ``Task[Block](cfg, rngs=rngs)`` runs ``Block.__init__``
under ``nnx.jit`` with NNX eager sharding off, and constrains every variable to the task's
submesh, sharded by its ``out_sharding`` logical names through the task's rules
(:func:`multimesh_flax.core.logical_to_mesh_spec`). The variables are created there and
nowhere else; each records its placement as the metadata ``task_sharding`` (NNX copies
metadata into ``nnx.Optimizer`` state, so the optimizer state of a parameter knows it too).
Inside a trace (``nnx.eval_shape``, ``nnx.jit``, an enclosing constructor under them) the
constructor only adds the constraints and the metadata.

**Calls** go through the one task call (``core/front/_task_call``), as function and Linen
tasks do. Inside ``multimesh_flax.jit`` a call runs as the task: the task's marker scope, its
rules for ``with_sharding_constraint`` and Flax's logical API, and its variables read through
constraints on its submesh, forward and backward. Traced by ``jax.jit``/``nnx.jit`` it warns
(``PlacementWarning``), like the other kinds. Called eagerly, it is the plain module run on the
task's submesh (array arguments move there). Under ``ignore_transforms`` it is exactly
``Block``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    Task,
    call_recomputed,
    check_rules_have_mesh,
    get_flag,
    has_registrations,
    logical_to_mesh_spec,
    make_task,
    nnx_transform,
)
from multimesh_flax.core.front import (
    EagerRunner,
    TaskCall,
    call_on_submesh,
    call_task,
    eager_mesh,
    move_array,
    run_as,
)
from multimesh_flax.core.trace import (
    ResolvedTask,
    constrain_to_task,
    current_session,
    current_task,
    registry_state,
    resolve_task,
)

TASK_SHARDING = "task_sharding"  # Variable metadata: where a task-born variable lives
_INSTANCE_KEY = "_mm_task_key"  # static attribute: one task per instance per trace
_KEYS = itertools.count()


# --- resolving and constraining ---------------------------------------------------------


def is_tracing() -> bool:
    """Whether JAX is tracing here (``jit``, ``eval_shape``, ``grad``) rather than eager."""
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def resolve(module: nnx.Module, spec: Task) -> ResolvedTask:
    """The ``ResolvedTask`` of a task module: one per instance per trace session."""
    name = spec.name or type(module).wrapped_module.__name__
    session = current_session()
    if session is None:
        return resolve_task(spec, name)
    return session.resolve_module(("nnx", getattr(module, _INSTANCE_KEY, id(module))), spec, name)


def _logical_spec(variable: nnx.Variable) -> PartitionSpec:
    names = variable.get_metadata().get("out_sharding")
    if names is None:
        return PartitionSpec()
    return names if isinstance(names, PartitionSpec) else PartitionSpec(*names)


def _check_names_mapped(path: tuple[Any, ...], logical: PartitionSpec, resolved: Any) -> None:
    known = {name for name, _ in resolved.rules}
    for entry in logical:
        for name in (entry,) if isinstance(entry, str) else tuple(entry or ()):
            if name not in known:
                where = "/".join(map(str, path))
                raise errors.UnmappedLogicalAxisError(
                    f"Variable {where!r} is annotated with logical axis {name!r} "
                    f"(out_sharding={tuple(logical)!r}), but task {resolved.name!r} has no "
                    f"rule for it (rules: {resolved.rules!r}). Add a rule to `logical_axes`, "
                    f"e.g. ({name!r}, None) to replicate it or ({name!r}, '<mesh axis>')."
                )


def variable_sharding(
    path: tuple[Any, ...], variable: nnx.Variable, resolved: ResolvedTask
) -> NamedSharding:
    """Where ``variable`` lives in task ``resolved``: its logical names through the rules.

    Raises:
        UnmappedLogicalAxisError: a logical name no rule of the task mentions.
        UnevenShardingError: a dimension that does not divide its shard count.
    """
    logical = _logical_spec(variable)
    _check_names_mapped(path, logical, resolved)
    value = variable.get_value()
    spec = logical_to_mesh_spec(
        logical, jnp.shape(value), dict(resolved.mesh.shape), resolved.rules
    )
    return NamedSharding(resolved.mesh, spec)


def own_variables(module: nnx.Module) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
    """``(path, variable)`` for every array variable of ``module`` (submodules included)."""
    return [
        (path, v)
        for path, v in nnx.iter_graph(module)
        if isinstance(v, nnx.Variable) and hasattr(v.get_value(), "shape")
    ]


def place_variables(module: nnx.Module, resolved: ResolvedTask, *, record: bool = True) -> None:
    """Constrains every variable of ``module`` onto the task's submesh; ``record``: also
    writes the placement into its metadata (at construction; a call leaves the metadata, and
    so the state's tree structure, as it is)."""
    for path, variable in own_variables(module):
        sharding = variable_sharding(path, variable, resolved)
        variable.set_value(constrain_to_task(variable.get_value(), sharding.spec, resolved))
        if record:
            variable.set_metadata(**{TASK_SHARDING: sharding})


# --- construction -------------------------------------------------------------------------


def _split_graph_args(args: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The NNX graph objects among ``args`` (``Rngs``, modules) and a function that puts
    replacements back (everything else is closed over)."""
    leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=_is_graph_object)
    where = [i for i, leaf in enumerate(leaves) if _is_graph_object(leaf)]

    def rebuild(nodes: list[Any]) -> Any:
        new = list(leaves)
        for i, node in zip(where, nodes, strict=True):
            new[i] = node
        return jax.tree_util.tree_unflatten(treedef, new)

    return [leaves[i] for i in where], rebuild


def _is_graph_object(x: Any) -> bool:
    return isinstance(x, nnx.Pytree)


def _init_unsharded(node: nnx.Module, args: Any, kwargs: Any) -> None:
    """``Block.__init__`` with NNX eager sharding off (the task places the variables)."""
    try:
        with nnx.use_eager_sharding(False):
            node.__init__(*args, **kwargs)
    except ValueError as e:
        if "auto mesh context or metadata is required" not in str(e):
            raise
        raise errors.UnplacedVariableError(
            f"{type(node).__name__} creates a variable that asks NNX to shard it eagerly "
            f"(metadata eager_sharding=True) with no mesh set: {e} Drop eager_sharding=True "
            "(the task places its variables itself) or construct it inside jax.set_mesh(mesh)."
        ) from e


def _construct_traced(cls: type, node: nnx.Module, args: Any, kwargs: Any) -> None:
    _init_unsharded(node, args, kwargs)
    object.__setattr__(node, _INSTANCE_KEY, next(_KEYS))
    place_variables(node, resolve(node, cls.task_spec))


def _construct_eager(cls: type, node: nnx.Module, args: Any, kwargs: Any) -> None:
    nodes, rebuild = _split_graph_args((args, kwargs))

    def build(graph_objects: list[Any]) -> nnx.Module:
        inner_args, inner_kwargs = rebuild(graph_objects)
        return cls(*inner_args, **inner_kwargs)  # traced: constraints and metadata only

    # ``Rngs`` and other graph objects go in replicated on the submesh and come back where
    # they were, so that the next task (on another submesh) can take them too.
    state = nnx.state(nodes)
    before = jax.tree_util.tree_map(lambda x: x.sharding, state)
    replicated = NamedSharding(resolve(node, cls.task_spec).mesh, PartitionSpec())
    nnx.update(nodes, jax.tree_util.tree_map(lambda x: jax.device_put(x, replicated), state))
    try:
        born = nnx.jit(build)(nodes)
    finally:
        nnx.update(nodes, jax.device_put(nnx.state(nodes), before))
    for name, value in vars(born).items():  # ``born`` is fresh: its parts become ``node``'s
        object.__setattr__(node, name, value)


def construct(cls: type, node: nnx.Module, *args: Any, **kwargs: Any) -> None:
    """``Task[Block]``'s construction hook (NNX's ``_pytree_meta_construct``)."""
    if get_flag("ignore_transforms"):
        _init_unsharded(node, args, kwargs)
        return
    if is_tracing():
        _construct_traced(cls, node, args, kwargs)
    else:
        _construct_eager(cls, node, args, kwargs)


# --- calls ------------------------------------------------------------------------------


def call_as_task(
    module: nnx.Module, spec: Task, method: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """Runs ``method(module, *args, **kwargs)`` (the wrapped ``__call__``, unbound) as
    ``spec``'s task, through the one task call (``core/front/_task_call.call_task``)."""
    if spec.name is None:
        spec = dataclasses.replace(spec, name=type(module).wrapped_module.__name__)
    return call_task(_task_call_of(module, spec, method), args, kwargs)


def _task_call_of(module: nnx.Module, spec: Task, method: Callable[..., Any]) -> TaskCall:
    """The NNX adapter: one task per instance per trace, the module's variable values
    reveal a trace, the variables are read through constraints on the submesh inside the
    task, recomputation checkpoints over the module's state (split and merged), and an
    eager call runs the module op by op on the submesh."""
    fun, transform = nnx_transform(module, method)
    return TaskCall(
        spec=spec,
        body=fun,
        eager=_eager_runner(module, spec, method),
        transform=transform,
        key=("nnx", getattr(module, _INSTANCE_KEY, id(module))),
        state=[v.get_value() for _, v in own_variables(module)],
        place=lambda resolved: _placed_variables(module, resolved),
        unstaged=_unstaged_runner(module, spec, fun, transform),
    )


def _unstaged_runner(module: nnx.Module, spec: Task, fun: Any, transform: Any) -> EagerRunner:
    """Under a JAX transformation that is not ours (``jax.grad``, ``jax.vmap``,
    ``jax.checkpoint`` outside every jit): the module's body on its submesh (where its
    variables live; its array arguments moved there), recomputed as its policy says (its
    results released by ``call_task``, as an eager call's are)."""

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        resolved = resolve(module, spec)
        replicated = NamedSharding(resolved.typed_mesh, PartitionSpec())
        moved = jax.tree_util.tree_map(lambda x: move_array(x, replicated), (args, kwargs))
        with eager_mesh(resolved):
            return call_recomputed(fun, moved[0], moved[1], spec.recompute, transform)

    return run


def _eager_runner(module: nnx.Module, spec: Task, method: Callable[..., Any]) -> EagerRunner:
    """An eager NNX call: the wrapped method op by op, transforms off, its array arguments
    moved onto the task's submesh (replicated), where the module's variables were born."""

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        resolved = resolve(module, spec)
        return call_on_submesh(resolved, functools.partial(method, module), args, kwargs)

    return run


@contextlib.contextmanager
def _placed_variables(module: nnx.Module, resolved: ResolvedTask) -> Iterator[None]:
    """The module's variables read through constraints on the task's submesh; their values
    are restored afterwards unless the call wrote them."""
    variables = own_variables(module)
    originals = [v.get_value() for _, v in variables]
    place_variables(module, resolved, record=False)
    read = [v.get_value() for _, v in variables]
    try:
        yield
    finally:
        for (_, v), original, constrained in zip(variables, originals, read, strict=True):
            if v.get_value() is constrained:  # not written by the call itself
                v.set_value(original)


# --- name-based tasks (register_task) ------------------------------------------------------


def _call_as_registered(module: nnx.Module, method: Callable[..., Any], args: Any, kw: Any) -> Any:
    """Runs ``method(module, ...)`` of a module matched by ``register_task`` as the matched
    task."""
    session = current_session()
    if get_flag("ignore_transforms") or session is None:
        return method(module, *args, **kw)
    state = registry_state(session)
    resolved = state.resolve(type(module).registered_match, False)
    state.modules.add(resolved.uid)
    if current_task() is resolved:
        return method(module, *args, **kw)
    return run_as(resolved, _task_call_of(module, resolved.task, method), args, kw)


_REGISTERED_CLASSES: dict[tuple[type, str, Any], type] = {}


def _registered_class(block: type, path: str, match: Any) -> type:
    """A subclass of ``block`` whose calls run as the registered task ``match``."""
    key = (block, path, match.registration)
    if key not in _REGISTERED_CLASSES:

        def __call__(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
            return _call_as_registered(self, block.__call__, args, kwargs)

        namespace = {
            "__call__": __call__,
            "__module__": block.__module__,
            "registered_match": match,
            "registered_path": path,
        }
        cls = type(block)(block.__name__, (block,), namespace)
        cls.__qualname__ = block.__qualname__
        _REGISTERED_CLASSES[key] = cls
    return _REGISTERED_CLASSES[key]


def enter_registered_tasks(nodes: Sequence[Any]) -> None:
    """Makes the NNX modules among ``nodes`` that a ``register_task`` matcher matches by
    attribute path (``blocks/0/attn``, or the last attribute, ``attn``) run as their tasks.

    ``nodes`` are graph objects merged inside a trace (``jit`` merges fresh copies), so
    their classes are swapped for a subclass that enters the task: NNX's own transforms
    inside the trace (``nnx.value_and_grad``) copy the swapped classes along.
    """
    session = current_session()
    if session is None or not has_registrations():
        return
    state = registry_state(session)
    for node in nodes:
        if not isinstance(node, nnx.Module):
            continue
        for path, module in nnx.iter_modules(node):
            if not path or task_spec_of(module) is not None:
                continue
            name = "/".join(map(str, path))
            match = state.match(name, str(path[-1]), module_class=type(module))
            if match is not None and not hasattr(type(module), "registered_match"):
                module.__class__ = _registered_class(type(module), name, match)


# --- the Task[Block] class --------------------------------------------------------------


def _make_task_class(block: type[nnx.Module], spec: Task) -> type[nnx.Module]:
    def __call__(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        return call_as_task(self, spec, block.__call__, args, kwargs)

    namespace = {
        "__call__": __call__,
        "_pytree_meta_construct": classmethod(construct),
        "__module__": block.__module__,
        "__doc__": f"``{block.__name__}`` running as a task (``multimesh_flax.task``).",
        "task_spec": spec,
        "wrapped_module": block,
    }
    cls = type(block)(f"Task[{block.__name__}]", (block,), namespace)
    cls.__qualname__ = cls.__name__
    return cls


def is_nnx_class(model: Any) -> bool:
    """Whether ``model`` is an ``nnx.Module`` subclass."""
    return isinstance(model, type) and issubclass(model, nnx.Module)


def task(
    block: type[nnx.Module],
    name: str | None = None,
    *,
    task: Task | None = None,
    **kwargs: Any,
) -> type[nnx.Module]:
    """Wraps an ``nnx.Module`` class so that each instance runs as a task on its submesh.

    Args:
        block: an ``nnx.Module`` subclass (``nnx.Linear``, your ``Block``, ...).
        name: the task's display name (default: ``block``'s class name).
        task: a ready ``Task``; exclusive with ``kwargs``.
        **kwargs: ``mesh`` (a ``TaskMesh`` or ``jax.sharding.Mesh``), ``mesh_slice``,
            ``devices`` with ``device_axes``, ``logical_axes``, or any ``Task`` field
            (``recompute="full"``: the backward recomputes the block's activations).

    Returns:
        A subclass of ``block`` named ``Task[<Block>]`` with ``block``'s constructor.

    Raises:
        TaskTypeError: ``block`` is not an ``nnx.Module`` class (an instance, say).
        InvalidTaskError: ``logical_axes`` without mesh axes, or contradictory options.

    Example:
        >>> from flax import nnx
        >>> import multimesh_flax as mm
        >>> Linear = mm.task(nnx.Linear, mesh=mm.TaskMesh(devices=[2, 3], axis_names=("x",)),
        ...                  logical_axes=[("out", "x"), ("in", None)])
        >>> init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("in", "out"))
        >>> layer = Linear(3, 4, kernel_init=init, rngs=nnx.Rngs(0))
        >>> kernel = layer.kernel.get_value()
        >>> kernel.sharding.spec, sorted(d.id for d in kernel.devices())
        (P(None, 'x'), [2, 3])
        >>> layer(jnp.ones((2, 3))).shape
        (2, 4)
    """
    _check_block(block)
    if task is None:
        check_rules_have_mesh(kwargs)
    return _make_task_class(block, make_task(name, task, kwargs))


def _check_block(block: Any) -> None:
    if is_nnx_class(block):
        return
    got = (
        f"an instance of {type(block).__name__}"
        if isinstance(block, nnx.Module)
        else f"{type(block).__name__}: {block!r}"
    )
    raise errors.TaskTypeError(
        f"Expected an NNX module class (a subclass of flax.nnx.Module) such as `nnx.Linear`, "
        f"got {got}. Pass the class and construct the wrapped class: "
        "`Task = task(Block, ...); model = Task(<Block's arguments>)`."
    )


def task_spec_of(module: Any) -> Task | None:
    """The ``Task`` of a ``Task[Block]`` class or instance, else ``None``."""
    cls = module if isinstance(module, type) else type(module)
    return getattr(cls, "task_spec", None)
