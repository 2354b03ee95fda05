"""Property tests: arbitrary input to the manifest parser, the decoder and a replica's update step.

Each property is the same promise: a valid result or a :class:`DeltaSyncError`
subclass, never another exception, never a hang (hypothesis deadlines), and
never a replica state that is not a published version.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync import DeltaSyncError, Publisher, Subscriber, TorchModuleApplier
from deltasync.errors import ManifestError
from deltasync.format import combine, decode, read_header
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest
from deltasync.stores import MemoryStore

# Bounded: a few seconds per property on 2 cores; the fuzz benchmark runs millions.
EXAMPLES = 150
DEADLINE_MS = 5000  # an example that takes this long is a hang as far as the suite is concerned

json_leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


def _published_store() -> tuple[dict[str, bytes], dict[int, dict[str, torch.Tensor]]]:
    """Objects of a small run (anchor + 3 deltas, compact codec) and the bf16 bits of each version."""
    store = MemoryStore("properties-source")
    g = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(40, 24, generator=g), "b": torch.randn(24, generator=g)}
    versions = {}
    with Publisher(weights, store, anchor_every=1000) as publisher:
        for v in range(4):
            if v:
                for t in weights.values():
                    t.add_(torch.randn(t.shape, generator=g) * (torch.rand(t.shape, generator=g) < 0.1))
            publisher.publish(v, block=True)
            publisher.flush()
            versions[v] = {n: t.to(torch.bfloat16).view(torch.int16).clone() for n, t in weights.items()}
    objects = {i.key: store.get(i.key) for i in store.list("")}
    return objects, versions


SOURCE, VERSIONS = _published_store()
MANIFEST = json.loads(SOURCE[MANIFEST_KEY])
names = itertools.count()


def _state(weights: dict[str, torch.Tensor]) -> int | None:
    """Which published version these weights equal bit for bit (``None``: none of them)."""
    for version, want in VERSIONS.items():
        if all(torch.equal(weights[n].view(torch.int16), w) for n, w in want.items()):
            return version
    return None


@settings(max_examples=EXAMPLES, deadline=DEADLINE_MS)
@given(json_values)
def test_manifest_parser_any_json(value: Any) -> None:
    try:
        Manifest.from_bytes(json.dumps(value).encode())
    except ManifestError:
        pass


@settings(max_examples=EXAMPLES, deadline=DEADLINE_MS)
@given(st.data())
def test_manifest_parser_mutated_manifests(data: st.DataObject) -> None:
    """A real manifest with one value anywhere in it replaced: valid and self-consistent, or refused."""
    raw = json.loads(json.dumps(MANIFEST))
    node: Any = raw
    path = []
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    if path:
        parent = raw
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = data.draw(json_values)
    try:
        manifest = Manifest.from_bytes(json.dumps(raw).encode())
    except ManifestError:
        return
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    numbers = [v.version for v in manifest.versions]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) if numbers else True


def _flip(blob: bytes, data: st.DataObject) -> bytes:
    buf = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 6))):
        if buf:
            buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    return bytes(buf)


@settings(max_examples=EXAMPLES, deadline=DEADLINE_MS, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_decoder_any_corruption_of_anchors_and_deltas(data: st.DataObject) -> None:
    """Decode + combine + apply to a scratch copy: a typed error or a patch that applies cleanly."""
    key = data.draw(st.sampled_from(sorted(k for k in SOURCE if k != MANIFEST_KEY)))
    blob = _flip(SOURCE[key], data)
    replica = {n: t.view(torch.bfloat16).clone() for n, t in VERSIONS[0].items()}
    applier = TorchModuleApplier(replica)
    try:
        header = read_header(blob)
        applier.validate(header)
        patch = combine([decode(blob, base=applier.lookup, header=header)], whole=header.kind == "anchor")
    except DeltaSyncError:
        return
    applier.apply(patch)


@settings(max_examples=EXAMPLES, deadline=DEADLINE_MS, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_update_step_never_leaves_an_unpublished_state(data: st.DataObject) -> None:
    """A replica at some version meets a store with one object corrupted (or the manifest edited):
    ``update()`` either ends at a published version, exactly, or raises a typed error; the weights
    always equal a published version, the one the subscriber reports."""
    start = data.draw(st.sampled_from([None, 0, 1, 2]))
    store = MemoryStore(f"properties-{next(names)}")
    objects = dict(SOURCE)
    victim = data.draw(st.sampled_from(sorted(objects)))
    if victim == MANIFEST_KEY and data.draw(st.booleans()):
        raw = json.loads(objects[victim])
        entry = data.draw(st.sampled_from(raw["versions"]))
        entry[data.draw(st.sampled_from(sorted(entry)))] = data.draw(json_values)
        objects[victim] = json.dumps(raw).encode()
    else:
        objects[victim] = _flip(objects[victim], data)
    for key, blob in objects.items():
        store.put(key, blob)
    held = VERSIONS[0 if start is None else start]
    replica = {n: t.view(torch.bfloat16).clone() for n, t in held.items()}
    run_id = MANIFEST["run_id"]
    options: dict[str, Any] = {} if start is None else {"start_version": start, "run_id": run_id}
    sub = Subscriber(store, TorchModuleApplier(replica), ack=False, **options)
    try:
        sub.update()
    except DeltaSyncError:
        pass
    finally:
        sub.close()
    state = _state(replica)
    assert state is not None, "the replica holds weights that no version has"
    if sub.version is not None:
        assert sub.version == state


@pytest.mark.parametrize("cut", [0, 1, 7, 8, 100])
def test_truncated_manifest_is_a_typed_error(cut: int) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_bytes(SOURCE[MANIFEST_KEY][:cut])

