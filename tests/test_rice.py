"""``exp-rice`` against docs/FORMAT.md: a reader and a writer written from the text, bit for bit, and hostile streams.

The reference functions below follow the specification step by step, in plain
Python (no numpy kernels, no shared helpers), so a kernel that drifts from the
text fails here even where it would still round-trip with itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.codec import Encoded, get_codec, kernels
from deltasync.codec.compact import sign_values
from deltasync.errors import CodecError, IntegrityError
from deltasync.tensors import TensorChange, TensorSpec

CODEC = get_codec("exp-rice")
WIDTHS = {"BF16": (2, np.int16), "F16": (2, np.int16), "F32": (4, np.int32)}


# ------------------------------------------------------------------------------------- the text, in Python


def classes(base: list[int], width: int) -> list[int]:
    """Step 1: the byte above the mantissa of each base bit pattern (never the sign)."""
    shift = 7 if width == 2 else 23
    return [(o >> shift) & 0xFF for o in base]


def rice(value: int, k: int) -> list[int]:
    """``value >> k`` one bits, a zero bit, then the ``k`` low bits of ``value``, least significant first."""
    return [1] * (value >> k) + [0] + [(value >> i) & 1 for i in range(k)]


def fixed(value: int, size: int) -> list[int]:
    return [(value >> i) & 1 for i in range(size)]


def to_bytes(bits: list[int]) -> bytes:
    """Bit ``i`` is bit ``i % 8`` of byte ``i // 8``; the last byte is padded with zero bits."""
    out = bytearray((len(bits) + 7) // 8)
    for i, bit in enumerate(bits):
        out[i // 8] |= bit << (i % 8)
    return bytes(out)


def best_rice(values: list[int], kmax: int) -> tuple[int, int]:
    """(bits, k) of the cheapest Rice parameter up to ``kmax``, the smallest on a tie."""
    return min((sum((v >> k) + 1 + k for v in values), k) for k in range(kmax + 1))


def write(base: list[int], changes: dict[int, int], width: int) -> tuple[bytes, bytes]:
    """The reference writer's two streams for ``changes`` (index -> new bit pattern) against ``base``."""
    mask = (1 << 8 * width) - 1
    cls = classes(base, width)
    idx_bits: list[int] = []
    val_bits: list[int] = []
    for c in range(256):
        members = [x for x in range(len(base)) if cls[x] == c]  # index order: position j is members[j]
        if not members:
            continue
        changed = [j for j, x in enumerate(members) if x in changes]
        if not changed or len(changed) == len(members):
            idx_bits += fixed(0 if not changed else 1, 8)
        else:
            unchanged = 2 * len(changed) > len(members)
            listed = [j for j in range(len(members)) if j not in changed] if unchanged else changed
            gaps = [b - a - 1 for a, b in zip([-1, *listed], [*listed, len(members)])]
            _, k = best_rice(gaps, max(gaps).bit_length())
            idx_bits += fixed((3 if unchanged else 2) | k << 2, 8)
            for gap in gaps:
                idx_bits += rice(gap, k)
        if not changed:
            continue
        words = []
        for j in changed:
            old, new = base[members[j]], changes[members[j]]
            d = (new - old) & mask
            d = d - (mask + 1) if d >> (8 * width - 1) else d  # signed
            z = ((d << 1) ^ (d >> (8 * width - 1))) & mask
            words.append((z - 1) & mask)
        size = max(words).bit_length()
        bits, k = best_rice(words, min(size, 8 * width))
        if size * len(words) <= bits:
            val_bits += fixed(64 + size, 8)
            for w in words:
                val_bits += fixed(w, size)
        else:
            val_bits += fixed(k, 8)
            for w in words:
                val_bits += rice(w, k)
    return to_bytes(idx_bits), to_bytes(val_bits)


class Bits:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def read(self, count: int) -> int:
        value = 0
        for i in range(count):
            if self.at >= 8 * len(self.data):
                raise ValueError("past the end")
            value |= ((self.data[self.at // 8] >> (self.at % 8)) & 1) << i
            self.at += 1
        return value

    def rice(self, k: int) -> int:
        q = 0
        while self.read(1):
            q += 1
        return q << k | self.read(k)

    def finish(self) -> None:
        if len(self.data) * 8 - self.at >= 8 or any(self.read(1) for _ in range(len(self.data) * 8 - self.at)):
            raise ValueError("trailing bits")


def read(base: list[int], idx: bytes, val: bytes, width: int, fields: list[Any] | None = None) -> dict[int, int]:
    """The reference reader: index -> new bit pattern (and each class's fields, into ``fields``)."""
    fields = [] if fields is None else fields
    mask = (1 << 8 * width) - 1
    cls = classes(base, width)
    idx_bits, val_bits = Bits(idx), Bits(val)
    out: dict[int, int] = {}
    for c in range(256):
        members = [x for x in range(len(base)) if cls[x] == c]
        if not members:
            continue
        field = idx_bits.read(8)
        mode, k = field & 3, field >> 2
        fields.append(("idx", c, mode))
        if mode < 2:
            changed = list(range(len(members))) if mode == 1 else []
        else:
            listed, p = [], -1
            while True:
                p += idx_bits.rice(k) + 1
                if p == len(members):
                    break
                listed.append(p)
            changed = [j for j in range(len(members)) if (j in listed) == (mode == 2)]
        if not changed:
            continue
        field = val_bits.read(8)
        fields.append(("val", c, "rice" if field < 64 else field - 64))
        for j in changed:
            w = val_bits.read(field - 64) if field >= 64 else val_bits.rice(field)
            z = (w + 1) & mask
            d = (z >> 1) ^ -(z & 1)
            out[members[j]] = (base[members[j]] + d) & mask
    idx_bits.finish()
    val_bits.finish()
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------------------ cases


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, np.ndarray, np.ndarray]:
    """(dtype, base, target): few exponent classes, densities from none to all, steps from one unit to wide."""
    dtype = draw(st.sampled_from(sorted(WIDTHS)))
    width, bits = WIDTHS[dtype]
    numel = draw(st.integers(1, 600))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shift = 7 if width == 2 else 23
    exps = rng.choice(rng.integers(0, 256, 6), numel)
    mant = rng.integers(0, 1 << shift, numel)
    sign = rng.integers(0, 2, numel) << (8 * width - 1)
    base = ((exps << shift) | mant | sign).astype(np.uint64).astype(np.uint16 if width == 2 else np.uint32)
    density = draw(st.sampled_from([0.0, 0.01, 0.3, 0.7, 1.0]))
    hit = rng.random(numel) < density
    hit[rng.integers(0, numel)] = True
    spread = draw(st.sampled_from([1, 3, 1000, 1 << (8 * width - 1)]))
    steps = rng.integers(1, spread + 1, numel) * rng.choice([-1, 1], numel)
    target = ((base.astype(np.int64) + np.where(hit, steps, 0)) & ((1 << 8 * width) - 1)).astype(base.dtype)
    return dtype, base.view(bits), target.view(bits)


def change_of(dtype: str, base: np.ndarray, target: np.ndarray) -> TensorChange:
    indices = np.nonzero(base != target)[0].astype(np.int64)
    spec = TensorSpec("w", (base.size,), dtype)
    return TensorChange(spec, torch.from_numpy(indices), torch.from_numpy(target[indices]),
                        torch.from_numpy(base[indices]), indices.size, torch.from_numpy(base.copy()))


def unsigned(a: np.ndarray) -> list[int]:
    return [int(v) for v in a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)]


def rice_encoded(change: TensorChange) -> Encoded:
    """``change`` with both streams Rice-coded, whichever is smaller (the codec may pick zstd for either)."""
    base = change.whole_base.numpy()
    width = base.dtype.itemsize
    starts = kernels.class_starts(base)
    order = np.argsort(kernels.exponent_ranks(base, change.indices.numpy(), starts), kind="stable")
    ranks = np.sort(kernels.exponent_ranks(base, change.indices.numpy(), starts))
    mask = (1 << 8 * width) - 1
    steps = (change.values.numpy().astype(np.int64) - change.base.numpy().astype(np.int64))[order] & mask
    steps = np.where(steps >> (8 * width - 1), steps - mask - 1, steps)  # signed
    words = (((steps << 1) ^ (steps >> 63)) - 1) & mask
    params: dict[str, Any] = {}
    sign_values(params, change.values.numpy())
    return Encoded(
        parts={
            "idx": torch.from_numpy(kernels.rice_rank_stream(ranks, starts)),
            "val": torch.from_numpy(kernels.rice_word_stream(words, np.diff(np.searchsorted(ranks, starts)), 8 * width)),
        },
        params=params,
    )


def decoded_by_the_codec(encoded: Encoded, change: TensorChange, base: np.ndarray) -> dict[int, int]:
    got = CODEC.decode(encoded.parts, encoded.params, change.spec, change.nnz, lambda n, at: base[at])
    return dict(zip(got.indices.tolist(), unsigned(got.values)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_streams_are_the_texts_bit_for_bit_and_read_back_by_it(case: tuple[str, np.ndarray, np.ndarray]) -> None:
    dtype, base, target = case
    width = WIDTHS[dtype][0]
    change = change_of(dtype, base, target)
    new = {int(i): v for i, v in zip(change.indices, unsigned(target[change.indices.numpy()]))}
    idx, val = write(unsigned(base), new, width)
    rice = rice_encoded(change)
    assert bytes(rice.parts["idx"].numpy()) == idx
    assert bytes(rice.parts["val"].numpy()) == val
    assert read(unsigned(base), idx, val, width) == new
    assert decoded_by_the_codec(rice, change, base) == new


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_each_stream_is_the_smaller_of_rice_and_zstd(case: tuple[str, np.ndarray, np.ndarray]) -> None:
    """Per tensor and stream the writer keeps whichever coding is smaller, and says so in ``iz`` / ``vz``."""
    dtype, base, target = case
    change = change_of(dtype, base, target)
    encoded, rice, zstd = CODEC.encode(change, level=1), rice_encoded(change), get_codec("compact-exp").encode(
        change, level=1)
    for part, flag in (("idx", "iz"), ("val", "vz")):
        sizes = {"rice": rice.parts[part].numel(), "zstd": zstd.parts[part].numel()}
        chosen = "zstd" if encoded.params.get(flag) else "rice"
        assert torch.equal(encoded.parts[part], (zstd if chosen == "zstd" else rice).parts[part])
        assert sizes[chosen] == min(sizes.values()) and (chosen == "rice" or sizes["zstd"] < sizes["rice"])
    if encoded.params.get("iz"):
        assert {k: encoded.params[k] for k in ("iw", "big")} == {k: zstd.params[k] for k in ("iw", "big")}
    assert decoded_by_the_codec(encoded, change, base) == {
        int(i): v for i, v in zip(change.indices, unsigned(target[change.indices.numpy()]))}


def test_steps_of_one_size_per_class_go_to_zstd() -> None:
    """A first optimizer step moves every weight of a class by the same number of units: zstd codes the
    repeats in fewer bytes than any Rice parameter; both flags decode."""
    base = np.repeat(np.array([0x3F00, 0x3A00], dtype=np.int16), 4096) + np.tile(np.arange(64, dtype=np.int16), 128)
    target = base + np.where(np.arange(8192) % 2, 37, -37).astype(np.int16)
    change = change_of("BF16", base, target)
    encoded = CODEC.encode(change, level=1)
    assert encoded.params.get("vz") == 1
    assert decoded_by_the_codec(encoded, change, base) == dict(zip(range(8192), unsigned(target)))


@pytest.mark.parametrize("flag", ["iz", "vz"])
@pytest.mark.parametrize("value", [2, -1, "1", True, 1.0, None])
def test_a_stream_flag_other_than_0_or_1_is_a_codec_error(flag: str, value: Any) -> None:
    encoded, change, base = _encoded()
    with pytest.raises(CodecError, match=f"param '{flag}' must be 0 or 1"):
        CODEC.decode(encoded.parts, {**encoded.params, flag: value}, change.spec, change.nnz, lambda n, at: base[at])


def test_every_class_field_occurs() -> None:
    """Classes unchanged, whole, listed by their changes and by the rest; steps of one unit down (no bits at
    all), one unit up (one bit each), varied (Rice-coded) and wide (fixed width)."""
    base = np.repeat(np.array([0x3F00, 0x3E00, 0x3D00, 0x3C00, 0x3B00], dtype=np.int16), 64)
    base += np.tile(np.arange(64, dtype=np.int16), 5)
    target = base.copy()
    target[64:128] += 1  # class 0x7C: every element, one unit up
    target[128:192:9] -= 1  # 0x7A: a few, one unit down
    target[192:256] += np.array([0, 1, -1, 2, -2, 5, -9, 30] * 8, dtype=np.int16)  # 0x78: most, varied
    target[256:320:5] += 1000  # 0x76: a few, one wide step
    change = change_of("BF16", base, target)
    encoded = rice_encoded(change)
    fields: list[Any] = []
    new = read(unsigned(base), bytes(encoded.parts["idx"].numpy()), bytes(encoded.parts["val"].numpy()), 2, fields)
    assert fields == [
        ("idx", 0x76, 2), ("val", 0x76, 11),  # zigzag(1000) - 1 = 1999: eleven bits
        ("idx", 0x78, 3), ("val", 0x78, "rice"),
        ("idx", 0x7A, 2), ("val", 0x7A, 0),
        ("idx", 0x7C, 1), ("val", 0x7C, 1),
        ("idx", 0x7E, 0),
    ]
    decoded = CODEC.decode(encoded.parts, encoded.params, change.spec, change.nnz, lambda n, at: base[at])
    assert decoded.indices.tolist() == list(new) and unsigned(decoded.values) == list(new.values())


def test_a_pair_that_changes_nothing_is_accepted() -> None:
    """A reader must accept a change whose new value equals the base (FORMAT.md, "Unchanged elements")."""
    base = np.arange(1000, dtype=np.int16) + 0x3F00
    target = base.copy()
    target[::50] += 1
    change = change_of("BF16", base, target)
    indices = np.r_[change.indices.numpy(), 999]
    values = np.r_[target[change.indices.numpy()], base[999]]  # element 999 "changes" to what it holds
    same = TensorChange(change.spec, torch.from_numpy(indices), torch.from_numpy(values),
                        torch.from_numpy(base[indices]), indices.size, change.whole_base)
    encoded = rice_encoded(same)
    decoded = CODEC.decode(encoded.parts, encoded.params, same.spec, same.nnz, lambda n, at: base[at])
    np.testing.assert_array_equal(decoded.indices, indices)
    np.testing.assert_array_equal(decoded.values, values)


def _encoded() -> tuple[Any, TensorChange, np.ndarray]:
    rng = np.random.default_rng(3)
    base = (rng.integers(0x3C00, 0x3F00, 4000)).astype(np.int16)
    target = base.copy()
    hit = rng.choice(4000, 300, replace=False)
    target[hit] += rng.integers(1, 40, 300).astype(np.int16)
    change = change_of("BF16", base, target)
    return rice_encoded(change), change, base


@pytest.mark.parametrize(
    ("part", "edit", "problem"),
    [
        ("idx", lambda b: b[:-1], "past the end|does not list"),
        ("idx", lambda b: b + b"\0", "follow its last code"),
        ("idx", lambda b: b[:1], "past the end"),
        ("idx", lambda b: bytes([0x05]) + b[1:], "out of range"),  # "every element changed" with a parameter
        ("val", lambda b: b[:-1], "past the end"),
        ("val", lambda b: b + b"\0", "follow its last code"),
        ("val", lambda b: bytes([200]) + b[1:], "out of range"),
        ("val", lambda b: b"\xff" * len(b), "out of range|past the end"),
        ("idx", lambda b: b"", "past the end"),
    ],
)
def test_a_malformed_stream_is_a_codec_error(part: str, edit: Any, problem: str) -> None:
    encoded, change, base = _encoded()
    parts = dict(encoded.parts)
    parts[part] = torch.tensor(list(edit(bytes(parts[part].numpy()))), dtype=torch.uint8)
    with pytest.raises((CodecError, IntegrityError), match=problem):
        CODEC.decode(parts, encoded.params, change.spec, change.nnz, lambda n, at: base[at])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_bytes_never_escape_as_anything_but_typed_errors(data: st.DataObject) -> None:
    encoded, change, base = _encoded()
    parts = dict(encoded.parts)
    part = data.draw(st.sampled_from(["idx", "val"]))
    raw = bytearray(parts[part].numpy().tobytes())
    for _ in range(data.draw(st.integers(1, 6))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    parts[part] = torch.tensor(list(raw), dtype=torch.uint8)
    nnz = data.draw(st.sampled_from([change.nnz, change.nnz - 1, change.nnz + 1, 0]))
    try:
        decoded = CODEC.decode(parts, encoded.params, change.spec, nnz, lambda n, at: base[at])
    except (CodecError, IntegrityError):
        return
    np.testing.assert_array_equal(decoded.indices, change.indices.numpy())  # only the original survives the digest


def test_it_needs_the_receivers_values() -> None:
    encoded, change, _ = _encoded()
    with pytest.raises(CodecError, match="needs the receiver's current values"):
        CODEC.decode(encoded.parts, encoded.params, change.spec, change.nnz, None)


def test_the_worked_example_of_the_text() -> None:
    """docs/FORMAT.md, ``exp-rice``: the streams of its worked example, byte for byte."""
    base = np.array([0x3F80, 0x3F81, 0x3F00, 0x3F82, 0x3F83, 0x3F01, 0x3F84, 0x3F85], dtype=np.uint16).view(np.int16)
    target = base.copy()
    target[[2, 0, 3, 4, 7]] += np.array([1, -1, 1, 1, 3], dtype=np.int16)
    change = change_of("BF16", base, target)
    encoded = CODEC.encode(change, level=1)
    assert bytes(encoded.parts["idx"].numpy()) == bytes.fromhex("021a6801")
    assert bytes(encoded.parts["val"].numpy()) == bytes.fromhex("4103d005")
    assert "iz" not in encoded.params and "vz" not in encoded.params
    assert read(unsigned(base), bytes.fromhex("021a6801"), bytes.fromhex("4103d005"), 2) == dict(
        zip([0, 2, 3, 4, 7], unsigned(target[[0, 2, 3, 4, 7]])))
