"""Run the conformance suite against deltasync's own decoder: the reference reader's walk, step by step.

    python conformance/check.py                 # every case under conformance/golden and conformance/broken
    python conformance/check.py conformance/broken/truncated

For each case it reads ``store/manifest.json``, holds zero-filled tensors of
the case's ``model``, and walks the versions in order exactly as
docs/CONFORMANCE.md describes for any implementation: the first anchor, then
each version's delta (or its anchor when it has no delta); every object's size
and digest against the manifest (whole, or by its header and tensors for
``blake3-entries``), every header against the model and the
manifest's claim; after each version, each tensor's SHA-256 against
``case.json``, and each catch-up span of the version, applied to the weights
of its base, against the same digests. A golden case passes when every listed
version is reached with the expected digests; a broken case passes when the
walk reaches exactly the versions listed and then refuses ``refuse.version``
(and, for a span, ``refuse.span_from``) with ``refuse.error``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from deltasync.appliers import TorchModuleApplier  # noqa: E402
from deltasync.errors import DeltaFormatError, DeltaSyncError, IntegrityError, VersionError  # noqa: E402
from deltasync.format import combine, decode, read_header  # noqa: E402
from deltasync.protocol.manifest import Manifest, ObjectRef  # noqa: E402
from deltasync.tensors import TensorSpec, bits_view, fingerprint  # noqa: E402

__all__ = ["Walk", "walk", "check", "cases", "digests"]


@dataclass
class Walk:
    """What a reader got from one store: digests per version reached, and the refusal that stopped it."""

    reached: dict[str, dict[str, str]]
    refused: tuple[int, DeltaSyncError] | None
    weights: dict[str, torch.Tensor]
    refused_span: int | None = None
    """The base of the span refused (``refused`` then names its version), if a span was."""
    spans: int = 0
    """Spans checked."""


def cases(root: Path = ROOT) -> list[Path]:
    """Every case directory of the suite."""
    return sorted(p.parent for p in root.glob("*/*/case.json"))


def _read(store: Path, ref: ObjectRef) -> bytes:
    data = (store / ref.key).read_bytes() if (store / ref.key).is_file() else b""
    if not ref.verify(data):
        raise IntegrityError(
            f"{ref.key}: {len(data)} bytes whose {ref.algorithm} differs from the manifest's ({ref.size} bytes)"
        )
    return data


def digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """Per tensor, the SHA-256 of its bytes: row-major, little-endian, in its own dtype."""
    return {
        name: hashlib.sha256(bits_view(t.contiguous()).reshape(-1).numpy().tobytes()).hexdigest()
        for name, t in sorted(weights.items())
    }


def _decode_version(
    store: Path, refs: tuple[ObjectRef, ...], kind: str, version: int, held: int | None, applier: TorchModuleApplier
) -> dict[str, Any]:
    files = [_read(store, ref) for ref in refs]
    headers = [read_header(data) for data in files]
    for ref, header in zip(refs, headers):
        applier.validate(header)  # fingerprint, and every carried tensor's name, shape and dtype
        if header.version != version or header.kind != kind:
            raise VersionError(f"{ref.key} holds {header.kind} v{header.version}, the manifest says {kind} v{version}")
        if kind == "delta" and header.base_version != held:
            raise VersionError(f"{ref.key} applies to v{header.base_version}, the reader holds v{held}")
    if kind == "anchor" and {n for h in headers for n in h.tensors} != set(applier.specs):
        raise DeltaFormatError(f"anchor v{version} does not carry every tensor")
    parts = [decode(data, base=applier.lookup, header=header) for data, header in zip(files, headers)]
    return combine(parts, whole=kind == "anchor")


def walk(case_dir: Path) -> Walk:
    """Follow the case's store from its first anchor to its latest version, as a conforming reader does."""
    case = json.loads((case_dir / "case.json").read_text())
    store = case_dir / case["store"]
    specs = [TensorSpec(m["name"], tuple(m["shape"]), m["dtype"]) for m in case["model"]]
    weights = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in specs}
    applier = TorchModuleApplier(weights, dtype=None)
    reached: dict[str, dict[str, str]] = {}
    states: dict[int, dict[str, torch.Tensor]] = {}  # the weights at each version reached: spans start there
    spans = 0
    held: int | None = None
    try:
        manifest = Manifest.from_bytes((store / "manifest.json").read_bytes())
    except DeltaSyncError as exc:
        return Walk(reached, (-1, exc), weights)
    for entry in sorted(manifest.versions, key=lambda e: e.version):
        try:
            if held is None or not entry.delta:
                if not entry.anchor:
                    continue  # not reachable without the versions before it
                applier.apply(_decode_version(store, entry.anchor, "anchor", entry.version, held, applier))
            else:
                kept = {name: t.clone() for name, t in weights.items()} if entry.anchor else {}
                try:
                    applier.apply(_decode_version(store, entry.delta, "delta", entry.version, held, applier))
                    if entry.anchor:  # the same version twice: the anchor must hold exactly what the delta made
                        whole = _decode_version(store, entry.anchor, "anchor", entry.version, held, applier)
                        for name, patch in whole.items():
                            flat = bits_view(weights[name]).reshape(-1).numpy()
                            if not (flat[patch.start : patch.start + patch.values.size] == patch.values).all():
                                raise IntegrityError(f"anchor v{entry.version} differs from its delta in {name}")
                except DeltaSyncError:
                    for name, before in kept.items():  # the version is refused: the walk holds v - 1 again
                        weights[name].copy_(before)
                    raise
        except DeltaSyncError as exc:
            return Walk(reached, (entry.version, exc), weights)
        held = entry.version
        reached[str(entry.version)] = digests(weights)
        states[entry.version] = {name: t.clone() for name, t in weights.items()}
        for span in entry.spans:
            if span.base not in states:
                continue  # its base was not reached (before the first anchor)
            try:
                _check_span(store, span.objects, span.base, entry.version, states[span.base],
                            reached[str(entry.version)])
            except DeltaSyncError as exc:
                return Walk(reached, (entry.version, exc), weights, span.base, spans)
            spans += 1
    return Walk(reached, None, weights, spans=spans)


