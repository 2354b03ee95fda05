"""Docs that cannot drift: every relative link and file reference resolves, and every notebook is built.

Covers README.md, docs/*.md, benchmarks/README.md and the examples: markdown links ``[text](path)`` and
``[text](path#anchor)`` to files of the repository, and file paths named in backquotes
(``benchmarks/lora.py``, ``tests/test_crash.py``, ``docs/img/lora_bytes.png``...) that look like paths of
this repository.
"""

from __future__ import annotations

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


def test_every_notebook_is_built_by_the_build_script() -> None:
    build = (ROOT / "notebooks" / "_build.py").read_text()
    hand_written = {"03_end_to_end.ipynb"}  # executed by its test, edited by hand (it runs benchmarks)
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert notebook.name in build or notebook.name in hand_written, notebook.name
