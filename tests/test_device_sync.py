"""``benchmarks/device_sync.py --quick`` runs on the CPU: every stage measured against its floor, bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_device_sync_quick_on_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device_sync.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "device_sync_cpu.json").read_text())
    assert result["exact"] and result["device"] == "cpu"
    assert set(result["stages"]) == {
        "anchor publish", "anchor publish, periodic", "anchor load", "anchor publish, one part",
        "anchor publish, periodic, one part", "anchor load, one part",
        "diff", "diff, device path", "decode", "decode, 1 thread", "decode, device path", "apply",
        "apply, staged", "whole update",
    }
    assert result["stages"]["diff, device path"]["host_waits"] == 2  # whatever the number of tensors
    rebuilt = result["stages"]["decode, device path"]
    assert rebuilt["host_waits"] == 1 and rebuilt["tensors"] == 64  # one wait for the file, not one per tensor
    for stage in result["stages"].values():
        assert stage["deltasync"] > 0 and stage["floor"] > 0
    assert "stage" in done.stdout and "floor" in done.stdout
