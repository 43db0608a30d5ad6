"""The import contract: no file imports another in a circle, and no layer imports a higher one.

Layers, highest first (a module may import its own layer and any lower one):

    commands     the ``pagestream`` commands (and ``python -m commands``)
    bench        benchmarks and their records (the service's benchmarks start the service)
    worker       the service (and the gateway), with no command code
    clients      the client library         } these two never import each other
    engine       the inference engine       }
    kernels      Triton kernels and their torch references

Packages are the layers, so no two packages import each other: an arrow between packages points
down or not at all.

Every import counts, also those inside functions (lazy imports are still dependencies) and
under ``TYPE_CHECKING``. ``from package import name`` counts as an import of the submodule
``package.name`` when one exists, else of the package itself.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("commands", "worker", "bench", "clients", "engine", "kernels")
# (layer, rank): a higher rank may import a lower one
LAYERS = (
    ("commands", 4),
    ("bench", 3),
    ("worker", 2),
    ("clients", 1),
    ("engine", 1),
    ("kernels", 0),
)
APART = {("clients", "engine"), ("engine", "clients")}  # same rank, never each other

Graph = dict[str, set[str]]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def import_graph(modules: dict[str, Path]) -> Graph:
    """Module -> the project modules it imports (anywhere in the file)."""
    graph: Graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets |= set(_imported(node, name, is_package, modules))
        graph[name] = {t for t in targets if t != name}
    return graph


def _imported(node: ast.AST, module: str, is_package: bool, known: Iterable[str]) -> list[str]:
    known = set(known)
    if isinstance(node, ast.Import):
        return [_closest(alias.name, known) for alias in node.names if _ours(alias.name)]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the module's package upwards
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    if not _ours(base):
        return []
    return [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else _closest(base, known)
        for alias in node.names
    ]


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _closest(name: str, known: set[str]) -> str:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def package_graph(graph: Graph) -> Graph:
    """The import graph folded onto top-level packages: ``bench -> worker`` if any module of
    bench imports any module of worker."""
    folded: Graph = {}
    for source, targets in graph.items():
        package = source.split(".")[0]
        folded.setdefault(package, set()).update(t.split(".")[0] for t in targets)
        folded[package].discard(package)
    return folded


def layer_of(module: str) -> tuple[str, int]:
    for layer, rank in LAYERS:  # most specific first
        if module == layer or module.startswith(layer + "."):
            return layer, rank
    raise AssertionError(f"{module} belongs to no layer")


def upward_imports(graph: Graph) -> list[str]:
    bad = []
    for source, targets in sorted(graph.items()):
        layer, rank = layer_of(source)
        for target in sorted(targets):
            target_layer, target_rank = layer_of(target)
            if target_rank > rank or (layer, target_layer) in APART:
                bad.append(f"{source} ({layer}) imports {target} ({target_layer})")
    return bad


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# -- the contract on the project ----------------------------------------------------------------


def test_no_file_imports_another_in_a_circle() -> None:
    assert cycles(import_graph(module_files())) == []


def test_no_layer_imports_a_higher_one() -> None:
    assert upward_imports(import_graph(module_files())) == []


def test_no_two_packages_import_each_other() -> None:
    assert cycles(package_graph(import_graph(module_files()))) == []


def test_the_checker_sees_every_package_and_lazy_imports() -> None:
    graph = import_graph(module_files())
    assert {"commands", "commands.bench", "bench.throughput", "engine.llm_engine"} <= set(graph)
    # commands registers its subcommands inside a function: still an edge
    assert "commands.bench" in graph["commands"]
    assert "clients.protocol" in graph["clients.aio"]  # `from clients import protocol`


# -- the checker itself can fail ---------------------------------------------------------------


def test_checker_finds_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    files = {
        "engine/__init__.py": "",
        "engine/a.py": "def f():\n    from engine import b\n",
        "engine/b.py": "from engine.c import x\n",
        "engine/c.py": "import engine.a\nx = 1\n",
        "engine/d.py": "from worker.service import run\n",
        "worker/__init__.py": "",
        "worker/service.py": "from engine.a import f\nrun = f\n",
        "commands/__init__.py": "",
        "clients/__init__.py": "",
        "clients/e.py": "from engine.d import run\n",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = import_graph(module_files(tmp_path))
    assert cycles(graph) == [["engine.a", "engine.b", "engine.c"]]
    # engine -> worker (d) and worker -> engine (service): a circle between packages
    assert cycles(package_graph(graph)) == [["engine", "worker"]]
    assert upward_imports(graph) == [
        "clients.e (clients) imports engine.d (engine)",
        "engine.d (engine) imports worker.service (worker)",
    ]
