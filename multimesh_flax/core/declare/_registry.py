"""Name-based tasks: ``register_task``, registries (``Context``) and name matching.

A *registration* pairs a regex (the *matcher*) with a way to build a ``Task``: a fixed
``task``, or ``callback(matched_name, backprop) -> Task``. Registrations live in a ``Context``.
Contexts entered with ``with ctx:`` form a thread-local stack on top of a process-wide default
context; ``register_task`` adds to the innermost active one. ``MultiMesh`` is a ``Context``.

Matching (what :func:`find_match` does for one name): active contexts are searched innermost
first and, inside one context, the latest registration first, so inner contexts and later
registrations win. A matcher matches a name when ``re.fullmatch`` succeeds; the *matched
name* is the matcher's first group (the whole match when the matcher has no group, or the
group did not take part). Which names are tried -- named-scope components and Flax module
paths -- is decided by ``_named_tasks``, which also turns matches into tasks during a trace.

The name ``"default"`` is special: the task registered for it receives glue that has no placed
input and no placed consumer (see ``fragment._place``).

This module only stores and matches; it knows nothing about meshes or tracing.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Callable
from typing import Any

from multimesh_flax import errors
from multimesh_flax.core.declare import _thread
from multimesh_flax.core.declare._task import Task

TaskCallback = Callable[[str, bool], Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Registration:
    """One ``register_task`` call: a compiled matcher and its task or callback."""

    pattern: re.Pattern[str]
    callback: TaskCallback | None
    task: Task | None
    module_class: type | None = None  # only modules of this class (and subclasses) match

    def matches_class(self, module_class: type | None) -> bool:
        """Whether a module of ``module_class`` (``None``: a named scope) may match."""
        if self.module_class is None:
            return True
        return module_class is not None and issubclass(module_class, self.module_class)

    def matched_name(self, name: str) -> str | None:
        """The matched name for ``name``, or ``None`` if the matcher does not match it."""
        found = self.pattern.fullmatch(name)
        if found is None:
            return None
        if self.pattern.groups and found.group(1) is not None:
            return found.group(1)
        return found.group(0)


@dataclasses.dataclass(frozen=True)
class Match:
    """A registration that matched, and the name it matched."""

    registration: Registration
    name: str


def _compile(matcher: Any) -> re.Pattern[str]:
    if isinstance(matcher, re.Pattern):
        return matcher
    if not isinstance(matcher, str):
        raise errors.InvalidMatcherError(
            f"Expected `matcher` to be a regex string such as 'layer_(\\d+)', got "
            f"{type(matcher).__name__}: {matcher!r}."
        )
    try:
        return re.compile(matcher)
    except re.error as e:
        raise errors.InvalidMatcherError(
            f"`matcher`={matcher!r} is not a valid regular expression ({e}). Escape "
            "special characters with `re.escape` to match a literal name."
        ) from e


def _check_module_class(module_class: Any, matcher: Any) -> re.Pattern[str]:
    """The pattern of a class registration (``matcher``, or any name)."""
    if not isinstance(module_class, type):
        raise errors.TaskTypeError(
            f"Expected `module_class` to be a Flax module class such as `nn.Dense` or "
            f"`nnx.Linear`, got {type(module_class).__name__}: {module_class!r}. Pass the "
            "class itself, not an instance."
        )
    return _compile(".*" if matcher is None else matcher)


def make_registration(
    matcher: Any,
    callback: TaskCallback | None,
    task: Task | None,
    module_class: type | None = None,
) -> Registration:
    """Validates ``register_task``'s arguments and builds the registration."""
    if module_class is not None:
        pattern = _check_module_class(module_class, matcher)
    elif matcher is None:
        raise errors.InvalidMatcherError(
            "Expected a `matcher` (a regex such as 'layer_(\\d+)') or a `module_class`, got "
            "neither. Pass one of them."
        )
    else:
        pattern = _compile(matcher)
    if (callback is None) == (task is None):
        got = "neither" if callback is None else "both"
        raise errors.TaskRegistrationError(
            f"Expected exactly one of `callback` and `task` for matcher {pattern.pattern!r}, "
            f"got {got}. Pass `task=Task(...)` for a fixed task, or `callback=fn` with "
            "`fn(matched_name, backprop) -> Task`."
        )
    if callback is not None and not callable(callback):
        raise errors.TaskCallbackError(
            f"Expected `callback` for matcher {pattern.pattern!r} to be a function "
            f"`(matched_name, backprop) -> Task`, got {type(callback).__name__}: {callback!r}. "
            "Pass a function, or `task=Task(...)` for a fixed task."
        )
    if task is not None and not isinstance(task, Task):
        raise errors.TaskTypeError(
            f"Expected `task` for matcher {pattern.pattern!r} to be a Task, got "
            f"{type(task).__name__}: {task!r}. Pass `task=Task(...)`, e.g. "
            "`Task(mesh_slice={'stage': 0})`."
        )
    return Registration(pattern=pattern, callback=callback, task=task, module_class=module_class)


