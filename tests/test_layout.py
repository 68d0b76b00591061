"""The package's layout rules (docs/design.md, "Code layout"), read from the source with `ast`:
no import cycle (imports inside functions counted), no module assigning another module's
globals, no function over 100 lines outside `deltarule/kernels/`."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deltarule"
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package (a package by its __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The package module a dotted name lies in (itself, or the nearest module above it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> dict[str, set[str]]:
    """The package modules `module` imports (anywhere in it), each with the local names it binds
    to a module."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _owner(alias.name) if alias.name.split(".")[0] == "deltarule" else None
                if target:
                    found.setdefault(target, set()).add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "deltarule":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:                     # a module: `from . import engine`
                    found.setdefault(full, set()).add(alias.asname or alias.name)
                else:                                   # a name of a module: `from .engine import run`
                    found.setdefault(_owner(source), set())
    found.pop(module, None)
    return found


def _cycles() -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    graph = {m: set(_imports(m)) for m in MODULES}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
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
    return cycles


def test_the_import_graph_has_no_cycle():
    assert MODULES["deltarule.eager"] and len(MODULES) > 100          # the walk saw the package
    assert _cycles() == []


def _fake_modules(monkeypatch, sources: dict[str, str]) -> None:
    """Modules `deltarule.<name>` with the given sources, seen by the checks here only."""
    for name in sources:
        monkeypatch.setitem(MODULES, f"deltarule.{name}", PACKAGE / f"{name}.py")
    real_read = pathlib.Path.read_text
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: sources[self.stem]
                        if self.parent == PACKAGE and self.stem in sources else real_read(self, *a, **k))


def test_the_cycle_finder_finds_a_cycle(monkeypatch):
    """The check above can fail: two modules importing each other inside functions form one."""
    _fake_modules(monkeypatch, {"fake_a": "def f():\n    from . import fake_b\n",
                                "fake_b": "def g():\n    from .fake_a import f\n"})
    assert ["deltarule.fake_a", "deltarule.fake_b"] in _cycles()


def _assignments_to_modules(module: str) -> list[str]:
    """`m.x = ...`, `m.x += ...`, `del m.x` and `setattr(m, ...)` where `m` is a name the module
    bound to another package module by an import."""
    module_names = set().union(*_imports(module).values()) if _imports(module) else set()
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in module_names:
            found.append(f"{module}:{node.lineno} {node.func.id}({node.args[0].id}, ...)")
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in module_names:
                    found.append(f"{module}:{node.lineno} {t.value.id}.{t.attr}")
    return found


def test_no_module_assigns_another_modules_globals():
    """A module's globals are set by that module (a setter it owns, or an argument)."""
    assert [a for m in MODULES for a in _assignments_to_modules(m)] == []


def test_the_assignment_finder_finds_assignments(monkeypatch):
    """The check above can fail: each form of writing another module's global is found."""
    _fake_modules(monkeypatch, {"fake_a": "import deltarule.engine as e\nfrom .backends import torch_backend\n"
                                          "def f():\n    from . import batch\n    torch_backend.X = 1\n"
                                          "    e.Y += 1\n    setattr(batch, 'Z', 2)\n    local = object()\n"
                                          "    local.W = 3\n"})
    assert _assignments_to_modules("deltarule.fake_a") == [
        "deltarule.fake_a:5 torch_backend.X", "deltarule.fake_a:6 e.Y", "deltarule.fake_a:7 setattr(batch, ...)"]


def _long_functions(path: pathlib.Path) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines, their docstring not counted."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str)
            first = body[1].lineno if docstring and len(body) > 1 else body[0].lineno
            lines = node.end_lineno - first + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


@pytest.mark.parametrize("area", sorted({p.relative_to(PACKAGE).parts[0] for p in PACKAGE.iterdir()
                                         if p.suffix == ".py" or (p / "__init__.py").exists()} - {"kernels"}))
def test_no_function_is_over_100_lines_outside_the_kernels(area):
    path = PACKAGE / area
    files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    assert [f for p in files for f in _long_functions(p)] == []
