"""Expert-addressable reads: a replica fetches only the tensors it holds, by byte range, verified.

Real stores (memory, local, S3 and HF through loopback servers), real deltas
and anchors from the Publisher, exact bitwise checks; tampered headers and
tensor bytes are refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import Publisher, Subscriber
from deltasync.appliers import TorchModuleApplier
from deltasync.errors import ConfigError, DeltaFormatError, IntegrityError
from deltasync.format import decode, decode_entries, header_ref, raw_header
from deltasync.protocol.keys import MANIFEST_KEY
from deltasync.protocol.manifest import Manifest, ObjectRef
from deltasync.replica.ranged import can_read_ranges, fetch_tensors
from deltasync.stores import Store
from deltasync.tensors import bits_view
from tests.conftest import make_store
from tests.format_helpers import with_header_text

EXPERTS = 8


def _moe_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-expert tensors (as a MoE checkpoint names them) plus shared ones."""
    g = torch.Generator().manual_seed(seed)
    weights = {"embed.weight": torch.randn(64, 512, generator=g), "gate.weight": torch.randn(EXPERTS, 512, generator=g)}
    for e in range(EXPERTS):
        for proj, shape in (("gate_proj", (256, 512)), ("up_proj", (256, 512)), ("down_proj", (512, 256))):
            weights[f"experts.{e}.{proj}.weight"] = torch.randn(*shape, generator=g)
    return weights


def _step(weights: dict[str, torch.Tensor], touched: list[int], seed: int) -> None:
    """Change ~2 % of the touched experts' elements and of the router (bf16 steps, so every change shows)."""
    g = torch.Generator().manual_seed(seed)
    names = ["gate.weight"] + [n for n in weights if n.startswith("experts.") and int(n.split(".")[1]) in touched]
    for name in names:
        t = weights[name]
        mask = torch.rand(t.shape, generator=g) < 0.02
        t.add_(mask * 0.05)


def _holds(rank: int, ranks: int):
    """An expert-parallel rank's tensors: its experts (linear placement) and the shared ones."""
    per = EXPERTS // ranks

    def wanted(name: str) -> bool:
        if not name.startswith("experts."):
            return True
        return rank * per <= int(name.split(".")[1]) < (rank + 1) * per

    return wanted


def _manifest(store: Store) -> Manifest:
    return Manifest.from_bytes(store.get(MANIFEST_KEY))


@pytest.mark.parametrize("backend", ["memory", "local", "s3", "hf"])
def test_rank_follows_only_its_experts_exactly_and_reads_less(
    backend: str, servers: dict[str, Any], tmp_path: Path
) -> None:
    trainer = _moe_weights()
    store = make_store(backend, servers, tmp_path)
    replica = {n: t.to(torch.bfloat16) for n, t in _moe_weights(seed=1).items()}  # stale until the anchor
    untouched = {n: t.clone() for n, t in replica.items()}
    wanted = _holds(rank=1, ranks=4)
    with (
        Publisher(trainer, store) as pub,
        Subscriber(store, TorchModuleApplier(replica), ack=False, only=wanted) as sub,
    ):
        pub.publish(0, block=True)
        pub.flush()
        info = sub.update()
        assert info is not None and info.route == ("anchor",)
        whole = sum(r.size for r in _manifest(store).entry(0).anchor)
        assert info.bytes < 0.6 * whole
        for version in range(1, 4):
            _step(trainer, touched=[1, 2, 5], seed=version)  # experts 2 and 3 belong to rank 1
            pub.publish(version, block=True)
            pub.flush()
            info = sub.update()
            delta = _manifest(store).entry(version).delta
            assert info is not None and info.bytes <= sum(r.size for r in delta)
            for name, t in replica.items():
                expected = trainer[name].to(torch.bfloat16) if wanted(name) else untouched[name]
                assert torch.equal(bits_view(t), bits_view(expected)), name


def test_fetch_matches_a_whole_decode_and_coalesces(tmp_path: Path) -> None:
    trainer = _moe_weights()
    store = make_store("local", {}, tmp_path)
    with Publisher(trainer, store) as pub:
        pub.publish(0, block=True)
        before = {n: bits_view(t.to(torch.bfloat16)).view(-1) for n, t in trainer.items()}
        _step(trainer, touched=list(range(EXPERTS)), seed=7)
        pub.publish(1, block=True)
        pub.flush()
    ref = _manifest(store).entry(1).delta[0]
    assert can_read_ranges(ref)
    whole = store.get(ref.key)
    base = lambda n, i: before[n][i].numpy()  # noqa: E731
    header, full = decode(whole, base=base)
    assert fetch_tensors(store, ref, _holds(0, 2)).bytes_read <= len(whole)  # small gaps read through
    per_rank = [fetch_tensors(store, ref, _holds(r, 2), gap=0) for r in range(2)]
    for fetched in per_rank:
        # The header, then per entry dtype at most two runs: a rank's experts lie together.
        assert fetched.requests <= 5, fetched.requests
        assert fetched.bytes_read < 0.7 * len(whole)
        decoded = decode_entries(fetched.header, fetched.entries, names=fetched.names, base=base)
        for name, patch in decoded.items():
            assert (patch.indices == full[name].indices).all() and (patch.values == full[name].values).all()
    # Every expert tensor belongs to exactly one rank; shared tensors to both.
    experts = [set(n for n in f.names if n.startswith("experts.")) for f in per_rank]
    every = {n for n in header.tensors if n.startswith("experts.")}
    assert experts[0].isdisjoint(experts[1]) and experts[0] | experts[1] == every


