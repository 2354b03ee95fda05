"""Round trips through every codec, proven with hypothesis, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.appliers import TorchModuleApplier
from deltasync.codec import codec_names, get_codec, register_codec
from deltasync.format import decode, encode_anchor, encode_delta, read_header
from deltasync.publish.diff import Snapshot, diff

SPARSE_CODECS = [name for name in codec_names() if name != "dense"]  # every registered codec that codes changes
DTYPES = {"BF16": (torch.bfloat16, torch.int16), "F16": (torch.float16, torch.int16), "F32": (torch.float32, torch.int32)}
# Bit patterns float comparisons get wrong: +-0, NaN payloads, +-inf, subnormals, extremes.
SPECIAL_16 = [0x0000, -0x8000, 0x7FC0, 0x7FC1, -0x003F, 0x7F80, -0x0080, 0x0001, -0x7FFF, 0x7F7F, -0x0081]
SPECIAL_32 = [0, -(2**31), 0x7FC00001, 0x7F800000, -0x00800000, 1, 0x7F7FFFFF]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[str, np.ndarray, np.ndarray]:
    """(dtype, base bits, target bits) with a drawn change pattern."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    bits = np.int16 if DTYPES[dtype][1] == torch.int16 else np.int32
    specials = SPECIAL_16 if bits is np.int16 else SPECIAL_32
    numel = draw(st.sampled_from([1, 2, 17, 1000, 70_000, 200_003]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    info = np.iinfo(bits)
    base = rng.integers(info.min, info.max, numel, dtype=bits, endpoint=True)
    base[rng.integers(0, numel, min(numel, 8))] = rng.choice(specials, min(numel, 8))
    pattern = draw(st.sampled_from(["none", "one", "first", "last", "ends", "all", "sparse", "long-gaps", "dense"]))
    idx = {
        "none": np.array([], dtype=np.int64),
        "one": rng.integers(0, numel, 1),
        "first": np.array([0]),
        "last": np.array([numel - 1]),
        "ends": np.unique([0, numel - 1]),
        "all": np.arange(numel),
        "sparse": rng.choice(numel, max(1, numel // 100), replace=False),
        "long-gaps": np.unique(np.r_[0, rng.integers(0, numel, 3), numel - 1]),
        "dense": rng.choice(numel, max(1, numel // 2), replace=False),
    }[pattern]
    target = base.copy()
    if draw(st.booleans()):  # +-1 ulp steps, the common case in RL updates
        target[idx] = target[idx] + rng.choice(np.array([-1, 1], dtype=bits), idx.size)
    else:
        target[idx] = rng.choice(specials + [int(info.max)], idx.size).astype(bits)
    return dtype, base, target


def roundtrip(dtype: str, base: np.ndarray, target: np.ndarray, codec: str, chunk: int = 1 << 22) -> None:
    torch_dtype, _ = DTYPES[dtype]
    trainer = {"w": torch.from_numpy(target.copy()).view(torch_dtype)}
    snapshot = Snapshot.capture({"w": torch.from_numpy(base.copy()).view(torch_dtype)}, dtype=None)
    replica = {"w": torch.from_numpy(base.copy()).view(torch_dtype)}
    applier = TorchModuleApplier(replica, dtype=None)

    changes = diff(snapshot, trainer, chunk=chunk)
    data = encode_delta(changes, version=5, base_version=4, codec=codec)
    header, patches = decode(data, base=applier.lookup)
    applier.validate(header)
    applier.apply(patches)

    assert header.nnz == int(np.count_nonzero(base != target))
    np.testing.assert_array_equal(replica["w"].view(DTYPES[dtype][1]).numpy(), target)


@pytest.mark.parametrize("codec", SPARSE_CODECS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios())
def test_roundtrip_is_bit_exact(codec: str, case: tuple[str, np.ndarray, np.ndarray]) -> None:
    roundtrip(*case, codec=codec)


def three_tensors_stepped(
    seed: int, codec: str = "compact"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], bytes]:
    """Three fp32 tensors, the same with 2 % of each moved, and the delta between them (``codec``)."""
    gen = torch.Generator().manual_seed(seed)
    old = {"a": torch.randn(64, 300, generator=gen), "b": torch.randn(300, 64, generator=gen),
           "c": torch.randn(5000, generator=gen)}
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        flat = t.view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 50]] += 0.05
    return old, new, encode_delta(diff(Snapshot.capture(old), new), version=1, base_version=0, codec=codec)


@pytest.mark.parametrize("codec", ["compact", "compact-exp", "exp-rice"])
def test_a_cpu_replica_is_read_in_place_by_the_rebuild(codec: str) -> None:
    """A replica's tensors held whole on the CPU in the published dtype are read in place (its lookup's
    ``flat``): inside the compiled rebuild, or whole by the codecs that rank positions by the receiver's tensor;
    never through ``read``. A transposed or wider tensor is read through ``read``. The patches are bit for bit
    those of a plain lookup function, which decodes tensor by tensor."""
    from deltasync.codec.base import FlatLookup

    old, new, data = three_tensors_stepped(3, codec)
    assert {e.codec for e in read_header(data).tensors.values()} == {codec}
    held = {"a": old["a"].to(torch.bfloat16), "b": old["b"].to(torch.bfloat16).t().contiguous().t(), "c": old["c"]}
    replica = TorchModuleApplier(held)  # "b" transposed, "c" held in fp32: both read through read
    read_for = []

    def read(name: str, indices: np.ndarray) -> np.ndarray:
        read_for.append(name)
        return replica.lookup.read(name, indices)

    _, patches = decode(data, base=FlatLookup(read, replica.lookup.flat))
    assert sorted(read_for) == ["b", "c"]
    assert replica.lookup.flat("a") is not None
    assert replica.lookup.flat("b") is None and replica.lookup.flat("c") is None
    _, alone = decode(data, base=lambda name, indices: replica.lookup(name, indices))
    for name, patch in alone.items():
        np.testing.assert_array_equal(patches[name].indices, patch.indices)
        np.testing.assert_array_equal(patches[name].values, patch.values)
    replica.apply(patches)
    for name, t in new.items():
        assert torch.equal(held[name].to(torch.bfloat16).view(torch.int16), t.to(torch.bfloat16).view(torch.int16))


def test_the_device_path_reads_every_layout_of_a_replica_into_its_buffer() -> None:
    """On the device path each tensor's bases are read straight into their place in the batch's buffer: in
    place from a tensor held whole in the published dtype, and through a copy from a transposed one or one
    held in fp32. The patches are bit for bit the host path's, and the replica ends at the trainer's bits."""
    old, new, data = three_tensors_stepped(3, "compact")
    held = {"a": old["a"].to(torch.bfloat16), "b": old["b"].to(torch.bfloat16).t().contiguous().t(),
            "c": old["c"].clone()}
    replica = TorchModuleApplier(held, stage=True)
    _, patches = decode(data, base=replica.lookup, on_device=replica.on_device)
    _, host = decode(data, base=TorchModuleApplier({n: t.clone() for n, t in held.items()}).lookup)
    assert sorted(patches) == ["a", "b", "c"]
    for name, patch in host.items():
        assert isinstance(patches[name].values, torch.Tensor)
        np.testing.assert_array_equal(patches[name].indices.numpy(), patch.indices)
        np.testing.assert_array_equal(patches[name].values.numpy(), patch.values)
    replica.apply(patches)
    for name, t in new.items():
        assert torch.equal(held[name].to(torch.bfloat16).view(torch.int16), t.to(torch.bfloat16).view(torch.int16))


def test_a_cpu_replica_writes_with_the_compiled_scatter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor held whole on the CPU in the published dtype takes its patch through ``kernels.put``; a
    transposed or wider one through torch. Every tensor ends bit-exact and its version counter moves, so
    autograd still refuses a backward through weights changed since its forward."""
    from deltasync.appliers import torch_module as torch_applier

    old, new, data = three_tensors_stepped(4)
    held = {"a": old["a"].to(torch.bfloat16).requires_grad_(),
            "b": old["b"].to(torch.bfloat16).t().contiguous().t(), "c": old["c"].clone()}
    replica = TorchModuleApplier(held)
    written = []
    real_put = torch_applier.put

    def put(dst: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
        written.append(dst.size)
        real_put(dst, indices, values)

    monkeypatch.setattr(torch_applier, "put", put)
    loss = (held["a"] * held["a"]).sum()  # saves "a" for its backward
    versions = {n: t._version for n, t in held.items()}
    _, patches = decode(data, base=replica.lookup)
    replica.apply(patches)
    assert written == [64 * 300]  # "a" alone: "b" is transposed, "c" held in fp32
    assert all(t._version > versions[n] for n, t in held.items())
    for name, t in new.items():
        assert torch.equal(held[name].detach().to(torch.bfloat16).view(torch.int16),
                           t.to(torch.bfloat16).view(torch.int16)), name
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("codec", ["compact", "compact-abs"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios(), offset=st.sampled_from([0, 5]))
def test_the_device_path_rebuilds_what_the_host_path_does(
    codec: str, case: tuple[str, np.ndarray, np.ndarray], offset: int
) -> None:
    """:mod:`deltasync.codec.device` on CPU tensors against the host decoder, bit for bit: every dtype,
    change pattern and special value, escapes, and a shard's offset into a longer tensor."""
    dtype, base, target = case
    torch_dtype, bits = DTYPES[dtype]
    changes = diff(Snapshot.capture({"w": torch.from_numpy(base.copy()).view(torch_dtype)}, dtype=None),
                   {"w": torch.from_numpy(target.copy()).view(torch_dtype)})
    data = encode_delta(changes, version=5, base_version=4, codec=codec)
    host_replica = TorchModuleApplier({"w": torch.from_numpy(base.copy()).view(torch_dtype)}, dtype=None)
    _, host = decode(data, base=host_replica.lookup)
    if offset:  # the same tensor as the tail of a longer one (a shard), read where the shard starts
        from deltasync.codec.device import decode_on_device, streams_of
        from deltasync.format.decode import file_entries

        entry = read_header(data).tensors.get("w")
        if entry is None or entry.codec not in ("compact", "compact-abs"):
            return
        longer = np.concatenate([np.zeros(offset, dtype=base.dtype), base])
        receiver = TorchModuleApplier({"w": torch.from_numpy(longer).view(torch_dtype)}, dtype=None, stage=True)
        parts = {k.split("::")[1]: v for k, v in file_entries(data).items()}
        dev = decode_on_device([streams_of("w", codec, parts, entry.params, entry.local_spec, entry.nnz, offset)],
                               receiver)
        np.testing.assert_array_equal(dev["w"].indices.numpy(), host["w"].indices + offset)
        np.testing.assert_array_equal(dev["w"].values.numpy(), host["w"].values)
        return
    receiver = TorchModuleApplier({"w": torch.from_numpy(base.copy()).view(torch_dtype)}, dtype=None, stage=True)
    _, dev = decode(data, base=receiver.lookup, on_device=receiver)
    assert dev.keys() == host.keys()
    for name, patch in host.items():
        if patch.indices is not None:  # sparse: rebuilt on the device; a dense tensor decodes on the host
            assert isinstance(dev[name].values, torch.Tensor) and dev[name].values.dtype == bits
            np.testing.assert_array_equal(dev[name].indices.numpy(), patch.indices)
        np.testing.assert_array_equal(np.asarray(dev[name].values), patch.values)


@pytest.mark.parametrize("codec", SPARSE_CODECS)
def test_gaps_beyond_uint16_and_uint32_escapes(codec: str) -> None:
    numel = (1 << 17) + 5
    base = np.zeros(numel, dtype=np.int16)
    target = base.copy()
    target[[0, 1, 70_000, numel - 1]] = [1, 2, 3, 4]  # gaps of 69,998 and 61,076 do not fit uint16
    roundtrip("BF16", base, target, codec)


def test_gap_width_adapts() -> None:
    from deltasync.codec.compact import encode_indices

    assert encode_indices(np.arange(0, 1000, 3), 3)[1] == {"iw": 1, "big": 0}
    assert encode_indices(np.arange(0, 10**6, 1000), 3)[1] == {"iw": 2, "big": 0}
    assert encode_indices(np.array([0, 10**8]), 3)[1]["big"] in (0, 1)


def test_mixed_model_chooses_dense_per_tensor() -> None:
    trainer = {"sparse": torch.zeros(1000, dtype=torch.bfloat16), "dense": torch.zeros(10, dtype=torch.bfloat16)}
    snapshot = Snapshot.capture(trainer)
    trainer["sparse"][::100] = 1.0
    trainer["dense"][:] = 2.0
    header, _ = decode(encode_delta(diff(snapshot, trainer), version=1, base_version=0), base=lambda n, i: np.zeros(i.size, np.int16))
    assert {n: e.codec for n, e in header.tensors.items()} == {"sparse": "compact", "dense": "dense"}


def test_anchor_roundtrip_special_values() -> None:
    bits = torch.tensor(SPECIAL_16 * 3, dtype=torch.int16)
    header, patches = decode(encode_anchor({"w": bits.view(torch.bfloat16).view(3, -1)}, version=0))
    assert header.kind == "anchor" and patches["w"].indices is None
    np.testing.assert_array_equal(patches["w"].values, bits.numpy())


def test_compact_is_smaller_than_raw_on_ulp_steps() -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(-30000, 30000, 1 << 20).astype(np.int16)
    target = base.copy()
    idx = rng.choice(base.size, base.size // 150, replace=False)
    target[idx] += rng.choice(np.array([-1, 1], dtype=np.int16), idx.size)
    snap = Snapshot.capture({"w": torch.from_numpy(base).view(torch.bfloat16)})
    changes = diff(snap, {"w": torch.from_numpy(target).view(torch.bfloat16)})
    sizes = {c: len(encode_delta(changes, version=1, base_version=0, codec=c)) for c in SPARSE_CODECS}
    assert sizes["compact"] < sizes["compact-abs"] < sizes["raw"]


class TestRegistry:
    def test_builtins(self) -> None:
        assert {"compact", "compact-abs", "raw", "dense"} <= set(codec_names())

    def test_unknown_lists_registered(self) -> None:
        with pytest.raises(ValueError, match="registered: .*compact"):
            get_codec("nope")

    def test_duplicate_refused(self) -> None:
        with pytest.raises(ValueError, match="already registered"):
            register_codec("raw", "x:Y")

    def test_plugin_registers_lazily(self) -> None:
        register_codec("raw-plugin", "tests.plugin_codec:PluginCodec")
        assert get_codec("raw-plugin").name == "raw-plugin"


class TestFastPathsMatchReference:
    """The optimised encoder pieces reproduce the straightforward formulas byte for byte."""

    @staticmethod
    def reference_indices(indices: np.ndarray, level: int) -> tuple[bytes, dict[str, int]]:
        import zstandard

        gaps = np.diff(indices, prepend=-1) - 1
        costs = []
        for width in (1, 2, 4):
            big = int(np.count_nonzero(gaps >= (1 << (8 * width)) - 1))
            costs.append((gaps.size * width + 8 * big, width, big))
        _, width, n_big = min(costs)
        escape = (1 << (8 * width)) - 1
        is_big = gaps >= escape
        main = np.where(is_big, escape, gaps).astype(f"<u{width}")
        payload = main.view(np.uint8).reshape(-1, width).T.tobytes() + gaps[is_big].astype("<u8").tobytes()
        frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload)
        return frame, {"iw": width, "big": n_big}

    @settings(max_examples=80, deadline=None)
    @given(
        numel=st.sampled_from([1, 300, 70_000, 1 << 20, 10**10]),
        count=st.integers(1, 3000),
        clustered=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def test_encode_indices(self, numel: int, count: int, clustered: bool, seed: int) -> None:
        from deltasync.codec.compact import encode_indices

        rng = np.random.default_rng(seed)
        if clustered:  # runs of neighbours, the shape of real deltas (gaps of 0 and a few long jumps)
            starts = rng.integers(0, numel, max(1, count // 20))
            picked = (starts[:, None] + np.arange(20)).reshape(-1)
        else:
            picked = rng.integers(0, numel, count)
        indices = np.unique(np.clip(picked, 0, numel - 1)).astype(np.int64)
        blob, params = encode_indices(indices, 1)
        frame, expected = self.reference_indices(indices, 1)
        assert params == expected and blob.tobytes() == frame

    @settings(max_examples=80, deadline=None)
    @given(
        numel=st.sampled_from([1, 300, 70_000, 1 << 20, 10**10]),
        count=st.integers(0, 3000),
        seed=st.integers(0, 2**32 - 1),
    )
    def test_decode_indices_inverts_the_reference_encoder(self, numel: int, count: int, seed: int) -> None:
        from deltasync.codec.compact import decode_indices
        from deltasync.tensors import TensorSpec

        rng = np.random.default_rng(seed)
        indices = np.unique(rng.integers(0, numel, count)).astype(np.int64)
        frame, params = self.reference_indices(indices, 1)
        spec = TensorSpec("w", (numel,), "BF16")
        decoded = decode_indices(np.frombuffer(frame, dtype=np.uint8), params, spec, indices.size)
        assert decoded.dtype == np.int64
        np.testing.assert_array_equal(decoded, indices)

    @pytest.mark.parametrize(
        ("gaps", "side", "params", "match"),
        [
            ([255, 0], [2**63 - 1], {"iw": 1, "big": 1}, "out of range"),  # a side gap that would wrap int64
            ([255, 255], [2**62, 2**62], {"iw": 1, "big": 2}, "out of range"),  # two that sum past it
            ([255, 3], [5, 6], {"iw": 1, "big": 2}, "escape count"),  # two side gaps, one escape
            ([254, 3], [], {"iw": 1, "big": 1}, "zstd frame declares"),  # no side list where params promise one
            ([255, 3], [], {"iw": 1, "big": 0}, "escape count"),  # an escape without a side list
            ([200, 200], [], {"iw": 1, "big": 0}, "out of range"),  # the sum of plain gaps passes numel
        ],
    )
    def test_decode_indices_refuses_hostile_streams(
        self, gaps: list[int], side: list[int], params: dict[str, int], match: str
    ) -> None:
        import zstandard

        from deltasync.codec.compact import decode_indices
        from deltasync.errors import CodecError
        from deltasync.tensors import TensorSpec

        payload = np.array(gaps, dtype=np.uint8).tobytes() + np.array(side, dtype="<u8").tobytes()
        frame = np.frombuffer(zstandard.ZstdCompressor(write_content_size=True).compress(payload), dtype=np.uint8)
        spec = TensorSpec("w", (300,), "BF16")
        with pytest.raises(CodecError, match=match):
            decode_indices(frame, params, spec, len(gaps))
        # The device path refuses the same streams (flags checked at its one wait, nothing read out of bounds).
        from deltasync.codec.device import decode_on_device, streams_of

        values = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(2 * len(gaps)))
        parts = {"idx": torch.from_numpy(frame.copy()), "val": torch.frombuffer(bytearray(values), dtype=torch.uint8)}
        receiver = TorchModuleApplier({"w": torch.zeros(300, dtype=torch.bfloat16)}, stage=True)
        with pytest.raises(CodecError, match="zstd frame declares" if "zstd" in match else "hostile index stream"):
            for codec in ("compact", "compact-abs"):
                decode_on_device([streams_of("w", codec, parts, params, spec, len(gaps), 0)], receiver)

    @pytest.mark.parametrize("width", [1, 2, 4, 8])
    def test_planes_roundtrip(self, width: int) -> None:
        from deltasync.codec.compact import UNSIGNED as _UNSIGNED
        from deltasync.codec.compact import planes as _planes
        from deltasync.codec.compact import unplanes as _unplanes

        words = np.random.default_rng(width).integers(0, 255, 1001 * width, dtype=np.uint8).view(_UNSIGNED[width])
        planes = _planes(words)
        assert planes.tobytes() == words.view(np.uint8).reshape(-1, width).T.tobytes()
        np.testing.assert_array_equal(_unplanes(planes.tobytes(), words.size, _UNSIGNED[width]), words)
        assert _planes(words[:0]).size == 0

    @pytest.mark.parametrize("bits", [np.int16, np.int32])
    def test_exponent_order_is_the_stable_order_of_the_exponent(self, bits: type) -> None:
        from deltasync.codec.compact import _exponent_order

        base = np.random.default_rng(0).integers(np.iinfo(bits).min, np.iinfo(bits).max, 50_000, dtype=bits)
        unsigned = base.view(f"<u{base.itemsize}")
        exponent = (unsigned >> (7 if base.itemsize == 2 else 23)).astype(np.uint16) & 0xFF
        np.testing.assert_array_equal(_exponent_order(base), np.argsort(exponent, kind="stable"))

    def test_reused_zstd_contexts_match_fresh_ones_across_threads(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import zstandard

        from deltasync.codec._zstd import compress, decompress

        rng = np.random.default_rng(0)
        payloads = [rng.integers(0, n % 50 + 2, n, dtype=np.uint8) for n in (10, 5000, 70_000, 300, 70_000)]
        fresh = [zstandard.ZstdCompressor(level=1, write_content_size=True).compress(p.tobytes()) for p in payloads]
        with ThreadPoolExecutor(3) as pool:
            reused = list(pool.map(lambda p: compress(p, 1), payloads * 3))
        assert [r.tobytes() for r in reused] == fresh * 3
        assert [decompress(r, p.size, "x") for r, p in zip(reused, payloads)] == [p.tobytes() for p in payloads]


class TestContainer:
    """The delta writer: same bytes as safetensors, whatever the thread count."""

    def test_serialize_matches_safetensors(self) -> None:
        import safetensors.torch

        from deltasync.format import serialize as _serialize

        tensors = {
            "b::val": torch.arange(5, dtype=torch.int16).view(torch.bfloat16),
            "a::idx": torch.arange(3, dtype=torch.int32),
            "c::x": torch.arange(7, dtype=torch.uint8),
            "z::w": torch.arange(6, dtype=torch.float32).view(2, 3),
            "e::v": torch.zeros(0, dtype=torch.int64),
            "d::s": torch.tensor(1.5, dtype=torch.float16),
            "f::m": torch.tensor([True, False]),
            "g::q": torch.arange(2, dtype=torch.int8),
            "h::r": torch.arange(2, dtype=torch.float64),
        }
        meta = {"format": "deltasync", "k": "v"}
        ours, theirs = _serialize(tensors, meta), safetensors.torch.save(tensors, metadata=meta)
        assert raw_header(ours) == raw_header(theirs) and body(ours) == body(theirs)
        loaded = safetensors.torch.load(ours)
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items())

    def test_serialize_defers_other_dtypes_to_safetensors(self) -> None:
        import safetensors.torch

        from deltasync.format import serialize as _serialize

        tensors = {"w::c": torch.zeros(3, dtype=torch.complex64), "w::i": torch.arange(3, dtype=torch.int32)}
        assert _serialize(tensors, {"a": "b"}) == safetensors.torch.save(tensors, metadata={"a": "b"})

    @pytest.mark.parametrize("codec", SPARSE_CODECS)
    def test_bytes_do_not_depend_on_workers(self, codec: str) -> None:
        gen = torch.Generator().manual_seed(0)
        weights = {f"t{i}": torch.randn(int(n), generator=gen) for i, n in enumerate([5000, 3, 70_000, 800, 1, 40_000])}
        snap = Snapshot.capture(weights)
        for t in weights.values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.01 * (torch.rand(t.shape, generator=gen) < 0.05))
        changes = diff(snap, weights)
        files = {w: encode_delta(changes, version=1, base_version=0, codec=codec, workers=w) for w in (1, 2, 3, 8)}
        assert len(set(files.values())) == 1


def raw_header(data: bytes) -> dict:
    from deltasync.format import raw_header as parse

    return parse(data)


def body(data: bytes) -> bytes:
    import struct

    return data[8 + struct.unpack("<Q", data[:8])[0] :]


def test_compact_exp_ranks_every_exponent_including_infinities_and_nans() -> None:
    """Bases at exponent 255 (inf, NaN) and 0 (zeros, subnormals) rank like any other class."""
    base = np.array([0x7F80, 0x0000, 0x7FC1, 0x3F80, 0xFF80, 0x0001, 0x7F80, 0x3F81] * 50, dtype=np.uint16)
    target = base.copy()
    target[[0, 2, 6, 9, 14, 399]] ^= 0x0002
    roundtrip("BF16", base.view(np.int16), target.view(np.int16), "compact-exp")


def test_compact_exp_is_smaller_when_changes_follow_the_exponent() -> None:
    """Small weights flip far more often than large ones: coding positions per exponent pays off."""
    rng = np.random.default_rng(0)
    values = torch.from_numpy(rng.standard_normal(1 << 19).astype(np.float32) * 0.02)
    snap = Snapshot.capture({"w": values})
    moved = values.clone()
    small = moved.abs() < 0.004
    moved[small] += 0.0004 * torch.sign(moved[small])  # moves small weights by a bf16 step or more
    changes = diff(snap, {"w": moved})
    sizes = {c: len(encode_delta(changes, version=1, base_version=0, codec=c)) for c in ("compact", "compact-exp")}
    assert sizes["compact-exp"] < 0.8 * sizes["compact"], sizes


@pytest.mark.parametrize("codec", ["compact-exp", "exp-rice"])
def test_exponent_ranked_codecs_read_the_base_in_chunks_each_checked(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole base goes through the lookup a chunk at a time (a last, short chunk too); the result is the
    same as in one read, and a chunk of the wrong size is refused."""
    from deltasync.codec import ranked
    from deltasync.errors import CodecError
    from deltasync.tensors import bits_view

    rng = np.random.default_rng(3)
    base = rng.standard_normal(5000).astype(np.float32) * 0.02
    target = base.copy()
    moved = rng.choice(5000, 400, replace=False)
    target[moved] *= 1.01
    snap = Snapshot.capture({"w": torch.from_numpy(base)})
    changes = diff(snap, {"w": torch.from_numpy(target)})
    blob = encode_delta(changes, version=1, base_version=0, codec=codec)
    held = bits_view(snap["w"]).numpy()
    reads: list[tuple[int, int]] = []

    def lookup(name: str, where: np.ndarray) -> np.ndarray:
        reads.append((int(where[0]), where.size) if where.size else (0, 0))
        return held[where]

    monkeypatch.setattr(ranked, "WHOLE_CHUNK", 1024)
    _, patches = decode(blob, base=lookup)
    assert reads == [(start, min(1024, 5000 - start)) for start in range(0, 5000, 1024)]
    (change,) = changes.changes
    assert np.array_equal(patches["w"].values, bits_view(change.values).numpy())
    assert np.array_equal(patches["w"].indices, change.indices.numpy())
    with pytest.raises(CodecError, match="wrong shape"):
        decode(blob, base=lambda name, where: held[where][:-1] if where[0] == 4096 else held[where])


def test_a_densely_changed_tensor_goes_whole_or_sparse_whichever_is_smaller() -> None:
    """Half of a norm's elements moved by one ulp: its changes code smaller than the whole tensor."""
    weights = {"norm": torch.ones(4096, dtype=torch.bfloat16), "noise": torch.zeros(64, dtype=torch.bfloat16)}
    snapshot = Snapshot.capture(weights)
    replica = {n: t.clone() for n, t in weights.items()}
    weights["norm"].view(torch.int16)[::2] += 1
    weights["noise"].copy_(torch.randn(64, generator=torch.Generator().manual_seed(0)))
    changes = diff(snapshot, weights)
    assert all(c.dense for c in changes.changes)
    data = encode_delta(changes, version=1, base_version=0)
    applier = TorchModuleApplier(replica)
    header, patches = decode(data, base=applier.lookup)
    assert {n: e.codec for n, e in header.tensors.items()} == {"norm": "compact", "noise": "dense"}
    assert header.tensors["norm"].nnz == 2048
    applier.validate(header)
    applier.apply(patches)
    assert all(torch.equal(replica[n].view(torch.int16), weights[n].view(torch.int16)) for n in weights)


class TestValueDigest:
    """Format 3 writers sign values with BLAKE3; files of formats 1 and 2 (BLAKE2b ``sum``) stay readable."""

    @staticmethod
    def encoded(codec: str = "compact") -> tuple[Any, Any, Any, Any]:
        from deltasync.codec.compact import values_digest
        from deltasync.tensors import TensorChange, TensorSpec

        rng = np.random.default_rng(1)
        base = rng.integers(-(2**15), 2**15, 5000, dtype=np.int16)
        indices = np.sort(rng.choice(5000, 70, replace=False)).astype(np.int64)
        new = base[indices] + 1
        spec = TensorSpec("w", (5000,), "BF16")
        change = TensorChange(spec, torch.from_numpy(indices), torch.from_numpy(new), torch.from_numpy(base[indices]),
                              indices.size, torch.from_numpy(base))
        encoded = get_codec(codec).encode(change, level=1)
        assert encoded.params["blake3"] == values_digest(new) and "sum" not in encoded.params
        return encoded, spec, (lambda name, where: base[where]), new

    @pytest.mark.parametrize("codec", ["compact", "compact-abs", "compact-exp", "exp-rice"])
    def test_blake3_is_written_and_checked(self, codec: str) -> None:
        import blake3

        encoded, spec, lookup, new = self.encoded(codec)
        assert encoded.params["blake3"] == blake3.blake3(new.tobytes()).hexdigest()[:16]  # the first 8 bytes
        decoded = get_codec(codec).decode(encoded.parts, encoded.params, spec, new.size, lookup)
        np.testing.assert_array_equal(decoded.values, new)

    def test_blake2b_sum_of_earlier_formats_is_checked(self) -> None:
        import hashlib

        encoded, spec, lookup, new = self.encoded()
        legacy = {k: v for k, v in encoded.params.items() if k != "blake3"}
        legacy["sum"] = hashlib.blake2b(new.tobytes(), digest_size=8).hexdigest()
        decoded = get_codec("compact").decode(encoded.parts, legacy, spec, new.size, lookup)
        np.testing.assert_array_equal(decoded.values, new)

    @pytest.mark.parametrize(
        "change",
        [
            {"blake3": None},  # no digest at all
            {"blake3": "0" * 16},  # a wrong one
            {"sum": "0" * 16},  # a right BLAKE3 beside a wrong BLAKE2b: every digest present must hold
            {"blake3": 12345},  # not a string
        ],
    )
    def test_missing_or_wrong_digests_are_integrity_errors(self, change: dict[str, Any]) -> None:
        from deltasync.errors import IntegrityError

        encoded, spec, lookup, new = self.encoded()
        params = {**encoded.params, **change}
        params = {k: v for k, v in params.items() if v is not None}
        with pytest.raises(IntegrityError, match="do not match"):
            get_codec("compact").decode(encoded.parts, params, spec, new.size, lookup)


class TestDevicePath:
    """``compact`` rebuilt on the receiver's device: one host wait per file, whatever the tensor count."""

    @staticmethod
    def delta(tensors: int) -> tuple[bytes, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(tensors)
        base = {f"t{i}": (torch.randn(5000, generator=gen) * 0.02).to(torch.bfloat16) for i in range(tensors)}
        target = {}
        for name, tensor in base.items():
            bits = tensor.view(torch.int16).clone()
            where = torch.randperm(5000, generator=gen)[:40]
            bits[where] += 1
            bits[where[:3]] = torch.tensor([0x7FC1, -0x8000, 0x7F80], dtype=torch.int16)  # NaN payload, -0, inf
            target[name] = bits.view(torch.bfloat16)
        data = encode_delta(diff(Snapshot.capture(base), target), version=2, base_version=1)
        return data, base, target

    @pytest.mark.parametrize("tensors", [3, 300])
    def test_one_host_wait_and_no_scalar_reads(self, tensors: int) -> None:
        from deltasync.codec.device import host_waits
        from tests.dispatch_helpers import host_wait_ops, recorded_ops, recorded_shapes, scans_along_rows

        data, base, target = self.delta(tensors)
        receiver = TorchModuleApplier({n: t.clone() for n, t in base.items()}, stage=True)
        before = host_waits()
        with recorded_ops() as ops:
            _, patches = decode(data, base=receiver.lookup, on_device=receiver)
        assert host_waits() - before == 1
        assert not host_wait_ops(ops) and "aten.cumsum_" in ops and "aten.sort" in ops
        with recorded_shapes() as calls:  # every prefix sum is one device-wide scan
            decode(data, base=receiver.lookup, on_device=receiver)
        assert not scans_along_rows(calls)
        receiver.apply(patches)
        for name, tensor in receiver.state().items():
            assert torch.equal(tensor.view(torch.int16), target[name].view(torch.int16)), name

    def test_batches_bound_the_scratch_and_give_the_same_patches(self) -> None:
        """Tensors go in batches of about ``batch`` changes, all queued before one wait; the patches do not
        change."""
        from deltasync.codec.device import decode_on_device, host_waits, streams_of
        from deltasync.format import read_header
        from deltasync.format.decode import file_entries
        from tests.dispatch_helpers import recorded_ops

        data, base, _ = self.delta(10)  # 40 changes per tensor
        header, entries = read_header(data), file_entries(data)
        items = [
            streams_of(name, e.codec, {k.split("::")[1]: v for k, v in entries.items() if k.startswith(name + "::")},
                       e.params, e.local_spec, e.nnz, 0)
            for name, e in header.tensors.items()
        ]
        receiver = TorchModuleApplier({n: t.clone() for n, t in base.items()}, stage=True)
        whole = decode_on_device(items, receiver)
        before = host_waits()
        with recorded_ops() as ops:
            batched = decode_on_device(items, receiver, batch=100)  # 3 tensors a batch, the last one 1
        assert host_waits() - before == 1 and ops.count("aten.sort") == 4  # one exponent sort per batch
        for name, patch in whole.items():
            assert torch.equal(patch.indices, batched[name].indices) and torch.equal(patch.values, batched[name].values)

    def test_a_receiver_that_drifted_is_refused_before_any_write(self) -> None:
        from deltasync.errors import IntegrityError

        data, base, _ = self.delta(5)
        held = {n: t.clone() for n, t in base.items()}
        held["t3"].view(torch.int16)[::50] += 2  # changed outside deltasync
        before = {n: t.clone() for n, t in held.items()}
        receiver = TorchModuleApplier(held, stage=True)
        with pytest.raises(IntegrityError, match="t3: the delta's bytes are intact"):
            decode(data, base=receiver.lookup, on_device=receiver)
        assert all(torch.equal(held[n].view(torch.int16), before[n].view(torch.int16)) for n in held)


    def test_escapes_where_the_device_has_no_static_nonzero(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Escapes are patched through the scatter fallback on a backend without ``nonzero_static``."""
        from deltasync.format import read_header
        from deltasync.tensors import device as tensor_device
        from tests.dispatch_helpers import without_static_nonzero

        base = {"w": torch.zeros(70_000, dtype=torch.bfloat16)}
        target = {"w": base["w"].clone()}
        target["w"].view(torch.int16)[[*range(0, 120, 3), 40_000, 69_999]] = 7  # short gaps, two escapes
        data = encode_delta(diff(Snapshot.capture(base), target), version=2, base_version=1)
        assert read_header(data).tensors["w"].params["big"] == 2
        without_static_nonzero(monkeypatch)
        receiver = TorchModuleApplier({"w": base["w"].clone()}, stage=True)
        _, patches = decode(data, base=receiver.lookup, on_device=receiver)
        assert tensor_device._NO_STATIC_KERNEL == {"cpu"}
        receiver.apply(patches)
        assert torch.equal(receiver.state()["w"].view(torch.int16), target["w"].view(torch.int16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_path_on_cuda_matches_the_host_path() -> None:
    data, base, target = TestDevicePath.delta(40)
    on_cuda = {n: t.cuda() for n, t in base.items()}
    receiver = TorchModuleApplier(on_cuda)
    assert receiver.on_device is receiver  # taken by default for weights on an accelerator
    _, patches = decode(data, base=receiver.lookup, on_device=receiver)
    _, host = decode(data, base=TorchModuleApplier({n: t.clone() for n, t in base.items()}).lookup)
    for name, patch in patches.items():
        assert patch.values.device.type == "cuda" and patch.indices.device.type == "cuda"
        np.testing.assert_array_equal(patch.indices.cpu().numpy(), host[name].indices)
        np.testing.assert_array_equal(patch.values.cpu().numpy(), host[name].values)
    receiver.apply(patches)
    for name, tensor in on_cuda.items():
        assert torch.equal(tensor.cpu().view(torch.int16), target[name].view(torch.int16)), name


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases=st.lists(scenarios(), min_size=1, max_size=6), codec=st.sampled_from(["compact", "compact-abs"]))
def test_the_device_path_rebuilds_whole_files_of_mixed_tensors(
    cases: list[tuple[str, np.ndarray, np.ndarray]], codec: str
) -> None:
    """Several tensors in one file, rebuilt together on the device: mixed dtypes and value widths,
    gap widths of 1, 2 and 4 bytes with and without escapes, empty and dense tensors beside sparse ones."""
    base = {f"t{i}": torch.from_numpy(b.copy()).view(DTYPES[d][0]) for i, (d, b, _) in enumerate(cases)}
    target = {f"t{i}": torch.from_numpy(t.copy()).view(DTYPES[d][0]) for i, (d, _, t) in enumerate(cases)}
    data = encode_delta(diff(Snapshot.capture(base, dtype=None), target), version=5, base_version=4, codec=codec)
    _, host = decode(data, base=TorchModuleApplier({n: t.clone() for n, t in base.items()}, dtype=None).lookup)
    receiver = TorchModuleApplier({n: t.clone() for n, t in base.items()}, dtype=None, stage=True)
    _, dev = decode(data, base=receiver.lookup, on_device=receiver)
    assert dev.keys() == host.keys()
    for name, patch in host.items():
        if patch.indices is not None:
            np.testing.assert_array_equal(dev[name].indices.numpy(), patch.indices)
        np.testing.assert_array_equal(np.asarray(dev[name].values), patch.values)
    receiver.apply(dev)
    for name, tensor in receiver.state().items():
        assert torch.equal(bits_of(tensor), bits_of(target[name])), name


def test_one_hostile_tensor_is_named_among_good_ones_on_the_device_path() -> None:
    """A tensor whose side gaps would wrap an int64 sum, between two good ones: the device path names it
    (not a neighbour whose indices the shared prefix sum carries past it) and writes nothing."""
    import json

    import zstandard

    from deltasync.errors import CodecError
    from deltasync.format import file_entries, raw_header, serialize

    gen = torch.Generator().manual_seed(3)
    base = {n: (torch.randn(70_000, generator=gen) * 0.02).to(torch.bfloat16) for n in ("a", "b", "c")}
    target = {n: t.clone() for n, t in base.items()}
    for tensor in target.values():
        tensor.view(torch.int16)[torch.randperm(70_000, generator=gen)[:50]] += 1
    data = encode_delta(diff(Snapshot.capture(base), target), version=5, base_version=4)
    tensors, meta = {k: v.clone() for k, v in file_entries(data).items()}, raw_header(data)["__metadata__"]
    entries = json.loads(meta["tensors"])
    # Tensor "b": 50 gaps, two of them escapes whose side gaps sum past 2**63.
    gaps = np.full(50, 3, dtype=np.uint8)
    gaps[[10, 20]] = 255
    payload = gaps.tobytes() + np.array([2**62 + 5, 2**62 + 7], dtype="<u8").tobytes()
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(payload)
    tensors["b::idx"] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    entries["b"]["params"].update(iw=1, big=2)
    entries["b"].pop("blake3", None)
    meta["tensors"] = json.dumps(entries)
    hostile = serialize(tensors, meta)
    held = {n: t.clone() for n, t in base.items()}
    receiver = TorchModuleApplier(held, stage=True)
    with pytest.raises(CodecError, match="^b: "):
        decode(hostile, base=receiver.lookup, on_device=receiver)
    with pytest.raises(CodecError, match="^b: "):
        decode(hostile, base=TorchModuleApplier({n: t.clone() for n, t in base.items()}).lookup)
    assert all(torch.equal(held[n].view(torch.int16), base[n].view(torch.int16)) for n in held)


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("chunk", [1, 300, 1 << 18])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(cases=st.lists(scenarios(), min_size=1, max_size=6), codec=st.sampled_from(["compact", "compact-abs"]))
def test_chunked_host_decode_gives_each_codecs_own_patches(
    cases: list[tuple[str, np.ndarray, np.ndarray]], codec: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host decodes compact tensors a chunk at a time (codec/packed.py): for whole files of mixed
    dtypes, gap widths, escapes, empty and dense tensors, in chunks of one tensor, a few, or all, every
    patch equals what the tensor's codec decodes on its own."""
    from deltasync.codec import packed
    from deltasync.format import read_header
    from deltasync.format.decode import file_entries

    monkeypatch.setattr(packed, "CHUNK", chunk)
    monkeypatch.setattr(packed, "TENSOR_COST", 0)  # chunks cut by changes alone: a few tensors each at 300
    base = {f"t{i}": torch.from_numpy(b.copy()).view(DTYPES[d][0]) for i, (d, b, _) in enumerate(cases)}
    target = {f"t{i}": torch.from_numpy(t.copy()).view(DTYPES[d][0]) for i, (d, _, t) in enumerate(cases)}
    data = encode_delta(diff(Snapshot.capture(base, dtype=None), target), version=5, base_version=4, codec=codec)
    receiver = TorchModuleApplier({n: t.clone() for n, t in base.items()}, dtype=None)
    _, chunked = decode(data, base=receiver.lookup)
    header, entries = read_header(data), file_entries(bytes(data))
    assert chunked.keys() == header.tensors.keys()
    for name, entry in header.tensors.items():
        parts = {key.split("::")[1]: part for key, part in entries.items() if key.split("::")[0] == name}
        alone = get_codec(entry.codec).decode(parts, entry.params, entry.local_spec, entry.nnz, receiver.lookup)
        if alone.indices is None:
            assert chunked[name].indices is None
        else:
            np.testing.assert_array_equal(chunked[name].indices, alone.indices)
        np.testing.assert_array_equal(chunked[name].values, alone.values)
    receiver.apply(chunked)
    for name, tensor in receiver.state().items():
        assert torch.equal(bits_of(tensor), bits_of(target[name])), name


def test_a_drifted_tensor_inside_a_chunk_is_named_and_nothing_is_decoded() -> None:
    """One tensor of a chunk whose base differs from the delta's: the chunk is decoded again tensor by
    tensor, which names that tensor (the first failure in file order) with the per-tensor message."""
    from deltasync.errors import IntegrityError

    gen = torch.Generator().manual_seed(5)
    base = {f"t{i}": (torch.randn(40_000, generator=gen) * 0.02).to(torch.bfloat16) for i in range(5)}
    target = {n: t.clone() for n, t in base.items()}
    for tensor in target.values():
        tensor.view(torch.int16)[torch.randperm(40_000, generator=gen)[:400]] += 1
    data = encode_delta(diff(Snapshot.capture(base), target), version=5, base_version=4)
    held = {n: t.clone() for n, t in base.items()}
    changed = (target["t2"].view(torch.int16) != base["t2"].view(torch.int16)).nonzero()[0]
    held["t2"].view(torch.int16)[changed] += 7  # this receiver drifted at a changed element of t2
    with pytest.raises(IntegrityError, match="^t2: .*does not hold the delta's base"):
        decode(data, base=TorchModuleApplier(held).lookup)


def test_chunks_group_one_kind_in_file_order_up_to_the_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync.codec import packed

    monkeypatch.setattr(packed, "CHUNK", 100)
    monkeypatch.setattr(packed, "TENSOR_COST", 10)
    sizes = [40, 40, 40, 500, 10, 10]
    kinds = ["a", "b", "a", "a", "a", "b"]
    assert packed.chunks(sizes, kinds) == [[0, 2], [1, 5], [3], [4]]
    assert packed.work([40, 40]) == 100


def test_chunks_count_each_tensors_fixed_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many small tensors fill a chunk by their fixed cost, not their few changes: a chunk of them is not
    taken for a light one when the threads' shares are dealt."""
    from deltasync.codec import packed

    monkeypatch.setattr(packed, "CHUNK", 100)
    monkeypatch.setattr(packed, "TENSOR_COST", 10)
    assert packed.chunks([1] * 12, ["a"] * 12) == [list(range(9)), [9, 10, 11]]
    monkeypatch.setattr(packed, "TENSOR_COST", 0)
    assert packed.chunks([1] * 12, ["a"] * 12) == [list(range(12))]


class TestKernels:
    """The compiled host kernels (codec/kernels.py) against the numpy decoder they replace."""

    @pytest.mark.parametrize("dtype", [np.int16, np.int32])
    def test_put_is_numpys_assignment_and_stops_at_an_index_out_of_range(self, dtype: type) -> None:
        from deltasync.codec.kernels import put

        rng = np.random.default_rng(0)
        dst = rng.integers(-1000, 1000, 5000).astype(dtype)
        indices = np.sort(rng.choice(5000, 300, replace=False)).astype(np.int64)
        values = rng.integers(-1000, 1000, 300).astype(dtype)
        expected = dst.copy()
        expected[indices] = values
        put(dst, indices, values)
        np.testing.assert_array_equal(dst, expected)
        for bad in (-1, 5000):
            before = dst.copy()
            with pytest.raises(IndexError):
                put(dst, np.array([3, bad, 7], dtype=np.int64), np.array([1, 2, 3], dtype=dtype))
            assert dst[3] == 1 and dst[7] == before[7]  # written up to the bad index, nothing after it
        with pytest.raises(ValueError):
            put(dst, indices, values[:-1])
        with pytest.raises(ValueError):
            put(dst, indices, values.astype(np.int64))

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
    def test_base_reads_match_index_select_and_refuse_what_is_out_of_range(self, dtype: torch.dtype) -> None:
        """``take`` is ``index_select``; a replica's lookup goes through it on the CPU, and an index out of
        range is still refused (by torch's own check) instead of read."""
        from deltasync.codec.kernels import take
        from deltasync.tensors import bits_view

        gen = torch.Generator().manual_seed(0)
        weights = torch.randn(3, 1000, generator=gen).to(dtype)
        flat = bits_view(weights).view(-1)
        index = torch.randperm(3000, generator=gen)[:300].sort().values
        picked = take(flat.numpy(), index.numpy())
        assert picked is not None and np.array_equal(picked, flat.index_select(0, index).numpy())
        assert take(flat.numpy(), np.array([0, 3000])) is None and take(flat.numpy(), np.array([-1])) is None
        receiver = TorchModuleApplier({"w": weights})  # published as bf16: fp32 and fp16 take torch's path
        published = receiver.specs["w"].torch_dtype
        expected = bits_view(weights.to(published)).view(-1)[index].numpy()
        assert np.array_equal(receiver.lookup("w", index.numpy()), expected)
        with pytest.raises((IndexError, RuntimeError)):
            receiver.lookup("w", np.array([5, 3000]))
        transposed = TorchModuleApplier({"w": weights.t()})  # not contiguous: torch's path, same bits
        expected = bits_view(weights.t().contiguous().to(published)).view(-1)[index]
        assert np.array_equal(transposed.lookup("w", index.numpy()), expected.numpy())

    @pytest.mark.parametrize("density", [0.001, 0.01, 0.04, 0.2, 0.9])
    def test_sparse_reads_hinted_ahead_match_index_select(self, density: float) -> None:
        """Below 5 % density ``take`` hints each read ``AHEAD`` changes ahead; at any density it reads exactly
        ``index_select``'s elements, and an index out of range (inside the hinted window or past it) is
        refused, never hinted or read."""
        from deltasync.codec import _gather
        from deltasync.codec.kernels import take

        assert _gather.take is _gather._take_hinted  # this numba lowers the hint (else the plain gather is taken)
        assert _gather.hint is _gather._prefetch  # and so does every kernel that hints its reads
        gen = torch.Generator().manual_seed(1)
        flat = torch.randint(-(2**15), 2**15, (200_000,), dtype=torch.int16, generator=gen)
        index = torch.randperm(flat.numel(), generator=gen)[: int(density * flat.numel())].sort().values
        picked = take(flat.numpy(), index.numpy())
        assert picked is not None and np.array_equal(picked, flat.index_select(0, index).numpy())
        for bad in (flat.numel(), 2**62, -1):
            for at in (0, _gather.AHEAD // 2, index.numel() - 1):
                hostile = index.numpy().copy()
                hostile[at] = bad
                assert take(flat.numpy(), hostile) is None

    def test_a_replica_reads_its_weights_where_they_are_now(self) -> None:
        """A CPU replica's reads see its weights as they are now: written in place, or replaced
        (``param.data = ...``, with new storage or another dtype); nothing read earlier is served again."""
        from deltasync.tensors import bits_view

        layer = torch.nn.Linear(4, 8, bias=False).to(torch.bfloat16)
        receiver = TorchModuleApplier(layer)
        index = np.array([0, 5, 31])
        first = bits_view(layer.weight.detach()).view(-1).numpy()[index].copy()
        assert np.array_equal(receiver.lookup("weight", index), first)
        layer.weight.data = layer.weight.data * 2  # new storage, new values
        moved = bits_view(layer.weight.detach()).view(-1).numpy()[index]
        assert not np.array_equal(moved, first) and np.array_equal(receiver.lookup("weight", index), moved)
        with torch.no_grad():
            layer.weight.add_(1)  # in place
        assert np.array_equal(receiver.lookup("weight", index), bits_view(layer.weight.detach()).view(-1).numpy()[index])
        layer.weight.data = layer.weight.data.float()  # no longer the published dtype: torch's path, same bits
        expected = bits_view(layer.weight.detach().to(torch.bfloat16)).view(-1).numpy()[index]
        assert np.array_equal(receiver.lookup("weight", index), expected)

    @settings(max_examples=60, deadline=None)
    @given(
        gaps=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**17), st.integers(0, 2**33)), max_size=60),
        slack=st.integers(0, 3),
    )
    def test_gap_indices_match_the_numpy_decoder(self, gaps: list[int], slack: int) -> None:
        from deltasync.codec.compact import decode_indices, encode_indices
        from deltasync.codec.kernels import gap_indices
        from deltasync.tensors import TensorSpec

        indices = np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1
        numel = int(indices[-1]) + 1 + slack if indices.size else 1 + slack
        blob, params = encode_indices(indices, level=1)
        spec = TensorSpec("w", (numel,), "F32")
        raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob.tobytes()), dtype=np.uint8)
        got = gap_indices(raw, indices.size, params["iw"], params["big"], numel)
        assert got is not None
        np.testing.assert_array_equal(got, decode_indices(blob, params, spec, indices.size))
        np.testing.assert_array_equal(got, indices)
        if indices.size:  # one element fewer and the last index is out of range
            assert gap_indices(raw, indices.size, params["iw"], params["big"], int(indices[-1])) is None

    @pytest.mark.parametrize(("gap", "width"), [(30, 1), (300, 2), (70_000, 4)])
    def test_gap_indices_of_every_width(self, gap: int, width: int) -> None:
        """Each gap width has its own compiled loop: each rebuilds its indices, escapes included."""
        from deltasync.codec.compact import encode_indices
        from deltasync.codec.kernels import gap_indices

        gaps = np.full(500, gap, dtype=np.int64)
        gaps[::7] = 2**40  # escapes at every width
        indices = np.cumsum(gaps + 1) - 1
        blob, params = encode_indices(indices, level=1)
        assert params["iw"] == width and params["big"] == gaps[::7].size
        raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob.tobytes()), dtype=np.uint8)
        numel = int(indices[-1]) + 1
        np.testing.assert_array_equal(gap_indices(raw, indices.size, width, params["big"], numel), indices)
        assert gap_indices(raw, indices.size, width, params["big"], numel - 1) is None  # the last one out of range

    @pytest.mark.parametrize("width", [2, 4])
    def test_add_steps_match_the_numpy_decoder(self, width: int) -> None:
        from deltasync.codec.compact import SIGNED, CompactCodec, planes, zigzag
        from deltasync.codec.kernels import add_steps

        rng = np.random.default_rng(width)
        info = np.iinfo(SIGNED[width])
        base = rng.integers(info.min, info.max, 50_000, dtype=SIGNED[width], endpoint=True)
        base[:4] = [info.min, info.max, 0, -1]
        steps = rng.integers(-3, 4, base.size).astype(SIGNED[width])
        steps[4:8] = [info.min, info.max, 1, -1]  # steps that wrap around the bit patterns
        new = (base.astype(np.int64) + steps).astype(SIGNED[width])  # wraps modulo 2**bits
        exponent = (base.view(f"<u{width}") >> (7 if width == 2 else 23)).astype(np.uint8)
        delta = (new.view(f"<u{width}") - base.view(f"<u{width}")).view(base.dtype)
        words = zigzag(delta)[exponent.argsort(kind="stable")]
        assert CompactCodec._value_payload(new, base).tobytes() == planes(words).tobytes()  # the encoder's kernel
        got = add_steps(planes(words), base)
        np.testing.assert_array_equal(got, new)
        assert got.dtype == base.dtype

    @settings(max_examples=80, deadline=None)
    @given(
        numel=st.integers(1, 30_000),
        density=st.sampled_from([0.0005, 0.01, 0.05, 0.3, 1.0]),
        width=st.sampled_from([2, 4]),
        spread=st.sampled_from([0, 300, 70_000]),
        offset=st.integers(0, 50),
        seed=st.integers(0, 2**16),
    )
    def test_rebuild_is_gap_indices_then_take_then_add_steps(
        self, numel: int, density: float, width: int, spread: int, offset: int, seed: int
    ) -> None:
        """The one-call rebuild of a ``compact`` tensor gives exactly what its three kernels give in turn, at
        every density (hinted or not), value width, gap width (escapes included) and shard offset."""
        from deltasync.codec.compact import SIGNED, encode_indices
        from deltasync.codec.kernels import add_steps, gap_indices, rebuild, step_payload, take

        rng = np.random.default_rng(seed)
        count = max(1, int(density * numel))
        indices = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
        if spread and count > 1:  # gaps that need 2 or 4 bytes, or escapes: a wider tensor (of a few M at most)
            count = min(count, 4_000_000 // spread)
            indices = indices[np.sort(rng.choice(indices.size, count, replace=False))]
            indices = indices + np.arange(count, dtype=np.int64) * spread
            numel = int(indices[-1]) + 1 + int(rng.integers(0, 3))
        info = np.iinfo(SIGNED[width])
        src = rng.integers(info.min, info.max, numel + offset + int(rng.integers(0, 5)), dtype=SIGNED[width],
                           endpoint=True)
        base = src[offset + indices]
        new = (base.astype(np.int64) + rng.integers(-3, 4, count)).astype(SIGNED[width])  # wraps modulo 2**bits
        blob, params = encode_indices(indices, level=1)
        idx = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob.tobytes()), dtype=np.uint8)
        val = step_payload(new, base)
        expected_indices = gap_indices(idx, count, params["iw"], params["big"], numel)
        assert expected_indices is not None
        expected = add_steps(val, take(src[offset:], expected_indices))
        got = rebuild(idx, count, params["iw"], params["big"], numel, val, src, offset)
        assert got is not None
        np.testing.assert_array_equal(got[0], indices)
        np.testing.assert_array_equal(got[1], expected)
        np.testing.assert_array_equal(got[1], new)
        assert got[1].dtype == src.dtype
        # What gap_indices refuses, and a shard that does not fit its source, are refused, never read past.
        assert rebuild(idx, count, params["iw"], params["big"], int(indices[-1]), val, src, offset) is None
        assert rebuild(idx, count, params["iw"], params["big"], numel, val, src, src.size - numel + 1) is None
        assert rebuild(idx, count, params["iw"], params["big"], numel, val, src, -1) is None
        assert rebuild(idx[:-1], count, params["iw"], params["big"], numel, val, src, offset) is None
        assert rebuild(idx, count, params["iw"], params["big"], numel, val[:-1], src, offset) is None

    def test_rebuild_refuses_hostile_gap_streams(self) -> None:
        """The rebuild's gap decoder runs ahead of its base reads: a hostile stream is refused wherever the
        bad gap lies, before or after the reads begin."""
        from deltasync.codec.kernels import rebuild

        src = np.arange(1000, dtype=np.int16)
        val = np.zeros(2 * 400, dtype=np.uint8)
        narrow = np.zeros(400, np.uint8)
        assert rebuild(narrow, 400, 1, 0, 1000, val, src)[0].tolist() == list(range(400))
        for at in (0, 100, 399):  # an escape the params do not count, early and late
            bad = narrow.copy()
            bad[at] = 255
            assert rebuild(np.concatenate([bad, np.array([5], np.uint64).view(np.uint8)]), 400, 1, 0, 1000, val,
                           src) is None
            assert rebuild(bad, 400, 1, 0, 1000, val, src) is None
            far = narrow.copy()
            far[at] = 254  # the indices then end at 653: past a tensor of 600
            assert rebuild(far, 400, 1, 0, 654, val, src) is not None
            assert rebuild(far, 400, 1, 0, 600, val, src) is None
        side = np.array([2**56], np.uint64).view(np.uint8)  # a side gap past any tensor
        escaped = narrow.copy()
        escaped[200] = 255
        assert rebuild(np.concatenate([escaped, side]), 400, 1, 1, 1000, val, src) is None

    def test_hostile_gap_streams_are_refused_not_read_past(self) -> None:
        from deltasync.codec.kernels import gap_indices

        def stream(narrow: list[int], side: list[int]) -> np.ndarray:
            return np.concatenate([np.array(narrow, np.uint8), np.array(side, np.uint64).view(np.uint8)])

        assert gap_indices(stream([3, 255], [5]), 2, 1, 1, 100).tolist() == [3, 9]
        assert gap_indices(stream([3, 255], [5]), 2, 1, 0, 100) is None  # size differs from the params
        assert gap_indices(stream([255, 255], [5]), 2, 1, 1, 100) is None  # more escapes than params say
        assert gap_indices(stream([3, 4], [5]), 2, 1, 1, 100) is None  # fewer escapes than params say
        assert gap_indices(stream([3, 255], [2**56]), 2, 1, 1, 100) is None  # a side gap past any tensor
        assert gap_indices(stream([3, 255], [2**63 - 1]), 2, 1, 1, 100) is None
        assert gap_indices(stream([3, 255], [95]), 2, 1, 1, 100).tolist() == [3, 99]  # the last element
        assert gap_indices(stream([3, 255], [96]), 2, 1, 1, 100) is None  # one past it

    def test_the_encoder_refuses_indices_that_are_not_sorted_and_unique(self) -> None:
        from deltasync.codec.kernels import gap_payload

        for bad in ([3, 3], [5, 2], [-1]):
            with pytest.raises(ValueError, match="sorted and unique"):
                gap_payload(np.array(bad, dtype=np.int64))
        assert gap_payload(np.array([], dtype=np.int64))[1:] == (1, 0)

    def test_importing_the_package_does_not_import_numba(self) -> None:
        """numba loads when a kernel first runs, not with the package (the CLI, manifest readers)."""
        import subprocess
        import sys

        code = "import sys, deltasync, deltasync.format, deltasync.codec.packed; print('numba' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False"

    @pytest.mark.parametrize("dtype", [np.int16, np.int32])
    def test_exponent_ranks_and_positions_invert_a_stable_sort_by_exponent(self, dtype: type) -> None:
        """Ranks are places in a stable sort of the whole tensor by exponent byte (any sign, inf, NaN,
        zero, subnormal); positions map sorted ranks back to indices and to their place in the ranks."""
        from deltasync.codec.kernels import exponent_positions, exponent_ranks

        rng = np.random.default_rng(7)
        info = np.iinfo(dtype)
        bits = rng.integers(info.min, info.max, 30_000, dtype=dtype, endpoint=True)
        bits[:6] = [0, -1, info.max, info.min, 1, -2]
        mantissa = 7 if dtype is np.int16 else 23
        exponent = ((bits.astype(np.int64) & ((1 << (8 * bits.itemsize)) - 1)) >> mantissa) & 0xFF
        order = exponent.argsort(kind="stable")
        rank_of = np.empty(bits.size, np.int64)
        rank_of[order] = np.arange(bits.size)
        indices = np.unique(np.r_[0, 1, 2, 3, rng.choice(bits.size, 3000, replace=False), bits.size - 1])
        ranks = exponent_ranks(bits, indices)
        np.testing.assert_array_equal(ranks, rank_of[indices])
        sorted_ranks = np.sort(ranks)
        found = exponent_positions(bits, sorted_ranks)
        assert found is not None
        where, slots = found
        np.testing.assert_array_equal(where, indices)
        np.testing.assert_array_equal(sorted_ranks[slots], ranks)
        assert exponent_positions(bits, np.array([bits.size], np.int64)) is None
        for _ in range(20):  # ranks out of order (callers pass sorted ones): refused or as many, never past them
            shuffled = rng.permutation(sorted_ranks)[:50]
            found = exponent_positions(bits, shuffled)
            assert found is None or found[0].shape == found[1].shape == shuffled.shape
        with pytest.raises(ValueError, match="sorted"):
            exponent_ranks(bits, indices[::-1].copy())

    def test_kernels_compile_where_no_cache_can_be_written(self) -> None:
        """A read-only install with no writable cache: the kernels compile in the process instead."""
        import subprocess
        import sys

        code = (
            "import numpy as np, numba.core.caching as c\n"
            "(getattr(c, 'CacheImpl', None) or c._CacheImpl)._locator_classes = []\n"
            "from deltasync.codec.kernels import gap_indices\n"
            "print(gap_indices(np.array([3, 4], np.uint8), 2, 1, 0, 100).tolist())\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "[3, 8]"


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.one_of(st.just(0), st.integers(0, 50)), max_size=30))
def test_segment_owners_match_repeat_interleave(counts: list[int]) -> None:
    """The device path's segment ids (marks and a prefix sum), empty segments included."""
    from deltasync.tensors import segment_owners

    sizes = torch.tensor(counts, dtype=torch.int64)
    expected = torch.repeat_interleave(torch.arange(len(counts)), sizes)
    assert torch.equal(segment_owners(sizes, int(sizes.sum())), expected)


