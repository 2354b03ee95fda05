"""Build the conformance suite: small golden stores, broken copies of one, and what a reader must get from each.

    python conformance/build.py                          # rewrites conformance/golden and conformance/broken
    python conformance/build.py shapes-bf16-exp-rice     # (re)builds one golden case, keeping the others
    python conformance/build.py schema-below-digests     # (re)builds one broken copy of a kept golden case

The stores are written through the public API (``Publisher``) from weights
edited bit by bit, so every feature a reader must handle appears on purpose:
each codec, BF16 / F16 / F32, a block-fp8 view (F8_E4M3 with F32 scales), 1- and 2-byte index gaps with escapes, tensors
changed densely, NaN payloads, infinities and signed zeros, 0-d to 4-D, odd
and zero-element tensors, a non-ASCII name, multi-part anchors, retired
anchors, and a version carried by two trainer ranks. Each case directory holds
``store/`` (a run prefix as an object store holds it) and ``case.json``:

- ``model``: every tensor's name, shape and dtype (what the reader holds);
- ``fingerprint``: the model fingerprint computed from ``model``;
- ``versions``: per reachable version, per tensor, the SHA-256 of its bytes
  (row-major, little-endian, in its dtype) once the reader holds that version;
- broken cases add ``refuse``: the version the reader must refuse and the
  error class (the ``deltasync.errors`` name) it corresponds to.

The committed stores are the reference: a rebuild writes new run ids, keys
and times, so it replaces the suite rather than reproducing it byte for byte.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

sys.path.insert(0, str(ROOT))

from check import digests  # noqa: E402

from deltasync import Publisher  # noqa: E402
from deltasync.control import rollback  # noqa: E402
from deltasync.format import header_ref, raw_header, read_header  # noqa: E402
from deltasync.format.digests import hasher, hexdigest  # noqa: E402
from deltasync.format.layout import pack  # noqa: E402
from deltasync.publish.fp8 import BlockFp8View  # noqa: E402
from deltasync.tensors import TensorSpec, bits_view, fingerprint  # noqa: E402
from deltasync.tensors.fp8 import BlockFp8, quantize_all  # noqa: E402

Weights = dict[str, torch.Tensor]
BF16_NAN_PAYLOADS = (0x7FC1, 0xFFA5, 0x7F81)  # quiet with payload, negative quiet, signalling


def model_of(weights: Weights) -> list[dict[str, Any]]:
    specs = [TensorSpec.of(n, t, None) for n, t in sorted(weights.items())]
    return [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in specs]


def set_bits(tensor: torch.Tensor, flat: Any, bits: Any) -> None:
    """Write raw bit patterns at flat positions (the tensor keeps its dtype; NaN payloads survive)."""
    view = bits_view(tensor).view(-1)
    unsigned = {2: np.uint16, 4: np.uint32}[view.element_size()]
    signed = np.asarray(bits, dtype=unsigned).view(view.numpy().dtype)  # 0xFFA5 as the int16 it is
    view[torch.as_tensor(flat)] = torch.from_numpy(signed.copy())


def nudge(tensor: torch.Tensor, flat: Any) -> None:
    """Move the elements at ``flat`` by one unit in the last place (their bit pattern + 1)."""
    view = bits_view(tensor).view(-1)
    where = torch.as_tensor(flat)
    view[where] = view[where] + 1


# ---------------------------------------------------------------------------------------------- models


def shapes_model(dtype: torch.dtype = torch.bfloat16) -> Weights:
    """Every shape a reader must handle, in one dtype."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "scalar": (),
        "odd.vector": (1023,),
        "matrix": (33, 65),
        "cube": (3, 5, 7),
        "hyper": (2, 3, 4, 5),
        "empty": (0, 4),
        "层.权重": (17,),
        "big": (150_000,),
    }
    return {name: (torch.randn(shape, generator=g) * 0.05).to(dtype) for name, shape in shapes.items()}


def shapes_steps(weights: Weights) -> list[Callable[[], None]]:
    """Edits, one per version after the anchor, that exercise gap widths, escapes, dense and special values."""
    big = weights["big"]

    def v1() -> None:  # runs of neighbours: 1-byte gaps; every tensor moves
        nudge(weights["odd.vector"], range(0, 1023, 3))
        nudge(weights["matrix"], [0, 64, 65, 2144])
        nudge(weights["cube"], [1, 2, 104])
        nudge(weights["hyper"], [0, 119])
        nudge(weights["scalar"], [0])
        nudge(weights["层.权重"], [16])
        nudge(big, range(7, 5000, 11))

    def v2() -> None:  # special values, and gaps of ~1000: 2-byte widths
        set_bits(big, [10, 20, 30], BF16_NAN_PAYLOADS)
        set_bits(big, [40, 50], [0x7F80, 0xFF80])  # +inf, -inf
        set_bits(big, [60, 70], [0x8000, 0x0000])  # -0.0, +0.0
        nudge(big, range(1000, 150_000, 997))

    def v3() -> None:  # small gaps with a few large ones: 1-byte width with escapes; a dense tensor
        nudge(big, [*range(100, 1100, 5), 40_000, 40_001, 90_000, 149_999])
        nudge(weights["matrix"], range(0, 33 * 65, 2))  # half of it: carried whole
        set_bits(big, [60, 70], [0x0000, 0x8000])  # signed zeros swap

    def v4() -> None:  # gaps up to ~2000 with one above 65534: 2-byte width with one escape
        nudge(big, [*range(0, 60_000, 1999), 140_000])
        set_bits(big, [10], [0x7FC2])  # a NaN payload changes

    def v5() -> None:  # three changes 70,000 apart: 4-byte gaps
        nudge(big, [0, 70_000, 140_001])
        nudge(weights["层.权重"], range(17))
        nudge(weights["odd.vector"], [1022])

    return [v1, v2, v3, v4, v5]


