"""The conformance suite (``conformance/``): every golden store decodes to its digests, every broken one is refused.

The stores are committed files written by earlier versions of the code, so these
tests also prove that what was once written stays readable.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard

from deltasync import Subscriber, errors
from deltasync.appliers import TorchModuleApplier
from deltasync.format import read_header
from deltasync.tensors import TensorSpec

ROOT = Path(__file__).resolve().parents[1] / "conformance"
sys.path.insert(0, str(ROOT))
from check import cases, check, digests, walk  # noqa: E402

GOLDEN = [c for c in cases() if c.parent.name == "golden"]
BROKEN = [c for c in cases() if c.parent.name == "broken"]
# A replica follows one route: of a version that lists a delta and an anchor it decodes one, so it cannot see that
# they differ (docs/PROTOCOL.md, "Following the chain"). Only the walk, which decodes both, refuses these.
BOTH_ROUTES = {"anchor-differs-from-delta"}
# A broken span leaves the chain intact: a replica that meets it takes the chain instead.
SPANS = {c.name for c in BROKEN if "span_from" in json.loads((c / "case.json").read_text())["refuse"]}


def _case(case_dir: Path) -> dict[str, Any]:
    return json.loads((case_dir / "case.json").read_text())


def _replica(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    specs = [TensorSpec(m["name"], tuple(m["shape"]), m["dtype"]) for m in case["model"]]
    return {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in specs}


def test_the_suite_is_there() -> None:
    assert len(GOLDEN) >= 6 and len(BROKEN) >= 7
    size = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    assert size < 8e6, f"the suite should stay small: {size / 1e6:.1f} MB"


@pytest.mark.parametrize("case_dir", GOLDEN + BROKEN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_reference_walk_meets_the_case(case_dir: Path) -> None:
    assert check(case_dir) == []


@pytest.mark.parametrize("case_dir", GOLDEN, ids=lambda p: p.name)
def test_a_subscriber_ends_at_the_latest_digests(case_dir: Path) -> None:
    """The library's own replica (routes, range-free fetches, checks) lands where the walk does."""
    case = _case(case_dir)
    weights = _replica(case)
    with Subscriber(str(case_dir / case["store"]), TorchModuleApplier(weights, dtype=None), ack=False) as sub:
        info = sub.update()
    latest = max(case["versions"], key=int)
    assert info is not None and str(info.version) == latest
    assert walk(case_dir).reached[latest] == case["versions"][latest]
    assert digests(weights) == case["versions"][latest]


@pytest.mark.parametrize("case_dir", [c for c in BROKEN if c.name not in BOTH_ROUTES | SPANS], ids=lambda p: p.name)
def test_a_subscriber_refuses_the_broken_version_and_keeps_the_last_good_one(case_dir: Path) -> None:
    case = _case(case_dir)
    weights = _replica(case)
    expected = getattr(errors, case["refuse"]["error"])
    with Subscriber(str(case_dir / case["store"]), TorchModuleApplier(weights, dtype=None), ack=False) as sub:
        with pytest.raises(expected):
            sub.update()
        kept = case["refuse"]["version"] - 1  # -1: a refused first anchor leaves the replica as it was
        assert sub.version == (kept if kept >= 0 else None)
    assert digests(weights) == (case["versions"][str(kept)] if kept >= 0 else digests(_replica(case)))


@pytest.mark.parametrize("case_dir", [c for c in BROKEN if c.name in SPANS], ids=lambda p: p.name)
def test_a_subscriber_refuses_a_broken_span_and_reaches_the_newest_by_the_chain(case_dir: Path) -> None:
    case = _case(case_dir)
    weights = _replica(case)
    expected = getattr(errors, case["refuse"]["error"])
    source = _case(ROOT / "golden" / "spans-schema-4")["versions"]
    info = None
    with Subscriber(str(case_dir / case["store"]), TorchModuleApplier(weights, dtype=None), ack=False) as sub:
        for _ in range(10):  # a damaged object is tried again (it may be the link's), then avoided
            try:
                info = sub.update()
                break
            except expected:
                assert sub.version is not None and digests(weights) == source[str(sub.version)]
    assert info is not None and digests(weights) == source[max(source, key=int)]
    assert walk(case_dir).refused_span == case["refuse"]["span_from"]


