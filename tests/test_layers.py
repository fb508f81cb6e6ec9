"""The package's layers (docs/design.md): imports run one way, without cycles or hiding.

frontend -> ir -> passes -> planning -> runtime -> observe -> api, over a base of small
modules every layer may use. Each module may import its own layer and the layers before
it; a module-level import cycle, or an import of the package inside a function (the usual
way to hide a cycle), fails here. Lazy imports of optional third-party dependencies are
allowed where a comment says why.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "streamsched"

LAYERS = ["base", "frontend", "ir", "passes", "planning", "runtime", "observe", "api"]
BASE = {"errors", "config", "branch", "_generation", "_native", "envinfo", "_lru", "_version", "_C", "_gc"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()
# The compiled extension: a base module that is not a .py file.
KNOWN = set(MODULES) | {"streamsched._C"}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"  # the package itself re-exports the api
    if parts[1] in LAYERS:
        return parts[1]
    if len(parts) == 2 and parts[1] in BASE:
        return "base"
    return "api"


def _absolute(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: pathlib.Path):
    """(imported streamsched module, line, inside a function, under TYPE_CHECKING, tree line text)."""
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    in_function: set[int] = set()
    in_type_checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            in_type_checking.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, path, node)
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in KNOWN else target for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in KNOWN and "." in target:
                target = target.rsplit(".", 1)[0]
            yield target, node.lineno, id(node) in in_function, id(node) in in_type_checking, lines


def test_every_module_has_a_layer():
    assert "streamsched.frontend.trace" in MODULES and "streamsched.runtime.program" in MODULES
    for layer in LAYERS[1:-1]:
        assert (PACKAGE / layer).is_dir(), f"streamsched/{layer}/ is missing"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_one_way(module):
    rank = LAYERS.index(layer_of(module))
    upward = []
    for target, line, _, _, _ in _imports(module, MODULES[module]):
        # Annotations too: a TYPE_CHECKING import of a later layer is the same coupling.
        if target in KNOWN and target != module:
            if LAYERS.index(layer_of(target)) > rank:
                upward.append(f"line {line}: {target} ({layer_of(target)})")
    assert not upward, f"{module} ({layer_of(module)}) imports a later layer: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_level_imports_hide_a_cycle(module):
    hidden = []
    for target, line, in_function, _, lines in _imports(module, MODULES[module]):
        if not in_function:
            continue
        if target.split(".")[0] == "streamsched":
            hidden.append(f"line {line}: {target}")
        elif "#" not in lines[line - 1] and not lines[line - 2].strip().startswith("#"):
            hidden.append(f"line {line}: {target} (a lazy import of a third-party module needs a comment saying why)")
    assert not hidden, f"{module} imports inside a function: {hidden}"


# The runtime runs what tracing produced and binds calls with ``frontend.binder``; it never
# reaches into the tracer itself.
RUNTIME_MAY_NOT_IMPORT = {"streamsched.frontend.trace"}


def _runtime_imports_of_the_tracer(module: str, path: pathlib.Path) -> list[str]:
    return [
        f"line {line}: {target}" for target, line, _, _, _ in _imports(module, path) if target in RUNTIME_MAY_NOT_IMPORT
    ]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) == "runtime"))
def test_runtime_does_not_import_the_tracer(module):
    found = _runtime_imports_of_the_tracer(module, MODULES[module])
    assert not found, f"{module} imports the tracer (frontend/trace.py): {found}"


def test_no_file_name_appears_twice():
    """A file name says what the file holds: two modules of one name (``plan.py`` in
    planning and in eager dispatch) read as one in tracebacks, logs and searches."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1 and name != "__init__.py"}
    assert not twice, f"file names used more than once: {twice}"


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        graph[module] = {
            target
            for target, _, in_function, type_checking, _ in _imports(module, path)
            if target in MODULES and target != module and not in_function and not type_checking
        }
    # A package importing its own submodules (re-exports) is not a cycle of the design,
    # unless a submodule imports the package back.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_catch_what_they_claim(tmp_path):
    """The checks themselves: an upward import and a hidden one are found."""
    source = "from ..module import StreamScheduledModule\n\ndef f():\n    from ..runtime import program\n"
    path = PACKAGE / "ir" / "graph.py"
    found = list(_imports("streamsched.ir.graph", path))
    assert found  # the real file imports something
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    imports = list(_imports("streamsched.ir.fake", fake))
    assert ("streamsched.module", 1) == imports[0][:2] and layer_of("streamsched.module") == "api"
    assert imports[1][0] == "streamsched.runtime.program" and imports[1][2] is True
    runtime_fake = tmp_path / "runtime_fake.py"
    runtime_fake.write_text("from ...frontend.trace import trace_model\n")
    assert _runtime_imports_of_the_tracer("streamsched.runtime.dispatch.fake", runtime_fake)
