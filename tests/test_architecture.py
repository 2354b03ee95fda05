"""The package's structure, read from its source: layers that point down, no cycles (registries included),
no private names or private state reached across modules, and docs/ARCHITECTURE.md's layer table equal to
the one here.

The graph is read statically (``ast``), so nothing is imported and optional dependencies need not be
installed. Imports inside functions count, and so does a ``"deltasync.module:Name"`` registry string or an
``import_module("deltasync....")`` call: each is an import that happens at run time.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "deltasync"

# Lower number, lower layer; a module may import its own layer and below. The longest matching prefix
# decides. docs/ARCHITECTURE.md's table must say the same (test_the_docs_table_is_this_table).
LAYERS: dict[str, int] = {
    "deltasync.errors": 0,
    "deltasync.util": 0,
    "deltasync.tensors": 1,
    "deltasync.stores": 2,
    "deltasync.codec": 3,
    "deltasync.format": 4,
    "deltasync.protocol": 5,
    "deltasync.publish": 6,
    "deltasync.replica": 6,
    "deltasync.appliers": 7,
    "deltasync.integrations": 8,
    "deltasync.control": 8,
    "deltasync.demo": 8,
    "deltasync.cli": 9,
    "deltasync": 10,  # the package face re-exports from everywhere
}
# Rooms of one layer that stand side by side and never import each other.
APART = [("deltasync.publish", "deltasync.replica"), ("deltasync.integrations", "deltasync.demo")]
REGISTRY = re.compile(r"deltasync(?:\.\w+)+(?=:\w+$)")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {module: ast.parse(path.read_text()) for module, path in MODULES.items()}


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
    """``(importer, imported module, name)`` for every import of a deltasync module, at any time."""
    edges = []
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges += [(module, a.name, "") for a in node.names if a.name.startswith("deltasync")]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node)
                if not target.startswith("deltasync"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.append((module, sub, "") if sub in MODULES else (module, target, alias.name))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found = REGISTRY.match(node.value)  # a registry's "module:Class", imported on first use
                if found and found.end() + 1 + len(node.value.split(":")[-1]) == len(node.value):
                    edges.append((module, found.group(0), ""))
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and str(first.value).startswith("deltasync"):
                    edges.append((module, str(first.value), ""))
    return edges


EDGES = _edges()


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _room(module: str) -> str:
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def test_every_registry_string_names_a_module() -> None:
    """A registry string that names no module would be an import that fails only when first used."""
    missing = sorted({f"{a} names {b}" for a, b, _ in EDGES if b not in MODULES and not any(
        b.startswith(m + ".") for m in MODULES)})
    assert not missing, "\n".join(missing)


def test_no_import_cycles_not_even_through_registries_or_lazy_imports() -> None:
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


def _private_members() -> dict[str, set[str]]:
    """``_name`` -> the modules whose classes define it (a method, a class attribute, or ``self._name = ...``)."""
    owners: dict[str, set[str]] = {}
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.append(item.name)
                    elif isinstance(item, ast.Assign):
                        names += [t.id for t in item.targets if isinstance(t, ast.Name)]
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.append(item.target.id)
            elif (
                isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"
            ):
                names.append(node.attr)
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    owners.setdefault(name, set()).add(module)
    return owners


def test_no_module_reaches_into_another_modules_private_state() -> None:
    """``x._name`` (``self`` included: a subclass of another module's class) where ``_name`` belongs to a class
    of another module and to none of this one: composition goes through public seams."""
    owners = _private_members()
    reached = []
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in owners and module not in owners[node.attr]:
                reached.append(f"{module}:{node.lineno} {ast.unparse(node)} (private to {sorted(owners[node.attr])})")
    assert not reached, "\n".join(reached)


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, b, _ in EDGES
        if b in MODULES or any(b.startswith(m) for m in MODULES)
        if _layer(b) > _layer(a)
    ]
    assert not upward, "\n".join(upward)


def test_rooms_side_by_side_stay_apart() -> None:
    crossing = sorted({
        f"{a} imports {b}" for a, b, _ in EDGES for left, right in APART
        if {_room(a), _room(b)} == {left, right}
    })
    assert not crossing, "\n".join(crossing)


def test_every_module_has_a_layer_and_a_docstring() -> None:
    for module, path in MODULES.items():
        assert any(module == p or module.startswith(p + ".") for p in LAYERS), module
        if path.stat().st_size > 200:
            assert ast.get_docstring(TREES[module]), f"{module} says nothing about what it owns"


def test_the_docs_table_is_this_table() -> None:
    """docs/ARCHITECTURE.md's layer table lists the same rooms in the same layers."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    documented: dict[str, int] = {}
    for row in re.finditer(r"^\| (\d+) \| ([^|]+) \|", text, re.M):
        for name in re.findall(r"`([\w./]+)`", row.group(2)):
            documented["deltasync" if name == "deltasync/" else "deltasync." + name.strip("/").replace("/", ".")
                       .removesuffix(".py")] = int(row.group(1))
    assert documented == LAYERS


# A measured figure: a duration or rate with its unit, a speed-up ratio, the machine it was measured on.
TIMING = re.compile(
    r"\d(?:[\d,.]*\d)?\s?(?:ms|us|µs|ns|GB/s|MB/s|GiB/s|MiB/s|changes/s)\b"
    r"|\d(?:\.\d+)?x (?:faster|slower|as fast)"
    r"|\bon (?:an? )?(?:H100|H200|A100|2 cores|two cores|a 2-core)"
    r"|\b\d+(?:\.\d+)?-\d+(?:\.\d+)? ?(?:ms|s)\b"
)


def _prose(tree: ast.Module, source: str) -> list[tuple[int, str]]:
    """Every comment and docstring line of a module, with its line number."""
    lines = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(tree):
        for statement in getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else []:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
                    and isinstance(statement.value.value, str):
                lines += [(statement.lineno + k, text) for k, text in enumerate(statement.value.value.split("\n"))]
    return lines


def test_no_timings_in_the_code() -> None:
    """Figures go stale inside code: comments and docstrings say what and why, and the measurements live in
    benchmarks/ (its result files and README), which the code may name but not quote."""
    found = [
        f"{module}:{number}: {text.strip()}"
        for module, path in MODULES.items()
        for number, text in _prose(TREES[module], path.read_text())
        if TIMING.search(text)
    ]
    assert not found, "\n".join(found)
