"""Rollback of live weights: a new version equal to an earlier one, bit for bit, on every store backend.

A live replica and a late joiner land on the restored version's weights through ordinary routes; the versions
between are retracted in the manifest (listed still: history is never rewritten); the trainer resumes from
the restored weights; a rollback nothing can reach, or from outside while the trainer's lease is live, is
refused with a typed error that says what to do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync import Publisher, Subscriber
from deltasync.appliers import TorchModuleApplier
from deltasync.control import rollback, weights_at
from deltasync.errors import ConflictError, VersionError
from deltasync.protocol.keys import MANIFEST_KEY
from deltasync.protocol.manifest import Manifest
from deltasync.stores import Store, open_store

ROOT = Path(__file__).resolve().parents[1]


def trained(version: int) -> dict[str, torch.Tensor]:
    """The trainer's fp32 weights after ``version`` steps (a bad step at 4 blows a few weights up)."""
    g = torch.Generator().manual_seed(0)
    w = {"layer.weight": torch.randn(48, 32, generator=g), "layer.bias": torch.randn(48, generator=g)}
    for v in range(1, version + 1):
        for t in w.values():
            t.view(-1)[(v * 11) % t.numel(): (v * 11) % t.numel() + 4] += 0.1 if v != 4 else 1e30
    return w


def bf16(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in weights.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def follower(store: Store) -> tuple[dict[str, torch.Tensor], Subscriber]:
    held = {n: torch.zeros_like(t) for n, t in bf16(trained(0)).items()}
    return held, Subscriber(store, TorchModuleApplier(held), ack=False)


def test_a_live_replica_and_a_late_joiner_land_on_the_restored_weights_and_the_trainer_resumes(store: Store) -> None:
    model = trained(0)
    live, sub = follower(store)
    with Publisher(model, store, anchor_every=1000, anchor_ratio=1e9) as publisher:
        for version in range(6):
            for name, t in trained(version).items():
                model[name].copy_(t)
            publisher.publish(version, block=True)
            publisher.flush()
            sub.update()
        assert sub.version == 5
        done = rollback(publisher, to=3, step=3)  # version 4 was the bad step
        assert (done.version, done.restores, done.retracted) == (6, 3, (4, 5))
        assert same(done.weights, bf16(trained(3))) and done.info is not None and done.info.kind == "delta"
        info = sub.update()
        assert info is not None and info.route == ("delta",) and same(live, bf16(trained(3)))
        late, joiner = follower(store)
        assert joiner.update() is not None and joiner.version == 6 and same(late, bf16(trained(3)))
        manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
        assert manifest.entry(6).restores == 3 and manifest.retracted() == {4, 5}
        assert [e.version for e in manifest.versions] == list(range(7))  # nothing rewritten
        # The trainer resumes from the restored weights (its own checkpoint of step 3 would do as well).
        for name, t in done.weights.items():
            model[name].copy_(t.float())
        model["layer.bias"][0] += 0.5
        publisher.publish(7, block=True)
        publisher.flush()
        assert sub.update() is not None and sub.version == 7 and same(live, bf16(model))
        assert same(weights_at(store, 3), bf16(trained(3)))
    sub.close()
    joiner.close()


def test_a_rollback_nothing_can_reach_is_refused_with_the_oldest_possible(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    model = trained(0)
    with Publisher(model, url, anchor_every=3, anchor_ratio=1e9, keep_anchors=1) as publisher:
        for version in range(8):
            for name, t in trained(version).items():
                model[name].copy_(t)
            publisher.publish(version, block=True)
        publisher.flush()
        with pytest.raises(VersionError, match="can reach v6 .* to v7"):
            rollback(publisher, to=2)
        with pytest.raises(VersionError, match="newest version"):
            rollback(publisher, to=7)
    assert Manifest.from_bytes(open_store(url).get(MANIFEST_KEY)).latest == 7  # nothing published


def test_the_command_refuses_a_live_trainer_and_rolls_back_once_it_is_gone(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    model = trained(0)
    publisher = Publisher(model, url)
    for version in range(4):
        for name, t in trained(version).items():
            model[name].copy_(t)
        publisher.publish(version, block=True)
    publisher.flush()
    live = _cli("rollback", url, "--to", "1")
    assert live.returncode == 2 and "ConflictError" in live.stderr and "takeover" in live.stderr
    with pytest.raises(ConflictError):
        rollback(url, 1)
    publisher.close()  # the trainer stops: its lease ends
    done = _cli("rollback", url, "--to", "1")
    assert done.returncode == 0, done.stderr
    assert "v4 restores v1" in done.stdout and "v2 to v3 retracted" in done.stdout
    held, sub = follower(open_store(url))
    assert sub.update() is not None and sub.version == 4 and same(held, bf16(trained(1)))
    sub.close()
    status = _cli("status", url, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["retracted"] == [2, 3]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deltasync.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
