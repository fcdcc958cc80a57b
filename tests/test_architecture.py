"""The layers of docs/architecture.md, checked on the source: who may import whom, no import
circles, and which packages load without torch."""

from __future__ import annotations

import ast
import re
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
    "tiers": {"errors"},
    "sched": {"cache"},
    "native": {"paths"},
    "attention": {"native"},
    "model": {"attention", "native", "catalog", "errors", "paths"},
    "sim": {"cache", "sched", "tiers", "errors"},
    "engine": {"cache", "tiers", "sched", "model", "attention", "native", "catalog", "errors",
               "paths"},
}
TORCH_FREE = ["prefixcache.cache", "prefixcache.tiers", "prefixcache.sched", "prefixcache.sim.cli",
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


def _all_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports, ``if TYPE_CHECKING`` blocks included."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):  # the package imports absolutely (ruff's TID252)
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            found.update(submodules or {node.module})
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_circles_even_through_type_only_imports() -> None:
    """A type-only import back is still two owners knowing each other (the pool and its index,
    the decoder and its compiled layers): none is left."""
    modules = _modules()
    graph = {name: _all_imports(name, path, modules) for name, path in modules.items()}
    pairs = sorted(f"{a} <-> {b}" for a, targets in graph.items() for b in targets
                   if a < b and a in graph.get(b, set()))
    assert pairs == []
    assert not {m for m in graph["prefixcache.cache.block_pool"] if "index" in m or "_cache" in m}


def test_outer_layers_use_the_engines_and_caches_public_interface() -> None:
    """Nothing outside engine/ reaches through the async engine into the engine, and nothing
    outside cache/ reads a private of the pool or an index."""
    reach_in = re.compile(r"\bengine\.engine\.")
    private = re.compile(r"\.(pool|index|evictor)\._[a-z]")
    wrong = []
    for name, path in _modules().items():
        text = path.read_text()
        if _layer(name) != "engine" and reach_in.search(text):
            wrong.append(f"{name}: engine.engine.")
        if _layer(name) != "cache" and private.search(text):
            wrong.append(f"{name}: a cache private")
    assert wrong == []


MAX_CLASS_LINES, MAX_PUBLIC_MEMBERS, MAX_FUNCTION_LINES = 300, 25, 60


def test_every_owner_stays_small() -> None:
    """No class over 300 lines or 25 public methods, no function over 60 lines: a feature
    that grows a hub past these gets an owner of its own instead."""
    wrong = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                public = [b.name for b in node.body
                          if isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef)
                          and not b.name.startswith("_")]  # fmt: skip
                if size > MAX_CLASS_LINES or len(public) > MAX_PUBLIC_MEMBERS:
                    wrong.append(f"{name}.{node.name}: {size} lines, {len(public)} public")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if size > MAX_FUNCTION_LINES:
                    wrong.append(f"{name}.{node.name}: {size} lines")
    assert wrong == []


def test_nothing_outside_the_engine_reaches_its_members() -> None:
    """The server, the tools and the cluster use the engine's methods (`tier_stats`,
    `add_cache_observer`, `pins_of`, `inspect`, ...), never its parts."""
    reach_in = re.compile(r"\bengine\.(offload|tiers|cache|pins|scheduler|runner|groups)\b"
                          r"|\.cache\.pool\b")
    wrong = [f"{name}: {m.group(0)}" for name, path in _modules().items()
             if _layer(name) in ("server", "tools", "cluster")
             for m in reach_in.finditer(path.read_text())]  # fmt: skip
    assert wrong == []
