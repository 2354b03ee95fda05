"""Applies are all or nothing: a write that fails between two tensors is taken back, a replica killed mid-write
knows it needs an anchor, and a replica can take back its last applies without the store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from deltasync import Publisher, Subscriber
from deltasync.appliers import TorchModuleApplier
from deltasync.codec import Decoded
from deltasync.errors import VersionError
from deltasync.stores.memory import MemoryStore

ROOT = Path(__file__).resolve().parents[1]


def weights_at(version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version``: every version moves a few elements of every tensor."""
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(32, 32, generator=g), "b": torch.randn(64, generator=g), "c": torch.randn(8, 16, generator=g)}
    for v in range(1, version + 1):
        for t in w.values():
            t.view(-1)[(v * 5) % t.numel(): (v * 5) % t.numel() + 3] += 0.5
    return {n: t.to(torch.bfloat16) for n, t in w.items()}


def publish(store: Any, versions: int, **options: Any) -> None:
    trainer = {n: t.float() for n, t in weights_at(0).items()}
    with Publisher(trainer, store, anchor_every=1000, anchor_ratio=1e9, **options) as publisher:
        for version in range(versions + 1):
            for name, t in weights_at(version).items():
                trainer[name].copy_(t.float())
            publisher.publish(version, block=True)


def exact(held: Mapping[str, torch.Tensor], version: int) -> bool:
    return all(torch.equal(held[n].view(torch.int16), t.view(torch.int16)) for n, t in weights_at(version).items())


class FailsOnce(TorchModuleApplier):
    """Writes the first tensor of the next apply, then fails (a full disk, a lost device), once."""

    armed = False

    def apply(self, decoded: Mapping[str, Decoded]) -> None:
        if not self.armed:
            return super().apply(decoded)
        self.armed = False
        first = next(iter(decoded))
        super().apply({first: decoded[first]})
        raise OSError("no space left on device")


def replica(store: Any, cls: type[TorchModuleApplier] = TorchModuleApplier, **options: Any) -> tuple[Any, Any]:
    held = {n: torch.zeros_like(t) for n, t in weights_at(0).items()}
    applier = cls(held)
    return held, Subscriber(store, applier, ack=False, **options)


def test_a_write_that_fails_between_two_tensors_is_taken_back() -> None:
    store = MemoryStore("tx-fails")
    publish(store, 1)
    held, sub = replica(store, FailsOnce)
    assert sub.update(version=0) is not None and exact(held, 0)
    sub.applier.armed = True
    with pytest.raises(OSError, match="no space"):
        sub.update()
    assert sub.version == 0 and exact(held, 0) and sub.stats.restored == 1  # as if nothing was written
    info = sub.update()  # the same delta, no anchor needed
    assert info is not None and info.route == ("delta",) and exact(held, 1)


def test_an_anchor_beyond_the_undo_budget_that_fails_leaves_a_replica_that_needs_an_anchor() -> None:
    store = MemoryStore("tx-anchor")
    publish(store, 2)
    held, sub = replica(store, FailsOnce, undo_bytes=0)
    assert sub.update() is not None and sub.version == 2
    sub.applier.armed = True
    with pytest.raises(OSError):
        sub.update(version=0)  # back: the anchor of v0, whole tensors, nothing kept to restore them with
    assert sub.version is None and sub.stats.restored == 0  # mixed: it knows, and the next route is an anchor
    info = sub.update()
    assert info is not None and info.route[0] == "anchor" and exact(held, 2)


def test_undo_takes_back_the_last_applies_without_the_store_and_holds() -> None:
    store = MemoryStore("tx-undo")
    publish(store, 4)
    held, sub = replica(store)
    for version in range(5):
        assert sub.update(version=version) is not None and exact(held, version)
    reads = sub.store.get
    sub.store.get = lambda *a, **k: (_ for _ in ()).throw(AssertionError("undo read the store"))  # type: ignore[method-assign]
    assert sub.undo(3) == 1 and exact(held, 1)
    assert sub.undo() == 0 and exact(held, 0)
    sub.store.get = reads  # type: ignore[method-assign]
    assert str(sub.pin) == "the version held" and sub.update() is None and sub.version == 0
    with pytest.raises(VersionError, match="can take back 0 applies from v0"):
        sub.undo()  # the anchor of v0 came from nothing: there is nothing before it
    assert exact(held, 0)
    sub.follow()
    assert sub.update() is not None and sub.version == 4 and exact(held, 4)


