"""Docs that cannot drift: every relative link and file reference resolves, and every notebook is built.

Covers README.md, docs/*.md, benchmarks/README.md and the examples: markdown links ``[text](path)`` and
``[text](path#anchor)`` to files of the repository, and file paths named in backquotes
(``benchmarks/lora.py``, ``tests/test_crash.py``, ``docs/img/lora_bytes.png``...) that look like paths of
this repository.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = [*DOCS, *sorted((ROOT / "examples").rglob("*.py")), *sorted((ROOT / "deltasync").rglob("*.py"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# A path of this repository in backquotes: starts with one of its top-level folders, has an extension.
TOP = ("benchmarks", "docs", "examples", "notebooks", "tests", "deltasync", "scripts", ".ci", "requirements")
PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")/[A-Za-z0-9_./-]+\.[a-z]+)`")


def test_every_relative_link_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_file_named_in_docs_and_code_exists() -> None:
    missing = []
    for source in SOURCES:
        for path in PATH.findall(source.read_text()):
            if "*" in path or "<" in path:
                continue
            if not (ROOT / path).exists():
                missing.append(f"{source.relative_to(ROOT)}: {path}")
    assert not missing, missing


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "deltasync").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_module_named_in_docs_and_examples_exists() -> None:
    """``deltasync.publish.publisher.Publisher`` and the like name a module of the package (and a name it
    defines); logger names and profiler ranges are names of their own."""
    modules = _modules()
    code = "\n".join(path.read_text() for path in modules.values())
    own_names = set(re.findall(r'getLogger\("([^"]+)"\)', code)) | set(re.findall(r'record_function\(f?"([^"{]+)', code))
    own_names |= {"deltasync.diff", "deltasync.decode"}  # the device paths' phase prefixes (tensors.device.Phases)
    sources = [*DOCS, *sorted((ROOT / "examples").rglob("*.py")), *sorted((ROOT / "notebooks").glob("*.ipynb")),
               *sorted((ROOT / "spaces_demo").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    unknown = []
    for source in sources:
        for name in re.findall(r"(?<![\w/.-])deltasync(?:\.[A-Za-z_]\w*)+", source.read_text()):
            if name in own_names or any(name.startswith(n + ".") for n in own_names):
                continue
            parts = name.split(".")
            k = next(k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules)
            module, rest = ".".join(parts[:k]), parts[k:]
            if rest and rest[0] not in _top_level_names(modules[module]):
                unknown.append(f"{source.relative_to(ROOT)}: {name}")
    assert not unknown, unknown


def test_every_notebook_is_built_by_the_build_script() -> None:
    build = (ROOT / "notebooks" / "_build.py").read_text()
    hand_written = {"03_end_to_end.ipynb"}  # executed by its test, edited by hand (it runs benchmarks)
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert notebook.name in build or notebook.name in hand_written, notebook.name
