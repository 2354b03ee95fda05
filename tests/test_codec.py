"""Round trips through every codec, proven with hypothesis, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.appliers import TorchModuleApplier
from deltasync.codec import codec_names, get_codec, register_codec
from deltasync.diff import Snapshot, diff
from deltasync.format import decode, encode_anchor, encode_delta

SPARSE_CODECS = ["compact", "compact-abs", "raw"]
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
