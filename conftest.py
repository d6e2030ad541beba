"""Root pytest configuration: 8 simulated CPU devices before any JAX operation.

Every test (and every doctest) sees ``jax.devices()`` as 8 CPU devices, so meshes of up to
8 devices, submeshes and MPMD programs run on a laptop. Doctests get ``jax``, ``jnp``,
``np`` and ``P`` in their namespace. Every test runs under ``context(strict=True)``: a
``PlacementWarning`` (a pattern matching nothing, a logical name without a rule, a task traced
by ``jax.jit``) raises ``StrictModeError``; tests of those warnings open ``strict=False``.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The CLI and notebooks keep compiled programs in a persistent cache (~/.cache by default);
# tests do not write there: the cache's own test passes a temporary directory.
os.environ.setdefault("MMFLAX_COMPILATION_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(jax=jax, jnp=jnp, np=np, P=P)


@pytest.fixture(autouse=True)
def _strict_placement():
    import multimesh_flax as mm
    from multimesh_flax.core.declare import _registry

    with mm.context(strict=True):
        yield
    # A registry a test filled but never entered is the "missing `with multi:`" mistake the
    # library warns about; one kept alive by a finished test (its traceback, a fixture) must
    # not warn in the tests after it.
    _registry._WITH_REGISTRATIONS.clear()
