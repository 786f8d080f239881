"""No import cycles inside `dream_trainer` at run time.

The graph is read from the source with `ast`, so no module is imported to build it. An edge
`a -> b` means that running module `a` (its top level, or any function in it) imports module `b`:

- module-level and function-local imports both count: a function-local import only postpones a
  cycle to the first call, it does not remove it;
- imports under `if TYPE_CHECKING:` do not count (they never run); its `else:` branch does;
- relative imports are resolved; `from pkg import name` is an edge to `pkg.name` when that is a
  submodule, and to `pkg` (its `__init__`) otherwise; `importlib.import_module("literal")` counts;
- a module's parent packages, which Python imports implicitly first, are not edges: otherwise every
  submodule would be in a cycle with `dream_trainer/__init__.py`, which imports the trainer. So a
  package `__init__` re-exporting its children is no cycle by itself, but a child that imports names
  from its own package (`from dream_trainer.callbacks import Callback` inside `callbacks/`) is:
  child -> package `__init__` -> child.

A cycle is a strongly connected component of more than one module (or a module importing itself).
`KNOWN_CYCLES` lists the import edges of cycles that are known and owned elsewhere; the graph without
those edges must have no cycle at all, so any new cycle fails, and an entry that no longer closes a
cycle fails too (delete it).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "dream_trainer"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# (importer, imported) -> why this import still closes a cycle, and how it goes. Aim: empty.
KNOWN_CYCLES: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `importer` runs `line` (at `lineno`), which imports `imported`."""

    importer: str
    imported: str
    lineno: int
    line: str


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package, by dotted name (a package's `__init__.py` under the package's name)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST, type_only: bool = False) -> Iterable[ast.AST]:
    """Every node that can run, i.e. all of them except the bodies of `if TYPE_CHECKING:` (those too
    with `type_only`)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not type_only and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest module of the package that `name` (a dotted module path) is, or lies in."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path], type_only: bool = False) -> list[Import]:
    """The intra-package imports `module` can run (and, with `type_only`, those for the type checker)."""
    source = path.read_text()
    lines = source.splitlines()
    is_package = path.name == "__init__.py"
    out: list[Import] = []

    def add(target: str | None, node: ast.stmt | ast.expr) -> None:
        if target is not None and target in modules:
            imp = Import(module, target, node.lineno, lines[node.lineno - 1].strip())
            if imp not in out:  # `from m import a, b` is one edge
                out.append(imp)

    for node in _runtime_nodes(ast.parse(source, filename=str(path)), type_only):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, modules), node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source_module = ".".join(base + ([node.module] if node.module else []))
            else:
                source_module = node.module or ""
            if _resolve(source_module, modules) is None:
                continue
            for alias in node.names:
                sub = f"{source_module}.{alias.name}"
                add(sub if sub in modules else _resolve(source_module, modules), node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(_resolve(node.args[0].value, modules), node)
    return out


def import_graph(root: Path = ROOT, package: str = PACKAGE, type_only: bool = False) -> dict[str, list[Import]]:
    """Module -> the imports it runs (edges to other modules of the package); with `type_only`, also
    those under `if TYPE_CHECKING:`."""
    modules = module_names(root, package)
    return {name: imports_of(name, path, modules, type_only) for name, path in modules.items()}


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components in no particular order, members sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def cycles(edges: dict[str, list[Import]]) -> list[list[str]]:
    """The components that are cycles: more than one module, or a module importing itself."""
    graph = {m: {i.imported for i in imps} for m, imps in edges.items()}
    return sorted(c for c in strongly_connected_components(graph) if len(c) > 1 or c[0] in graph[c[0]])


def shortest_cycle(component: list[str], edges: dict[str, list[Import]]) -> list[Import]:
    """One shortest cycle through the component's first module, as the import statements that close it."""
    members = set(component)
    start = component[0]
    came_from: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for imp in edges[node]:
            if imp.imported not in members:
                continue
            if imp.imported == start:
                chain = [imp]
                while chain[0].importer != start:
                    chain.insert(0, came_from[chain[0].importer])
                return chain
            if imp.imported not in came_from:
                came_from[imp.imported] = imp
                queue.append(imp.imported)
    raise AssertionError(f"{component} is not a cycle")


def describe(component: list[str], edges: dict[str, list[Import]]) -> str:
    """A cycle for humans: its chain, then every import inside the component (file, line, statement)."""
    chain = shortest_cycle(component, edges)
    members = set(component)
    lines = [" -> ".join([chain[0].importer] + [imp.imported for imp in chain])]
    for module in component:
        for imp in edges[module]:
            if imp.imported in members:
                lines.append(f"    {imp.importer} -> {imp.imported}   (line {imp.lineno}: {imp.line})")
    return "\n".join(lines)


def without(edges: dict[str, list[Import]], removed: Iterable[tuple[str, str]]) -> dict[str, list[Import]]:
    drop = set(removed)
    return {m: [i for i in imps if (i.importer, i.imported) not in drop] for m, imps in edges.items()}