def dtypes_model() -> Weights:
    g = torch.Generator().manual_seed(1)
    return {
        "half.weight": (torch.randn(40, 30, generator=g) * 0.05).to(torch.float16),
        "half.odd": (torch.randn(777, generator=g)).to(torch.float16),
        "single.weight": torch.randn(20, 50, generator=g) * 0.05,
        "single.scalar": torch.tensor(1.5),
        "brain.weight": (torch.randn(64, 16, generator=g) * 0.05).to(torch.bfloat16),
    }


def dtypes_steps(weights: Weights) -> list[Callable[[], None]]:
    def v1() -> None:
        nudge(weights["half.weight"], range(0, 1200, 7))
        nudge(weights["half.odd"], [0, 776])
        nudge(weights["single.weight"], range(3, 1000, 13))
        nudge(weights["brain.weight"], [5, 6, 7, 500])

    def v2() -> None:
        set_bits(weights["half.odd"], [1, 2, 3], [0x7E01, 0xFC00, 0x8000])  # F16 NaN payload, -inf, -0.0
        set_bits(weights["single.weight"], [0, 1], [0x7FC00123, 0xFF800000])  # F32 NaN payload, -inf
        nudge(weights["single.scalar"], [0])

    def v3() -> None:
        nudge(weights["half.weight"], range(0, 1200, 2))  # dense
        nudge(weights["single.weight"], [999])

    return [v1, v2, v3]


# ---------------------------------------------------------------------------------------------- runs


def run(
    root: Path, weights: Weights, steps: list[Callable[[], None]], **options: Any
) -> dict[str, dict[str, str]]:
    """Publish v0 and one version per step into ``root/store``; return each version's digests."""
    expected = {}
    with Publisher(weights, str(root / "store"), dtype=None, lease_s=1.0, **options) as publisher:
        publisher.publish(0, block=True)
        publisher.flush()
        expected[str(publisher.version)] = digests(weights)
        for step, edit in enumerate(steps, start=1):
            edit()
            publisher.publish(step, block=True)
            publisher.flush()
            expected[str(publisher.version)] = digests(weights)
    return expected


def write_case(root: Path, weights: Weights, versions: dict[str, dict[str, str]], **extra: Any) -> None:
    model = model_of(weights)
    specs = [TensorSpec(m["name"], tuple(m["shape"]), m["dtype"]) for m in model]
    case = {"model": model, "fingerprint": fingerprint(specs), "store": "store", "versions": versions, **extra}
    (root / "case.json").write_text(json.dumps(case, indent=1, ensure_ascii=False) + "\n")
    for junk in (root / "store").rglob(".*"):  # the writer's local temporaries, if any
        if junk.is_file():
            junk.unlink()
    acks = root / "store" / "acks"
    if acks.exists():
        shutil.rmtree(acks)


def shapes_case(codec: str) -> Callable[[Path], None]:
    def build(root: Path) -> None:
        weights = shapes_model()
        write_case(root, weights, run(root, weights, shapes_steps(weights), codec=codec, anchor_every=1000))

    return build


def dtypes_case(root: Path) -> None:
    weights = dtypes_model()
    write_case(root, weights, run(root, weights, dtypes_steps(weights), anchor_every=1000))


def multipart_retired_case(root: Path) -> None:
    """Anchors in several files, one every two versions, the two newest kept: older ones are retired."""
    weights = shapes_model()
    versions = run(root, weights, shapes_steps(weights), anchor_every=2, keep_anchors=2, part_bytes=64 << 10)
    manifest = json.loads((root / "store" / "manifest.json").read_text())
    first_anchor = min(v["version"] for v in manifest["versions"] if v.get("anchor"))
    write_case(root, weights, {v: d for v, d in versions.items() if int(v) >= first_anchor})


def golden_cases() -> dict[str, Callable[[Path], None]]:
    """Every golden case by name, with what builds it."""
    return {
        **{f"shapes-bf16-{codec}": shapes_case(codec)
           for codec in ("compact", "compact-abs", "compact-exp", "exp-rice", "raw")},
        "dtypes-f16-f32-compact": dtypes_case,
        "anchors-multipart-retired": multipart_retired_case,
        "sharded-2-ranks": sharded,
        "format-2-blake3": blake3_case,
        "format-3-value-blake3": blake3_case,
        "anchors-by-entries": by_entries_case,
        "format-4-packed": packed_case,
        "format-4-table-checksum": packed_case,
        "spans-schema-4": spans_case,
        "fp8-block-compact": fp8_case("compact", BlockFp8()),
        "fp8-block-raw": fp8_case("raw", BlockFp8((16, 16))),
    }


