"""The notebooks in ``notebooks/``: each runs top to bottom in a fresh kernel (in the reduced
"smoke" setting, ``MMFLAX_SMOKE=1``), and each committed ``.ipynb`` is the executed twin of
its jupytext ``.py`` source (same cells, every cell run, no errors, pictures kept).

Rebuild the ``.ipynb`` files after editing a source with ``notebooks/execute.py``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest


def _dev_dependency(name: str):
    """Imports a module of the ``dev`` dependency group; a missing one fails, never skips."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.fail(
            f"The dev dependency {name!r} is missing (declared in pyproject.toml's `dev` "
            f"group). Install it: `pip install {name}` or `python dev.py test`. ({e})",
            pytrace=False,
        )


jupytext = _dev_dependency("jupytext")
nbclient = _dev_dependency("nbclient")
nbformat = _dev_dependency("nbformat")
_dev_dependency("ipykernel")  # the kernel the smoke runs start

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]-*.py"))
IDS = [p.stem for p in SOURCES]
CELL_TIMEOUT_S = 600


def _code_cells(notebook) -> list[str]:
    return [c.source.strip() for c in notebook.cells if c.cell_type == "code"]


def _cells(notebook) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in notebook.cells]


def _plots(source: Path) -> bool:
    text = source.read_text(encoding="utf-8")
    return "plt.show()" in text or "plot_timeline(" in text


def test_there_are_notebooks():
    assert len(SOURCES) >= 8, [p.name for p in SOURCES]


@pytest.mark.heavy
@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_notebook_runs_in_smoke_mode(source, monkeypatch):
    monkeypatch.setenv("MMFLAX_SMOKE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # silences jupyter_core's path warning
    notebook = jupytext.read(source)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()  # raises CellExecutionError with the failing cell and traceback
    assert all(c.execution_count for c in notebook.cells if c.cell_type == "code")


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_committed_notebook_is_the_executed_source(source):
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} is missing; run notebooks/execute.py"
    committed = nbformat.read(paired, as_version=4)
    assert _cells(committed) == _cells(jupytext.read(source)), (
        f"{paired.name} is out of date with {source.name}; run notebooks/execute.py "
        f"{source.name[:2]}"
    )
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "every cell must have run"
    outputs = [o for c in code for o in c.outputs]
    assert outputs, "the committed notebook holds no outputs"
    assert not [o for o in outputs if o.output_type == "error"]
    if _plots(source):
        assert any("image/png" in o.get("data", {}) for o in outputs), "no picture kept"


def test_readme_lists_every_notebook():
    readme = (NOTEBOOKS / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in SOURCES if p.with_suffix(".ipynb").name not in readme]
    assert not missing, missing


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_first_cell_configures_devices_before_jax_runs(source):
    first = _code_cells(jupytext.read(source))[0]
    assert 'os.environ.setdefault("JAX_PLATFORMS", "cpu")' in first
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in first
    assert 'SMOKE = os.environ.get("MMFLAX_SMOKE") == "1"' in first
    assert first.index("jax_num_cpu_devices") < first.index("import multimesh_flax")
