"""Objects referenced by their entries (``blake3-entries``): every byte is covered, or the object is refused."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.format import digests, encode_anchor, header_ref, raw_header
from deltasync.format.check import intact_by_entries
from deltasync.protocol.manifest import ObjectRef

KEY = "anchors/0000000000-0a1b2c3d-part0000.safetensors"


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "layers.0.bias": torch.randn(8, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "scale": torch.tensor(1.5, dtype=torch.bfloat16),
    }


def by_entries(data: bytes) -> ObjectRef:
    """The reference a publisher writes for an anchor: size, and its header's digest as the object's."""
    head = header_ref(data)
    return ObjectRef(KEY, len(data), head[1], None, head, digests.BY_ENTRIES)


def with_header(data: bytes, edit) -> bytes:
    """``data`` with its safetensors header edited by ``edit(layout)`` and the data area after it kept."""
    layout = raw_header(data)
    size = 8 + int.from_bytes(data[:8], "little")
    edit(layout)
    text = json.dumps(layout, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[size:]


@pytest.fixture(scope="module")
def anchor() -> bytes:
    return encode_anchor(weights(), version=0)


def test_an_anchor_is_intact_and_its_reference_is_its_header(anchor: bytes) -> None:
    ref = by_entries(anchor)
    assert ref.verify(anchor) and ref.verify(bytearray(anchor)) and ref.verify(memoryview(anchor))
    assert ref.digest == digests.hexdigest([anchor[: ref.header[0]]], "blake3")
    assert ref.to_json()[digests.BY_ENTRIES] == ref.digest and ObjectRef.from_json(ref.to_json()) == ref


def test_every_flipped_byte_is_refused(anchor: bytes) -> None:
    """Header (length prefix, JSON, padding) and every entry's bytes: no position escapes a digest."""
    ref = by_entries(anchor)
    for at in range(len(anchor)):
        damaged = bytearray(anchor)
        damaged[at] ^= 0x40
        assert not ref.verify(damaged), f"a flip at byte {at} of {len(anchor)} went unnoticed"


def test_a_shorter_or_longer_object_is_refused(anchor: bytes) -> None:
    ref = by_entries(anchor)
    assert not ref.verify(anchor[:-1]) and not ref.verify(anchor + b"\0")
    assert not intact_by_entries(anchor + b"\0" * 8, ref.header)  # trailing bytes no entry covers
    assert not intact_by_entries(anchor[: ref.header[0] - 1], ref.header)


def test_bytes_outside_every_entry_are_refused(anchor: bytes) -> None:
    """A forged header whose own digest the manifest carries, leaving a gap no tensor digest covers."""

    def gap(layout: dict) -> None:
        for name, info in layout.items():
            if name != "__metadata__" and info["data_offsets"][0] > 0:
                info["data_offsets"] = [info["data_offsets"][0] + 2, info["data_offsets"][1] + 2]

    forged = with_header(anchor, gap)
    forged = forged + b"\0\0"  # the entries now end where the file does, after a 2-byte hole
    assert not by_entries(forged).verify(forged)


def test_an_entry_no_tensor_owns_is_refused(anchor: bytes) -> None:
    def stray(layout: dict) -> None:
        body = max(info["data_offsets"][1] for name, info in layout.items() if name != "__metadata__")
        layout["stray"] = {"dtype": "U8", "shape": [4], "data_offsets": [body, body + 4]}

    forged = with_header(anchor, stray) + b"evil"
    assert not by_entries(forged).verify(forged)


@pytest.mark.parametrize("algorithm", [None, "sha256"])
def test_a_tensor_without_a_blake3_digest_is_refused(anchor: bytes, algorithm: str | None) -> None:
    """SHA-256 entry digests are format 1's; a ``blake3-entries`` reference promises BLAKE3 for every tensor."""

    def drop(layout: dict) -> None:
        tensors = json.loads(layout["__metadata__"]["tensors"])
        digest = tensors["layers.0.bias"].pop("blake3")
        if algorithm is not None:
            tensors["layers.0.bias"][algorithm] = digest
        layout["__metadata__"]["tensors"] = json.dumps(tensors)

    forged = with_header(anchor, drop)
    assert not by_entries(forged).verify(forged)