FROZEN = {  # written by earlier writers and kept as they are: what was written stays readable
    1: ("shapes-bf16-compact", "shapes-bf16-compact-abs", "shapes-bf16-compact-exp", "shapes-bf16-raw",
        "dtypes-f16-f32-compact", "anchors-multipart-retired", "sharded-2-ranks"),  # SHA-256 digests
    2: ("format-2-blake3",),  # BLAKE3 digests for objects, headers and entries; BLAKE2b value digests
    3: ("format-3-value-blake3", "shapes-bf16-exp-rice",  # manifest schema 2: anchors by whole-object BLAKE3
        "anchors-by-entries"),  # manifest schema 3, deltas with the plain header
    4: ("format-4-packed",),  # packed tables without a content checksum
}


def blake3_case(root: Path) -> None:
    """BLAKE3 digests for objects, headers and entries (and, from format 3, values); anchors in two parts."""
    weights = shapes_model()
    write_case(root, weights, run(root, weights, shapes_steps(weights), anchor_every=1000, part_bytes=64 << 10))


def by_entries_case(root: Path) -> None:
    """Manifest schema 3: anchors (in parts, one every two versions) referenced by their headers' digests
    (``blake3-entries``), deltas by whole-object BLAKE3."""
    weights = dtypes_model()
    write_case(root, weights, run(root, weights, dtypes_steps(weights), anchor_every=2, part_bytes=4 << 10))


def spans_case(root: Path) -> None:
    """Manifest schema 4: catch-up spans up to 4 versions long beside the chain of the F16 / F32 / BF16 model's
    versions, with elements that change in several of the versions a span covers."""
    weights = dtypes_model()
    steps = dtypes_steps(weights)
    for k in range(5):
        steps.append(lambda k=k: (nudge(weights["half.weight"], range(k * 5, 1200, 31)),
                                  nudge(weights["brain.weight"], range(k, 1024, 97)),
                                  nudge(weights["single.weight"], [k, 999 - k])))
    versions = run(root, weights, steps, anchor_every=1000, max_span=4)
    done = rollback(str(root / "store"), 6, step=9)  # v9 restores v6: an ordinary delta, marked
    versions[str(done.version)] = versions["6"]
    write_case(root, weights, versions)
    manifest = json.loads((root / "store" / "manifest.json").read_text())
    assert manifest["schema"] == 4 and len(manifest["versions"][8].get("spans", [])) > 1  # the broken copies' span
    assert manifest["versions"][9]["restores"] == 6


def broken_spans(out: Path, source: Path, only: tuple[str, ...] | None = None) -> None:
    """Copies of the spans case with version 8's longest span damaged: the chain stays good, so the walk reaches
    version 8 and refuses its span; or the manifest lists a span no reader may take, refused as a whole."""
    case = json.loads((source / "case.json").read_text())
    manifest = json.loads((source / "store" / "manifest.json").read_text())
    entry = next(v for v in manifest["versions"] if v["version"] == 8)
    longest = entry["spans"][-1]
    key = longest["objects"][0]["key"]

    def make(name: str, error: str, why: str, fault: Callable[[Path], None], *, version: int = 8,
             span_from: int | None = longest["from"]) -> None:
        if only is None or name in only:
            copy_broken(out / name, source, case, fault, version=version, error=error, why=why,
                        versions=9 if version == 8 else None, span_from=span_from)

    def edit(store: Path, change: Callable[[dict[str, Any]], None]) -> None:
        stored = json.loads((store / "manifest.json").read_text())
        change(next(v for v in stored["versions"] if v["version"] == 8))
        (store / "manifest.json").write_text(json.dumps(stored, indent=1, ensure_ascii=False))

    def flip(store: Path) -> None:
        data = bytearray((store / key).read_bytes())
        data[-5] ^= 0x01
        (store / key).write_bytes(bytes(data))

    def other_base(store: Path) -> None:
        edit(store, lambda v: v["spans"][-1].update({"from": longest["from"] + 1}))

    def restores_previous(store: Path) -> None:
        stored = json.loads((store / "manifest.json").read_text())
        stored["versions"][9]["restores"] = 8
        (store / "manifest.json").write_text(json.dumps(stored, indent=1, ensure_ascii=False))

    def from_previous(store: Path) -> None:
        delta = dict(entry["delta"][0], key=entry["delta"][0]["key"].replace("deltas/", "spans/", 1))
        (store / delta["key"]).parent.mkdir(exist_ok=True)
        (store / delta["key"]).write_bytes((store / entry["delta"][0]["key"]).read_bytes())
        edit(store, lambda v: v["spans"].insert(0, {"from": 7, "objects": [delta]}))

    make("span-flipped-byte", "IntegrityError", "one byte of version 8's longest span differs from the manifest's "
         "digest; the chain is intact", flip)
    make("span-other-base", "VersionError", "the manifest lists version 8's longest span one version later than "
         "the base its files name", other_base, span_from=longest["from"] + 1)
    make("restores-previous", "ManifestError", "version 9 says it restores version 8, the one before it (a "
         "rollback restores a version at least two back)", restores_previous, version=-1, span_from=None)
    make("span-from-previous", "ManifestError", "version 8 lists a span from version 7 (a span starts at least "
         "two versions back), a copy of its own delta under a key of its own", from_previous, version=-1,
         span_from=None)


