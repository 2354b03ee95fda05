"""Pinned versions: a replica told to hold, to go to an exact version (ahead or back), or to follow at most one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltasync import Publisher, Subscriber
from deltasync.appliers import TorchModuleApplier
from deltasync.errors import ConfigError, VersionError
from deltasync.stores.memory import MemoryStore


def weights_of(version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version``: every version moves a few elements."""
    w = torch.zeros(4, 64)
    for v in range(1, version + 1):
        w.view(-1)[(v * 7) % 256: (v * 7) % 256 + 5] += 0.25 * v
    return {"w": w.to(torch.bfloat16)}


@pytest.fixture
def run(request: pytest.FixtureRequest) -> MemoryStore:
    """Versions 0 to 9, anchors at 0 and 4 and 8."""
    store = MemoryStore(f"pins-{request.node.name}")
    trainer = {"w": torch.zeros(4, 64)}
    with Publisher(trainer, store, anchor_every=4, anchor_ratio=1e9, keep_anchors=3) as publisher:
        for version in range(10):
            trainer["w"].copy_(weights_of(version)["w"].float())
            publisher.publish(version, block=True)
    return store


def replica(store: MemoryStore) -> tuple[dict[str, torch.Tensor], Subscriber]:
    held = {"w": torch.zeros(4, 64, dtype=torch.bfloat16)}
    return held, Subscriber(store, TorchModuleApplier(held), ack=False)


def exact(held: dict[str, Any], version: int) -> bool:
    return torch.equal(held["w"].view(torch.int16), weights_of(version)["w"].view(torch.int16))


def test_a_replica_goes_back_to_an_exact_version_and_forward_again(run: MemoryStore) -> None:
    held, sub = replica(run)
    assert sub.update() is not None and sub.version == 9 and exact(held, 9)
    info = sub.update(version=6)  # back: again from the anchor at or before it
    assert info is not None and info.previous == 9 and info.route[0] == "anchor" and sub.version == 6
    assert exact(held, 6)
    info = sub.update(version=2)
    assert info is not None and info.route[0] == "anchor" and exact(held, 2)
    info = sub.update(version=7)  # ahead again: from what it holds, no anchor
    assert info is not None and "anchor" not in info.route and exact(held, 7)


def test_go_to_pins_the_version_until_told_to_follow(run: MemoryStore) -> None:
    held, sub = replica(run)
    sub.go_to(5)
    assert str(sub.pin) == "exactly v5"
    assert sub.update() is not None and sub.version == 5 and exact(held, 5)
    assert sub.update() is None and sub.poll() is None and sub.version == 5  # stays there
    sub.follow()
    assert sub.update() is not None and sub.version == 9 and exact(held, 9)
    sub.go_to(3)
    assert sub.poll() is not None and sub.version == 3 and exact(held, 3)


def test_hold_stays_and_follow_at_most_stops_short_and_never_goes_back(run: MemoryStore) -> None:
    held, sub = replica(run)
    sub.follow(at_most=4)
    assert sub.update() is not None and sub.version == 4 and exact(held, 4)
    assert sub.update() is None and sub.version == 4
    sub.hold()
    assert str(sub.pin) == "the version held" and sub.update() is None and sub.version == 4
    sub.follow(at_most=7)
    assert sub.update() is not None and sub.version == 7 and exact(held, 7)
    sub.follow(at_most=5)  # past it: stays where it is
    assert sub.update() is None and sub.version == 7
    sub.follow(at_most=100)  # beyond the newest: the newest
    assert sub.update() is not None and sub.version == 9


def test_a_version_no_anchor_reaches_back_to_is_refused_with_the_oldest(run: MemoryStore) -> None:
    store = MemoryStore("pins-retired")
    trainer = {"w": torch.zeros(4, 64)}
    with Publisher(trainer, store, anchor_every=4, anchor_ratio=1e9, keep_anchors=1) as publisher:
        for version in range(10):
            trainer["w"].copy_(weights_of(version)["w"].float())
            publisher.publish(version, block=True)
    held, sub = replica(store)
    assert sub.update() is not None and sub.version == 9
    with pytest.raises(VersionError, match="no longer listed .* keeps 8 to 9"):
        sub.update(version=6)
    assert sub.version == 9 and exact(held, 9)
    with pytest.raises(VersionError, match="not published"):
        sub.update(version=12)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_a_pin_that_is_not_a_version_is_refused(run: MemoryStore, bad: Any) -> None:
    _, sub = replica(run)
    with pytest.raises(ConfigError, match="version number"):
        sub.go_to(bad)
    with pytest.raises(ConfigError, match="version number"):
        sub.follow(at_most=bad)
    assert str(sub.pin) == "the newest"
