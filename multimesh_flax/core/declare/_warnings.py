"""Placement warnings: the program runs, but probably not where or how it was meant to.

Every such case goes through :func:`warn_placement`: it warns ``PlacementWarning`` once per
cause (a key naming the pattern, logical name or task), or, under ``context(strict=True)``,
raises ``StrictModeError`` with the same message every time.
"""

from __future__ import annotations

import difflib
import os
import sys
import threading
import warnings
from collections.abc import Hashable, Iterable

import flax
import jax

import multimesh_flax
from multimesh_flax import errors
from multimesh_flax.core.declare import _config

_LOCK = threading.Lock()
_WARNED: set[Hashable] = set()


def warn_placement(key: Hashable, message: str) -> None:
    """Warns ``message`` once per ``key``; raises it as ``StrictModeError`` in strict mode.

    Raises:
        StrictModeError: ``context(strict=True)`` is on.
    """
    if _config.get_flag("strict"):
        raise errors.StrictModeError(f"{message} (Raised because `context(strict=True)` is on.)")
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(message, errors.PlacementWarning, stacklevel=_user_stacklevel())


_LIBRARIES = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (jax, flax, multimesh_flax))


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost frame outside multimesh_flax, JAX and Flax."""
    frame, level = sys._getframe(2), 2  # the caller of warn_placement's caller
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


def forget_warnings() -> None:
    """Lets every placement warning fire again (for tests and notebooks)."""
    with _LOCK:
        _WARNED.clear()


def closest_names(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The up to ``n`` candidates most similar to ``name`` (difflib), best first."""
    pool = sorted(set(candidates))
    found = difflib.get_close_matches(name, pool, n=n, cutoff=0.5)
    return found or difflib.get_close_matches(name, pool, n=n, cutoff=0.0)
