"""``benchmarks/device_sync.py --quick`` runs on the CPU: every stage measured against its floor, bit-exact."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_device_sync_quick_on_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device_sync.py"), "--quick", "--out", str(tmp_path),
         "--profile", str(tmp_path / "profiles"), "--fused", "16"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "device_sync_cpu_fused_16.json").read_text())
    # exact, the vLLM rank's tensors included: 16 to a parameter, not side by side in the file's order
    assert result["exact"] and result["device"] == "cpu" and result["fused"] == 16
    assert set(result["stages"]) == {
        "anchor publish", "anchor publish, periodic", "anchor load", "anchor load, copied", "anchor publish, one part",
        "anchor publish, periodic, one part", "anchor load, one part", "anchor load, copied, one part",
        "diff", "diff, device path", "decode", "decode, 1 thread", "decode, device path", "apply",
        "apply, staged", "decode, vLLM rank", "apply, vLLM rank", "whole update",
    }
    assert result["stages"]["diff, device path"]["host_waits"] == 2  # whatever the number of tensors
    rebuilt = result["stages"]["decode, device path"]
    assert rebuilt["host_waits"] == 1 and rebuilt["tensors"] == 64  # one wait for the file, not one per tensor
    assert result["stages"]["decode, vLLM rank"]["host_waits"] == 1  # through a rank's index map too
    # Where each device path's host time went, by phase (the GPU run's breakdown, without a profiler)
    phases = {"inflate", "inflate_wait", "queue", "wait", "check_values"}
    assert set(rebuilt["phases"]) == phases == set(result["stages"]["decode, vLLM rank"]["phases"])
    assert set(result["stages"]["diff, device path"]["phases"]) == {"search", "wait_found", "wait_changes"}
    assert all(t >= 0 for t in rebuilt["phases"].values()) and rebuilt["phases"]["inflate"] > 0
    assert result["stages"]["whole update"]["phases"] == {}  # a CPU replica decodes on the host path
    assert "host time of the device paths by phase" in done.stdout
    one = result["stages"]["decode, 1 thread"]
    assert one["threads"] == 1 and one["floor_changes_per_s"] > 0  # the per-core floor, also on one core
    assert "floor" in done.stdout.split("decode, 1 thread")[1].splitlines()[0]
    for stage in result["stages"].values():
        assert stage["deltasync"] > 0 and stage["floor"] > 0
    assert "stage" in done.stdout and "floor" in done.stdout
    # --profile: one more run of each stage under torch's profiler and cProfile, the library's phases named
    for stage, phase in (("diff", "diff/snapshot.py"), ("decode", "rebuild"), ("apply", "(put)"),
                         ("whole_update", "deltasync.decode")):
        text = (tmp_path / "profiles" / f"profile_{stage}.txt").read_text()
        assert "torch ops by self host time" in text and "cProfile" in text and phase in text, stage
        assert json.loads(gzip.open(tmp_path / "profiles" / f"profile_{stage}.json.gz").read())["traceEvents"]


def test_device_sync_on_checkpoints_of_a_run(tmp_path: Path) -> None:
    """``--checkpoints``: a run's own weights and steps (files, or directories of files) instead of the
    synthetic model; the step timed is the first checkpoint's change to the second, counted exactly."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.weight": (torch.randn(300, 40, generator=gen) * 0.02).to(torch.bfloat16) for i in range(6)}
    weights["norm.weight"] = torch.ones(40, dtype=torch.bfloat16)
    paths, changed = [], []
    for k in range(4):
        if k:  # a step: some elements move by one or a few ulps
            moved = 0
            for tensor in weights.values():
                bits = tensor.view(torch.int16).view(-1)
                where = torch.randperm(bits.numel(), generator=gen)[: bits.numel() // 50]
                bits[where] += torch.randint(1, 4, (len(where),), generator=gen, dtype=torch.int16)
                moved += len(where)
            changed.append(moved)
        if k == 1:  # a directory of two files
            (tmp_path / "step-1").mkdir()
            names = sorted(weights)
            save_file({n: weights[n].clone() for n in names[:3]}, str(tmp_path / "step-1" / "a.safetensors"))
            save_file({n: weights[n].clone() for n in names[3:]}, str(tmp_path / "step-1" / "b.safetensors"))
            paths.append(str(tmp_path / "step-1"))
        else:
            save_file({n: t.clone() for n, t in weights.items()}, str(tmp_path / f"step-{k}.safetensors"))
            paths.append(str(tmp_path / f"step-{k}.safetensors"))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device_sync.py"), "--checkpoints", *paths, "--repeats", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "device_sync_cpu_checkpoints.json").read_text())
    assert result["exact"] and result["checkpoints"] == paths and result["tensors"] == 7
    assert result["changes"] == changed[0] and result["density"] == changed[0] / result["params"]
    assert result["params"] == 6 * 300 * 40 + 40
    assert all(stage["deltasync"] > 0 for stage in result["stages"].values())


def _script() -> object:
    """benchmarks/device_sync.py as a module (its own directory on the path, as when it runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_sync_script", ROOT / "benchmarks" / "device_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_sync_refuses_up_front_what_it_has_no_room_for(tmp_path: Path, monkeypatch) -> None:
    """A run whose stores no filesystem can hold (a container's 64 MB /dev/shm, a small disk) or whose
    masters and copies its GPU cannot hold is refused before anything is allocated, saying what to change;
    a checkpoint's size is read from its files' headers, its non-float tensors left out as the run leaves them."""
    import pytest
    import torch
    from safetensors.torch import save_file

    script = _script()
    with pytest.raises(SystemExit, match="TMPDIR"):
        script.scratch_place(1 << 60)  # type: ignore[attr-defined]
    assert script.scratch_place(1 << 10).is_dir()  # type: ignore[attr-defined]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 80 << 30))
    with pytest.raises(SystemExit, match="smaller --params"):
        script.check_device_memory(torch.device("cuda"), 4 << 30, 2 << 30, "1,000M parameters")  # type: ignore[attr-defined]
    script.check_device_memory(torch.device("cuda"), 1 << 20, 1 << 20, "tiny")  # type: ignore[attr-defined]
    script.check_device_memory(torch.device("cpu"), 1 << 60, 1 << 60, "any")  # type: ignore[attr-defined]
    (tmp_path / "ckpt").mkdir()
    save_file({"a": torch.zeros(10, 3, dtype=torch.bfloat16), "steps": torch.zeros(7, dtype=torch.int64)},
              str(tmp_path / "ckpt" / "one.safetensors"))
    save_file({"b": torch.zeros(5, dtype=torch.float32)}, str(tmp_path / "ckpt" / "two.safetensors"))
    assert script.checkpoint_bytes(str(tmp_path / "ckpt")) == (30 * 2 + 5 * 4, 35)  # type: ignore[attr-defined]
