"""The core's import graph: stages in pipeline order, no cycles, no imports hidden in functions.

The Flax layer (``multimesh_flax/layers``) is held to the last two rules as well.

``multimesh_flax/core`` is laid out as the pipeline it implements (see its README):
declare -> trace -> plan -> fragment -> run -> front. A module may import modules of its own
stage or of earlier stages only, so the graph is a DAG by construction; this file checks it
from the source text (``ast``), the way a newcomer would read the imports.

``multimesh_flax/distributed`` and the core meet at one op list: ``distributed._dispatch``
reads the ops from ``run._ops`` (through the ``run`` package's re-exports) and makes a
``ProcessHandOff``, which the build (``front._build``, the last stage) passes to the compile
pass in a multi-process job. No other module crosses between them, and the modules of both
packages together form a DAG, package ``__init__.py`` files included.

Each stage package's ``__init__.py`` re-exports the stage's entry points, and that is the
only way in: a module of one stage imports names from another stage's package, never one of
its private (``_``) modules, and so do ``multimesh_flax/layers``,
``multimesh_flax/distributed`` and ``multimesh_flax/planner``. A stage's own modules import
each other directly.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "multimesh_flax"
CORE = PACKAGE / "core"
LAYERS = PACKAGE / "layers"
PLANNER = PACKAGE / "planner"
DISTRIBUTED = PACKAGE / "distributed"
STAGES = ("declare", "trace", "plan", "fragment", "run", "front")


def _modules() -> dict[str, Path]:
    """``{"stage._module": path}`` for every module of the core's stage packages."""
    return {
        f"{path.parent.name}.{path.stem}": path
        for stage in STAGES
        for path in sorted((CORE / stage).glob("_*.py"))
        if path.name != "__init__.py"
    }


def _reexported_from(stage: str, name: str) -> str:
    """The module of ``stage`` whose ``name`` the stage's ``__init__.py`` re-exports."""
    init = ast.parse((CORE / stage / "__init__.py").read_text())
    for node in init.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            return (node.module or "").removeprefix("multimesh_flax.core.")
    raise AssertionError(f"multimesh_flax.core.{stage} does not re-export {name!r}")


def _core_target(node: ast.ImportFrom) -> list[str]:
    """The core modules an ``from multimesh_flax.core... import ...`` statement names."""
    module = node.module or ""
    if not module.startswith("multimesh_flax.core."):
        return []
    rest = module.removeprefix("multimesh_flax.core.").split(".")
    if len(rest) == 2:  # from multimesh_flax.core.stage._module import name
        return [".".join(rest)]
    return [  # from ...core.stage import _module, or a name the stage re-exports
        f"{rest[0]}.{alias.name}"
        if alias.name.startswith("_")
        else _reexported_from(rest[0], alias.name)
        for alias in node.names
    ]


def _distributed_target(node: ast.ImportFrom) -> list[str]:
    """The ``distributed._module`` names an ``from multimesh_flax.distributed...`` names."""
    module = node.module or ""
    if module == "multimesh_flax.distributed":
        return [f"distributed.{a.name}" for a in node.names if a.name.startswith("_")]
    if module.startswith("multimesh_flax.distributed."):
        return ["distributed." + module.removeprefix("multimesh_flax.distributed.")]
    return []


