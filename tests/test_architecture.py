"""The package's structure, read from its source: no cycles, no private imports across modules,
no module over 500 lines, and every import pointing down the layers of docs/ARCHITECTURE.md.

The graph is read statically (``ast``), so nothing is imported and optional
dependencies need not be installed; imports inside functions count too.
``importlib.import_module`` with a registry string ("module:Class") is how a
lower layer names a plugin without importing it, and is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "deltasync"
MAX_LINES = 500

# Lower number, lower layer; a module may import its own layer and below. The longest matching
# prefix decides. Mirrors the table in docs/ARCHITECTURE.md.
LAYERS: dict[str, int] = {
    "deltasync.errors": 0,
    "deltasync.jsonio": 0,
    "deltasync.keys": 0,
    "deltasync.stopping": 0,
    "deltasync.options": 0,
    "deltasync.parallel": 0,
    "deltasync.gc_pause": 0,
    "deltasync.digests": 0,
    "deltasync.checkpoint_names": 1,
    "deltasync.tensors": 1,
    "deltasync.stores": 2,
    "deltasync.diff": 2,
    "deltasync.device_diff": 2,
    "deltasync.diff_chunks": 2,
    "deltasync.forms": 2,
    "deltasync.codec": 3,
    "deltasync.format": 4,
    "deltasync.manifest": 5,
    "deltasync.commit": 6,
    "deltasync.retired": 6,
    "deltasync.resume": 6,
    "deltasync.publish_options": 6,
    "deltasync.acks": 6,
    "deltasync.fetch": 6,
    "deltasync.ranged": 6,
    "deltasync.cache": 6,
    "deltasync.publisher": 7,
    "deltasync.sharded": 7,
    "deltasync.subscriber": 7,
    "deltasync.appliers": 8,
    "deltasync.models": 8,
    "deltasync.peft": 8,
    "deltasync.lora": 8,
    "deltasync.integrations": 9,
    "deltasync.demo": 9,
    "deltasync.cli": 10,
    "deltasync": 11,  # the package face re-exports from everywhere
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges() -> list[tuple[str, str, str]]:
    """``(importer, imported module, name)`` for every import of a deltasync module."""
    edges = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges += [(module, a.name, "") for a in node.names if a.name.startswith("deltasync")]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node)
                if not target.startswith("deltasync"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.append((module, sub, "") if sub in MODULES else (module, target, alias.name))
    return edges


EDGES = _edges()


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b, _ in EDGES:
        if b in MODULES and b != a and not a.startswith(b + "."):  # a package's own __init__ is no cycle
            graph[a].add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_no_private_names_imported_across_modules() -> None:
    """A private module may exist, but what others take from it are public names."""
    private = sorted({f"{a} imports {b}.{n}" for a, b, n in EDGES if n.startswith("_") and not n.startswith("__")})
    assert not private, "\n".join(private)


def test_no_module_over_500_lines() -> None:
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, b, _ in EDGES
        if b in MODULES or any(b.startswith(m) for m in MODULES)
        if _layer(b) > _layer(a)
    ]
    assert not upward, "\n".join(upward)


def test_every_module_has_a_layer_and_a_docstring() -> None:
    for module, path in MODULES.items():
        assert any(module == p or module.startswith(p + ".") for p in LAYERS), module
        if path.stat().st_size > 200:
            assert ast.get_docstring(ast.parse(path.read_text())), f"{module} says nothing about what it owns"
