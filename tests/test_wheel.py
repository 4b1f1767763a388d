"""The wheel ships the product and only the product (issue 34): maturin packs
the package under ``[tool.maturin] python-source`` (``python/kvmux``), so
what only the tests and kvmux's own overhead benchmarks use lives outside it
(``tests/support``, ``benches/overhead``) and no module of the wheel imports
it; the wheel's modules import each other without a cycle, and the command
line imports the benchmarks, never the other way round."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]

#: What moved out of ``kvmux.bench`` (and where it went).
MOVED = {
    "kvmux/bench/sim.py": "tests/support/sim.py",
    "kvmux/bench/children.py": "tests/support/children.py",
    **{
        f"kvmux/bench/{name}.py": f"benches/overhead/{name}.py"
        for name in (
            "case",
            "runner",
            "timing",
            "lifecycle",
            "host_lifecycle",
            "layers",
            "lookup",
            "copies",
            "stall",
            "compose",
            "compose_lmcache",
        )
    },
}

#: The product: what an operator runs (the connectors, the host tier, doctor,
#: the demo, bench serve and fleet with their launchers).
PRODUCT = [
    "kvmux/__init__.py",
    "kvmux/__main__.py",
    "kvmux/mux/connector.py",
    "kvmux/host_cache/connector.py",
    "kvmux/cli/__init__.py",
    "kvmux/cli/doctor.py",
    "kvmux/cli/diagnosis.py",
    "kvmux/cli/fleet.py",
    "kvmux/cli/pd_pair.py",
    "kvmux/cli/demo.py",
    "kvmux/cli/engine.py",
    "kvmux/cli/bench.py",
    "kvmux/bench/serve.py",
    "kvmux/bench/fleet.py",
    "kvmux/bench/server.py",
    "kvmux/bench/redis.py",
    "kvmux/bench/lmcache.py",
    "kvmux/bench/tiny_model.py",
    "kvmux/py.typed",
    "kvmux/_core.pyi",
]

DEV = ("tests", "benches")
#: A string that is a bare dotted path into the development code: what
#: ``importlib.import_module`` or vLLM's ``kv_connector_module_path`` would load.
DEV_PATH = re.compile(r"^(tests|benches)(\.\w+)+$")


def _maturin() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["maturin"]


def wheel_files() -> list[str]:
    """The files maturin packs from the Python source (paths inside the
    wheel): every file of the package folder named by ``module-name`` under
    ``python-source``, less bytecode and built extensions (the wheel's
    ``_core`` is built from ``rust/``, not copied)."""
    source = ROOT / _maturin()["python-source"]
    package = _maturin()["module-name"].split(".")[0]
    out = []
    for path in sorted((source / package).rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        if path.suffix in (".pyc", ".so", ".pyd"):
            continue
        out.append(path.relative_to(source).as_posix())
    return out


def _module(path: str) -> tuple[str, bool]:
    """(dotted name, is a package) of a wheel path such as ``kvmux/cli/bench.py``."""
    parts = path.removesuffix(".pyi").removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (never run)."""
    out: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _imported(path: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` per import statement of ``path`` (a wheel path),
    anywhere in its code (module level and inside functions), relative
    imports resolved: ``import X`` is ``(X, [])``, ``from X import a, b`` is
    ``(X, [a, b])``."""
    source = ROOT / _maturin()["python-source"]
    mod, is_pkg = _module(path)
    out: list[tuple[str, list[str]]] = []
    for node in _runtime_nodes(ast.parse((source / path).read_text())):
        if isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            out.append((name, [a.name for a in node.names]))
    return out


def imports(path: str) -> set[str]:
    """Every name ``path`` imports: each module, and for ``from X import a``
    ``X.a`` too."""
    return {n for m, names in _imported(path) for n in (m, *(f"{m}.{a}" for a in names))}


def module_graph() -> dict[str, set[str]]:
    """The wheel's modules, each with the modules of the wheel it imports:
    ``from P import a`` imports the module ``P.a`` where there is one (as
    ``from kvmux import _core``), else the package ``P`` (its ``__init__``)."""
    files = [f for f in wheel_files() if f.endswith((".py", ".pyi"))]
    mods = {_module(f)[0]: f for f in files}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps: set[str] = set()
        if path.endswith(".py"):  # a .pyi: the compiled core, which imports no Python
            for name, names in _imported(path):
                if not names:
                    deps.add(name)
                for a in names:
                    deps.add(f"{name}.{a}" if f"{name}.{a}" in mods else name)
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_wheel_has_the_product_and_none_of_the_moved_development_code():
    files = set(wheel_files())
    assert not files & set(MOVED), sorted(files & set(MOVED))
    assert not [f for f in PRODUCT if f not in files]
    for old, new in MOVED.items():
        assert (ROOT / new).is_file(), f"{old} moved to {new}, which is missing"


def test_no_module_of_the_wheel_imports_the_tests_or_the_benchmarks():
    bad = {
        f: sorted(n for n in imports(f) if n.split(".")[0] in DEV)
        for f in wheel_files()
        if f.endswith(".py")
    }
    assert {f: n for f, n in bad.items() if n} == {}


def test_no_module_of_the_wheel_names_a_module_of_the_tests_or_the_benchmarks():
    """Not as a string either (``importlib.import_module``, vLLM's
    ``kv_connector_module_path``)."""
    source = ROOT / _maturin()["python-source"]
    bad = []
    for f in wheel_files():
        if not f.endswith(".py"):
            continue
        for node in ast.walk(ast.parse((source / f).read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if DEV_PATH.match(node.value):
                    bad.append((f, node.value))
    assert bad == []


def test_the_modules_of_the_wheel_import_each_other_without_a_cycle():
    graph = module_graph()
    assert "kvmux.cli.doctor" in graph and graph["kvmux.cli.fleet"]  # the graph was read
    assert cycles(graph) == []


def test_the_command_line_imports_the_benchmarks_never_the_other_way_round():
    graph = module_graph()
    up = {m: sorted(d for d in deps if d.startswith("kvmux.cli")) for m, deps in graph.items()}
    assert {m: d for m, d in up.items() if m.startswith("kvmux.bench") and d} == {}
    assert any(d.startswith("kvmux.bench") for d in graph["kvmux.cli.bench"])


@pytest.mark.parametrize(
    ("graph", "want"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, want):
    assert cycles(graph) == want