# --- the package ----------------------------------------------------------------------------------------
def test_no_import_cycles():
    edges = without(import_graph(), KNOWN_CYCLES)
    found = cycles(edges)
    assert not found, "import cycles in dream_trainer (break them; see this file's docstring):\n" + "\n".join(
        describe(c, edges) for c in found
    )


# ids from a list: pytest 8.0 calls an ids function with NOTSET when the list is empty (as it is now).
@pytest.mark.parametrize("edge", sorted(KNOWN_CYCLES), ids=["->".join(edge) for edge in sorted(KNOWN_CYCLES)])
def test_known_cycles_are_still_cycles(edge):
    edges = import_graph()
    importer, imported = edge
    assert any(i.imported == imported for i in edges.get(importer, ())), (
        f"{importer} no longer imports {imported}: remove {edge} from KNOWN_CYCLES"
    )
    assert any(importer in c and imported in c for c in cycles(edges)), (
        f"{importer} -> {imported} no longer closes a cycle: remove it from KNOWN_CYCLES"
    )


def test_callbacks_never_import_the_trainer():
    """The bus and the built-in callbacks need the trainer instance, never its module."""
    edges = import_graph()
    offenders = [
        f"{i.importer} line {i.lineno}: {i.line}"
        for m, imps in edges.items()
        if m.startswith(f"{PACKAGE}.callbacks")
        for i in imps
        if i.imported == f"{PACKAGE}.trainer"
    ]
    assert offenders == []


# What the trainer is built from or builds on. None of it names the trainer's module, not even for the
# type checker: each is typed against `TrainerProtocol` (protocol.py) or a protocol of its own, so the
# package has no circle at all (a type-only import of the trainer from below closes one for every reader,
# human or tool). `tuner/` and `cli/` sit above the trainer; `lightning/` below it.
ABOVE_THE_TRAINER = (f"{PACKAGE}.trainer", f"{PACKAGE}.tuner", f"{PACKAGE}.cli", PACKAGE)


def _above(module: str) -> bool:
    return module == PACKAGE or any(module == m or module.startswith(m + ".") for m in ABOVE_THE_TRAINER[:-1])


def test_nothing_below_the_trainer_imports_it_even_for_types():
    edges = import_graph(type_only=True)
    offenders = [
        f"{i.importer} line {i.lineno}: {i.line}"
        for m, imps in edges.items()
        if not _above(m)
        for i in imps
        if _above(i.imported)
    ]
    assert offenders == [], (
        "a module below the trainer imports the trainer, tuner/ or cli/ (type it against "
        "dream_trainer.protocol.TrainerProtocol, or move it above the trainer):\n" + "\n".join(offenders)
    )


def test_hook_spec_is_a_leaf():
    """`hook_spec` is the bottom layer: it may import nothing of the package but `errors`."""
    assert {i.imported for i in import_graph()[f"{PACKAGE}.hook_spec"]} <= {f"{PACKAGE}.errors"}


# --- the checker itself, on a made-up package -----------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def _cycles_in(tmp_path: Path, files: dict[str, str]) -> list[list[str]]:
    return cycles(import_graph(_write(tmp_path, files), "pkg"))


def test_checker_finds_function_local_and_relative_cycles(tmp_path):
    found = _cycles_in(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import B\n",
            "b.py": "def f():\n    from pkg import a\n",
            "c.py": "import pkg.d\n",
            "d.py": "import importlib\nimportlib.import_module('pkg.c')\n",
        },
    )
    assert found == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_checker_ignores_type_checking_imports_but_not_their_else(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "import pkg.b\n",
        "b.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import A\n",
    }
    assert _cycles_in(tmp_path, files) == []
    files["b.py"] += "else:\n    from pkg.a import A\n"
    assert _cycles_in(tmp_path / "2", files) == [["pkg.a", "pkg.b"]]


def test_checker_package_init_reexports_are_not_cycles_but_child_to_init_is(tmp_path):
    files = {
        "__init__.py": "from pkg.sub import Thing\n",
        "sub/__init__.py": "from .x import Thing\nfrom . import y\n",
        "sub/x.py": "from pkg.sub import y\nThing = 1\n",  # `y` is a submodule: an edge to sub.y only
        "sub/y.py": "",
    }
    assert _cycles_in(tmp_path, files) == []
    files["sub/y.py"] = "from pkg.sub import Thing\n"  # a name from the package's __init__
    assert _cycles_in(tmp_path / "2", files) == [["pkg.sub", "pkg.sub.x", "pkg.sub.y"]]


def test_describe_names_the_import_lines(tmp_path):
    edges = import_graph(
        _write(tmp_path, {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "import pkg.a\n"}), "pkg"
    )
    text = describe(cycles(edges)[0], edges)
    assert text.splitlines()[0] == "pkg.a -> pkg.b -> pkg.a"
    assert "pkg.b -> pkg.a   (line 1: import pkg.a)" in text