def _top_level_targets(path: Path) -> set[str]:
    """Core (``stage._module``) and distributed (``distributed._module``) modules a module
    imports at module level."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            found.update(_core_target(node), _distributed_target(node))
    return found


def _imports(path: Path) -> tuple[set[str], list[int]]:
    """(core modules imported at module level, lines of our imports inside functions).

    Third-party imports inside functions are allowed (matplotlib is imported where a figure is
    drawn); an import of ``multimesh_flax`` inside a function is how a cycle hides.
    """
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            top.update(_core_target(node))
        if isinstance(node, ast.If):  # e.g. ``if TYPE_CHECKING:`` -- still an arrow
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom):
                    top.update(_core_target(inner))
    nested = [
        inner.lineno
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for inner in ast.walk(node)
        if isinstance(inner, ast.ImportFrom)
        and (inner.module or "").startswith("multimesh_flax")
        or isinstance(inner, ast.Import)
        and any(a.name.startswith("multimesh_flax") for a in inner.names)
    ]
    return top, nested


def test_every_core_module_sits_in_a_stage_package() -> None:
    loose = [p.name for p in CORE.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside the stage packages {STAGES}: {loose}"
    assert len(_modules()) >= 20


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_import_inside_a_function(name: str) -> None:
    _, nested = _imports(_modules()[name])
    assert not nested, f"{name} imports inside functions at lines {nested}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_imports_point_to_the_same_or_an_earlier_stage(name: str) -> None:
    stage = STAGES.index(name.split(".")[0])
    top, _ = _imports(_modules()[name])
    later = sorted(t for t in top if STAGES.index(t.split(".")[0]) > stage)
    assert not later, f"{name} (stage {STAGES[stage]}) imports later stages: {later}"


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


def test_import_graph_is_acyclic() -> None:
    _assert_acyclic(
        {name: _imports(path)[0] & _modules().keys() for name, path in _modules().items()}
    )


# --- stage packages: the only way into a stage ----------------------------------------------


def _private_core_imports(path: Path, own_stage: str | None) -> list[str]:
    """``stage._module`` for each private core module that ``path`` imports from a stage other
    than ``own_stage`` (anywhere in the file: functions and ``if`` blocks too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            named = [(node.module or "", [a.name for a in node.names])]
        elif isinstance(node, ast.Import):
            named = [(a.name, []) for a in node.names]
        else:
            continue
        for module, names in named:
            rest = module.split(".")[2:] if module.startswith("multimesh_flax.core.") else []
            if not rest or rest[0] == own_stage:
                continue
            if len(rest) > 1 and rest[1].startswith("_"):
                found.append(f"{rest[0]}.{rest[1]}")
            found.extend(f"{rest[0]}.{n}" for n in names if n.startswith("_"))
    return found


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_module_imports_another_stages_private_module(name: str) -> None:
    found = _private_core_imports(_modules()[name], name.split(".")[0])
    assert not found, (
        f"{name} imports private modules of other stages: {found}; import the names their "
        "stage package re-exports instead (add them to its __init__.py)"
    )


def _outside_modules() -> dict[str, Path]:
    return {
        f"{folder.name}.{path.stem}": path
        for folder in (LAYERS, DISTRIBUTED, PLANNER)
        for path in sorted(folder.glob("*.py"))
    }


@pytest.mark.parametrize("name", sorted(_outside_modules()))
def test_layers_and_distributed_import_the_core_through_its_exports(name: str) -> None:
    found = _private_core_imports(_outside_modules()[name], None)
    assert not found, (
        f"{name} imports private core modules {found}; import from multimesh_flax.core or "
        "its stage packages instead"
    )


@pytest.mark.parametrize("stage", STAGES)
def test_stage_packages_only_reexport_their_own_modules(stage: str) -> None:
    """A stage ``__init__.py`` holds its docstring and ``from .._module import name as name``
    lines over its own modules (``name as name``: an explicit re-export)."""
    init = ast.parse((CORE / stage / "__init__.py").read_text())
    body = init.body[1:] if isinstance(init.body[0], ast.Expr) else init.body
    assert body, f"multimesh_flax.core.{stage} exports nothing"
    for node in body:
        assert isinstance(node, ast.ImportFrom), ast.dump(node)
        prefix = f"multimesh_flax.core.{stage}._"
        assert (node.module or "").startswith(prefix), node.module
        assert all(a.asname == a.name for a in node.names), [a.name for a in node.names]


# --- the core and multimesh_flax.distributed ---------------------------------------------------


def _distributed_modules() -> dict[str, Path]:
    return {
        f"distributed.{path.stem}": path
        for path in sorted(DISTRIBUTED.glob("_*.py"))
        if path.name != "__init__.py"
    }


def test_distributed_reads_the_core_only_through_the_op_list() -> None:
    crossing = {
        name: sorted(t for t in _top_level_targets(path) if not t.startswith("distributed."))
        for name, path in _distributed_modules().items()
    }
    allowed = {"distributed._dispatch": ["run._ops"]}
    assert {k: v for k, v in crossing.items() if v} == allowed


def test_only_the_build_reaches_distributed() -> None:
    """The build chooses the multi-process dispatcher; ``run`` never imports it."""
    crossing = {
        name: sorted(t for t in _top_level_targets(path) if t.startswith("distributed."))
        for name, path in _modules().items()
    }
    assert {k: v for k, v in crossing.items() if v} == {"front._build": ["distributed._dispatch"]}


def test_the_op_list_imports_only_the_declare_stage() -> None:
    """``run._ops`` sits below both dispatchers: importing it pulls in no later stage."""
    top, _ = _imports(_modules()["run._ops"])
    assert all(t.startswith("declare.") for t in top), top


def test_core_and_distributed_import_graph_is_acyclic() -> None:
    modules = {**_modules(), **_distributed_modules()}
    _assert_acyclic(
        {name: _top_level_targets(path) & modules.keys() for name, path in modules.items()}
    )


def _package_files() -> dict[str, Path]:
    """``{"core.run.__init__": path, "core.run._ops": path, ...}``: every file of the core's
    stage packages and of ``multimesh_flax/distributed``, package ``__init__.py`` included."""
    folders = [CORE / stage for stage in STAGES] + [DISTRIBUTED]
    return {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts): path
        for folder in folders
        for path in sorted(folder.glob("*.py"))
    }


