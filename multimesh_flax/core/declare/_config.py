"""Compiler contexts: thread-local switches that change how transformations behave.

Four switches exist, each with its own context manager, plus :func:`context` to set several
at once:

* :func:`autoshard` -- logical sharding constraints resolve through task rules (turned on by
  ``parallelize``, ``jit`` and ``with multi_mesh:``);
* :func:`enable_fast_path` -- a program with no tasks compiles to one plain ``jax.jit``;
* :func:`enable_recomputation` -- task backward passes recompute their forward
  (``jax.checkpoint``) instead of keeping activations, for every task kind;
* :func:`ignore_transforms` -- every multimesh transformation becomes the identity, for
  debugging and as the numerical reference;
* ``strict`` (through :func:`context` only) -- a ``PlacementWarning`` (a pattern that matched
  nothing, a logical name without a rule, a task traced by a foreign transformation) is raised
  as ``StrictModeError`` instead.

Every manager restores the previous value on exit, also when the body raises. A value that
is not a bool raises ``ContextFlagError`` on entry, before anything changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np

from multimesh_flax import errors
from multimesh_flax.core.declare import _thread


@dataclasses.dataclass(frozen=True)
class _Flags:
    autoshard: bool = False
    enable_fast_path: bool = True
    enable_recomputation: bool = False
    ignore_transforms: bool = False
    strict: bool = False


_DEFAULTS = _Flags()


def _flags() -> _Flags:
    """The switches in force in this thread."""
    return _thread.STATE.flags or _DEFAULTS


_NAMES = tuple(f.name for f in dataclasses.fields(_Flags))


def get_flag(name: str) -> bool:
    """Returns the current value of one switch (``"autoshard"``, ``"ignore_transforms"``, ...).

    Raises:
        ContextFlagError: ``name`` is not one of the five switches.
    """
    if name not in _NAMES:
        raise errors.ContextFlagError(f"Unknown switch {name!r}; expected one of {list(_NAMES)}.")
    return getattr(_flags(), name)


def _is_switch_value(value: object) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return True
    return isinstance(value, (int, np.integer)) and value in (0, 1)


def _check_switches(values: dict[str, bool | None]) -> None:
    for name, value in values.items():
        if value is not None and not _is_switch_value(value):
            raise errors.ContextFlagError(
                f"Expected switch `{name}` to be True or False, got {type(value).__name__}: "
                f"{value!r} (a non-empty string would turn it on). Pass a bool."
            )


@contextlib.contextmanager
def _override(**values: bool | None) -> Iterator[None]:
    _check_switches(values)
    saved = _thread.STATE.flags
    changes = {name: bool(value) for name, value in values.items() if value is not None}
    _thread.STATE.flags = dataclasses.replace(_flags(), **changes)
    try:
        yield
    finally:
        _thread.STATE.flags = saved


def autoshard(enable: bool = True) -> contextlib.AbstractContextManager[None]:
    """Opens a context where sharding constraints are logical and resolve through tasks.

    Inside a task, logical names map through the task's rules onto its submesh; outside
    every task, constraints replicate.

    Example:
        >>> import multimesh_flax as mm
        >>> with mm.autoshard():
        ...     mm.core.get_flag("autoshard")
        True
        >>> mm.core.get_flag("autoshard")
        False
    """
    return _override(autoshard=enable)


def enable_fast_path(enable: bool = True) -> contextlib.AbstractContextManager[None]:
    """(En|dis)ables the plain ``jax.jit`` path for programs without tasks.

    With the fast path off, even a program with no tasks goes through the MPMD partitioner
    (one fragment), which is useful to test the partitioner itself.

    Example:
        >>> import multimesh_flax as mm
        >>> with mm.enable_fast_path(False):
        ...     mm.core.get_flag("enable_fast_path")
        False
    """
    return _override(enable_fast_path=enable)


def enable_recomputation(enable: bool = True) -> contextlib.AbstractContextManager[None]:
    """(En|dis)ables recomputation of task forward passes during their backward pass.

    Task bodies traced inside this context -- task functions, Linen ``Task[Module]`` and NNX
    ``Task[Block]`` alike -- are wrapped in ``jax.checkpoint`` (the ``"full"`` policy): the
    backward pass keeps only the task's inputs and recomputes its activations, trading
    compute for memory. A task's own ``recompute`` and ``parallelize_step(...,
    recompute=...)`` take precedence over this switch
    (``multimesh_flax.core.declare._recompute``).

    Example:
        >>> import multimesh_flax as mm
        >>> with mm.enable_recomputation():
        ...     mm.core.get_flag("enable_recomputation")
        True
    """
    return _override(enable_recomputation=enable)


def ignore_transforms(ignore: bool = True) -> contextlib.AbstractContextManager[None]:
    """Makes every multimesh transformation the identity (a debugging and reference mode).

    ``task``, ``with_sharding_constraint``, ``microbatch`` and ``jit``/``parallelize``
    then compute exactly what the undecorated function computes.

    Example:
        >>> import jax.numpy as jnp
        >>> import multimesh_flax as mm
        >>> double = mm.task(lambda x: 2 * x, mesh=mm.TaskMesh(devices=[1]))
        >>> with mm.ignore_transforms():
        ...     double(jnp.ones(2)).devices() == {jax.devices()[0]}
        True
    """
    return _override(ignore_transforms=ignore)


def context(
    autoshard: bool | None = None,
    enable_recomputation: bool | None = None,
    enable_fast_path: bool | None = None,
    ignore_transforms: bool | None = None,
    strict: bool | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Sets several switches at once; ``None`` leaves a switch as it is.

    ``strict=True`` turns every ``PlacementWarning`` (a ``register_task`` pattern that matched
    nothing, a logical name with no rule, a task traced by ``jax.jit`` instead of
    ``multimesh_flax.jit``) into a ``StrictModeError``.

    Example:
        >>> import multimesh_flax as mm
        >>> with mm.context(autoshard=True, ignore_transforms=True):
        ...     mm.core.get_flag("autoshard"), mm.core.get_flag("ignore_transforms")
        (True, True)
    """
    return _override(
        autoshard=autoshard,
        enable_recomputation=enable_recomputation,
        enable_fast_path=enable_fast_path,
        ignore_transforms=ignore_transforms,
        strict=strict,
    )
