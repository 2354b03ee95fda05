"""Catch-up spans: a replica k versions behind reaches the newest in O(log k) objects, exactly.

One run of 1000 versions is published once per module (a small model whose changes fall in a hot tenth of
its elements, as an optimizer's do, so spans of every length are worth writing); replicas join it at
1 to 1000 versions behind. Each must end bit-identical to the trainer, downloading exactly the objects and
bytes the planner promised.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch

from deltasync import Publisher, Subscriber
from deltasync.appliers import TorchModuleApplier
from deltasync.errors import IntegrityError
from deltasync.integrations.trl.metrics import publish_metrics
from deltasync.protocol.keys import SPANS
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest, plan_route
from deltasync.protocol.retired import read_retired
from deltasync.publish.spans import MAX_DENSITY, SpanLevels, merge, run_of
from deltasync.replica.fetch import BAD_AFTER
from deltasync.stores import Store
from deltasync.stores.memory import MemoryStore
from deltasync.stores.wrap import DelegatingStore
from deltasync.tensors import ChangeSet, TensorChange, TensorSpec

from .faults import FaultyStore

VERSIONS = 1000
BEHIND = (1, 2, 3, 7, 8, 100, 1000)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 32)).to(torch.bfloat16)


def step(model: torch.nn.Module, version: int) -> None:
    """One version's changes: a few elements of a hot tenth of each weight, and now and then a whole bias."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.view(-1)
            if name.endswith("bias"):
                if version % 50 == 0:
                    flat += 0.5
                continue
            hot = flat.numel() // 10
            at = torch.randint(0, hot, (max(1, flat.numel() // 200),), generator=g) * 10
            flat[at] += torch.randn(at.numel(), generator=g, dtype=torch.float32).to(p.dtype) * 0.05


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_exact(expected: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.view(torch.int16), expected[name].view(torch.int16)), name


class Reads(DelegatingStore):
    """Records the version objects a replica reads."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.keys: list[str] = []

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if key != MANIFEST_KEY:
            self.keys.append(key)
        return super().get(key, max_bytes=max_bytes)


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    store = MemoryStore("spans-run")
    trainer = net()
    held = {}
    started = time.perf_counter()
    with Publisher(trainer, store, anchor_every=10 * VERSIONS, anchor_ratio=1e9, max_span=1024) as publisher:
        for version in range(VERSIONS + 1):
            if version:
                step(trainer, version)
            publisher.publish(version, block=True)
            publisher.flush()
            if VERSIONS - version in BEHIND:
                held[version] = weights(trainer)
    manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
    assert manifest.latest == VERSIONS, time.perf_counter() - started
    return {"store": store, "manifest": manifest, "held": held, "final": weights(trainer)}


def replica_at(run: dict[str, Any], version: int, store: Store) -> tuple[torch.nn.Module, Subscriber]:
    model = net()
    model.load_state_dict(run["held"][version])
    return model, Subscriber(store, TorchModuleApplier(model), start_version=version,
                             run_id=run["manifest"].run_id, ack=False)


@pytest.mark.parametrize("behind", BEHIND)
def test_a_replica_behind_reaches_the_newest_in_logarithmic_objects_exactly(run: dict[str, Any], behind: int) -> None:
    manifest, start = run["manifest"], VERSIONS - behind
    plan = plan_route(manifest, start)
    assert plan is not None
    # Never more than two objects per power of two: up to the largest span, then down.
    assert len(plan.steps) <= 2 * math.ceil(math.log2(behind + 1)), [s.label for s in plan.steps]
    chain = sum(manifest.entry(v).delta_bytes for v in range(start + 1, VERSIONS + 1))
    assert plan.nbytes <= chain
    if behind >= 7:
        assert "span" in [s.label for s in plan.steps]
    reads = Reads(run["store"])
    model, sub = replica_at(run, start, reads)
    info = sub.update()
    assert info is not None and info.version == VERSIONS
    assert info.bytes == plan.nbytes and info.route == tuple(s.label for s in plan.steps)
    assert sorted(reads.keys) == sorted(o.key for s in plan.steps for o in s.objects)
    assert_exact(run["final"], model)


def test_spans_are_smaller_than_what_they_replace_and_than_the_anchor(run: dict[str, Any]) -> None:
    manifest = run["manifest"]
    anchor = manifest.anchors()[-1].anchor_bytes
    count = 0
    for entry in manifest.versions:
        for span in entry.spans:
            count += 1
            assert entry.version % (entry.version - span.base) == 0  # a power of two that divides the version
            assert (entry.version - span.base) & (entry.version - span.base - 1) == 0
            chain = sum(manifest.entry(v).delta_bytes for v in range(span.base + 1, entry.version + 1))
            assert span.nbytes < chain and span.nbytes < anchor
            assert all(o.key.startswith(SPANS) for o in span.objects)
    assert count >= VERSIONS * 0.9  # about one a version: 1/2 + 1/4 + ...


def test_a_damaged_span_is_refused_and_the_replica_takes_the_chain(run: dict[str, Any]) -> None:
    faulty = FaultyStore(run["store"])
    faulty.corrupt[SPANS] = lambda data: data[:-16] + bytes(16)
    start = VERSIONS - 8
    model, sub = replica_at(run, start, faulty)
    with pytest.raises(IntegrityError):
        sub.update()
    assert sub.version == start
    assert_exact(run["held"][start], model)  # refused before any write
    refusals = 1
    while True:  # a hash mismatch may be the link's: tried again, then avoided, and the next span tried
        try:
            info = sub.update()
            break
        except IntegrityError:
            refusals += 1
            assert sub.version is not None and refusals <= BAD_AFTER * 4
    assert info is not None and info.version == VERSIONS and "span" not in info.route
    assert_exact(run["final"], model)


def test_spans_are_retired_with_their_chain() -> None:
    store = MemoryStore("spans-retired")
    trainer = net()
    written = set()
    with Publisher(trainer, store, anchor_every=12, anchor_ratio=1e9, keep_anchors=1, retire_grace_s=0.0,
                   max_span=8) as publisher:
        for version in range(40):
            if version:
                step(trainer, version)
            publisher.publish(version, block=True)
            publisher.flush()
            written |= {info.key for info in store.list(SPANS)}
    manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
    oldest = manifest.versions[0].version
    assert oldest == 36
    listed = {o.key for e in manifest.versions for o in e.objects()}
    assert any(e.spans for e in manifest.versions)
    assert all(s.base >= oldest for e in manifest.versions for s in e.spans)
    stored = {info.key for info in store.list(SPANS)}
    assert stored == {o.key for e in manifest.versions for s in e.spans for o in s.objects} and stored <= listed
    assert len(written) > len(stored)  # the others went with their chain (no grace here)
    assert not read_retired(store).entries
    model = net()
    Subscriber(store, TorchModuleApplier(model), ack=False).update()
    assert_exact(weights(trainer), model)


def test_max_span_zero_writes_no_span() -> None:
    store = MemoryStore("no-spans")
    trainer = net()
    with Publisher(trainer, store, max_span=0) as publisher:
        for version in range(9):
            if version:
                step(trainer, version)
            publisher.publish(version, block=True)
    manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
    assert not any(e.spans for e in manifest.versions) and not list(store.list(SPANS))
    assert b'"schema": 3' in store.get(MANIFEST_KEY)  # readers of schema 3 still read it


def test_the_trainer_reports_what_spans_cost() -> None:
    infos = []
    trainer = net()
    with Publisher(trainer, MemoryStore("span-cost"), on_publish=infos.append) as publisher:
        for version in range(9):
            if version:
                step(trainer, version)
            publisher.publish(version, block=True)
    spans = [i for i in infos if i.kind == "span"]
    assert [i.version for i in spans] == [2, 4, 6, 8]
    assert all(i.bytes > 0 and i.t_total >= i.t_encode >= 0 for i in spans)
    logged = publish_metrics(infos, 8)  # what a TRL trainer's logs carry
    deltas = [i for i in infos if i.kind == "delta"]
    assert logged["deltasync/span_bytes"] == sum(i.bytes for i in spans) / len(deltas)
    assert logged["deltasync/span_s"] > 0


# ---------------------------------------------------------------------- the runs spans are merged from


def _spec(name: str, numel: int) -> TensorSpec:
    return TensorSpec(name, (numel,), "BF16")


def _change(spec: TensorSpec, old: torch.Tensor, new: torch.Tensor) -> ChangeSet:
    at = torch.nonzero(old != new).reshape(-1)
    change = TensorChange(spec, at, new[at], old[at], int(at.numel()))
    return ChangeSet((change,) if at.numel() else (), (spec,))


def test_merged_runs_keep_the_oldest_base_and_the_newest_value_and_drop_what_came_back() -> None:
    spec = _spec("w", 64)
    g = torch.Generator().manual_seed(1)
    states = [torch.randint(-100, 100, (64,), generator=g, dtype=torch.int16)]
    for _ in range(8):
        nxt = states[-1].clone()
        at = torch.randint(0, 64, (6,), generator=g)
        nxt[at] = torch.randint(-100, 100, (6,), generator=g, dtype=torch.int16)
        states.append(nxt)
    states[8][:4] = states[0][:4]  # some elements come back to where they started
    runs = [run_of(_change(spec, states[v - 1], states[v]), v) for v in range(1, 9)]
    merged = runs[0]
    for r in runs[1:]:
        merged = merge(merged, r)
    idx, old, new = merged.tensors["w"]
    expected = torch.nonzero(states[0] != states[8]).reshape(-1)
    assert idx.tolist() == expected.tolist()
    assert old.tolist() == states[0][expected].tolist() and new.tolist() == states[8][expected].tolist()
    with pytest.raises(ValueError, match="do not meet"):
        merge(runs[0], runs[2])


def test_levels_hand_out_each_power_of_two_that_divides_the_version_and_stop_at_the_density_cap() -> None:
    spec = _spec("w", 1000)
    levels = SpanLevels(max_span=8, numel=1000)
    state = torch.zeros(1000, dtype=torch.int16)
    due = {}
    for v in range(1, 17):
        nxt = state.clone()
        nxt[v * 3: v * 3 + 3] += 1
        due[v] = [(r.base, r.version) for r in levels.record(_change(spec, state, nxt), v)]
        state = nxt
    assert due[1] == [] and due[2] == [(0, 2)] and due[4] == [(2, 4), (0, 4)]
    assert due[8] == [(6, 8), (4, 8), (0, 8)] and due[16] == [(14, 16), (12, 16), (8, 16)]  # 16 > max_span
    dense = SpanLevels(max_span=64, numel=100)
    state = torch.zeros(100, dtype=torch.int16)
    for v in range(1, 5):
        nxt = state.clone()
        nxt[(v - 1) * 10: v * 10] += 1  # 10 % a version: a span of two covers 20 % > MAX_DENSITY
        assert 0.1 <= MAX_DENSITY < 0.2
        assert dense.record(_change(_spec("w", 100), state, nxt), v) == []
        state = nxt
