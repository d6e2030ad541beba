"""A persistent compilation cache: a second run of the same program compiles (almost) nothing.

An MPMD step compiles one XLA executable per distinct fragment (each stage's forward and
backward, glue, optimizer updates); most compile in well under a second, below JAX's default
threshold for its persistent cache (one second), so none would be kept. This module turns
JAX's persistent compilation cache on with every executable kept, in a directory that
survives the process: ``mmflax train`` and the notebooks call it first thing.

The directory is, in order: the ``directory`` argument; the environment variable
``MMFLAX_COMPILATION_CACHE``; else ``$XDG_CACHE_HOME/multimesh_flax/jax`` (by default
``~/.cache/multimesh_flax/jax``). ``off`` (argument or variable) leaves the cache off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

ENV_VAR = "MMFLAX_COMPILATION_CACHE"
OFF = "off"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/multimesh_flax/jax``, ``~/.cache/multimesh_flax/jax`` by default."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "multimesh_flax" / "jax"


def enable_compilation_cache(directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Keeps every compiled executable in a directory that later processes read.

    Call it before the first compilation of the process (a cache enabled after JAX has
    compiled something may stay off for that process). Programs compiled before are not
    affected; later compilations of identical programs (same HLO, devices, JAX version and
    flags) load from the directory instead of compiling.

    Args:
        directory: the cache directory; ``None``: ``$MMFLAX_COMPILATION_CACHE``, else
            :func:`default_cache_dir`. ``"off"`` (here or in the variable) disables it.

    Returns:
        The directory in use, or ``None`` when disabled.

    Example:
        >>> import multimesh_flax as mm
        >>> mm.enable_compilation_cache("off") is None
        True
    """
    chosen = directory if directory is not None else os.environ.get(ENV_VAR)
    if chosen is not None and str(chosen).lower() == OFF:
        return None
    path = Path(chosen).expanduser() if chosen else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    logger.info("persistent compilation cache in %s", path)
    return path


class _Events:
    """Counts of XLA compilations and persistent-cache hits (``jax.monitoring``), for the
    process and for each thread: JAX reports them in the thread that compiles."""

    COMPILE = "/jax/core/compile/backend_compile_duration"
    HIT = "/jax/compilation_cache/cache_hits"

    def __init__(self) -> None:
        self.process = _Counts()
        self._threads = threading.local()
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def thread(self) -> _Counts:
        """This thread's counts."""
        counts = getattr(self._threads, "counts", None)
        if counts is None:
            counts = self._threads.counts = _Counts()
        return counts

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        # JAX reports every compile-or-load with this event, a hit just before it ends.
        if event != self.COMPILE:
            return
        mine = self.thread()
        if mine.hit:
            mine.hit = False
            return
        for counts in (self.process, mine):
            counts.compiles += 1
            counts.compile_seconds += duration

    def _on_event(self, event: str, **_: Any) -> None:
        if event == self.HIT:
            mine = self.thread()
            self.process.cache_hits += 1
            mine.cache_hits += 1
            mine.hit = True


@dataclasses.dataclass
class _Counts:
    compiles: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0
    hit: bool = False  # the compilation in progress in this thread was a cache hit


_EVENTS: _Events | None = None


def compilation_counter(*, this_thread: bool = False) -> Callable[[], dict[str, float]]:
    """A function that reads what was compiled since this call (``this_thread``: by the
    calling thread only).

    Its result: ``compiles`` (XLA compilations, persistent-cache hits excluded),
    ``compile_seconds`` (their time) and ``cache_hits`` (executables loaded from the
    persistent compilation cache instead of compiled).

    Example:
        >>> read = compilation_counter()
        >>> _ = jax.jit(lambda x: x * 3 + 1)(2.0)
        >>> counts = read()
        >>> counts["compiles"] + counts["cache_hits"] >= 1
        True
    """
    global _EVENTS
    if _EVENTS is None:
        _EVENTS = _Events()
    counts = _EVENTS.thread() if this_thread else _EVENTS.process
    before = (counts.compiles, counts.compile_seconds, counts.cache_hits)

    def read() -> dict[str, float]:
        return {
            "compiles": counts.compiles - before[0],
            "compile_seconds": counts.compile_seconds - before[1],
            "cache_hits": counts.cache_hits - before[2],
        }

    return read