class Context:
    """A registry of name-based tasks, active inside ``with context:``.

    Registrations of the innermost active context win over those of outer ones; the
    process-wide default context (where ``register_task`` adds outside every ``with``) is the
    outermost. Within one context, a later registration wins over an earlier one that
    matches the same name. Entering a context is reentrant and thread-local.

    Example:
        >>> import multimesh_flax as mm
        >>> def f(x):
        ...     with jax.named_scope("head"):
        ...         return x + 1
        >>> outer, inner = mm.Context(), mm.Context()
        >>> outer.register_task("head", task=mm.Task(mesh=mm.TaskMesh(devices=[1])))
        >>> inner.register_task("head", task=mm.Task(mesh=mm.TaskMesh(devices=[2])))
        >>> with outer:
        ...     with inner:
        ...         y = mm.jit(f)(jnp.ones(2))
        ...     z = mm.jit(f)(jnp.ones(2))
        >>> [d.id for d in y.devices()], [d.id for d in z.devices()]
        ([2], [1])
    """

    def __init__(self) -> None:
        self._registrations: list[Registration] = []
        self._version = 0
        self._entered = False  # ever used as ``with context:`` (see inactive_contexts)

    @property
    def registrations(self) -> tuple[Registration, ...]:
        """The registrations of this context, oldest first."""
        return tuple(self._registrations)

    def register_task(
        self,
        matcher: str | re.Pattern[str] | None = None,
        *,
        callback: TaskCallback | None = None,
        task: Any = None,
        module_class: type | None = None,
    ) -> None:
        """Registers a name-based task in this context (see :func:`register_task`)."""
        self._registrations.append(make_registration(matcher, callback, task, module_class))
        self._version += 1
        _WITH_REGISTRATIONS.add(self)

    def __enter__(self) -> Context:
        _thread.STATE.contexts.append(self)
        self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        _thread.STATE.contexts.pop()


_DEFAULT = Context()

# Every live context that holds registrations, to notice one used outside its ``with``.
_WITH_REGISTRATIONS: weakref.WeakSet[Context] = weakref.WeakSet()


def inactive_contexts() -> list[Context]:
    """Live contexts with registrations that have never been entered (``with``).

    Those are the likely mistakes (tasks registered on a ``MultiMesh`` that is then never
    made active). A context that was entered before is left alone when it is not active
    now: the user knows its ``with``, and it may just be kept alive by a step built in it.
    """
    active = {id(ctx) for ctx in active_contexts()}
    return [
        ctx
        for ctx in list(_WITH_REGISTRATIONS)
        if id(ctx) not in active and not getattr(ctx, "_entered", False)
    ]


def active_contexts() -> list[Context]:
    """The active contexts, innermost first, ending with the process-wide default."""
    return [*reversed(_thread.STATE.contexts), _DEFAULT]


def has_registrations() -> bool:
    """Whether any active context holds a registration (cheap; checked on hot paths)."""
    return any(ctx._registrations for ctx in active_contexts())