def test_frames_inflate_straight_into_their_targets_or_are_refused() -> None:
    """``decompress_into``: a frame fills its targets exactly; one that holds more or less than they take,
    carries bytes after it, or is corrupt is a ``CodecError``, and its targets are left as they were."""
    from deltasync.codec._zstd import check_frame, compress, decompress_into
    from deltasync.errors import CodecError

    payload = np.arange(3000, dtype=np.uint32).view(np.uint8) % 7
    frame = check_frame(compress(payload, 3), payload.size, "t::idx")
    out = np.zeros(payload.size + 10, dtype=np.uint8)
    targets = [out[:100], out[100:5000], out[5010:]]  # 100 + 4900 + 7000 bytes
    decompress_into(frame, targets, "t::idx")
    assert np.array_equal(np.concatenate(targets), payload) and not out[5000:5010].any()
    for wrong in ([out[:11999]], [out[:12000], np.zeros(1, dtype=np.uint8)]):
        with pytest.raises(CodecError, match="declares 12000 bytes, header expects"):
            decompress_into(frame, wrong, "t::idx")
    with pytest.raises(CodecError, match="after the zstd frame"):
        decompress_into(np.concatenate([frame, frame[:5]]), [np.zeros(12000, dtype=np.uint8)], "t::idx")
    broken = frame.copy()
    broken[len(broken) // 2] ^= 0xFF
    untouched = np.full(12000, 5, dtype=np.uint8)
    with pytest.raises(CodecError):
        decompress_into(broken, [untouched], "t::idx")
    assert (untouched == 5).all()


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 40), max_size=20), seed=st.integers(0, 2**16))
def test_segment_sums_match_per_segment_sums(counts: list[int], seed: int) -> None:
    """Prefix-sum differences give each consecutive segment's sum, empty segments included; bools count."""
    from deltasync.tensors import segment_sums

    values = torch.randint(-50, 50, (sum(counts),), generator=torch.Generator().manual_seed(seed))
    sizes = torch.tensor(counts, dtype=torch.int64)
    expected = torch.tensor([int(part.sum()) for part in values.split(counts)], dtype=torch.int64)
    assert torch.equal(segment_sums(values, sizes), expected)
    assert torch.equal(segment_sums(values > 0, sizes),
                       torch.tensor([int((part > 0).sum()) for part in values.split(counts)], dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D"):
        segment_sums(values.view(-1, 1), sizes)


def test_host_ints_reads_counts_and_lists_back_in_order_one_copy_per_device() -> None:
    """Ints pass through, one-element tensors become ints, and each tensor of ``lists`` follows with all of its
    elements, in order: what a read-back gathers from the device in one copy."""
    from deltasync.tensors import host_ints
    from tests.dispatch_helpers import recorded_ops

    values = [3, torch.tensor(7), torch.tensor([9]), 0, torch.tensor(-2)]
    lists = [torch.tensor([1, 2, 3]), torch.zeros(0, dtype=torch.int64), torch.tensor([[4], [5]])]
    with recorded_ops() as ops:
        got = host_ints(values, lists)
    assert got == [3, 7, 9, 0, -2, 1, 2, 3, 4, 5]
    assert ops.count("aten.cat") == 1  # one buffer for the device, copied back once
    assert host_ints([1, 2]) == [1, 2] and host_ints([], [torch.tensor([6])]) == [6]