def fp8_model(rule: BlockFp8) -> Weights:
    """A bf16 model of which two tensors are published in block fp8: one with edge blocks on both axes (a block
    and a half by two and a third) and one that starts all zero; a vector stays bf16."""
    g = torch.Generator().manual_seed(2)
    rows, cols = rule.block
    return {
        "proj.weight": (torch.randn(rows * 3 // 2 + 8, cols * 7 // 3, generator=g) * 0.05).to(torch.bfloat16),
        "zero.weight": torch.zeros(rows + 2, cols // 2, dtype=torch.bfloat16),
        "norm.weight": torch.ones(cols * 7 // 3, dtype=torch.bfloat16),
    }


FP8_NAMES = ("proj.weight", "zero.weight")


def fp8_steps(weights: Weights, rule: BlockFp8) -> list[Callable[[], None]]:
    proj = weights["proj.weight"]
    rows, cols = rule.block

    def v1() -> None:  # a few elements move an ulp: most fp8 bytes stay, some cross a rounding boundary
        nudge(proj, range(0, proj.numel(), 61))
        nudge(weights["norm.weight"], [0, weights["norm.weight"].numel() - 1])

    def v2() -> None:  # one block's largest element doubles: its scale and every element move
        with torch.no_grad():
            block = proj[:rows, cols : 2 * cols]
            row, col = divmod(int(block.abs().argmax()), block.shape[1])
            block[row, col] *= 2

    def v3() -> None:  # the all-zero tensor gets values in one block (scale 1.0 -> amax / 448); an edge block zeroes
        with torch.no_grad():
            weights["zero.weight"][rows:, :] = 0.25
            proj[rows:, 2 * cols :] = 0

    return [v1, v2, v3]


def fp8_case(codec: str, rule: BlockFp8) -> Callable[[Path], None]:
    def build(root: Path) -> None:
        """A block-fp8 view published from bf16 weights: the reader holds e4m3 tensors and their float32 scales,
        and must end bit-identical to the reference quantizer's output of each version's weights."""
        weights = fp8_model(rule)
        expected = {}
        view = BlockFp8View(weights, rule, names=FP8_NAMES)
        with Publisher(view, str(root / "store"), lease_s=1.0, codec=codec, anchor_every=1000,
                       anchor_ratio=100.0, max_span=0) as publisher:  # one anchor: every version by its delta
            for step, edit in enumerate([lambda: None, *fp8_steps(weights, rule)]):
                edit()
                publisher.publish(step, block=True)
                publisher.flush()
                expected[str(publisher.version)] = digests(quantize_all(weights, FP8_NAMES, rule))
        write_case(root, quantize_all(weights, FP8_NAMES, rule), expected)

    return build


def broken_fp8(out: Path, source: Path, only: tuple[str, ...] | None = None) -> None:
    """Copies of the ``raw`` fp8 case with one value of version 2's delta forged and its entry digest and object
    digest recomputed: only the reader's checks of the fp8 view's values can refuse them."""
    case = json.loads((source / "case.json").read_text())
    manifest = json.loads((source / "store" / "manifest.json").read_text())
    key = next(v["delta"][0]["key"] for v in manifest["versions"] if v["version"] == 2)

    def make(name: str, why: str, tensor: str, value: bytes) -> None:
        if only is not None and name not in only:
            return

        def fault(store: Path) -> None:
            data = bytearray((store / key).read_bytes())
            start, _ = _entry_range(bytes(data), f"{tensor}::val")
            data[start : start + len(value)] = value
            (store / key).write_bytes(_set_entry_digest(bytes(data), tensor))
            _rehash(store, key)

        copy_broken(out / name, source, case, fault, version=2, error="CodecError", why=why)

    make("fp8-nan-value", "one e4m3 value of version 2 is 0x7F, a NaN no block-fp8 view holds (entry and object "
         "digests recomputed)", "proj.weight", b"\x7f")
    make("fp8-scale-zero", "one block scale of version 2 is +0.0, not a positive finite float32 (entry and object "
         "digests recomputed)", "proj.weight_scale_inv", b"\x00\x00\x00\x00")


def packed_case(root: Path) -> None:
    """Format 4: every delta with the packed header (its table with a content checksum since
    ``format-4-table-checksum``); one anchor (of three files, by their headers), so a reader reaches every
    version through the deltas."""
    weights = dtypes_model()
    write_case(root, weights, run(root, weights, dtypes_steps(weights), anchor_every=1000, part_bytes=4 << 10,
                                  max_span=0))  # spans have a case of their own


def copy_broken(
    root: Path, source: Path, case: dict[str, Any], fault: Callable[[Path], None], *, version: int, error: str,
    why: str, versions: int | None = None, span_from: int | None = None,
) -> None:
    """A copy of the case at ``source`` in ``root``, its store edited by ``fault``: the reader holds the versions
    below ``versions`` (default ``version``) and refuses ``version`` (its span from ``span_from``, when given)
    with ``error``."""
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(source / "store", root / "store")
    fault(root / "store")
    kept = {v: d for v, d in case["versions"].items() if int(v) < (version if versions is None else versions)}
    refuse: dict[str, Any] = {"version": version, "error": error, "why": why}
    if span_from is not None:
        refuse["span_from"] = span_from
    (root / "case.json").write_text(
        json.dumps({**case, "versions": kept, "refuse": refuse}, indent=1, ensure_ascii=False) + "\n"
    )


def broken_by_entries(out: Path, source: Path, only: tuple[str, ...] | None = None) -> None:
    """Copies of the ``blake3-entries`` case, its first anchor the only one, damaged where only its entries'
    digests can tell (a reader that checks the header alone would accept them), or with a malformed header
    that its digest pins; ``only`` these, by name."""
    manifest = json.loads((source / "store" / "manifest.json").read_text())
    ref = manifest["versions"][0]["anchor"][0]
    case = json.loads((source / "case.json").read_text())

    def make(name: str, why: str, fault: Callable[[Path], None]) -> None:
        if only is None or name in only:
            edit = lambda store: (only_first_anchor(store), fault(store))  # noqa: E731
            copy_broken(out / name, source, case, edit, version=0, error="IntegrityError", why=why)

    def only_first_anchor(store: Path) -> None:  # every route then starts at the damaged anchor
        edited = json.loads((store / "manifest.json").read_text())
        for version in edited["versions"][1:]:
            for later in version.pop("anchor", []):
                (store / later["key"]).unlink()
        (store / "manifest.json").write_text(json.dumps(edited, indent=1, ensure_ascii=False))

    def flip(store: Path) -> None:
        data = bytearray((store / ref["key"]).read_bytes())
        data[-3] ^= 0x01  # in the last tensor's bytes; the header and its digest are untouched
        (store / ref["key"]).write_bytes(bytes(data))

    def tail(store: Path) -> None:
        data = (store / ref["key"]).read_bytes() + bytes(8)
        (store / ref["key"]).write_bytes(data)
        edited = json.loads((store / "manifest.json").read_text())
        edited["versions"][0]["anchor"][0]["size"] = len(data)  # the size matches; no tensor covers the tail
        (store / "manifest.json").write_text(json.dumps(edited, indent=1, ensure_ascii=False))

    def malformed(store: Path) -> None:
        data = (store / ref["key"]).read_bytes()
        length = struct.unpack("<Q", data[:8])[0]
        text = data[8 : 8 + length].decode()
        assert '"format_version":"3"' in text, "the anchor's metadata was not found verbatim"
        _repin(store, 0, 0, _file(text.replace('"format_version":"3"', '"format_version":"03"', 1).rstrip(),
                                  data[8 + length :]))

    make("flipped-byte-entries", "one byte of a tensor differs from the BLAKE3 its anchor's header lists", flip)
    make("unhashed-tail-entries", "8 bytes after the last tensor, in the manifest's size but in no entry", tail)
    make("malformed-header-entries", "the anchor's header spells format_version '03' (not canonical); the "
         "manifest pins that header, so the object cannot be shown intact", malformed)


def broken_walks(out: Path, source: Path, only: tuple[str, ...] | None = None) -> None:
    """Copies of the ``blake3-entries`` case that break a rule of the store as a whole, which a reader meets as it
    walks it: a manifest that breaks a rule of its own (refused as a whole: ``refuse.version`` -1), and an anchor
    that differs from the delta of its version; ``only`` these, by name."""
    case = json.loads((source / "case.json").read_text())

    def make(name: str, version: int, error: str, why: str, fault: Callable[[Path], None]) -> None:
        if only is None or name in only:
            copy_broken(out / name, source, case, fault, version=version, error=error, why=why)

    def edit_manifest(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
        def fault(store: Path) -> None:
            manifest = json.loads((store / "manifest.json").read_text())
            edit(manifest)
            (store / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))

        return fault

    def lower_schema(manifest: dict[str, Any]) -> None:
        assert manifest["schema"] == 3
        manifest["schema"] = 2  # a schema 2 reader knows no blake3-entries digest

    def second_header_digest(manifest: dict[str, Any]) -> None:
        header = manifest["versions"][1]["delta"][0]["header"]
        header["sha256"] = header["blake3"]  # which of the two would a reader check?

    def anchor_differs(store: Path) -> None:
        manifest = json.loads((store / "manifest.json").read_text())
        entry = next(v for v in manifest["versions"] if v.get("delta") and v.get("anchor"))
        data = bytearray((store / entry["anchor"][0]["key"]).read_bytes())
        header, _ = _header(bytes(data))
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
        data[-1] ^= 0x01  # the last tensor's last byte; its entry digest, the header's and the manifest's follow
        _repin(store, entry["version"], 0, _set_entry_digest(bytes(data), last))

    make("schema-below-digests", -1, "ManifestError",
         "the manifest says schema 2 but lists blake3-entries references, which need schema 3",
         edit_manifest(lower_schema))
    make("header-digest-twice", -1, "ManifestError",
         "a header reference carries two digest keys (blake3 and sha256) where one is allowed",
         edit_manifest(second_header_digest))
    make("anchor-differs-from-delta", 2, "IntegrityError",
         "version 2 lists a delta and an anchor whose weights differ in one element; each object is intact",
         anchor_differs)


def _repin(store: Path, version: int, part: int, data: bytes) -> None:
    """Write ``data`` over anchor file ``part`` of ``version``, and make its ``blake3-entries`` reference pin it:
    size, header size and header digest."""
    manifest = json.loads((store / "manifest.json").read_text())
    ref = next(v for v in manifest["versions"] if v["version"] == version)["anchor"][part]
    (store / ref["key"]).write_bytes(data)
    size, digest = header_ref(data, "blake3")
    ref.update({"size": len(data), "blake3-entries": digest, "header": {"size": size, "blake3-entries": digest}})
    (store / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))


def broken_alone() -> dict[str, Callable[[], None]]:
    """The broken cases copied from a committed golden store that is never rebuilt, by name: each can be built
    alone (``python conformance/build.py schema-below-digests``)."""
    out, source = ROOT / "broken", ROOT / "golden" / "anchors-by-entries"
    builders = {
        **dict.fromkeys(("flipped-byte-entries", "unhashed-tail-entries", "malformed-header-entries"),
                        broken_by_entries),
        **dict.fromkeys(("schema-below-digests", "header-digest-twice", "anchor-differs-from-delta"), broken_walks),
    }
    return {name: functools.partial(build, out, source, only=(name,)) for name, build in builders.items()}


# ---------------------------------------------------------------------------------------------- sharded


def broken_packed(out: Path, source: Path, only: tuple[str, ...] | None = None) -> None:
    """Copies of a format 4 case with version 2's delta damaged inside its packed header, every hash
    recomputed: only the format's own checks can refuse them (those named in ``only``, or all)."""
    manifest = json.loads((source / "store" / "manifest.json").read_text())
    key = next(v["delta"][0]["key"] for v in manifest["versions"] if v["version"] == 2)
    case = json.loads((source / "case.json").read_text())

    def make(name: str, error: str, why: str, edit: Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes]],
             after: Callable[[dict[str, Any]], None] = lambda packed: None) -> None:
        if only is not None and name not in only:
            return
        root = out / name
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(source / "store", root / "store")
        header, body = edit(*_unpacked(source / "store" / key))
        packed = pack(header["__metadata__"], {k: v for k, v in header.items() if k != "__metadata__"})
        after(packed)
        (root / "store" / key).write_bytes(_file(json.dumps(packed, separators=(",", ":"), ensure_ascii=False), body))
        _rehash(root / "store", key)
        versions = {v: d for v, d in case["versions"].items() if int(v) < 2}
        refuse = {"version": 2, "error": error, "why": why}
        (root / "case.json").write_text(
            json.dumps({**case, "versions": versions, "refuse": refuse}, indent=1, ensure_ascii=False) + "\n"
        )

    def overlap(header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        start, stop = header[first]["data_offsets"]
        second = next(k for k in header if k != "__metadata__" and header[k]["data_offsets"][0] == stop)
        a, b = header[second]["data_offsets"]
        header[second]["data_offsets"] = [a - 1, b - 1]  # one byte in two streams, one byte in none
        return header, body

    def stray(header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        tensor = next(k for k in header if k != "__metadata__").rpartition("::")[0]
        header[f"{tensor}::extra"] = {"dtype": "U8", "shape": [4], "data_offsets": [len(body), len(body) + 4]}
        body += b"\0\1\2\3"
        return _with_entry_digest(header, body, tensor), body

    def plain_too(packed: dict[str, Any]) -> None:  # a reader taking either table must not see the other
        packed["__metadata__"]["tensors"] = json.dumps({})

    def renamed_under_the_old_checksum(packed: dict[str, Any]) -> None:
        """A tensor renamed with its streams (a valid table), the frame's checksum still the original's."""
        frame = base64.b64decode(packed["__metadata__"]["tensors_zstd"])
        table = zstandard.ZstdDecompressor().decompress(frame).decode()
        old = next(iter(json.loads(table)))
        edited = table.replace(f'"{old}"', f'"{old[:-1]}{"X" if old[-1] != "X" else "Y"}"')
        forged = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(edited.encode())[:-4] + frame[-4:]
        packed["__metadata__"]["tensors_zstd"] = base64.b64encode(forged).decode()

    make("packed-overlapping-streams", "DeltaFormatError",
         "the packed table places two streams over one byte and leaves another unclaimed", overlap)
    make("packed-stray-stream", "DeltaFormatError",
         "the packed table lists a stream its tensor's codec does not use (the entry digest covers it)", stray)
    make("packed-table-twice", "DeltaFormatError",
         "the packed header also holds a plain 'tensors' table, which a reader must not read",
         lambda header, body: (header, body), plain_too)
    make("packed-table-checksum", "DeltaFormatError",
         "the packed table names a tensor otherwise, its streams with it, under the original table's checksum",
         lambda header, body: (header, body), renamed_under_the_old_checksum)


def _unpacked(path: Path) -> tuple[dict[str, Any], bytes]:
    """A packed delta's header as format 3 lays it out, and its data area."""
    data = path.read_bytes()
    return raw_header(data), data[8 + struct.unpack("<Q", data[:8])[0] :]


def _with_entry_digest(header: dict[str, Any], body: bytes, tensor: str) -> dict[str, Any]:
    """``header`` with ``tensor``'s entry digest recomputed over its streams, in entry-name order."""
    table = json.loads(header["__metadata__"]["tensors"])
    h = hasher("blake3")
    for key in sorted(k for k in header if k != "__metadata__" and k.rpartition("::")[0] == tensor):
        start, stop = header[key]["data_offsets"]
        h.update(body[start:stop])
    table[tensor]["blake3"] = h.hexdigest()
    header["__metadata__"]["tensors"] = json.dumps(table, separators=(",", ":"), ensure_ascii=False)
    return header


def _rank(rank: int, world: int, init: str, root: str) -> None:
    import torch.distributed as dist

    from deltasync.publish.sharded import ShardedPublisher

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        weights = shapes_model()
        steps = shapes_steps(weights)
        versions = {}
        with ShardedPublisher(weights, str(Path(root) / "store"), lease_s=1.0, anchor_every=1000) as publisher:
            for step in range(len(steps) + 1):
                if step:
                    steps[step - 1]()
                publisher.publish(step, block=True)
                publisher.flush()
                versions[str(publisher.version)] = digests(weights)
        if rank == 0:
            write_case(Path(root), weights, versions)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def sharded(root: Path) -> None:
    import torch.multiprocessing as mp

    root.mkdir(parents=True)
    rendezvous = tempfile.mkdtemp(prefix="conformance-")
    try:
        mp.start_processes(_rank, args=(2, f"file://{rendezvous}/init", str(root)), nprocs=2, start_method="spawn")
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- broken


def _header(data: bytes) -> tuple[dict[str, Any], bytes]:
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _file(header_text: str, body: bytes) -> bytes:
    encoded = header_text.encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + body


def _entry_range(data: bytes, key: str) -> tuple[int, int]:
    header, _ = _header(data)
    length = struct.unpack("<Q", data[:8])[0]
    start, stop = header[key]["data_offsets"]
    return 8 + length + start, 8 + length + stop


def _rehash(store: Path, key: str, *, size: int | None = None) -> None:
    """Make the manifest's reference to ``key`` match the object as it now is (size and digest, in the
    reference's own algorithm)."""
    data = (store / key).read_bytes()
    manifest = json.loads((store / "manifest.json").read_text())
    for entry in manifest["versions"]:
        spans = [ref for span in entry.get("spans", []) for ref in span["objects"]]
        for ref in entry.get("delta", []) + entry.get("anchor", []) + spans:
            if ref["key"] == key:
                ref["size"] = len(data) if size is None else size
                algorithm = "sha256" if "sha256" in ref else "blake3"
                ref[algorithm] = hexdigest([data], algorithm)
                ref.pop("header", None)  # a header reference would describe the old bytes
    (store / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))


def _set_entry_digest(data: bytes, tensor: str) -> bytes:
    """Recompute one tensor's entry digest in the header after its entries were edited."""
    header, body = _header(data)
    tensors = json.loads(header["__metadata__"]["tensors"])
    keys = sorted(k for k in header if k != "__metadata__" and k.rsplit("::", 1)[0] == tensor)
    algorithm = "sha256" if "sha256" in tensors[tensor] else "blake3"
    h = hasher(algorithm)
    for key in keys:
        start, stop = header[key]["data_offsets"]
        h.update(body[start:stop])
    old, new = tensors[tensor][algorithm], h.hexdigest()
    length = struct.unpack("<Q", data[:8])[0]
    text = data[8 : 8 + length].decode().replace(old, new)
    return _file(text, body)


def broken(out: Path, source: Path, suffix: str = "", only: tuple[str, ...] | None = None) -> None:
    """Copies of a golden store with one fault each, in version 2's delta; ``only`` these faults, named
    with ``suffix``."""
    manifest = json.loads((source / "store" / "manifest.json").read_text())
    key = next(v["delta"][0]["key"] for v in manifest["versions"] if v["version"] == 2)
    case = json.loads((source / "case.json").read_text())

    def make(name: str, error: str, why: str, fault: Callable[[Path], None]) -> None:
        if only is None or name in only:
            copy_broken(out / f"{name}{suffix}", source, case, fault, version=2, error=error, why=why)

    def flip(store: Path) -> None:
        data = bytearray((store / key).read_bytes())
        data[-5] ^= 0x01
        (store / key).write_bytes(bytes(data))

    def truncate(store: Path) -> None:
        data = (store / key).read_bytes()
        (store / key).write_bytes(data[: len(data) // 2])

    def wrong_size(store: Path) -> None:
        _rehash(store, key, size=(store / key).stat().st_size + 16)

    def corrupt_zstd(store: Path) -> None:
        data = bytearray((store / key).read_bytes())
        start, stop = _entry_range(bytes(data), "big::idx")
        data[start + 4 : start + 12] = b"\xff" * 8  # inside the zstd frame header
        (store / key).write_bytes(_set_entry_digest(bytes(data), "big"))
        _rehash(store, key)

    def forged_value(store: Path) -> None:
        data = (store / key).read_bytes()
        header, body = _header(data)
        start, stop = header["big::val"]["data_offsets"]
        raw = bytearray(zstandard.ZstdDecompressor().decompress(body[start:stop]))
        raw[0] ^= 0x02  # one changed element's value moves, every hash recomputed
        frame = zstandard.ZstdCompressor(level=1).compress(bytes(raw))
        delta = len(frame) - (stop - start)
        new_body = body[:start] + frame + body[stop:]
        for entry_key, entry in header.items():
            if entry_key != "__metadata__" and entry["data_offsets"][0] >= stop:
                entry["data_offsets"] = [entry["data_offsets"][0] + delta, entry["data_offsets"][1] + delta]
        header["big::val"]["data_offsets"] = [start, start + len(frame)]
        rebuilt = _file(json.dumps(header, separators=(",", ":"), ensure_ascii=False), new_body)
        (store / key).write_bytes(_set_entry_digest(rebuilt, "big"))
        _rehash(store, key)

    def wrong_fingerprint(store: Path) -> None:
        data = (store / key).read_bytes()
        header, body = _header(data)
        old = header["__metadata__"]["fingerprint"]
        length = struct.unpack("<Q", data[:8])[0]
        text = data[8 : 8 + length].decode().replace(old, "0" * len(old))
        (store / key).write_bytes(_file(text, body))
        _rehash(store, key)

    def duplicate_key(store: Path) -> None:
        data = (store / key).read_bytes()
        _, body = _header(data)
        length = struct.unpack("<Q", data[:8])[0]
        text = data[8 : 8 + length].decode().rstrip()
        meta = json.loads(text)["__metadata__"]
        forged = dict(meta, version="99")
        # The same object twice: a parser keeping the first sees v2, one keeping the last sees v99.
        twice = '"__metadata__":' + json.dumps(meta, ensure_ascii=False) + ',"__metadata__":' + json.dumps(
            forged, ensure_ascii=False
        )
        text = text.replace('"__metadata__":' + json.dumps(meta, separators=(",", ":"), ensure_ascii=False), twice, 1)
        assert text.count('"__metadata__"') == 2, "the header's metadata was not found verbatim"
        (store / key).write_bytes(_file(text, body))
        _rehash(store, key)

    algorithm = "sha256" if "sha256" in manifest["versions"][0]["anchor"][0] else "blake3"
    make("flipped-byte", "IntegrityError", f"one byte of the object differs from the manifest's {algorithm}", flip)
    make("truncated", "IntegrityError", "the object is shorter than the manifest's size", truncate)
    make("wrong-size", "IntegrityError", "the manifest declares a size the object does not have", wrong_size)
    make("corrupt-zstd", "CodecError", "a zstd frame is damaged; every hash matches the damaged bytes", corrupt_zstd)
    entries = read_header((source / "store" / key).read_bytes()).tensors.values()
    value_digest = "BLAKE3" if any("blake3" in entry.params for entry in entries) else "BLAKE2b"
    make("forged-value", "IntegrityError", "one value was changed and every hash recomputed: the codec's "
         f"{value_digest} of the decoded values does not match", forged_value)
    make("wrong-fingerprint", "FingerprintMismatch", "the delta names another model", wrong_fingerprint)
    make("duplicate-json-key", "DeltaFormatError", "the header holds __metadata__ twice", duplicate_key)


def main(argv: list[str]) -> None:
    """Rebuild the golden cases named in ``argv``, or all that current writers produce, and their broken copies.

    The cases of earlier formats (:data:`FROZEN`) and their broken copies were written by earlier writers
    and stay as they are: they prove that what was once written stays readable.
    """
    os.environ.setdefault("DELTASYNC_THREADS", "1")
    alone = broken_alone()
    picked = [name for name in argv if name in alone]
    for name in picked:  # copies of a committed golden store: built alone, the store itself untouched
        alone[name]()
    if picked and len(picked) == len(argv):
        print(f"wrote {', '.join(picked)} under {ROOT / 'broken'}")
        return
    argv = [name for name in argv if name not in alone]
    cases = golden_cases()
    unknown = set(argv) - set(cases)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; golden cases: {sorted(cases)}; broken cases built "
                         f"alone: {sorted(alone)}")
    kept = {name for names in FROZEN.values() for name in names}
    frozen = set(argv) & kept
    if frozen:
        raise SystemExit(f"{sorted(frozen)} were written by earlier formats' writers and are kept as they are")
    names = argv or [name for name in cases if name not in kept]
    for name in names:
        shutil.rmtree(ROOT / "golden" / name, ignore_errors=True)
        cases[name](ROOT / "golden" / name)
    if "format-3-value-blake3" in names:
        only = ("forged-value",)
        for name in only:
            shutil.rmtree(ROOT / "broken" / f"{name}-format-3", ignore_errors=True)
        broken(ROOT / "broken", ROOT / "golden" / "format-3-value-blake3", suffix="-format-3", only=only)
    if "format-4-packed" in names:
        only = ("packed-overlapping-streams", "packed-stray-stream", "packed-table-twice")
        broken_packed(ROOT / "broken", ROOT / "golden" / "format-4-packed", only=only)
    if "format-4-table-checksum" in names:
        broken_packed(ROOT / "broken", ROOT / "golden" / "format-4-table-checksum", only=("packed-table-checksum",))
    if "spans-schema-4" in names:
        broken_spans(ROOT / "broken", ROOT / "golden" / "spans-schema-4")
    if "fp8-block-raw" in names:
        broken_fp8(ROOT / "broken", ROOT / "golden" / "fp8-block-raw")
    total = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    print(f"wrote {', '.join(names)} under {ROOT} ({total / 1e6:.1f} MB in all)")


if __name__ == "__main__":
    main(sys.argv[1:])