def _file_targets(path: Path, files: dict[str, Path]) -> set[str]:
    """The files a file imports at module level: another package counts as its
    ``__init__.py`` (which Python runs first; a module's own package is already running),
    and ``from package import _mod`` names the file of ``_mod``."""
    own = ".".join(path.relative_to(PACKAGE).parent.parts)
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
        if not module.startswith("multimesh_flax."):
            continue
        name = module.removeprefix("multimesh_flax.")
        init = [] if name == own else [f"{name}.__init__"]
        for target in (name, *init, *(f"{name}.{a.name}" for a in node.names)):  # type: ignore[union-attr]
            if target in files:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_package_files_form_no_loop() -> None:
    """Counting each package ``__init__.py`` as a file of its own, there is no loop either:
    Python can import the packages in any order."""
    files = _package_files()
    assert _cycles({name: _file_targets(path, files) for name, path in files.items()}) == []


# --- the Flax layer -------------------------------------------------------------------------


def _layer_modules() -> dict[str, Path]:
    return {path.stem: path for path in sorted(LAYERS.glob("_*.py")) if path.stem != "__init__"}


def _layer_imports(path: Path) -> set[str]:
    """The ``multimesh_flax.layers`` modules a module imports at module level."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if module == "multimesh_flax.layers":
            found.update(alias.name for alias in node.names)
        elif module.startswith("multimesh_flax.layers."):
            found.add(module.removeprefix("multimesh_flax.layers."))
    return found


@pytest.mark.parametrize("name", sorted(_layer_modules()))
def test_no_layer_module_imports_inside_a_function(name: str) -> None:
    _, nested = _imports(_layer_modules()[name])
    assert not nested, f"layers.{name} imports inside functions at lines {nested}"


def test_layer_import_graph_is_acyclic() -> None:
    modules = _layer_modules()
    assert len(modules) >= 8
    _assert_acyclic({name: _layer_imports(path) & modules.keys() for name, path in modules.items()})


def test_the_checker_sees_a_cycle_and_a_backward_import(tmp_path: Path) -> None:
    """The parser finds the arrows these tests rely on (so they cannot pass vacuously)."""
    source = tmp_path / "_probe.py"
    source.write_text(
        "from multimesh_flax.core.front import _jit\n"
        "from multimesh_flax.core.declare._task import Task\n"
        "def f():\n    from multimesh_flax.core.run import _dispatch\n"
        "def g():\n    import numpy\n"
    )
    top, nested = _imports(source)
    assert top == {"front._jit", "declare._task"}
    assert nested == [4]
    source.write_text(
        "from multimesh_flax.core.run import RunOp\n"
        "from multimesh_flax.distributed import _wire, host_values\n"
    )
    assert _top_level_targets(source) == {"run._ops", "distributed._wire"}
    source.write_text(
        "from multimesh_flax.core.run import RunOp, _dispatch\n"
        "from multimesh_flax.core.trace._trace import trace_program\n"
        "from multimesh_flax.core.fragment import Partition\n"
        "def f():\n    import multimesh_flax.core.plan._pipeline\n"
    )
    assert _private_core_imports(source, None) == [
        "run._dispatch",
        "trace._trace",
        "plan._pipeline",
    ]
    assert _private_core_imports(source, "trace") == ["run._dispatch", "plan._pipeline"]
