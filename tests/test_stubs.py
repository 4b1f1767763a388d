"""``kvmux/_core.pyi`` describes the Rust module exactly: every public name
and method the extension exports is declared, and nothing else."""

from __future__ import annotations

import ast
import inspect
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
            declared = stub[name] - {"__init__"}
            assert methods == declared, (name, methods ^ declared)
