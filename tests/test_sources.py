"""Every source file compiles cleanly from scratch.

The shared ``__pycache__`` hides compile-time warnings (an invalid escape sequence in a
docstring) that a fresh clone meets on first import, where ``filterwarnings = error`` turns
them into a ``SyntaxError``. Compiling each file here, warnings as errors, catches them
whatever the cache holds.
"""

import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    p
    for folder in ("multimesh_flax", "models", "benchmarks", "tests", "notebooks")
    for p in (ROOT / folder).rglob("*.py")
)


def test_every_source_compiles_without_warnings():
    assert len(SOURCES) > 50
    broken = []
    for path in SOURCES:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(encoding="utf-8"), str(path), "exec")
            except (SyntaxError, SyntaxWarning, DeprecationWarning) as e:
                broken.append(f"{path.relative_to(ROOT)}: {e}")
    assert not broken, "\n".join(broken)
