"""``kvmux/_core.pyi`` describes the Rust module exactly: every public name
and method the extension exports is declared, and nothing else; and mypy's
``stubtest`` finds every signature (parameter names, kinds, defaults),
property and class marker (``@final``) the same at runtime."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import kvmux._core as core

STUB = Path(core.__file__).with_name("_core.pyi")


def _stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
    return out


def test_the_stub_declares_every_exported_name_and_method():
    stub = _stub_names()
    exported = {n for n in dir(core) if not n.startswith("_")}
    assert exported == set(stub)
    for name in exported:
        obj = getattr(core, name)
        if inspect.isclass(obj):
            methods = {m for m in vars(obj) if not m.startswith("_") or m in ("__len__",)}
            methods.discard("__new__")
            declared = stub[name] - {"__init__", "__new__"}
            assert methods == declared, (name, methods ^ declared)


#: stubtest checks only the module it is given. Following the imports of the
#: parent package (``kvmux/__init__.py`` imports the connectors for type
#: checkers, and they import vLLM and torch) would type-check those too:
#: minutes, and nothing stubtest compares. Typeshed's own stubs are still
#: read, so ``typing_extensions.final`` and the annotations resolve.
MYPY_CONFIG = "[mypy]\nfollow_imports = skip\n"


def test_stubtest_finds_the_stub_equal_to_the_runtime(tmp_path):
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(config), core.__name__],
        cwd=tmp_path,  # mypy's cache goes there, not into the checkout
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mypy.stubtest kvmux._core:\n{proc.stdout}{proc.stderr}"