def test_the_undo_log_keeps_the_newest_applies_within_its_budget() -> None:
    store = MemoryStore("tx-budget")
    publish(store, 6)
    held, sub = replica(store, undo_bytes=200)  # a delta here overwrites 9 elements: 9 * (8 + 2) = 90 bytes
    for version in range(7):
        sub.update(version=version)
    with pytest.raises(VersionError, match="can take back 2 applies from v6, not 3"):
        sub.undo(3)
    assert sub.version == 6 and exact(held, 6)  # nothing taken back
    assert sub.undo(2) == 4 and exact(held, 4)


def test_a_checkpoint_that_fails_midway_is_restored_and_recorded_at_the_version_it_held(tmp_path: Path) -> None:
    from deltasync.appliers.checkpoint.applier import CheckpointDirApplier

    url = str(tmp_path / "run")
    publish(url, 2)
    ckpt = tmp_path / "ckpt"
    assert _watch(url, ckpt, "--version", "1").returncode == 0

    class FlushFails(CheckpointDirApplier):
        def _write(self, decoded: Any, run_id: Any, version: Any) -> None:
            if version == 2:  # the apply of v2 dies after its first tensor; the restore of v1 goes through
                first = next(iter(decoded))
                super()._write({first: decoded[first]}, run_id, version)
                raise OSError("no space left on device")
            super()._write(decoded, run_id, version)

    applier = FlushFails(ckpt)
    sub = Subscriber(url, applier, ack=False, **applier.resume_options())
    with pytest.raises(OSError):
        sub.update()
    assert sub.version == 1 and sub.stats.restored == 1
    state = json.loads((ckpt / "deltasync.json").read_text())
    assert state["version"] == 1 and state["clean"] is True
    sub.close()
    applier.close()
    assert exact(load_file(ckpt / "model.safetensors"), 1)


def test_a_replica_killed_between_two_writes_knows_it_needs_an_anchor(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    publish(url, 2)
    ckpt = tmp_path / "ckpt"
    assert _watch(url, ckpt, "--version", "1").returncode == 0
    marker = tmp_path / "writing"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from deltasync import Subscriber\n"
        "from deltasync.appliers.checkpoint.applier import CheckpointDirApplier\n"
        "class Slow(CheckpointDirApplier):\n"
        "    def _write(self, decoded, run_id, version):\n"
        "        first = next(iter(decoded))\n"
        "        super()._write({first: decoded[first]}, run_id, version)\n"
        "        state = Path(sys.argv[2]) / 'deltasync.json'\n"
        "        state.write_text(state.read_text().replace('\"clean\": true', '\"clean\": false'))\n"
        "        Path(sys.argv[3]).touch()\n"
        "        time.sleep(120)\n"
        "applier = Slow(sys.argv[2])\n"
        "Subscriber(sys.argv[1], applier, ack=False, **applier.resume_options()).update()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script, url, str(ckpt), str(marker)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.poll() is None and time.monotonic() < deadline, "the replica never began writing"
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGKILL)  # between its first tensor and the last
    finally:
        process.wait(30)
    assert json.loads((ckpt / "deltasync.json").read_text())["clean"] is False
    again = _watch(url, ckpt)
    assert again.returncode == 0, again.stderr
    assert "no resumable version" in again.stdout and "via anchor" in again.stdout
    assert exact(load_file(ckpt / "model.safetensors"), 2)


def _watch(url: str, ckpt: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deltasync.cli", "watch", url, "--model", str(ckpt), "--once",
                           "--no-ack", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