def registrations_fingerprint() -> tuple[tuple[int, int], ...]:
    """Identifies the active registrations, for caches keyed by what a trace would match."""
    return tuple((id(ctx), ctx._version) for ctx in active_contexts() if ctx._registrations)


def find_match(*names: str, module_class: type | None = None) -> Match | None:
    """The winning registration for the first of ``names`` it matches, or ``None``.

    Registrations are tried in priority order (innermost context first, latest first);
    for each, ``names`` are tried in order. ``module_class``: the class of the module the
    names belong to (``None`` for a named scope), for registrations by ``module_class``.
    """
    for ctx in active_contexts():
        for registration in reversed(ctx._registrations):
            if not registration.matches_class(module_class):
                continue
            for name in names:
                matched = registration.matched_name(name)
                if matched is not None:
                    return Match(registration, matched)
    return None


def register_task(
    matcher: str | re.Pattern[str] | None = None,
    *,
    callback: TaskCallback | None = None,
    task: Any = None,
    module_class: type | None = None,
) -> None:
    """Registers a name-based task in the innermost active ``Context``.

    During ``jit``/``parallelize`` tracing, ``matcher`` is matched (``re.fullmatch``) against
    the names of ``jax.named_scope`` scopes and against Flax module paths (``layer_0``,
    ``block/layer_0``) and names (``layer_0``). Everything traced inside a matched scope or
    module runs as the task: forward and backward on its submesh, its logical rules active for
    ``with_sharding_constraint`` and for Flax's ``nn.with_logical_constraint`` and
    ``nn.with_logical_partitioning`` metadata. The innermost match (or explicit ``task``) wins.
    One matched name is one task per trace, wherever it occurs. A scope name containing ``/``
    is several nested scopes. Registered tasks act only while ``jit``/``parallelize`` trace;
    called eagerly, the program computes the same values without moving anything.

    **Classes inside modules you do not own.** ``module_class=Block`` matches every module
    of that class (or a subclass) wherever another module creates it, by its path
    (``encoder/layers_0`` for Linen, ``blocks/0`` for NNX; ``matcher``, if given, must also
    match the path): each instance is its own task, named by its path. No module namespace
    needs patching.

    Args:
        matcher: a regular expression; its first group, if any, is the *matched name*.
            Optional with ``module_class``.
        callback: ``callback(matched_name, backprop) -> Task``, called once per trace for the
            forward (``backprop=False``) and, if the program differentiates it, the backward
            (``backprop=True``). A backward ``Task`` equal field by field to the forward one
            is the same task.
        task: a fixed ``Task`` for every matched name (an unnamed one takes the matched
            name). Exactly one of ``callback`` and ``task`` is required.

        module_class: a Flax module class (Linen or NNX): match its instances by class.

    Raises:
        InvalidMatcherError: ``matcher`` is not a valid regular expression, or neither
            ``matcher`` nor ``module_class`` is given.
        TaskRegistrationError: neither or both of ``callback`` and ``task``.
        TaskCallbackError: ``callback`` is not callable (and, at trace time, when it returns
            something other than a ``Task``).
        TaskTypeError: ``task`` is not a ``Task``, or ``module_class`` is not a class.

    Example:
        >>> import multimesh_flax as mm
        >>> def two_stages(name, backprop):
        ...     return mm.Task(mesh=mm.TaskMesh(devices=[int(name)]))
        >>> def f(x):
        ...     with jax.named_scope("stage_0"):
        ...         x = x * 2
        ...     with jax.named_scope("stage_1"):
        ...         return x + 1
        >>> with mm.Context():
        ...     mm.register_task(r"stage_(\\d)", callback=two_stages)
        ...     y = mm.jit(f)(jnp.ones(2))
        >>> y.tolist(), [d.id for d in y.devices()]
        ([3.0, 3.0], [1])
    """
    active_contexts()[0].register_task(
        matcher, callback=callback, task=task, module_class=module_class
    )