def test_the_golden_stores_cover_what_a_reader_must_handle() -> None:
    seen: Counter[tuple[Any, ...]] = Counter()
    for path in (ROOT / "golden").rglob("*.safetensors"):
        header = read_header(path.read_bytes())
        seen["kind", header.kind] += 1
        seen["format", header.format_version] += 1
        for name, entry in header.tensors.items():
            if entry.digest is not None:
                seen["entry digest", header.format_version, entry.digest[0]] += 1
            seen["codec", entry.codec] += 1
            seen["dtype", entry.spec.dtype] += 1
            seen["dims", len(entry.spec.shape)] += 1
            for key in ("sum", "blake3"):
                if key in entry.params:
                    seen["value digest", header.format_version, key] += 1
            if entry.codec == "exp-rice":
                seen["exp-rice streams", entry.params.get("iz", 0), entry.params.get("vz", 0)] += 1
            if "iw" in entry.params:
                seen["gap bytes", entry.params["iw"], "escapes" if entry.params["big"] else "plain"] += 1
            if entry.rows is not None:
                seen["shard rows"] += 1
            if entry.spec.numel == 0:
                seen["zero elements", header.kind] += 1
            if not name.isascii():
                seen["non-ascii name"] += 1
    for need in [
        ("codec", "compact"), ("codec", "compact-abs"), ("codec", "compact-exp"), ("codec", "exp-rice"),
        ("codec", "raw"), ("codec", "dense"),
        ("dtype", "BF16"), ("dtype", "F16"), ("dtype", "F32"),
        *[("dims", d) for d in range(5)],
        ("gap bytes", 1, "plain"), ("gap bytes", 1, "escapes"), ("gap bytes", 2, "plain"), ("gap bytes", 2, "escapes"),
        ("gap bytes", 4, "plain"), ("shard rows",), ("zero elements", "anchor"), ("non-ascii name",),
        ("format", 1), ("format", 2), ("format", 3), ("format", 4), ("entry digest", 1, "sha256"),
        ("entry digest", 2, "blake3"), ("entry digest", 3, "blake3"), ("entry digest", 4, "blake3"),
        ("value digest", 1, "sum"), ("value digest", 2, "sum"), ("value digest", 3, "blake3"),
        ("value digest", 4, "blake3"),
        *[("exp-rice streams", iz, vz) for iz in (0, 1) for vz in (0, 1)],
    ]:
        assert seen[need if len(need) > 1 else need[0]], f"no golden file has {need}"
    manifests = {p.parent.parent.name: json.loads(p.read_text()) for p in ROOT.glob("golden/*/store/manifest.json")}
    assert any(len(v.get("anchor", [])) > 1 for m in manifests.values() for v in m["versions"])  # multi-part anchors
    assert any(v.get("anchor") and v.get("delta") for m in manifests.values() for v in m["versions"])
    assert any(json.loads(p.read_text())["retired"] for p in (ROOT / "golden").glob("*/store/retired.json"))
    refs = [r for m in manifests.values() for v in m["versions"] for r in v.get("delta", []) + v.get("anchor", [])]
    assert {m["schema"] for m in manifests.values()} == {1, 2, 3, 4}
    assert sum(len(v.get("spans", [])) for m in manifests.values() for v in m["versions"]) >= 3
    assert any("sha256" in r for r in refs) and any("blake3" in r and "blake3" in r["header"] for r in refs)
    assert any("blake3-entries" in r and "blake3-entries" in r["header"] for r in refs)


def test_packed_tables_appear_with_and_without_their_content_checksum() -> None:
    """Current writers checksum a packed table; the first format 4 writers did not, and both stay readable."""
    seen = set()
    for path in (ROOT / "golden").rglob("*.safetensors"):
        data = path.read_bytes()
        header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
        table = header["__metadata__"].get("tensors_zstd")
        if table is not None:
            seen.add(zstandard.get_frame_parameters(base64.b64decode(table)).has_checksum)
    assert seen == {True, False}


def test_special_values_reach_the_reader_bit_exactly() -> None:
    """NaN payloads, infinities and signed zeros are bit patterns like any other."""
    weights = walk(ROOT / "golden" / "shapes-bf16-compact").weights
    bits = weights["big"].view(torch.int16).numpy().view(np.uint16)
    assert {0x7FC2, 0xFFA5, 0x7F81} <= set(bits[[10, 20, 30]].tolist())
    assert bits[40] == 0x7F80 and bits[50] == 0xFF80 and bits[60] == 0x0000 and bits[70] == 0x8000
    half = walk(ROOT / "golden" / "dtypes-f16-f32-compact").weights
    assert half["half.odd"].view(torch.int16).numpy().view(np.uint16)[1] == 0x7E01
    assert half["single.weight"].view(torch.int32).numpy().view(np.uint32).reshape(-1)[0] == 0x7FC00123


def test_an_anchor_that_differs_from_its_delta_is_refused_by_a_reader_that_decodes_both() -> None:
    """The walk compares a version's anchor with what its delta made before it holds either, and refuses the
    version (IntegrityError), keeping the one before; a replica takes one of the two and cannot tell."""
    case_dir = ROOT / "broken" / "anchor-differs-from-delta"
    case = _case(case_dir)
    result = walk(case_dir)
    assert result.refused is not None and result.refused[0] == 2
    assert isinstance(result.refused[1], errors.IntegrityError)
    assert digests(result.weights) == case["versions"]["1"]  # nothing of version 2 is kept
    weights = _replica(case)
    with Subscriber(str(case_dir / case["store"]), TorchModuleApplier(weights, dtype=None), ack=False) as sub:
        info = sub.update()
    assert info is not None and info.route == ("anchor", "delta")  # version 2's anchor, never its delta


def test_a_refused_manifest_is_refused_as_a_whole() -> None:
    """``refuse.version`` -1: the manifest itself breaks a rule, and no version of the store is reached."""
    for name in ("schema-below-digests", "header-digest-twice"):
        case = _case(ROOT / "broken" / name)
        assert case["refuse"]["version"] == -1 and case["refuse"]["error"] == "ManifestError"
        result = walk(ROOT / "broken" / name)
        assert result.reached == {} and result.refused is not None and result.refused[0] == -1
        assert isinstance(result.refused[1], errors.ManifestError)