def test_a_malformed_header_is_refused_even_with_its_digest(anchor: bytes) -> None:
    forged = with_header(anchor, lambda layout: layout["__metadata__"].update(format="other"))
    assert not by_entries(forged).verify(forged)
    head = header_ref(anchor)
    assert not intact_by_entries(anchor, (head[0] - 8, head[1]))  # a header size that is not 8 + its length


def test_a_reference_by_entries_names_its_header() -> None:
    from deltasync.errors import ManifestError

    with pytest.raises(ManifestError, match="header"):
        ObjectRef(KEY, 100, "a" * 64, None, None, digests.BY_ENTRIES)
    with pytest.raises(ManifestError, match="header"):
        ObjectRef(KEY, 100, "a" * 64, None, (16, "b" * 64), digests.BY_ENTRIES)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_random_anchors_are_intact_and_any_flip_is_caught(shapes, seed: int, data: st.DataObject) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": torch.randn(shape, generator=g).to(torch.bfloat16) for i, shape in enumerate(shapes)}
    blob = encode_anchor(tensors, version=3)
    ref = by_entries(blob)
    assert ref.verify(blob)
    at = data.draw(st.integers(0, len(blob) - 1))
    damaged = bytearray(blob)
    damaged[at] ^= 1 << data.draw(st.integers(0, 7))
    assert not ref.verify(damaged)


def test_a_publisher_references_anchors_by_entries_and_a_replica_checks_them(tmp_path, monkeypatch) -> None:
    """End to end through a local store: schema 3, anchors by their headers, deltas whole; a replica lands
    bit-exact, parsing each anchor part's header once (as it checks the part), and a fresh one refuses an
    anchor damaged inside a tensor and keeps its weights."""
    from deltasync import Publisher, Subscriber
    from deltasync.appliers import TorchModuleApplier
    from deltasync.errors import IntegrityError
    from deltasync.format import read_header
    from deltasync.replica import fetch as fetch_module

    model = {n: t.float() for n, t in weights().items()}
    with Publisher(model, str(tmp_path / "run"), part_bytes=128) as publisher:
        publisher.publish(0, block=True)
        model["layers.0.weight"][3, 4] += 1
        publisher.publish(1, block=True)
    raw = json.loads((tmp_path / "run" / "manifest.json").read_text())
    anchors, deltas = raw["versions"][0]["anchor"], raw["versions"][1]["delta"]
    assert raw["schema"] == 3 and len(anchors) > 1
    assert all(set(r) == {"key", "size", "blake3-entries", "header"} for r in anchors)
    assert all("blake3" in r and "blake3-entries" not in r for r in deltas)

    replica = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in model.items()}
    parsed_again: list[int] = []
    monkeypatch.setattr(fetch_module, "read_header", lambda data: parsed_again.append(1) or read_header(data))
    with Subscriber(str(tmp_path / "run"), TorchModuleApplier(replica), ack=False) as sub:
        assert sub.update().version == 1
    assert len(parsed_again) == len(deltas)  # the anchor parts' headers came from their checks
    assert all(torch.equal(replica[n].view(torch.int16), t.bfloat16().view(torch.int16)) for n, t in model.items())

    path = tmp_path / "run" / max(anchors, key=lambda r: r["size"] - r["header"]["size"])["key"]
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0x01  # the last tensor's last byte; header untouched
    path.write_bytes(bytes(damaged))
    fresh = {n: torch.zeros_like(t) for n, t in replica.items()}
    with Subscriber(str(tmp_path / "run"), TorchModuleApplier(fresh), ack=False) as sub:
        with pytest.raises(IntegrityError):
            sub.update()
        assert sub.version is None
    assert all(not t.any() for t in fresh.values())
