"""The wire format: metadata, golden files, and refusal of every malformed input."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import safetensors.torch
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.appliers import TorchModuleApplier
from deltasync.errors import (
    CodecError,
    DeltaFormatError,
    DeltaSyncError,
    FingerprintMismatch,
    IntegrityError,
    TensorMismatch,
)
from deltasync.format import decode, encode_anchor, encode_delta, file_entries, raw_header, read_header, serialize
from deltasync.publish.diff import Snapshot, diff
from tests.format_helpers import with_header, with_header_text

GOLDEN = Path(__file__).parent / "golden"


def golden_weights() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A deterministic base and target: the fixture behind the golden files."""
    base = {
        "embed.weight": (torch.arange(96, dtype=torch.float32).view(12, 8) / 7).to(torch.bfloat16),
        "norm.weight": torch.ones(8, dtype=torch.bfloat16),
    }
    target = {k: v.clone() for k, v in base.items()}
    target["embed.weight"].view(-1)[[0, 5, 77, 95]] += 1
    target["norm.weight"].view(torch.int16)[3] = -0x8000  # -0.0
    return base, target


def make_delta(codec: str = "compact") -> tuple[bytes, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    base, target = golden_weights()
    data = encode_delta(diff(Snapshot.capture(base), target), version=2, base_version=1, codec=codec)
    return data, base, target


def rebuild(data: bytes, mutate) -> bytes:
    """Re-serialize a file after ``mutate(tensors, metadata)`` edits it (in its own format: a packed
    delta's entries and table as format 3 lists them, packed again)."""
    tensors = {name: t.clone() for name, t in file_entries(data).items()}
    meta = raw_header(data)["__metadata__"]
    mutate(tensors, meta)
    return serialize(tensors, meta)


def edit_entry(name: str, **changes) -> callable:
    def mutate(tensors, meta) -> None:
        entries = json.loads(meta["tensors"])
        entries[name].update(changes)
        meta["tensors"] = json.dumps(entries)

    return mutate


class TestHeader:
    def test_metadata_is_self_describing(self) -> None:
        data, _, _ = make_delta()
        meta = raw_header(data)["__metadata__"]
        assert meta["format"] == "deltasync" and meta["format_version"] == "4"
        assert meta["kind"] == "delta" and meta["version"] == "2" and meta["base_version"] == "1"
        header = read_header(data)
        assert header.nnz == 5 and header.numel == 104
        assert header.sparsity == pytest.approx(1 - 5 / 104)
        assert header.tensors["embed.weight"].codec == "compact"
        assert header.tensors["norm.weight"].nnz == 1

    def test_anchor_is_a_plain_checkpoint(self) -> None:
        base, _ = golden_weights()
        data = encode_anchor(base, version=1)
        loaded = safetensors.torch.load(data)
        assert loaded.keys() == base.keys()
        assert all(torch.equal(loaded[k].view(torch.int16), base[k].view(torch.int16)) for k in base)
        assert read_header(data).kind == "anchor"

    def test_raw_delta_readable_without_deltasync(self) -> None:
        data, _, target = make_delta("raw")
        loaded = safetensors.torch.load(data)
        idx, val = loaded["embed.weight::idx"], loaded["embed.weight::val"]
        assert idx.dtype == torch.int32 and val.dtype == torch.bfloat16
        assert torch.equal(val, target["embed.weight"].view(-1)[idx.long()])

    def test_a_tensor_spec_is_checked_once_and_kept_within_bounds(self) -> None:
        """Every version's header names the same tensors: each spec is checked and made once, then reused; a
        header with a bad one is refused every time; the cache is bounded."""
        import deltasync.format.header as header_module

        header_module._spec.cache_clear()
        data = make_delta()[0]
        first, again = read_header(data), read_header(data)
        assert [e.spec for e in first.tensors.values()] == [e.spec for e in again.tensors.values()]
        assert all(a.spec is b.spec for a, b in zip(first.tensors.values(), again.tensors.values()))
        assert header_module._spec.cache_info().currsize == 2
        bad = rebuild(data, edit_entry("norm.weight", dtype="F32x"))
        for _ in range(2):  # a dtype no spec may carry: refused the second time as the first, never kept
            with pytest.raises(DeltaFormatError, match="unsupported dtype"):
                read_header(bad)
        assert header_module._spec.cache_info().currsize == 2
        assert header_module._spec.cache_info().maxsize == 1 << 16


class TestGolden:
    """Files written by format version 1 stay readable, bit for bit."""

    @pytest.mark.parametrize("codec", ["compact", "compact-abs", "raw"])
    def test_golden_delta_decodes(self, codec: str) -> None:
        data = (GOLDEN / f"delta_v1_{codec}.safetensors").read_bytes()
        base, target = golden_weights()
        applier = TorchModuleApplier(base)
        header, patches = decode(data, base=applier.lookup)
        applier.validate(header)
        applier.apply(patches)
        for name in target:
            assert torch.equal(base[name].view(torch.int16), target[name].view(torch.int16))

    def test_raw_encoding_is_stable(self) -> None:
        # safetensors orders metadata keys freely, so compare the parsed header and the body bytes.
        data, _, _ = make_delta("raw")
        golden = (GOLDEN / "delta_v1_raw.safetensors").read_bytes()
        # Files written since carry a BLAKE3 digest per tensor (for range reads) and a later format
        # version; the rest of a raw file is unchanged.
        header = raw_header(data)
        entries = json.loads(header["__metadata__"]["tensors"])
        found = {name: entry.pop("blake3") for name, entry in entries.items()}
        header["__metadata__"]["tensors"] = json.dumps(entries, separators=(",", ":"))
        assert header["__metadata__"].pop("format_version") == "3"
        old = raw_header(golden)
        assert old["__metadata__"].pop("format_version") == "1"
        assert header == old
        loaded = safetensors.torch.load(data)
        for name, digest in found.items():
            parts = b"".join(loaded[k].reshape(-1).view(torch.uint8).numpy().tobytes() for k in sorted(loaded)
                             if k.startswith(name + "::"))
            assert blake3.blake3(parts).hexdigest() == digest
        body = 8 + struct.unpack("<Q", data[:8])[0]
        assert data[body:] == golden[8 + struct.unpack("<Q", golden[:8])[0] :]


class TestEntries:
    def test_writable_buffers_are_viewed_and_bytes_copied(self) -> None:
        from deltasync.format.decode import file_entries

        weights = {"a": torch.randn(3, 5).bfloat16(), "b": torch.randn(7), "e": torch.zeros(0, 3, dtype=torch.bfloat16)}
        data = encode_anchor(weights, version=0)
        buffer = bytearray(data)
        lo = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
        viewed, copied = file_entries(buffer), file_entries(data)
        for name, tensor in weights.items():
            assert torch.equal(viewed[name], tensor) and torch.equal(copied[name], tensor)
        assert lo <= viewed["a"].data_ptr() < lo + len(buffer)  # no copy of the weights
        header, patches = decode(memoryview(buffer))
        assert header.kind == "anchor"
        assert np.array_equal(np.asarray(patches["b"].values), weights["b"].view(torch.int32).reshape(-1).numpy())

    @pytest.mark.parametrize(
        "edit",
        [
            lambda h: h["b"].update(data_offsets=[0, 32]),  # overlaps a
            lambda h: h.pop("b"),  # leaves the last 32 bytes unclaimed
            lambda h: h["a"].update(data_offsets=[0, 28], shape=[7]),  # a gap of 4 bytes
            lambda h: h["b"].update(data_offsets=[32, 68], shape=[9]),  # past the end
        ],
    )
    def test_entries_must_tile_the_data_area(self, edit: Any) -> None:
        """A gap, an overlap or an overrun is refused whether the buffer is viewed or copied."""
        from deltasync.format.decode import file_entries

        good = encode_anchor({"a": torch.zeros(8), "b": torch.ones(8)}, version=0)
        bad = with_header(good, edit)
        for buffer in (bytearray(bad), bad):
            with pytest.raises(DeltaFormatError):
                file_entries(buffer)


class TestRefusals:
    def test_truncated(self) -> None:
        data, _, _ = make_delta()
        with pytest.raises(DeltaFormatError):
            read_header(data[:5])
        with pytest.raises(DeltaFormatError):
            decode(data[:-3])

    def test_huge_header_length(self) -> None:
        data, _, _ = make_delta()
        with pytest.raises(DeltaFormatError, match="header length"):
            read_header(struct.pack("<Q", 1 << 60) + data[8:])

    def test_header_not_json(self) -> None:
        with pytest.raises(DeltaFormatError, match="JSON"):
            read_header(struct.pack("<Q", 4) + b"{{{{")

    def test_not_deltasync(self) -> None:
        plain = safetensors.torch.save({"w": torch.zeros(2)})
        with pytest.raises(DeltaFormatError, match="not a deltasync file"):
            read_header(plain)

    def test_future_format_version(self) -> None:
        data, _, _ = make_delta()
        newer = rebuild(data, lambda t, m: m.update(format_version="5"))
        with pytest.raises(DeltaFormatError, match="upgrade deltasync"):
            read_header(newer)

    def test_unknown_codec(self) -> None:
        data, _, _ = make_delta()
        with pytest.raises(CodecError, match="unknown codec 'zip'.*upgrade deltasync here"):
            decode(rebuild(data, edit_entry("norm.weight", codec="zip")), base=lambda n, i: np.zeros(i.size, np.int16))

    @pytest.mark.parametrize("bad", [[104], [-1], [5, 5], [9, 4]])
    def test_raw_bad_indices(self, bad: list[int]) -> None:
        data, base, _ = make_delta("raw")

        def mutate(t, m) -> None:
            t["norm.weight::idx"] = torch.tensor(bad, dtype=torch.int32)
            t["norm.weight::val"] = torch.zeros(len(bad), dtype=torch.bfloat16)
            edit_entry("norm.weight", nnz=len(bad))(t, m)

        with pytest.raises(CodecError, match="out of range|increasing"):
            decode(rebuild(data, mutate))

    def test_nnz_disagrees_with_parts(self) -> None:
        data, _, _ = make_delta("raw")
        with pytest.raises(CodecError, match="expected"):
            decode(rebuild(data, edit_entry("embed.weight", nnz=3)))

    def test_nnz_beyond_numel(self) -> None:
        data, _, _ = make_delta()
        with pytest.raises(DeltaFormatError, match="nnz"):
            read_header(rebuild(data, edit_entry("norm.weight", nnz=9)))

    def test_decompression_bomb_refused_before_inflating(self) -> None:
        data, _, _ = make_delta()
        bomb = zstandard.ZstdCompressor().compress(bytes(50 << 20))
        bad = rebuild(
            data, lambda t, m: t.update({"embed.weight::val": torch.frombuffer(bytearray(bomb), dtype=torch.uint8)})
        )
        with pytest.raises(CodecError, match="declares"):
            decode(bad, base=lambda n, i: np.zeros(i.size, np.int16))

    def test_stray_entry(self) -> None:
        data, _, _ = make_delta("raw")  # a plain header can list an entry of no tensor; a packed one cannot
        with pytest.raises(DeltaFormatError, match="without metadata"):
            decode(rebuild(data, lambda t, m: t.update({"other::idx": torch.zeros(1, dtype=torch.uint8)})))

    def test_stray_stream(self) -> None:
        data, base, _ = make_delta()
        forged = rebuild(data, lambda t, m: t.update({"norm.weight::extra": torch.zeros(1, dtype=torch.uint8)}))
        with pytest.raises(DeltaFormatError, match="extra"):
            decode(forged, base=TorchModuleApplier(base).lookup)

    def test_wrong_base_detected_by_value_digest(self) -> None:
        data, base, _ = make_delta("compact")
        drifted = {k: v.clone() for k, v in base.items()}
        drifted["embed.weight"].view(-1)[77] += 3  # the replica is not at the delta's base
        with pytest.raises(IntegrityError, match="resync from an anchor"):
            decode(data, base=TorchModuleApplier(drifted).lookup)

    def test_compact_without_base_refused(self) -> None:
        data, _, _ = make_delta("compact")
        with pytest.raises(CodecError, match="needs the receiver"):
            decode(data)


class TestReceiverValidation:
    def test_other_model_refused(self) -> None:
        data, _, _ = make_delta()
        applier = TorchModuleApplier(
            {"embed.weight": torch.zeros(12, 9, dtype=torch.bfloat16),
             "norm.weight": torch.zeros(8, dtype=torch.bfloat16)}
        )
        with pytest.raises(FingerprintMismatch, match="anchor"):
            applier.validate(read_header(data))

    def test_tensor_mismatch_with_forged_fingerprint(self) -> None:
        data, base, _ = make_delta()
        applier = TorchModuleApplier(base)
        forged = rebuild(data, edit_entry("norm.weight", shape=[2, 4]))
        forged = rebuild(forged, lambda t, m: m.update(fingerprint=applier.fingerprint))
        with pytest.raises(TensorMismatch, match="norm.weight"):
            applier.validate(read_header(forged))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_files_raise_only_typed_errors(data: st.DataObject) -> None:
    """Any corruption either decodes or raises a DeltaSyncError; nothing else escapes."""
    codec = data.draw(st.sampled_from(["compact", "raw", "compact-abs", "compact-exp", "exp-rice"]))
    original, base, _ = make_delta(codec)
    buf = bytearray(original)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    try:
        header, patches = decode(bytes(buf), base=TorchModuleApplier(base).lookup)
        TorchModuleApplier(base).validate(header)
    except DeltaSyncError:
        pass


# ---------------------------------------------------------------------- shards (one file per trainer rank)


def _shards(
    world: int, codec: str = "compact", flat: bool = False
) -> tuple[list[bytes], list[bytes], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Anchor and delta shards of the golden weights, cut into ``world`` row chunks as ranks would
    (``flat``: equal flat element slices, as DeepSpeed ZeRO-3 partitions parameters)."""
    from deltasync.format import Elements
    from deltasync.publish.sharded import chunk_rows
    from deltasync.tensors import TensorSpec

    base, target = golden_weights()
    specs = tuple(TensorSpec.of(n, t) for n, t in base.items())
    anchors, deltas = [], []
    for rank in range(world):
        if flat:
            size = {n: -(-t.numel() // world) for n, t in base.items()}
            rows = {n: Elements(min(rank * size[n], t.numel()), min((rank + 1) * size[n], t.numel()))
                    for n, t in base.items()}
            rows = {n: r for n, r in rows.items() if r.stop > r.start}
            mine = {n: base[n].reshape(-1)[r.start : r.stop] for n, r in rows.items()}
            later = {n: target[n].reshape(-1)[r.start : r.stop] for n, r in rows.items()}
        else:
            rows = {n: chunk_rows(t.shape[0], world, rank) for n, t in base.items()}
            rows = {n: r for n, r in rows.items() if r[1] > r[0]}
            mine = {n: base[n][a:b] for n, (a, b) in rows.items()}
            later = {n: target[n][a:b] for n, (a, b) in rows.items()}
        anchors.append(encode_anchor(mine, version=1, model=specs, rows=rows))
        changes = diff(Snapshot.capture(mine), later)
        if changes.nnz:
            deltas.append(encode_delta(changes, version=2, base_version=1, codec=codec, model=specs, rows=rows))
    return anchors, deltas, base, target


@pytest.mark.parametrize("batched", [False, True], ids=["host", "on-device"])
@pytest.mark.parametrize("flat", [False, True], ids=["rows", "elements"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("codec", ["compact", "raw", "compact-exp", "exp-rice"])
def test_shards_join_into_exact_weights(world: int, codec: str, flat: bool, batched: bool) -> None:
    """Shard files, decoded on the host or rebuilt on the receiver's device (as a replica on an
    accelerator does): a shard's indices are shifted to the full tensor's either way."""
    from deltasync.format import combine

    anchors, deltas, base, target = _shards(world, codec, flat)
    replica = {n: torch.zeros_like(t) for n, t in base.items()}
    applier = TorchModuleApplier(replica, stage=batched)
    for files, whole in ((anchors, True), (deltas, False)):
        headers = [read_header(f) for f in files]
        for header in headers:
            applier.validate(header)  # full shapes and the full model's fingerprint in every shard
        applier.apply(combine([decode(f, base=applier.lookup, on_device=applier.on_device) for f in files],
                              whole=whole))
    for name in target:
        assert torch.equal(replica[name].view(torch.int16), target[name].view(torch.int16))


def test_overlapping_shards_and_anchor_gaps_are_refused() -> None:
    from deltasync.format import combine

    anchors, deltas, _, _ = _shards(2, "raw")
    with pytest.raises(DeltaFormatError, match="same elements"):
        combine([decode(anchors[0]), decode(anchors[0])], whole=True)
    with pytest.raises(DeltaFormatError, match="leaves elements"):
        combine([decode(anchors[1])], whole=True)
    with pytest.raises(DeltaFormatError, match="same elements"):
        combine([decode(deltas[0]), decode(deltas[0])], whole=False)


@pytest.mark.parametrize("rows", [[5, 3], [0, 13], [-1, 2], [0], "0:3", [True, 2], [0, 2.5]])
def test_bad_rows_are_refused(rows: object) -> None:
    anchors, _, _, _ = _shards(2)
    bad = rebuild(anchors[0], edit_entry("embed.weight", rows=rows))
    with pytest.raises(DeltaFormatError, match="bad rows"):
        read_header(bad)


@pytest.mark.parametrize("elements", [[5, 3], [0, 97], [-1, 2], [0], "0:3", [True, 2], [0, 2.5]])
def test_bad_elements_are_refused(elements: object) -> None:
    anchors, _, _, _ = _shards(2, flat=True)
    bad = rebuild(anchors[0], edit_entry("embed.weight", elements=elements))
    with pytest.raises(DeltaFormatError, match="bad elements"):
        read_header(bad)


def test_rows_and_elements_together_are_refused() -> None:
    anchors, _, _, _ = _shards(2, flat=True)
    bad = rebuild(anchors[0], edit_entry("embed.weight", rows=[0, 1]))
    with pytest.raises(DeltaFormatError, match="bad elements"):
        read_header(bad)


def test_a_shard_whose_slice_does_not_match_its_rows_is_refused() -> None:
    anchors, _, _, _ = _shards(2)
    fewer = rebuild(anchors[0], edit_entry("embed.weight", rows=[0, 5]))  # the file holds 6 rows
    with pytest.raises(DeltaFormatError, match="nnz"):
        decode(fewer)
    more = rebuild(anchors[0], edit_entry("embed.weight", rows=[0, 7]))
    with pytest.raises(DeltaFormatError, match="nnz"):  # an anchor's nnz is every element it carries
        decode(more)


def test_threads_decode_the_same_patches_and_raise_the_first_failure_in_file_order() -> None:
    """Tensors decode on several threads: the patches do not depend on it, nor does which error is raised."""
    from deltasync.util import threads as parallel

    gen = torch.Generator().manual_seed(0)
    weights = {f"t{i}": torch.randn(400_000, generator=gen) for i in range(6)}
    snapshot = Snapshot.capture(weights)
    for t in weights.values():
        t[torch.randperm(t.numel(), generator=gen)[:40_000]] *= 1.01
    data = encode_delta(diff(snapshot, weights), version=1, base_version=0)
    held = {n: t.clone() for n, t in snapshot.items()}
    replica = TorchModuleApplier(held)
    one = decode(data, base=replica.lookup)[1]
    assert sum(e.nnz for e in read_header(data).tensors.values()) > parallel.MIN_PARALLEL_WORK  # threads run
    for workers in (2, 3, 8):
        parallel.WORKERS, saved = workers, parallel.WORKERS
        try:
            many = decode(data, base=replica.lookup)[1]
        finally:
            parallel.WORKERS = saved
        assert many.keys() == one.keys()
        assert all(np.array_equal(many[n].indices, one[n].indices) and np.array_equal(many[n].values, one[n].values)
                   for n in one)
    # Two tensors whose base differs: the error names the first of them in the file, every time.
    for name in ("t4", "t1"):
        held[name].view(torch.int16).view(-1)[:] += 1
    for _ in range(5):
        with pytest.raises(IntegrityError, match="^t1: "):
            decode(data, base=replica.lookup)
    assert parallel.map_shared(lambda x: x * 2, [3, 1, 2], [10**6, 1, 10**6], workers=2) == [6, 2, 4]


def _with_table_text(data: bytes, edit: Any) -> bytes:
    """A packed delta with the JSON text of its tensor table passed through ``edit``, packed again."""
    def repack(text: str) -> str:
        header = json.loads(text)
        table = zstandard.ZstdDecompressor().decompressobj().decompress(
            base64.b64decode(header["__metadata__"]["tensors_zstd"]))
        frame = zstandard.ZstdCompressor().compress(edit(table.decode()).encode())
        header["__metadata__"]["tensors_zstd"] = base64.b64encode(frame).decode()
        return json.dumps(header, separators=(",", ":"))

    return with_header_text(data, repack)


def _small_delta(*, packed: bool = True) -> bytes:
    weights = {"w": torch.randn(64, generator=torch.Generator().manual_seed(0))}
    snapshot = Snapshot.capture(weights)
    weights["w"][3] += 1.0
    data = encode_delta(diff(snapshot, weights), version=7, base_version=6)
    return data if packed else _as_format_3(data)


def _as_format_3(data: bytes) -> bytes:
    """A packed delta written again with the plain header of format 3 (the same data area)."""
    meta = raw_header(data)["__metadata__"]
    table = json.loads(meta["tensors"])
    for entry in table.values():
        del entry["parts"]
    meta = {**meta, "format_version": "3", "tensors": json.dumps(table, separators=(",", ":"))}
    return serialize({k: v.clone() for k, v in file_entries(data).items()}, meta)


@pytest.mark.parametrize("spelling", ["07", "+7", " 7", "7 ", "7_0", "٧", "7.0", "-7", ""])
def test_metadata_integers_have_one_spelling(spelling: str) -> None:
    """"7" is the only way to write 7: two parsers must never read two different versions."""
    data = _small_delta()
    assert read_header(data).version == 7
    forged = with_header_text(data, lambda t: t.replace('"version":"7"', f'"version":"{spelling}"'))
    assert forged != data
    with pytest.raises(DeltaFormatError, match="decimal integer"):
        read_header(forged)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('\\"nnz\\":1', '\\"nnz\\":true'),  # a boolean is not a count
        ('\\"shape\\":[64]', '\\"shape\\":[true]'),
        ('\\"iw\\":1', '\\"iw\\":true'),
        ('\\"nnz\\":1', '\\"nnz\\":1,\\"nnz\\":1'),  # a key twice inside the tensor table
    ],
)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_header_json_booleans_and_duplicate_keys_are_refused(old: str, new: str, packed: bool) -> None:
    if packed:  # the table is JSON of its own inside the packed frame, not a string inside the header
        data = _small_delta()
        forged = _with_table_text(data, lambda t: t.replace(old.replace("\\", ""), new.replace("\\", ""), 1))
    else:
        data = _small_delta(packed=False)
        forged = with_header_text(data, lambda t: t.replace(old, new, 1))
    assert forged != data and read_header(data).format_version == (4 if packed else 3)
    replica = TorchModuleApplier({"w": torch.zeros(64, dtype=torch.bfloat16)})
    with pytest.raises((DeltaFormatError, CodecError)):
        decode(forged, base=replica.lookup)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_a_signed_zero_in_the_table_is_refused(packed: bool) -> None:
    """``-0`` is 0 to one parser and a negative zero to another: refused, whichever field holds it."""
    if packed:
        data = _small_delta()
        forged = _with_table_text(data, lambda t: t.replace('"shape":[64]', '"shape":[64],"rows":[-0,64]', 1))
    else:
        data = _small_delta(packed=False)
        forged = with_header_text(
            data, lambda t: t.replace('\\"shape\\":[64]', '\\"shape\\":[64],\\"rows\\":[-0,64]', 1)
        )
    assert forged != data
    with pytest.raises(DeltaFormatError, match="-0"):
        read_header(forged)


def test_a_key_twice_in_the_safetensors_header_is_refused() -> None:
    data = _small_delta()
    forged = with_header_text(data, lambda t: t.replace('{"__metadata__"', '{"__metadata__":{},"__metadata__"', 1))
    with pytest.raises(DeltaFormatError, match="twice"):
        read_header(forged)


class TestWhatTwoReadersCouldReadDifferently:
    """Each rule of the spec that a lenient reader would get wrong, refused here."""

    def test_a_delta_entry_with_nothing_changed_and_an_anchor_entry_not_dense(self) -> None:
        data = _small_delta()
        with pytest.raises(DeltaFormatError, match="nnz >= 1"):
            read_header(rebuild(data, edit_entry("w", nnz=0)))
        anchor = encode_anchor({"w": torch.zeros(8, dtype=torch.bfloat16)}, version=0)
        with pytest.raises(DeltaFormatError, match="every element"):
            read_header(rebuild(anchor, edit_entry("w", codec="raw")))

    def test_a_stream_the_codec_does_not_read(self) -> None:
        data = _small_delta()

        def extra(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
            tensors["w::hidden"] = torch.zeros(4, dtype=torch.uint8)

        with pytest.raises(DeltaFormatError, match="not streams of codec"):
            decode(rebuild(data, extra), base=TorchModuleApplier({"w": torch.zeros(64, dtype=torch.bfloat16)}).lookup)

    def test_bytes_after_a_zstd_frame(self) -> None:
        from deltasync.codec._zstd import compress, decompress

        frame = compress(b"x" * 100, 1)
        assert decompress(frame, 100, "t::idx") == b"x" * 100
        with pytest.raises(CodecError, match="after the zstd frame"):
            decompress(np.concatenate([frame, frame]), 100, "t::idx")  # a second frame hides a second payload

    def test_json_is_utf8_without_a_byte_order_mark(self) -> None:
        from deltasync.util.jsonio import load_json

        assert load_json('{"a": "é"}'.encode(), what="x", error=ValueError) == {"a": "é"}
        for data in ('{"a": 1}'.encode("utf-16"), b"\xef\xbb\xbf" + b'{"a": 1}', '{"a": 1}'.encode("utf-32")):
            with pytest.raises(ValueError):
                load_json(data, what="x", error=ValueError)

    def test_object_keys_and_latest_are_exact(self) -> None:
        from deltasync.errors import ManifestError
        from deltasync.protocol.manifest import Manifest
        from deltasync.stores import check_key

        with pytest.raises(ManifestError):
            check_key("deltas/a.safetensors\n")
        raw = json.loads(Manifest("r", "f", 10, "w", 1.0).to_bytes())
        for latest in (1.0, True):
            forged = dict(raw, latest=latest)
            with pytest.raises(ManifestError, match="latest"):
                Manifest.from_bytes(json.dumps(forged).encode())

    def test_a_tensor_name_with_a_superscript_digit_is_published(self, tmp_path: Path) -> None:
        from deltasync import Publisher, Subscriber

        weights = {"w.1²": torch.ones(4), "layer.10.w": torch.ones(3), "layer.2.w": torch.ones(3)}
        with Publisher(weights, str(tmp_path / "run")) as publisher:
            publisher.publish(0, block=True)
        replica = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in weights.items()}
        assert Subscriber(str(tmp_path / "run"), TorchModuleApplier(replica)).update() is not None
        assert all(torch.equal(replica[n], weights[n].to(torch.bfloat16)) for n in weights)

    def test_an_anchor_file_of_empty_tensors_is_published_and_followed(self, tmp_path: Path) -> None:
        """A part that holds only zero-element tensors has no data bytes: its header is the whole object."""
        from deltasync import Publisher, Subscriber

        weights = {"big": torch.ones(4096), "none": torch.zeros(0, 4), "zero": torch.zeros(4, 0)}
        with Publisher(weights, str(tmp_path / "run"), part_bytes=1024) as publisher:
            publisher.publish(0, block=True)
        replica = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in weights.items()}
        assert Subscriber(str(tmp_path / "run"), TorchModuleApplier(replica)).update() is not None
        assert torch.equal(replica["big"], torch.ones(4096, dtype=torch.bfloat16))

    def test_a_retired_list_is_strict_json_too(self, tmp_path: Path) -> None:
        from deltasync.errors import ManifestError
        from deltasync.protocol.keys import RETIRED_KEY
        from deltasync.protocol.retired import read_retired
        from deltasync.stores import open_store

        store = open_store(str(tmp_path / "run"))
        for text in ('{"schema": 1, "schema": 1, "run_id": "r", "retired": []}',
                     '{"schema": 1, "run_id": "r", "retired": [["deltas/a.safetensors", NaN]]}',
                     '{"schema": 1, "run_id": "r", "retired": [["deltas/a.safetensors", true]]}'):
            store.put(RETIRED_KEY, text.encode())
            with pytest.raises(ManifestError):
                read_retired(store)


def test_threads_are_kept_between_calls_and_never_wait_on_themselves() -> None:
    """One pool serves every call; work that fans out again from a pool thread, and callers on many
    threads at once, all finish; a forked child gets a pool of its own."""
    import os
    import threading

    from deltasync.util import threads as parallel

    work = [10**6] * 16
    assert parallel.map_shared(lambda x: x, list(range(16)), work, workers=4) == list(range(16))
    pool = parallel._pool(3)
    assert parallel._pool(3) is pool  # kept
    nested = parallel.map_shared(
        lambda x: sum(parallel.map_shared(lambda y: x * y, list(range(8)), [10**6] * 8, workers=4)),
        list(range(16)), work, workers=4,
    )
    assert nested == [x * 28 for x in range(16)]
    results: list[list[int]] = []
    callers = [threading.Thread(target=lambda: results.append(
        parallel.map_shared(lambda x: x + 1, list(range(16)), work, workers=4))) for _ in range(6)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=60)
    assert results == [list(range(1, 17))] * 6
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: the parent's pool threads do not exist here
        ok = parallel.map_shared(lambda x: x, list(range(16)), work, workers=4) == list(range(16))
        os.write(write, b"1" if ok and parallel._pool(3) is not pool else b"0")
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 1) == b"1"


def test_items_that_hold_the_gil_run_on_one_thread_the_callers() -> None:
    """``serial`` items (a chunk of tensors too small for their compiled work to outweigh their Python) all run
    on the calling thread, in any mix; the others are dealt around them; results come back in order, and the
    first failure in item order is raised."""
    import threading

    from deltasync.util import threads as parallel

    where: dict[int, int] = {}

    def record(x: int) -> int:
        where[x] = threading.get_ident()
        return -x

    serial = [x % 3 == 0 for x in range(12)]
    assert parallel.map_shared(record, list(range(12)), [10**6] * 12, workers=4, serial=serial) == [
        -x for x in range(12)]
    assert {where[x] for x in range(12) if serial[x]} == {threading.get_ident()}
    assert len(set(where.values())) > 1  # the others were dealt to the pool's threads too
    where.clear()
    assert parallel.map_shared(record, list(range(12)), [10**6] * 12, workers=4, serial=[True] * 12) == [
        -x for x in range(12)]
    assert set(where.values()) == {threading.get_ident()}

    def fail(x: int) -> int:
        if x in (5, 9):
            raise ValueError(f"item {x}")
        return x

    with pytest.raises(ValueError, match="item 5"):
        parallel.map_shared(fail, list(range(12)), [10**6] * 12, workers=4, serial=serial)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_anchor_from_cuda_tensors_is_the_anchor_of_their_cpu_copies() -> None:
    """Tensors on the GPU reach the host through one pinned buffer: odd sizes, a strided view, an empty
    tensor and two dtypes end byte for byte where their CPU copies would."""
    from deltasync.format import encode_anchor

    gen = torch.Generator().manual_seed(0)
    on_cpu = {
        "a": torch.randn(7, 3, generator=gen).to(torch.bfloat16),
        "b": torch.randn(1001, generator=gen),
        "c": torch.randn(6, 4, generator=gen).to(torch.bfloat16).t(),  # not contiguous
        "d": torch.zeros(0, 5, dtype=torch.bfloat16),
    }
    on_gpu = {name: t.cuda() for name, t in on_cpu.items()}
    on_gpu["c"] = on_cpu["c"].t().contiguous().cuda().t()
    assert encode_anchor(on_gpu, version=3) == encode_anchor(on_cpu, version=3)


class TestPackedHeader:
    """Format 4: a delta's stream layout and tensor table travel zstd-compressed under one ``streams`` entry."""

    @staticmethod
    def _plain(data: bytes) -> bytes:
        """The same delta written with the format-3 header."""
        return _as_format_3(data)

    @staticmethod
    def _meta(data: bytes) -> dict[str, Any]:
        length = struct.unpack("<Q", data[:8])[0]
        return json.loads(data[8 : 8 + length])

    def test_a_delta_is_packed_and_reads_as_its_plain_twin(self) -> None:
        data, base, target = make_delta()
        plain = self._plain(data)
        packed_head, plain_head = 8 + struct.unpack("<Q", data[:8])[0], 8 + struct.unpack("<Q", plain[:8])[0]
        assert safetensors.torch.load(data).keys() == {"streams"}  # still a valid safetensors file
        assert data[packed_head:] == plain[plain_head:]  # the same data area, byte for byte
        assert self._meta(data).keys() == {"__metadata__", "streams"} and "tensors" not in self._meta(data)
        unpacked, flat = raw_header(data), raw_header(plain)
        table = json.loads(unpacked["__metadata__"].pop("tensors"))
        assert {k: v for k, v in unpacked.items() if k != "__metadata__"} == {
            f"{name}::{part}": info for name, entry in table.items() for part, info in entry.pop("parts").items()}
        assert table == json.loads(flat["__metadata__"].pop("tensors"))
        assert unpacked == {**flat, "__metadata__": {**flat["__metadata__"], "format_version": "4"}}
        assert read_header(data).tensors == read_header(plain).tensors
        for blob in (data, bytearray(data), plain):
            replica = {k: v.clone() for k, v in base.items()}
            applier = TorchModuleApplier(replica)
            header, patches = decode(blob, base=applier.lookup)
            applier.apply(patches)
            assert all(torch.equal(replica[k].view(torch.int16), target[k].view(torch.int16)) for k in target)

    def test_the_table_is_parsed_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A reader parses the inflated table once (unpacking it), not again for the tensor entries; a plain
        header's ``tensors`` text is still parsed where it is read."""
        import deltasync.format.header as header_module
        import deltasync.format.layout as layout_module
        from deltasync.util.jsonio import load_json

        parsed: list[str] = []

        def counting(data: bytes, *, what: str, error: type[Exception]) -> Any:
            parsed.append(what)
            return load_json(data, what=what, error=error)

        data = make_delta()[0]
        plain = self._plain(data)
        monkeypatch.setattr(header_module, "load_json", counting)
        monkeypatch.setattr(layout_module, "load_json", counting)
        assert read_header(data).tensors == read_header(plain).tensors
        assert parsed == ["safetensors header", "the packed tensor table", "safetensors header", "metadata 'tensors'"]

    def test_a_file_decoded_with_its_header_is_not_parsed_again(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A receiver that read a file's header to check it (as a subscriber does) hands it to ``decode``: the
        header keeps where each entry lies, and nothing of the file is parsed a second time."""
        import deltasync.format.header as header_module
        import deltasync.format.layout as layout_module
        from deltasync.util.jsonio import load_json

        parsed: list[str] = []

        def counting(data: bytes, *, what: str, error: type[Exception]) -> Any:
            parsed.append(what)
            return load_json(data, what=what, error=error)

        data, base, _ = make_delta()
        monkeypatch.setattr(header_module, "load_json", counting)
        monkeypatch.setattr(layout_module, "load_json", counting)
        header = read_header(data)
        assert parsed == ["safetensors header", "the packed tensor table"]
        replica = TorchModuleApplier({n: t.clone() for n, t in base.items()})
        again, patches = decode(data, base=replica.lookup, header=header)
        assert again is header and parsed == ["safetensors header", "the packed tensor table"]
        assert decode(data, base=replica.lookup)[1].keys() == patches.keys()
        assert parsed[2:] == ["safetensors header", "the packed tensor table"]  # without it: parsed here

    def test_the_header_shrinks(self) -> None:
        """272 tensors like SmolLM2-135M's, one changed element each: the packed header is a fraction of the plain."""
        weights = {f"model.layers.{i // 9}.mlp.part_{i % 9}.weight": torch.randn(64) for i in range(272)}
        snapshot = Snapshot.capture(weights)
        for t in weights.values():
            t[5] += 1.0
        data = encode_delta(diff(snapshot, weights), version=2, base_version=1)
        plain = self._plain(data)
        head, plain_head = struct.unpack("<Q", data[:8])[0], struct.unpack("<Q", plain[:8])[0]
        assert head * 3 < plain_head, (head, plain_head)

    def test_a_raw_delta_and_an_anchor_keep_the_plain_header(self) -> None:
        base, _ = golden_weights()
        assert read_header(make_delta("raw")[0]).format_version == 3
        assert read_header(encode_anchor(base, version=1)).format_version == 3

    def test_an_anchor_claiming_format_4_is_refused(self) -> None:
        base, _ = golden_weights()
        data = encode_anchor(base, version=1)
        forged = with_header_text(data, lambda t: t.replace('"format_version":"3"', '"format_version":"4"'))
        with pytest.raises(DeltaFormatError):
            read_header(forged)

    @staticmethod
    def _frame(table: bytes, *, size: bool = True) -> str:
        return base64.b64encode(zstandard.ZstdCompressor(write_content_size=size).compress(table)).decode()

    @pytest.mark.parametrize(
        ("edit", "match"),
        [
            (lambda h, f: h["__metadata__"].update(tensors_zstd="not base64!"), "base64"),
            (lambda h, f: h["__metadata__"].update(tensors_zstd=base64.b64encode(b"plain text").decode()), "zstd"),
            (lambda h, f: h["__metadata__"].update(tensors_zstd=f(b"{}", size=False)), "declare"),
            (lambda h, f: h["__metadata__"].update(tensors_zstd=base64.b64encode(
                base64.b64decode(h["__metadata__"]["tensors_zstd"]) + b"\0").decode()), "one zstd frame"),
            (lambda h, f: h["__metadata__"].update(tensors_zstd=f(b"[]")), "object"),
            (lambda h, f: h["__metadata__"].update(tensors_zstd=f(b'{"norm.weight":{"codec":"compact"}}')), "parts"),
            (lambda h, f: h["__metadata__"].update(tensors="{}"), "only"),
            (lambda h, f: h.update(extra={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}), "one entry"),
            (lambda h, f: h["streams"].update(data_offsets=[1, h["streams"]["shape"][0]]), "'streams'"),
            (lambda h, f: h["streams"].update(dtype="BF16"), "'streams'"),
            (lambda h, f: h["streams"].update(data_offsets=[0, h["streams"]["shape"][0] + 2],
                                              shape=[h["streams"]["shape"][0] + 2]), "end at byte"),
        ],
        ids=["base64", "not-zstd", "no-size", "trailing", "not-object", "no-parts", "plain-too", "extra-entry",
             "offset", "dtype", "longer"],
    )
    def test_a_malformed_packed_header_is_refused(self, edit: Any, match: str) -> None:
        data, _, _ = make_delta()

        def forge(text: str) -> str:
            header = json.loads(text)
            edit(header, self._frame)
            return json.dumps(header, separators=(",", ":"))

        with pytest.raises(DeltaFormatError, match=match):
            read_header(with_header_text(data, forge))

    def test_a_table_that_would_inflate_past_the_cap_is_refused_before_inflating(self) -> None:
        data, _, _ = make_delta()
        frame = bytearray(zstandard.ZstdCompressor().compress(b"{}"))
        # A frame header declaring 2**40 bytes: frame header descriptor with an 8-byte content size field.
        bomb = bytes(frame[:4]) + bytes([0xC0]) + (1 << 40).to_bytes(8, "little") + bytes(frame[6:])

        def forge(text: str) -> str:
            header = json.loads(text)
            header["__metadata__"]["tensors_zstd"] = base64.b64encode(bomb).decode()
            return json.dumps(header, separators=(",", ":"))

        with pytest.raises(DeltaFormatError, match="at most"):
            read_header(with_header_text(data, forge))

    @pytest.mark.parametrize(
        "shape", [{}, "", [-1, -1], [True], None], ids=["dict", "text", "negative", "bool", "null"]
    )
    def test_an_entry_whose_shape_is_not_a_list_of_sizes_is_refused(self, shape: Any) -> None:
        """A one-byte entry whose shape is ``{}`` or ``""`` unpacks to no dimensions (a product of 1): found by
        the fuzzer in a packed table, where it reached ``reshape`` with a dict."""
        from deltasync.format.layout import entry_span

        assert entry_span({"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, 1, "t::idx") == (0, 1)
        with pytest.raises(DeltaFormatError, match="impossible type, shape or byte range"):
            entry_span({"dtype": "U8", "shape": shape, "data_offsets": [0, 1]}, 1, "t::idx")

    def test_streams_that_overlap_are_refused(self) -> None:
        data, base, _ = make_delta()
        forged = _with_table_text(data, lambda t: t.replace('"data_offsets":[0,', '"data_offsets":[1,', 1))
        with pytest.raises(DeltaFormatError):
            decode(forged, base=TorchModuleApplier(base).lookup)

    def test_the_table_carries_a_checksum_that_catches_a_table_edited_into_another_valid_one(self) -> None:
        """A tensor renamed together with its streams is a valid table; only the frame's checksum tells."""
        data, base, _ = make_delta()
        frame = base64.b64decode(self._meta(data)["__metadata__"]["tensors_zstd"])
        assert zstandard.get_frame_parameters(frame).has_checksum
        old = next(iter(json.loads(raw_header(data)["__metadata__"]["tensors"])))
        new = old[:-1] + ("X" if old[-1] != "X" else "Y")  # the same length

        def rename_keeping_the_checksum(text: str) -> str:
            header = json.loads(text)
            table = zstandard.ZstdDecompressor().decompress(frame).decode()
            renamed = table.replace(f'"{old}"', f'"{new}"').encode()
            edited = zstandard.ZstdCompressor(write_checksum=True).compress(renamed)
            header["__metadata__"]["tensors_zstd"] = base64.b64encode(edited[:-4] + frame[-4:]).decode()
            return json.dumps(header, separators=(",", ":"))

        forged = with_header_text(data, rename_keeping_the_checksum)
        with pytest.raises(DeltaFormatError, match="checksum"):
            read_header(forged)
        with pytest.raises(DeltaFormatError, match="checksum"):
            decode(forged, base=TorchModuleApplier(base).lookup)

    def test_a_table_without_a_checksum_is_read_as_earlier_writers_wrote_it(self) -> None:
        data, base, target = make_delta()
        unchecked = _with_table_text(data, lambda text: text)  # packed again with no checksum
        frame = base64.b64decode(self._meta(unchecked)["__metadata__"]["tensors_zstd"])
        assert not zstandard.get_frame_parameters(frame).has_checksum
        assert read_header(unchecked).tensors == read_header(data).tensors
        replica = {k: v.clone() for k, v in base.items()}
        applier = TorchModuleApplier(replica)
        applier.apply(decode(unchecked, base=applier.lookup)[1])
        assert all(torch.equal(replica[k].view(torch.int16), target[k].view(torch.int16)) for k in target)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_edits_inside_a_packed_table_raise_only_typed_errors(data: st.DataObject) -> None:
    """What a byte flip seldom reaches: the structure inside the compressed table. Any edit either decodes
    or raises a DeltaSyncError (a receiver's order: header, its check against the receiver, decode)."""
    codec = data.draw(st.sampled_from(["compact", "compact-abs", "compact-exp", "exp-rice"]))
    original, base, _ = make_delta(codec)

    def edit(text: str) -> str:
        table = json.loads(text)
        for _ in range(data.draw(st.integers(1, 3))):
            name = data.draw(st.sampled_from(sorted(table)))
            entry = table[name]
            where = data.draw(st.sampled_from(["entry", "params", "parts", "stream", "name"]))
            if where == "name":
                table[data.draw(st.text(max_size=12))] = table.pop(name)
                continue
            node = {"entry": entry, "params": entry.get("params"), "parts": entry.get("parts")}.get(where)
            if where == "stream" and isinstance(entry.get("parts"), dict) and entry["parts"]:
                node = entry["parts"][data.draw(st.sampled_from(sorted(entry["parts"])))]
            if not isinstance(node, dict):
                continue
            key = data.draw(st.sampled_from(sorted(node) + ["extra"]))
            if data.draw(st.booleans()) and key in node:
                del node[key]
            else:
                node[key] = data.draw(_JSON)
        return json.dumps(table)

    forged = _with_table_text(original, edit)
    receiver = TorchModuleApplier(base)
    try:  # the subscriber's order: the header against the receiver, then the decode
        header = read_header(forged)
        receiver.validate(header)
        decode(forged, base=receiver.lookup, header=header)
    except DeltaSyncError:
        pass


def test_a_tensor_renamed_inside_a_packed_table_is_a_typed_refusal_even_before_validate() -> None:
    """A packed table renames a tensor's streams with it (a flipped literal in its zstd frame can do that), so
    the decoder asks the receiver for a tensor it does not hold: a TensorMismatch, never a KeyError."""
    data, base, _ = make_delta()
    renamed = _with_table_text(data, lambda t: t.replace('"norm.weight"', '"norm.weighz"'))
    assert "norm.weighz" in read_header(renamed).tensors
    with pytest.raises(TensorMismatch, match="norm.weighz"):
        decode(renamed, base=TorchModuleApplier(base).lookup)


class TestEdgesTheSpecNamesAnErrorFor:
    """Edges where an implementer must pick an error class: the one docs/FORMAT.md names, and no other."""

    @pytest.mark.parametrize("codec", [5, None, True, ["compact"], {"name": "compact"}])
    @pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
    def test_a_codec_that_is_not_a_string_is_refused_with_the_table(self, codec: Any, packed: bool) -> None:
        if packed:
            forged = _with_table_text(_small_delta(), lambda t: t.replace('"codec":"compact"',
                                                                          f'"codec":{json.dumps(codec)}', 1))
        else:
            forged = rebuild(_small_delta(packed=False), edit_entry("w", codec=codec))
        with pytest.raises(DeltaFormatError, match="codec must be a string") as info:
            read_header(forged)
        assert not isinstance(info.value, CodecError)  # a malformed table, not a codec this reader lacks

    def test_a_codec_name_this_reader_does_not_know_is_a_codec_error_at_decode(self) -> None:
        forged = _with_table_text(_small_delta(), lambda t: t.replace('"codec":"compact"', '"codec":"compact-v9"', 1))
        read_header(forged)
        with pytest.raises(CodecError, match="unknown codec 'compact-v9'"):
            decode(forged, base=TorchModuleApplier({"w": torch.zeros(64, dtype=torch.bfloat16)}).lookup)

    @pytest.mark.parametrize("entry", [[1], "compact", 5, None, True])
    def test_a_table_entry_that_is_not_an_object(self, entry: Any) -> None:
        def replace(header: dict[str, Any]) -> None:
            table = json.loads(header["__metadata__"]["tensors"])
            table["w"] = entry
            header["__metadata__"]["tensors"] = json.dumps(table)

        with pytest.raises(DeltaFormatError, match="tensor entry must be an object"):
            read_header(with_header(_small_delta(packed=False), replace))
        with pytest.raises(DeltaFormatError, match="under 'parts'"):  # packed: the entry holds its streams
            read_header(_with_table_text(_small_delta(), lambda t: json.dumps({"w": entry})))

    @pytest.mark.parametrize("value", ["ABCDEF0123456789", "0123456789abcde", "0123456789abcdef0", "", 5, None,
                                       ["0123456789abcdef"]])
    @pytest.mark.parametrize("key", ["blake3", "sum"])
    def test_a_value_digest_of_the_wrong_form_is_refused_as_a_mismatch(self, key: str, value: Any) -> None:
        """It matches no values: an IntegrityError like a digest that differs or is missing, never a CodecError."""
        data, base, _ = make_delta()

        def edit(text: str) -> str:
            table = json.loads(text)
            for entry in table.values():
                entry["params"][key] = value
            return json.dumps(table)

        forged = _with_table_text(data, edit)
        read_header(forged)  # a codec parameter: nothing of the table's own form
        with pytest.raises(IntegrityError, match="publisher's"):
            decode(forged, base=TorchModuleApplier(base).lookup)

    @pytest.mark.parametrize(("old", "new"), [('"iw":1', '"iw":1.0'), ('"big":0', '"big":0.0'),
                                              ('"iw":1', '"iw":1e0'), ('"iw":1', '"iw":true')])
    def test_iw_and_big_spelled_otherwise_are_codec_errors(self, old: str, new: str) -> None:
        data = _small_delta()
        forged = _with_table_text(data, lambda t: t.replace(old, new, 1))
        assert forged != data
        read_header(forged)  # a codec parameter: checked as the tensor decodes
        with pytest.raises(CodecError, match="bad index params"):
            decode(forged, base=TorchModuleApplier({"w": torch.zeros(64, dtype=torch.bfloat16)}).lookup)

    def test_a_signed_zero_codec_parameter_is_refused_as_the_json_is_parsed(self) -> None:
        forged = _with_table_text(_small_delta(), lambda t: t.replace('"big":0', '"big":-0', 1))
        with pytest.raises(DeltaFormatError, match="-0") as info:
            read_header(forged)
        assert not isinstance(info.value, CodecError)

    def test_the_dtype_names_a_reader_accepts_are_the_eleven_the_spec_lists(self) -> None:
        """Read-only bytes of a plain file are read by safetensors itself, which knows more names (U16, F8_E5M2,
        ...): every path refuses them alike, before any codec sees the entry."""
        from deltasync.format import SAFETENSORS_DTYPES

        assert set(SAFETENSORS_DTYPES) == {
            "BOOL", "U8", "I8", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "I64", "F64",
        }
        anchor = encode_anchor({"w": torch.zeros(8, dtype=torch.bfloat16)}, version=0)  # 16 bytes of data
        lookup = TorchModuleApplier({"w": torch.zeros(8, dtype=torch.bfloat16)}).lookup
        widths = {"U16": 2, "U32": 4, "U64": 8, "C64": 8, "F8_E5M2": 1, "F8_E8M0": 1, "f8_e4m3": 1, "bf16": 2}
        for name, width in widths.items():
            forged = with_header(anchor, lambda h: h["w"].update(dtype=name, shape=[16 // width]))
            for data in (forged, bytearray(forged)):
                with pytest.raises(DeltaFormatError) as info:
                    decode(data, base=lookup)
                assert not isinstance(info.value, CodecError), name
        for name, width in {"I16": 2, "F16": 2, "F64": 8, "BOOL": 1, "F8_E4M3": 1}.items():  # known, not this entry's
            forged = with_header(anchor, lambda h: h["w"].update(dtype=name, shape=[16 // width]))
            for data in (forged, bytearray(forged)):
                with pytest.raises(CodecError, match="part 'val'"):
                    decode(data, base=lookup)

    @pytest.mark.parametrize("stream", ["idx", "val"])
    def test_exp_rice_streams_are_1d_bytes(self, stream: str) -> None:
        data, base, _ = make_delta("exp-rice")
        lookup = TorchModuleApplier(base).lookup

        def as_2d(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
            tensors[f"embed.weight::{stream}"] = tensors[f"embed.weight::{stream}"].reshape(1, -1)

        def as_int8(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
            tensors[f"embed.weight::{stream}"] = tensors[f"embed.weight::{stream}"].view(torch.int8)

        with pytest.raises(CodecError, match="must be 1-D"):
            decode(rebuild(data, as_2d), base=lookup)
        with pytest.raises(CodecError, match="torch.int8"):
            decode(rebuild(data, as_int8), base=lookup)

    def test_a_whole_file_is_decoded_without_its_entry_digests(self) -> None:
        """The manifest's digest of the whole object covers them; the reference reader looks at one only after a
        value digest fails, to say which side is at fault."""
        data, base, target = make_delta()

        def edit(text: str) -> str:
            table = json.loads(text)
            table["embed.weight"]["blake3"] = "0" * 64
            return json.dumps(table)

        forged = _with_table_text(data, edit)
        replica = {k: v.clone() for k, v in base.items()}
        applier = TorchModuleApplier(replica)
        applier.apply(decode(forged, base=applier.lookup)[1])
        assert all(torch.equal(replica[k].view(torch.int16), target[k].view(torch.int16)) for k in target)
        stale = TorchModuleApplier({k: torch.zeros_like(v) for k, v in base.items()})
        with pytest.raises(IntegrityError, match="altered after it was written"):
            decode(forged, base=stale.lookup)