class TestTampering:
    @pytest.fixture()
    def published(self, tmp_path: Path) -> tuple[Store, Any, bytes]:
        trainer = _moe_weights()
        store = make_store("local", {}, tmp_path)
        with Publisher(trainer, store) as pub:
            pub.publish(0, block=True)
            pub.flush()
        ref = _manifest(store).entry(0).anchor[0]
        return store, ref, store.get(ref.key)

    def test_changed_tensor_bytes_are_refused(self, published) -> None:
        store, ref, data = published
        layout = raw_header(data)
        body = ref.header[0]
        start = body + layout["experts.2.up_proj.weight"]["data_offsets"][0]
        store.put(ref.key, data[:start] + bytes([data[start] ^ 1]) + data[start + 1 :])
        with pytest.raises(IntegrityError, match="experts.2.up_proj.weight"):
            fetch_tensors(store, ref, lambda n: n == "experts.2.up_proj.weight")
        fetch_tensors(store, ref, lambda n: n == "experts.3.up_proj.weight")  # untouched tensors still verify

    def test_changed_header_is_refused(self, published) -> None:
        store, ref, data = published
        store.put(ref.key, data[:20] + bytes([data[20] ^ 1]) + data[21:])
        with pytest.raises(IntegrityError, match="header"):
            fetch_tensors(store, ref, lambda n: True)

    def test_impossible_ranges_are_refused_even_with_a_matching_hash(self, published) -> None:
        store, ref, data = published
        layout = raw_header(data)
        layout["experts.0.up_proj.weight"]["data_offsets"] = [0, 10**12]
        raw = json.dumps(layout).encode()
        raw += b" " * (-len(raw) % 8)
        forged = len(raw).to_bytes(8, "little") + raw + data[ref.header[0] :]
        store.put(ref.key, forged)
        assert ref.algorithm == "blake3-entries"  # an anchor: its digest is its header's
        head = header_ref(forged)
        forged_ref = dataclasses.replace(ref, size=len(forged), digest=head[1], header=head)
        with pytest.raises(DeltaFormatError, match="impossible"):
            fetch_tensors(store, forged_ref, lambda n: n == "experts.0.up_proj.weight")

    def test_a_malformed_header_its_digest_pins_is_an_integrity_error_whole_and_a_format_error_in_part(
        self, published
    ) -> None:
        """Under ``blake3-entries`` a whole read checks the object by its parts, header included: a header that
        matches its digest but is malformed leaves the object unproven (IntegrityError). A partial read checks the
        header by its digest alone and then parses it as any file's (DeltaFormatError)."""
        store, ref, data = published
        size = ref.header[0]
        text = data[8:size].decode()
        assert '"format_version":"3"' in text
        forged = with_header_text(data, lambda t: t.replace('"format_version":"3"', '"format_version":"03"', 1))
        store.put(ref.key, forged)
        head = header_ref(forged)
        forged_ref = dataclasses.replace(ref, size=len(forged), digest=head[1], header=head)
        raw = json.loads(store.get(MANIFEST_KEY))
        raw["versions"][0]["anchor"][0] = forged_ref.to_json()
        store.put(MANIFEST_KEY, json.dumps(raw).encode())
        assert not forged_ref.verify(forged)
        with pytest.raises(DeltaFormatError, match="decimal integer"):
            fetch_tensors(store, forged_ref, lambda n: True)
        replica = {n: t.to(torch.bfloat16) for n, t in _moe_weights(seed=1).items()}
        with Subscriber(store, TorchModuleApplier(replica), ack=False) as sub:
            with pytest.raises(IntegrityError, match=ref.key):
                sub.update()
        with Subscriber(store, TorchModuleApplier(replica), ack=False, only=_holds(rank=0, ranks=2)) as sub:
            with pytest.raises(DeltaFormatError, match="decimal integer"):
                sub.update()

    def test_objects_without_a_header_hash_are_downloaded_whole(self, published, tmp_path: Path) -> None:
        store, ref, data = published
        whole = ObjectRef.of(ref.key, [data])  # a whole-object digest and no header reference
        assert not can_read_ranges(whole)
        with pytest.raises(ValueError):
            fetch_tensors(store, whole, lambda n: True)


def test_only_is_checked() -> None:
    applier = TorchModuleApplier({"a": torch.zeros(2, dtype=torch.bfloat16)})
    with pytest.raises(ConfigError, match="only"):
        Subscriber("memory://only-check", applier, only=["b"])
    with pytest.raises(ConfigError, match="only"):
        Subscriber("memory://only-check", applier, only="a")