def _check_span(
    store: Path, refs: tuple[ObjectRef, ...], base: int, version: int, at_base: dict[str, torch.Tensor],
    expected: dict[str, str],
) -> None:
    """A span's files, decoded as a delta from ``base`` onto the weights of ``base``, make exactly ``version``."""
    weights = {name: t.clone() for name, t in at_base.items()}
    applier = TorchModuleApplier(weights, dtype=None)
    applier.apply(_decode_version(store, refs, "delta", version, base, applier))
    if digests(weights) != expected:
        raise IntegrityError(f"the span from v{base} does not make v{version}")


def check(case_dir: Path) -> list[str]:
    """What differs from the case's expectations (empty: the case passes)."""
    case = json.loads((case_dir / "case.json").read_text())
    problems = []
    specs = [TensorSpec(m["name"], tuple(m["shape"]), m["dtype"]) for m in case["model"]]
    if fingerprint(specs) != case["fingerprint"]:
        problems.append(f"fingerprint {fingerprint(specs)}, case says {case['fingerprint']}")
    result = walk(case_dir)
    if result.reached != case["versions"]:
        wrong = sorted(set(result.reached) ^ set(case["versions"]), key=int) or [
            v for v in case["versions"] if result.reached.get(v) != case["versions"][v]
        ]
        problems.append(f"versions reached differ from the case's at {wrong}")
    refuse = case.get("refuse")
    if refuse is None and result.refused is not None:
        version, exc = result.refused
        problems.append(f"refused v{version}: {type(exc).__name__}: {exc}")
    elif refuse is not None:
        if result.refused is None:
            problems.append(f"accepted everything; v{refuse['version']} must be refused ({refuse['error']})")
        elif (result.refused[0], type(result.refused[1]).__name__, result.refused_span) != (
                refuse["version"], refuse["error"], refuse.get("span_from")):
            version, exc = result.refused
            span = "" if result.refused_span is None else f" (its span from v{result.refused_span})"
            wanted = "" if refuse.get("span_from") is None else f" (its span from v{refuse['span_from']})"
            problems.append(f"refused v{version}{span} with {type(exc).__name__} ({exc}); expected "
                            f"v{refuse['version']}{wanted} with {refuse['error']}")
    return problems


def main(argv: list[str]) -> int:
    chosen = [Path(a) for a in argv] or cases()
    failed = 0
    for case_dir in chosen:
        problems = check(case_dir)
        failed += bool(problems)
        shown = case_dir.resolve().relative_to(ROOT) if case_dir.resolve().is_relative_to(ROOT) else case_dir
        print(f"{'FAIL' if problems else 'pass'}  {shown}")
        for problem in problems:
            print(f"      {problem}")
    print(f"{len(chosen) - failed} of {len(chosen)} cases pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
