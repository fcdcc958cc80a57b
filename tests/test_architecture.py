"""The layers of docs/architecture.md, checked on the source: who may import whom, no import
circles, and which packages load without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# package -> the packages its modules may import (besides itself); absent: anything
ALLOWED = {
    "paths": set(),
    "errors": set(),
    "catalog": set(),
    "cache": set(),
    "sched": {"cache"},
    "native": {"paths"},
    "attention": {"native"},
    "model": {"attention", "native", "catalog", "paths"},
    "sim": {"cache", "sched", "errors"},
    "engine": {"cache", "sched", "model", "attention", "native", "catalog", "errors", "paths"},
}
TORCH_FREE = ["prefixcache.cache", "prefixcache.sched", "prefixcache.sim.cli",
              "prefixcache.engine.config", "prefixcache.catalog", "prefixcache.cli"]  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "prefixcache").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (anywhere but under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            submodules = {f"{base}.{a.name}" for a in node.names} & set(modules)
            found.update(submodules or {base})
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = sorted(
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in targets
        if _layer(a) in ALLOWED and _layer(b) != _layer(a) and _layer(b) not in ALLOWED[_layer(a)]
    )
    assert wrong == []


def test_no_import_circles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert circles == []


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
