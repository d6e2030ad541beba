"""Root pytest configuration: 8 simulated CPU devices before any JAX operation.

Every test (and every doctest) sees ``jax.devices()`` as 8 CPU devices, so meshes of up to
8 devices, submeshes and MPMD programs run on a laptop. Doctests get ``jax``, ``jnp``,
``np`` and ``P`` in their namespace. Every test runs under ``context(strict=True)``: a
``PlacementWarning`` (a pattern matching nothing, a logical name without a rule, a task traced
by ``jax.jit``) raises ``StrictModeError``; tests of those warnings open ``strict=False``.
For speed, the suite compiles with LLVM at optimisation level 0 and XLA's older fusion
emitter, and shares one persistent compilation cache per run (see the comment below).
"""

import atexit
import functools
import os
import re
import shutil
import signal
import tempfile
import threading
from importlib import metadata
from pathlib import Path


def _jaxlib_version() -> tuple[int, ...]:
    return tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])


os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# XLA compilation is most of the suite's time (about two thirds of the in-process test time,
# measured with jax.monitoring's compile events), and the suite compiles the same small
# programs in many tests. Two settings, for every process the suite starts (the variables are
# inherited: xdist workers, notebooks, the CLI, jax.distributed jobs):
# * LLVM at optimisation level 0 compiles CPU programs in about half the time, and XLA's
#   older elemental emitter for fusions (`--xla_cpu_use_fusion_emitters=false`) saves about a
#   third of what is left (gpt-tiny's 2-stage 1F1B step, 12 executables, fresh processes,
#   loaded host: 8.6-9.9 s of CPU to build and run it once, 5.3-7.0 s with the flag). Tests
#   run tiny models, so the slower code costs little. Parallel and reference programs are
#   compiled alike. The benchmarks' smoke run uses them too; real runs (`dev.py run`) use
#   XLA's defaults.
# * One persistent compilation cache per suite run (a temporary directory, removed at the
#   end; never ~/.cache), so a program another test already compiled is loaded instead.
#   A caller's own MMFLAX_COMPILATION_CACHE (a directory, or "off") is kept.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if _jaxlib_version() >= (0, 11):  # jaxlib 0.12's XLA lacks the flag; an unknown flag aborts
    TEST_XLA_FLAGS = TEST_XLA_FLAGS[:1]
for _flag in TEST_XLA_FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
if "MMFLAX_COMPILATION_CACHE" not in os.environ:  # the first process of the run makes it
    _suite_cache = tempfile.mkdtemp(prefix="mmflax-suite-xla-")
    atexit.register(shutil.rmtree, _suite_cache, ignore_errors=True)
    os.environ["MMFLAX_COMPILATION_CACHE"] = _suite_cache

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import multimesh_flax as mm  # noqa: E402

mm.enable_compilation_cache()  # before the first compilation; see above

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(jax=jax, jnp=jnp, np=np, P=P)


@pytest.fixture(autouse=True)
def _strict_placement():
    from multimesh_flax.core.declare import _registry

    with mm.context(strict=True):
        yield
    # A registry a test filled but never entered is the "missing `with multi:`" mistake the
    # library warns about; one kept alive by a finished test (its traceback, a fixture) must
    # not warn in the tests after it.
    _registry._WITH_REGISTRATIONS.clear()


@pytest.fixture(autouse=True)
def _default_sigint_and_sigterm():
    """Gives every test the signal state a shell gives a program: SIGINT and SIGTERM
    unblocked, SIGINT raising ``KeyboardInterrupt``.

    Children inherit an ignored or blocked signal across ``exec``. In two fresh-clone suite
    runs, tests that send SIGINT to a child (``test_misuse``'s launcher, ``test_checkpoint_
    faults``' Ctrl-C at exit) saw it ignored, while they pass alone: an earlier test in the
    same worker left SIGINT ignored or blocked (the culprit is not found yet). Restoring the
    state after each test keeps tests independent.
    """
    yield
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "heavy: runs for 15 s or more; scheduled first, so the two workers finish together",
    )
    config.addinivalue_line(  # pytest-xdist registers it too; this keeps `-p no:xdist` working
        "markers", "xdist_group(name): the module's tests run on one worker (see below)"
    )


def pytest_collection_modifyitems(items):
    """``heavy`` tests first (stable otherwise): with ``--dist loadgroup`` (``dev.py test``)
    the workers take tests one at a time in this order, and the longest ones started first
    leave short ones, not a long one, for the end of the run."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


_GROUP_MARK = re.compile(r'^pytestmark = pytest\.mark\.xdist_group\("([^"]+)"\)', re.M)


@functools.cache
def _group_of(path: str) -> str | None:
    """The ``xdist_group`` name test module ``path`` (relative to the root) is marked with
    (``pytestmark = pytest.mark.xdist_group("name")``), or ``None``."""
    file = Path(__file__).parent / path
    found = _GROUP_MARK.search(file.read_text()) if file.is_file() else None
    return found.group(1) if found else None


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown under `-p no:xdist`
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` as ``dev.py test`` means it: the tests of the modules marked with
    one ``xdist_group`` name run on one worker, every other test is handed out on its own, in
    collection order (``heavy`` first, see above) after the groups, largest first.

    pytest-xdist 3.8 implements ``loadgroup`` by appending ``@group`` to each test's node
    id, which pytest 9 no longer lets it do (``nodeid`` is derived there): the groups were
    silently split across workers, and a module's expensive fixture (the benchmark smoke
    run, 4 minutes) ran once per worker. This scheduler reads the group from the module's
    source instead (module-level marks only).
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid.split("::", 1)[0]) or nodeid

    return ModuleGroups(config, log)
