"""Every notebook in notebooks/ runs top to bottom in quick mode, without a cell error.

Each notebook is copied to a temporary directory and executed from there with
``DELTASYNC_NOTEBOOK_QUICK=1`` through nbclient and the ``python3`` kernel; the
kernel's working directory is ``notebooks/``, so notebooks find the repository
as they do when opened there. The committed notebooks (and their outputs) are
never rewritten. Notebook 03 runs ``benchmarks/end_to_end.py --quick`` and
``benchmarks/catchup.py --quick`` in quick mode, so this also covers both scripts
and the JSON they write.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT_S = 600  # per cell; quick mode targets under a minute per notebook on a loaded 2-core machine


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    copy = tmp_path / path.name
    shutil.copyfile(path, copy)
    before = path.read_bytes()
    monkeypatch.setenv("DELTASYNC_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    errors = [
        output for cell in notebook.cells if cell.cell_type == "code"
        for output in cell.get("outputs", []) if output.get("output_type") == "error"
    ]
    assert not errors
    assert path.read_bytes() == before, "the committed notebook changed"


def test_notebooks_are_committed_with_outputs() -> None:
    """Each notebook renders on its own: every code cell ran, and at least one cell drew a figure."""
    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        assert all(c.get("execution_count") for c in cells), f"{path.name} has cells that never ran"
        images = [o for c in cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        assert images, f"{path.name} holds no plot"
        assert not [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"], path.name


def test_quick_results_never_land_in_the_committed_results(tmp_path: Path) -> None:
    """``--quick`` runs write to a temporary directory unless told otherwise (cheap: no benchmark runs)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _common import RESULTS, results_dir
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert results_dir(True, None) != RESULTS
    assert results_dir(False, None) == RESULTS
    assert results_dir(True, str(tmp_path)) == tmp_path
    assert os.fspath(results_dir(False, str(tmp_path))) == os.fspath(tmp_path)
