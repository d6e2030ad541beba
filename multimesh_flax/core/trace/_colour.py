"""Registered tasks during a trace: matching names, entering tasks, colouring equations.

``_registry`` stores matchers; this module makes them act while ``jit``/``parallelize``
trace a program, so that a registered task behaves like an explicit ``task``:

* **Flax modules.** ``trace_program`` traces under :func:`intercept_flax_modules`, a
  ``flax.linen.intercept_methods`` interceptor. A module method whose module path
  (``"/".join(module.path)``, e.g. ``block/layer_0``) or name (``layer_0``; the class name for
  the top-level module -- exactly the scope Flax adds to JAX's name stack) matches runs inside
  the task: its marker scope, its rules for ``with_sharding_constraint``, and
  :func:`flax_rules` for Flax's own ``nn.with_logical_constraint`` and
  ``LogicallyPartitioned`` parameters.
* **Named scopes.** JAX offers no hook when a ``jax.named_scope`` opens, so scopes are matched
  from name stacks: at trace time by :func:`current_task` (which ``with_sharding_constraint``
  uses), after tracing by :func:`colour_equations`, which colours every equation by the
  innermost explicit marker or matching scope component of its name stack. Under
  ``transpose(`` the component belongs to the backward pass, which runs as
  ``callback(name, True)``'s task.

Each (registration, matched name, backprop) is resolved once per trace session; labels are
cached per name-stack string, so colouring costs one regex pass per distinct stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
from flax import linen as nn
from jax._src import source_info_util
from jax.sharding import AbstractMesh, NamedSharding

from multimesh_flax import errors
from multimesh_flax.core.declare import (
    STATE,
    Match,
    Phase,
    Registration,
    Task,
    active_contexts,
    call_recomputed,
    closest_names,
    effective,
    find_match,
    get_flag,
    has_registrations,
    inactive_contexts,
    linen_transform,
    use_device_list,
    warn_placement,
)
from multimesh_flax.core.trace import _session
from multimesh_flax.core.trace._program import Equation, each_distinct

_TRANSFORM = re.compile(r"^\w+\((.*)\)$")
_EMPTY_MESH = AbstractMesh((), ())


def _current_name_stack() -> str:
    # JAX has no public accessor for the name stack being traced; ``source_info_util`` is
    # where ``jax.named_scope`` keeps it. Its string is the one equations carry.
    return str(source_info_util.current_name_stack())


def _components(stack: str) -> list[tuple[str, int]]:
    """``(scope name, offset in stack)`` per component, transform wrappers removed."""
    found, offset = [], 0
    for part in stack.split("/"):
        start, name = offset, part
        wrapped = _TRANSFORM.match(name)
        while wrapped:
            start += name.index("(") + 1
            name = wrapped.group(1)
            wrapped = _TRANSFORM.match(name)
        if name:
            found.append((name, start))
        offset += len(part) + 1
    return found


def _same_task(a: Task, b: Task) -> bool:
    if a is b:
        return True
    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a))


class _SessionState:
    """Matching and resolving registered tasks in one trace session; what it learns is kept
    on the session (``TraceSession.registered``)."""

    def __init__(self, session: _session.TraceSession) -> None:
        self.session = session
        learnt = session.registered
        learnt.used = True
        self.resolved = learnt.resolved
        self.origin = learnt.origin
        self.matches = learnt.matches
        self.labels = learnt.labels
        self.modules = learnt.modules

    def match(self, *names: str, module_class: type | None = None) -> Match | None:
        """The winning registration for ``names`` (see ``_registry.find_match``), cached;
        ``module_class``: the class of the module they name (``None``: a named scope)."""
        key = (names, module_class)
        if key not in self.matches:
            self.matches[key] = find_match(*names, module_class=module_class)
        return self.matches[key]

    def resolve(self, match: Match, backprop: bool) -> _session.ResolvedTask:
        """The task of ``match`` for the forward or backward pass (resolved once)."""
        key = (match.registration, match.name, backprop)
        if key not in self.resolved:
            spec = task_for(match, backprop)
            fwd = self.resolve(match, False) if backprop else None
            if fwd is not None and _same_task(spec, fwd.task):
                self.resolved[key] = fwd
            else:
                resolved = _resolve(spec, match)
                self.session.tasks[resolved.uid] = resolved
                self.origin[resolved.uid] = match
                self.resolved[key] = resolved
        return self.resolved[key]

    def stack_label(self, stack: str) -> _session.Label | None:
        """The label of an equation with name stack ``stack`` (innermost task wins)."""
        if stack not in self.labels:
            self.labels[stack] = self._find_label(stack)
        return self.labels[stack]

    def _find_label(self, stack: str) -> _session.Label | None:
        for name, offset in reversed(_components(stack)):
            backprop = "transpose(" in stack[:offset]
            marker = _session.MARKER_RE.match(name)
            if marker is not None:
                uid = int(marker.group(1))
                if uid not in self.session.tasks:
                    continue
                if backprop and uid in self.origin:
                    uid = self.resolve(self.origin[uid], True).uid
            else:
                match = self.match(name)
                if match is None:
                    continue
                uid = self.resolve(match, backprop).uid
            return _session.Label(uid, Phase.B if backprop else Phase.F)
        return None


def registry_state(session: _session.TraceSession) -> _SessionState:
    """Matching and resolving registered tasks in ``session`` (``match``, ``resolve``, and the
    module uids it entered, ``modules``); what it learns is kept on the session."""
    return _SessionState(session)


def task_for(match: Match, backprop: bool) -> Task:
    registration = match.registration
    if registration.task is not None:
        return registration.task
    spec = registration.callback(match.name, backprop)  # type: ignore[misc]
    if not isinstance(spec, Task):
        raise errors.TaskCallbackError(
            f"The callback of matcher {registration.pattern.pattern!r} returned "
            f"{type(spec).__name__}: {spec!r} for matched name {match.name!r} "
            f"(backprop={backprop}); expected a Task. Return e.g. "
            "`Task(mesh_slice={'stage': 0})`."
        )
    return spec


def _resolve(spec: Task, match: Match) -> _session.ResolvedTask:
    try:
        return _session.resolve_task(spec, match.name)
    except errors.MultiMeshError as e:
        raise type(e)(
            f"{e} (task registered for matcher {match.registration.pattern.pattern!r}, "
            f"matched name {match.name!r})"
        ) from e


def default_task() -> _session.ResolvedTask | None:
    """The task registered for the name ``"default"``, resolved, or ``None``.

    It decides where glue goes that has no placed input and no placed consumer (and unused
    program inputs); without it that is the first task's submesh.
    """
    match = find_match("default")
    if match is None:
        return None
    return _resolve(task_for(match, False), match)


# --- trace time -----------------------------------------------------------------------------


def current_task() -> _session.ResolvedTask | None:
    """The innermost task being traced: explicit, registered Flax module, or named scope.

    Without active registrations this is ``_session.current_task()``. With them, the current
    name stack decides; the explicit task stack is the fallback (a nested ``jax.jit`` starts
    a fresh name stack).
    """
    explicit = _session.current_task()
    session = _session.current_session()
    if session is None or not has_registrations():
        return explicit
    label = registry_state(session).stack_label(_current_name_stack())
    return explicit if label is None else session.tasks[label.task]


@contextlib.contextmanager
def abstract_mesh(mesh: AbstractMesh) -> Iterator[None]:
    """``mesh`` as the ambient abstract mesh, through the empty mesh (``use_abstract_mesh``
    refuses to change a mesh's size directly)."""
    with jax.sharding.use_abstract_mesh(_EMPTY_MESH), jax.sharding.use_abstract_mesh(mesh):
        yield


@contextlib.contextmanager
def flax_rules(resolved: _session.ResolvedTask) -> Iterator[None]:
    """Makes Flax's logical API resolve through ``resolved``'s rules onto its mesh.

    Sets ``nn.logical_axis_rules`` and the task's abstract mesh (which Flax requires before
    it applies any logical constraint). The abstract mesh passes through the empty mesh
    because ``jax.sharding.use_abstract_mesh`` refuses to change a mesh's size directly.
    Constraints made this way name the abstract mesh; :func:`concretise_constraints` puts
    them back on the task's devices after tracing.
    """
    STATE.flax_rules.append(resolved.uid)
    try:
        with (
            nn.logical_axis_rules(resolved.rules),
            abstract_mesh(resolved.ambient_mesh),
        ):
            yield
    finally:
        STATE.flax_rules.pop()


def module_names(module: nn.Module) -> tuple[str, ...]:
    name = module.name or type(module).__name__
    path = tuple(module.path) if module.scope is not None else ()
    return ("/".join(path), name) if path else (name,)


def _intercept(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
    session = _session.current_session()
    if session is None or get_flag("ignore_transforms"):
        return next_fun(*args, **kwargs)
    state = registry_state(session)
    match = state.match(*module_names(context.module), module_class=type(context.module))
    if match is not None:
        resolved = state.resolve(match, False)
        state.modules.add(resolved.uid)
        if _session.current_task() is not resolved:
            with _session.enter_task(resolved), flax_rules(resolved):
                return _call_registered(next_fun, args, kwargs, context, resolved)
    else:
        resolved = current_task()  # a matched named scope around this module
        active = STATE.flax_rules[-1] if STATE.flax_rules else None
        if resolved is not None and resolved.uid in state.origin and resolved.uid != active:
            with flax_rules(resolved):
                return next_fun(*args, **kwargs)
    return next_fun(*args, **kwargs)


def _call_registered(
    next_fun: Any, args: Any, kwargs: Any, context: Any, resolved: _session.ResolvedTask
) -> Any:
    """A matched module's ``__call__``, recomputed in the backward pass when the registered
    task's policy says so (other methods run as they are)."""
    if context.method_name != "__call__" or not effective(resolved.task.recompute).enabled:
        return next_fun(*args, **kwargs)
    fun, transform = linen_transform(context.module, lambda clone, *a, **k: clone(*a, **k))
    return call_recomputed(fun, args, kwargs, resolved.task.recompute, transform)


@contextlib.contextmanager
def intercept_flax_modules() -> Iterator[None]:
    """Runs matched Flax module methods as their registered tasks (while registrations exist)."""
    if not has_registrations():
        yield
        return
    with nn.intercept_methods(_intercept):
        yield


# --- after tracing --------------------------------------------------------------------------


def inner_stacks(eqn: Any) -> list[str]:
    """The name stacks of every equation nested inside ``eqn`` (loops, conditionals, ...)."""
    found = []
    for sub in jex.jaxprs_in_params(eqn.params):
        for inner in sub.eqns:
            found.append(str(inner.source_info.name_stack))
            found.extend(inner_stacks(inner))
    return found


def _check_control_flow(eqn: Any, label: _session.Label, state: _SessionState) -> None:
    for stack in inner_stacks(eqn):
        for name, _ in _components(stack):
            match = state.match(name)
            if match is None:
                continue
            backprop = label is not None and label.phase is Phase.B
            if label is None or state.resolve(match, backprop).uid != label.task:
                raise errors.TaskInControlFlowError(
                    f"Registered task {match.name!r} (matcher "
                    f"{match.registration.pattern.pattern!r}) starts inside "
                    f"`{eqn.primitive.name}` (inner scope {stack!r}). A loop or conditional "
                    "runs as one unit on one submesh, so it cannot contain a task boundary. "
                    "Unroll the loop in Python, or match the whole loop instead."
                )


def marker_label(stack: str, tasks: dict[int, _session.ResolvedTask]) -> _session.Label | None:
    """The label of the innermost explicit task marker in a name stack (``None``: none).

    Backward when the stack shows ``transpose(`` before the marker. Registered tasks are
    matched afterwards (:func:`label_equations`), where they are innermost.
    """
    matches = [m for m in _session.MARKER_RE.finditer(stack) if int(m.group(1)) in tasks]
    if not matches:
        return None
    last = matches[-1]
    backward = "transpose(" in stack[: last.start()]
    return _session.Label(int(last.group(1)), Phase.B if backward else Phase.F)


def colour_equations(
    equations: Sequence[Equation], session: _session.TraceSession, devices: Any
) -> list[Equation]:
    """``equations`` with their labels: the innermost explicit task marker of each name
    stack (:func:`marker_label`), then registered tasks where they are innermost
    (:func:`label_equations`); constraints then go onto their task's mesh
    (:func:`concretise_constraints`).

    Raises:
        TaskInControlFlowError: a registered scope starts inside a loop or conditional.
    """
    marks = each_distinct(lambda s: marker_label(s, session.tasks), [e.stack for e in equations])
    marked = [Equation(e.eqn, e.stack, label) for e, label in zip(equations, marks, strict=True)]
    return concretise_constraints(label_equations(marked, session, devices), session)


def label_equations(
    equations: list[Equation], session: _session.TraceSession, devices: Any
) -> list[Equation]:
    """Relabels equations where a registered task is the innermost task of their name stack.

    ``equations`` carry the labels from explicit markers alone; an equation keeps its label
    where the innermost task is that marker's (forward, or a backward that is the same task),
    and gets ``(task uid, "fwd" | "bwd")`` of the registered task otherwise. Backward tasks
    of registrations are resolved here, against ``devices``.

    Raises:
        TaskInControlFlowError: a registered scope starts inside a loop or conditional.
    """
    stacks = [e.stack for e in equations]
    warn_inactive(stacks)
    if not has_registrations() and not session.registered.used:
        return equations
    state = registry_state(session)
    out: list[Equation] = []
    with use_device_list(devices):
        for equation in equations:
            mine = state.stack_label(equation.stack)
            if jex.jaxprs_in_params(equation.eqn.params):
                _check_control_flow(equation.eqn, mine, state)
            keep = mine is None or equation.label == mine
            out.append(equation if keep else equation._replace(label=mine))
    warn_unmatched(state, stacks)
    _check_scope_recompute(state, {e.label.task for e in out if e.label is not None})
    return out


def _check_scope_recompute(state: _SessionState, uids: set[int]) -> None:
    """Refuses (or, for a step-wide policy, warns about) recomputation of a task matched
    only by ``jax.named_scope`` names: a scope has no call to wrap in ``jax.checkpoint``.

    Raises:
        RecomputePolicyError: such a task sets ``recompute`` itself.
    """
    for uid in sorted(uids & state.origin.keys() - state.modules):
        task, name = state.session.tasks[uid].task, state.origin[uid].name
        if not effective(task.recompute).enabled:
            continue
        advice = (
            "a named scope has no call to wrap in `jax.checkpoint`. Wrap the scoped code in a "
            "function task (`mm.task(fun, ..., recompute=...)`) or a Flax module, or "
            "`jax.checkpoint` it yourself."
        )
        if task.recompute is not None:
            raise errors.RecomputePolicyError(
                f"Expected a task with `recompute` to run a Flax module or function, got the "
                f"task registered for {state.origin[uid].registration.pattern.pattern!r}, "
                f"matched only by the named scope {name!r}: {advice}"
            )
        warn_placement(
            ("scope-recompute", name),
            f"The task of named scope {name!r} is not recomputed although recomputation is "
            f"on for the step: {advice}",
        )


def warn_inactive(stacks: Sequence[str]) -> None:
    """Warns when a registry (a ``MultiMesh`` or ``Context``) that is *not* active holds a
    matcher matching a name of the traced program that no active registration matches:
    probably a missing ``with multi:``."""
    inactive = inactive_contexts()
    if not inactive:
        return
    names = {name for stack in set(stacks) for name, _ in _components(stack)}
    names = {n for n in names if find_match(n) is None}  # not claimed by active ones
    for ctx in inactive:
        for registration in ctx.registrations:
            if registration.module_class is not None:  # matches modules, not these names
                continue
            hit = next((n for n in sorted(names) if registration.matched_name(n)), None)
            if hit is not None:
                warn_placement(
                    ("inactive", id(ctx), id(registration)),
                    f"{ctx!r} has a task registered for {registration.pattern.pattern!r}, "
                    f"which matches {hit!r} in the traced program, but it is not active, so "
                    "that registration was ignored (everything it would place runs elsewhere, "
                    "often on all devices). Trace inside `with multi_mesh:` (or `with "
                    "context:`), e.g. around the `jit`/`parallelize_step` call.",
                )
                break


_OURS = re.compile(r"mmtask\d+_|mmmb\d+_")


def warn_unmatched(state: _SessionState, stacks: Sequence[str]) -> None:
    """Warns for each active registration whose matcher matched no name in the trace.

    The names seen are every named-scope component of every equation and every Flax module
    path and name met while tracing. A matcher for ``"default"`` is exempt (it names glue).
    """
    scopes = {name for stack in set(stacks) for name, _ in _components(stack)}
    modules = {n for names, _ in state.matches for n in names}
    seen = sorted(n for n in scopes | modules if not _OURS.match(n))
    for ctx in active_contexts():
        for registration in ctx.registrations:
            if registration.module_class is not None:
                if not any(m is not None and m.registration is registration
                           for m in state.matches.values()):  # fmt: skip
                    _warn_unmatched_class(registration, state)
                continue
            if registration.matched_name("default") is not None:
                continue
            if not any(registration.matched_name(n) is not None for n in seen):
                _warn_unmatched(registration, seen)


def nearest_first(pattern: str, names: Sequence[str], n: int = 20) -> list[str]:
    """Up to ``n`` of ``names``, the most like ``pattern`` first (its regex syntax
    stripped, so ``'block_(\\d+)'`` is compared as ``'block_'``); a note of how many more."""
    literal = re.sub(r"\\[dwsDWS]|[\^$()\[\]{}+*?|.\\]", "", pattern)
    ranked = sorted(
        set(names), key=lambda name: (-difflib.SequenceMatcher(None, literal, name).ratio(), name)
    )
    return ranked[:n] + ([f"... ({len(ranked)} in all)"] if len(ranked) > n else [])


def _warn_unmatched(registration: Registration, seen: list[str]) -> None:
    pattern = registration.pattern.pattern
    warn_placement(
        ("unmatched", id(registration)),
        f"register_task matcher {pattern!r} matched no name in the traced program, so "
        "nothing was placed by it (it runs wherever other tasks or glue put it, often on "
        f"all devices). Closest names: {closest_names(pattern, seen)}; names seen, nearest "
        "first (named scopes, Flax module paths and full NNX attribute paths such as "
        f"'blocks/layers/0'): {nearest_first(pattern, seen)}. Matchers must match a whole "
        "name (re.fullmatch): fix the pattern, e.g. 'layer_([0-9]+)' for 'layer_0'.",
    )


def _warn_unmatched_class(registration: Registration, state: _SessionState) -> None:
    cls = registration.module_class
    seen = sorted({c.__name__ for _, c in state.matches if c is not None})
    warn_placement(
        ("unmatched", id(registration)),
        f"register_task(module_class={cls.__name__}) matched no module in the traced program "
        f"(pattern {registration.pattern.pattern!r} on its path), so nothing was placed by "
        f"it. Module classes seen: {seen}. Register the class the model really instantiates "
        "(a subclass matches too), or loosen the pattern.",
    )


def _retarget(eqn: Any, mesh: jax.sharding.Mesh) -> Any:
    sharding = eqn.params["sharding"]
    source = sharding.mesh
    abstract = source.abstract_mesh if isinstance(source, jax.sharding.Mesh) else source
    spec = sharding.spec
    if abstract != mesh.abstract_mesh:  # made for another mesh shape: replicate here
        spec = jax.sharding.PartitionSpec()
    params = {**eqn.params, "sharding": NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)}
    context = eqn.params.get("context_mesh")
    if isinstance(context, AbstractMesh) and not context.empty:
        params["context_mesh"] = mesh.abstract_mesh
    return eqn.replace(params=params)


def concretise_constraints(
    equations: list[Equation], session: _session.TraceSession
) -> list[Equation]:
    """Puts Flax's and registered tasks' sharding constraints onto the task's own mesh.

    Flax constraints name the task's abstract mesh (see :func:`flax_rules`); they get its
    devices. In a registered task, a constraint made for a mesh of another shape -- the
    forward's, transposed into a backward task placed elsewhere -- replicates on the
    backward's mesh instead. Other constraints of explicit tasks are left as they are.
    """
    origin = session.registered.origin
    tasks = session.tasks
    out = []
    for equation in equations:
        eqn, label = equation.eqn, equation.label
        sharding = eqn.params.get("sharding")
        if (
            label is not None
            and eqn.primitive.name == "sharding_constraint"
            and isinstance(sharding, NamedSharding)
            and (label.task in origin or isinstance(sharding.mesh, AbstractMesh))
            and sharding.mesh != tasks[label.task].mesh
        ):
            equation = equation._replace(eqn=_retarget(eqn, tasks[label.task].mesh))
        out.append(equation)
    return out
