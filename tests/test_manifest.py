"""Manifest schema, route planning and retention: pure functions, no I/O."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.errors import ManifestError
from deltasync.protocol.manifest import (
    Manifest,
    ObjectRef,
    Span,
    VersionEntry,
    deletable,
    plan_retention,
    plan_route,
)

GOLDEN = Path(__file__).parent / "golden" / "manifest_v1.json"
SHA = "0" * 64


def ref(key: str, size: int) -> ObjectRef:
    return ObjectRef(key, size, SHA)


def build(n: int, anchors: dict[int, int], delta_size: int = 10) -> Manifest:
    """Versions 0..n-1; deltas of ``delta_size`` for v >= 1; anchors {version: size}."""
    versions = []
    for v in range(n):
        delta = (ref(f"deltas/{v}", delta_size),) if v else ()
        anchor = (ref(f"anchors/{v}", anchors[v]),) if v in anchors else ()
        versions.append(VersionEntry(v, step=v * 10, time=1000.0 + v, nnz=5, delta=delta, anchor=anchor))
    return Manifest("run", "fp", 100, "writer", 0.0, tuple(versions))


class TestSchema:
    def test_roundtrip(self) -> None:
        m = build(5, {0: 1000, 3: 1000})
        assert Manifest.from_bytes(m.to_bytes()) == m

    def test_golden_v1_stays_readable(self) -> None:
        m = Manifest.from_bytes(GOLDEN.read_bytes())
        assert m.latest == 3 and [a.version for a in m.anchors()] == [0, 2]
        assert m.entry(3).delta[0].key == "deltas/0000000003-9f2c1a7b.safetensors"

    def test_blake3_references_beside_sha256_ones(self) -> None:
        """A format 1 run continued by a current writer: both digests in one manifest, schema 2 on write."""
        old = Manifest.from_bytes(GOLDEN.read_bytes())
        assert old.schema == 1 and Manifest.from_bytes(old.to_bytes()).schema == 1
        data = b"\x08" + bytes(7) + b"{}      " + b"x" * 100
        new = ObjectRef.of("deltas/0000000004-0a1b2c3d.safetensors", [data[:16], data[16:]], header=(16, "a" * 64))
        assert new.algorithm == "blake3" and new.size == len(data) and new.verify(data) and not new.verify(data[:-1])
        raw = json.loads(old.with_version(VersionEntry(4, delta=(new,)), now=1.0, lease_s=1.0).to_bytes())
        assert raw["schema"] == 2 and raw["versions"][-1]["delta"][0]["header"] == {"size": 16, "blake3": "a" * 64}
        back = Manifest.from_bytes(json.dumps(raw).encode())
        assert back.entry(4).delta[0] == new and back.entry(3).delta[0].algorithm == "sha256"

    def test_anchors_by_entries_make_schema_3_and_only_while_listed(self, monkeypatch) -> None:
        """Schema 3 names ``blake3-entries``: written only while such a reference is listed, so a replica too
        old to check one says "upgrade" instead of seeing a reference without a digest."""
        head = (24, "c" * 64)
        anchor = ObjectRef("anchors/0000000005-0a1b2c3d-part0000.safetensors", 1000, head[1], None, head,
                           "blake3-entries")
        m = build(5, {0: 1000})
        with_anchor = m.with_version(VersionEntry(5, delta=(ref("deltas/5", 10),), anchor=(anchor,)),
                                     now=1.0, lease_s=1.0)
        raw = json.loads(with_anchor.to_bytes())
        assert raw["schema"] == 3 and raw["versions"][-1]["anchor"][0] == {
            "key": anchor.key, "size": 1000, "blake3-entries": "c" * 64,
            "header": {"size": 24, "blake3-entries": "c" * 64},
        }
        back = Manifest.from_bytes(with_anchor.to_bytes())
        assert back.schema == 3 and back.entry(5).anchor[0] == anchor
        assert json.loads(plan_retention(back, keep_anchors=1, now=2.0).to_bytes())["schema"] == 3
        assert json.loads(m.to_bytes())["schema"] == 2
        monkeypatch.setattr("deltasync.protocol.manifest.SCHEMA", 2)  # a reader from before schema 3
        with pytest.raises(ManifestError, match="schema 3 is not supported; upgrade deltasync"):
            Manifest.from_bytes(with_anchor.to_bytes())

    def test_unknown_fields_are_ignored(self) -> None:
        raw = json.loads(GOLDEN.read_bytes())
        raw["future_field"] = {"x": 1}
        raw["versions"][0]["future"] = True
        assert Manifest.from_bytes(json.dumps(raw).encode()).latest == 3

    @pytest.mark.parametrize(
        "mutate, match",
        [
            (lambda r: r.update(format="other"), "not a deltasync manifest"),
            (lambda r: r.update(schema=99), "upgrade deltasync"),
            (lambda r: r["versions"][1]["delta"][0].update(key="../../etc/passwd"), "unsafe object key"),
            (lambda r: r["versions"][1]["delta"][0].update(key="https://evil/x"), "unsafe object key"),
            (lambda r: r["versions"][1]["delta"][0].update(key="/abs/path"), "unsafe object key"),
            (lambda r: r["versions"].reverse(), "strictly increasing"),
            (lambda r: r["versions"][1]["delta"][0].update(size=-1), "bad size"),
            (lambda r: r["versions"][1].update(version="1"), "non-negative integer"),
            (lambda r: r["versions"][0].pop("anchor"), "neither delta nor anchor"),
            (lambda r: r.update(versions={}), "must be a list"),
            (lambda r: r.pop("run_id"), "malformed"),
            (lambda r: r["versions"][1]["delta"][0].pop("sha256"), "has no digest"),
            (lambda r: r["versions"][1]["delta"][0].update(blake3="1" * 64), "two digests"),
            (lambda r: r["versions"][1]["delta"][0].update(sha256="1" * 63), "bad sha256"),
            (lambda r: r["versions"][1]["delta"][0].update(header={"size": 8, "blake3": "1" * 64}), "must carry"),
            (lambda r: r["versions"][1]["delta"][0].update({"blake3-entries": "1" * 64}), "two digests"),
            (lambda r: r["versions"][1]["delta"][0].update(header={"size": 8, "sha256": "1" * 64, "blake3": "1" * 64}),
             "the header reference of .*: two digests"),
            (lambda r: r["versions"][0]["anchor"][0].update({"blake3-entries": r["versions"][0]["anchor"][0].pop(
                "sha256")}), "header"),
        ],
    )
    def test_bad_manifests_refused(self, mutate, match: str) -> None:
        raw = json.loads(GOLDEN.read_bytes())
        mutate(raw)
        with pytest.raises(ManifestError, match=match):
            Manifest.from_bytes(json.dumps(raw).encode())

    def test_a_schema_below_its_digests_is_refused(self) -> None:
        """``blake3`` needs schema 2, ``blake3-entries`` schema 3: a reader of the lower schema would find a
        reference without a digest it knows. A higher schema than needed is read as it is."""
        head = (24, "c" * 64)
        anchor = ObjectRef("anchors/0000000005-0a1b2c3d-part0000.safetensors", 1000, head[1], None, head,
                           "blake3-entries")
        whole = ObjectRef.of("deltas/0000000005-0a1b2c3d.safetensors", [b"x" * 10])
        for entry, needed in ((VersionEntry(5, delta=(whole,)), 2), (VersionEntry(5, anchor=(anchor,)), 3)):
            raw = json.loads(build(5, {0: 1000}).with_version(entry, now=1.0, lease_s=1.0).to_bytes())
            assert raw["schema"] == needed
            for schema in range(1, needed):
                with pytest.raises(ManifestError, match=f"schema {schema} lists digests of schema {needed}"):
                    Manifest.from_bytes(json.dumps(dict(raw, schema=schema)).encode())
        only_sha256 = json.loads(GOLDEN.read_bytes())
        for schema in (1, 2, 3):
            assert Manifest.from_bytes(json.dumps(dict(only_sha256, schema=schema)).encode()).schema == schema

    def test_not_json(self) -> None:
        with pytest.raises(ManifestError, match="JSON"):
            Manifest.from_bytes(b"{nope")

    @pytest.mark.parametrize("field", ["step", "version"])
    def test_a_signed_zero_is_refused_not_read_as_zero(self, field: str) -> None:
        """``-0`` is 0 to one parser and a negative zero to another: 0 has one spelling, without a sign."""
        text = GOLDEN.read_text()
        forged = text.replace(f'"{field}": 0,', f'"{field}": -0,', 1)
        assert forged != text
        with pytest.raises(ManifestError, match="-0"):
            Manifest.from_bytes(forged.encode())

    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=400) | st.text(max_size=300).map(str.encode))
    def test_fuzz_only_manifest_errors(self, data: bytes) -> None:
        try:
            Manifest.from_bytes(data)
        except ManifestError:
            pass

    def test_appending_must_go_forward(self) -> None:
        m = build(3, {0: 100})
        with pytest.raises(ManifestError, match="does not follow"):
            m.with_version(VersionEntry(2, delta=(ref("deltas/x", 1),)), now=0, lease_s=1)


class TestPlan:
    def test_up_to_date(self) -> None:
        plan = plan_route(build(4, {0: 100}), 3)
        assert plan is not None and plan.steps == ()

    def test_delta_chain(self) -> None:
        plan = plan_route(build(6, {0: 1000}), 2)
        assert [(s.version, s.kind) for s in plan.steps] == [(3, "delta"), (4, "delta"), (5, "delta")]
        assert plan.nbytes == 30

    def test_new_replica_takes_newest_anchor(self) -> None:
        plan = plan_route(build(6, {0: 1000, 4: 1000}), None)
        assert [(s.version, s.kind) for s in plan.steps] == [(4, "anchor"), (5, "delta")]

    def test_cheaper_anchor_beats_long_chain(self) -> None:
        plan = plan_route(build(50, {0: 100, 45: 100}, delta_size=10), 1)
        assert plan.steps[0].kind == "anchor" and plan.steps[0].version == 45

    def test_chain_beats_expensive_anchor(self) -> None:
        plan = plan_route(build(50, {0: 10_000, 45: 10_000}, delta_size=10), 40)
        assert all(s.kind == "delta" for s in plan.steps)

    def test_avoids_bad_objects(self) -> None:
        m = build(6, {0: 1000, 3: 1000})
        plan = plan_route(m, 1, avoid={"deltas/2"})
        assert [(s.version, s.kind) for s in plan.steps] == [(3, "anchor"), (4, "delta"), (5, "delta")]
        assert plan_route(m, 1, avoid={"deltas/5"}) is None

    def test_pruned_history_goes_through_anchor(self) -> None:
        m = plan_retention(build(10, {0: 100, 5: 100, 8: 100}), keep_anchors=1, now=0)
        plan = plan_route(m, 2)
        assert plan.steps[0] == plan.steps[0].__class__(8, "anchor", (ref("anchors/8", 100),))

    def test_empty(self) -> None:
        assert plan_route(Manifest("r", "f", 1, "w", 0.0), None) is None

    def test_every_route_ends_at_latest(self) -> None:
        """No route leads to an older version: a reader holds one only on its way to the latest."""
        m = build(9, {0: 100, 3: 100, 6: 100})
        for held in [None, *range(9)]:
            plan = plan_route(m, held)
            assert plan is not None and plan.target == m.latest
            assert [s.version for s in plan.steps] == sorted({s.version for s in plan.steps})
            assert not plan.steps or plan.steps[-1].version == m.latest
            assert all(held is None or s.version > held for s in plan.steps)


class TestRetention:
    def test_keeps_newest_anchors_and_what_follows(self) -> None:
        m = plan_retention(build(10, {0: 100, 4: 100, 7: 100}), keep_anchors=2, now=50.0)
        assert [v.version for v in m.versions] == [4, 5, 6, 7, 8, 9]
        assert not m.versions[0].delta  # v4 is reached through its anchor only
        retired = {k for k, _ in m.retired}
        assert {"anchors/0", "deltas/1", "deltas/3", "deltas/4"} <= retired
        assert "anchors/4" not in retired

    def test_every_kept_version_reaches_latest(self) -> None:
        m = plan_retention(build(30, {0: 100, 10: 100, 20: 100}), keep_anchors=2, now=0)
        for v in [None] + [e.version for e in m.versions]:
            assert plan_route(m, v) is not None

    def test_deletable_after_grace(self) -> None:
        m = plan_retention(build(10, {0: 100, 5: 100}), keep_anchors=1, now=100.0)
        due, kept = deletable(m, now=150.0, grace=300)
        assert due == [] and kept.retired == m.retired
        due, kept = deletable(m, now=500.0, grace=300)
        assert "anchors/0" in due and kept.retired == ()


# ---------------------------------------------------------------------- catch-up spans (schema 4)


def with_spans(m: Manifest, spans: dict[int, list[tuple[int, int]]]) -> Manifest:
    """``m`` with spans {version: [(base, size), ...]} (each one object ``spans/<version>-<base>``)."""
    versions = tuple(
        e.with_spans(tuple(Span(b, (ref(f"spans/{e.version}-{b}", size),)) for b, size in spans.get(e.version, [])))
        for e in m.versions
    )
    return Manifest(m.run_id, m.fingerprint, m.numel, m.writer, 0.0, versions)


class TestSpans:
    def test_roundtrip_and_schema_4_only_while_a_span_is_listed(self) -> None:
        m = with_spans(build(9, {0: 1000}), {4: [(2, 15), (0, 25)], 8: [(0, 40), (6, 15), (4, 25)]})
        assert [s.base for s in m.entry(8).spans] == [6, 4, 0]  # kept longest last
        raw = json.loads(m.to_bytes())
        assert raw["schema"] == 4 and raw["versions"][4]["spans"][1] == {"from": 0, "objects": [
            {"key": "spans/4-0", "size": 25, "blake3": SHA}]}
        assert Manifest.from_bytes(m.to_bytes()).versions == m.versions
        assert json.loads(build(9, {0: 1000}).to_bytes())["schema"] == 2
        for schema in (1, 2, 3):
            with pytest.raises(ManifestError, match="schema"):
                Manifest.from_bytes(json.dumps(dict(raw, schema=schema)).encode())

    @pytest.mark.parametrize(
        "spans, match",
        [
            ([{"from": 3, "objects": [{"key": "spans/x", "size": 1, "sha256": SHA}]}], "at least 2 versions below"),
            ([{"from": 5, "objects": [{"key": "spans/x", "size": 1, "sha256": SHA}]}], "at least 2 versions below"),
            ([{"from": 0, "objects": [{"key": "spans/x", "size": 1, "sha256": SHA}]},
              {"from": 2, "objects": [{"key": "spans/y", "size": 1, "sha256": SHA}]}], "longest last"),
            ([{"from": 2, "objects": [{"key": "spans/x", "size": 1, "sha256": SHA}]},
              {"from": 2, "objects": [{"key": "spans/y", "size": 1, "sha256": SHA}]}], "longest last"),
            ([{"from": 2, "objects": []}], "lists no object"),
            ([{"from": 2, "objects": [{"key": "deltas/1", "size": 1, "sha256": SHA}]}], "twice|duplicate"),
            ([{"from": "2", "objects": [{"key": "spans/x", "size": 1, "sha256": SHA}]}], "from"),
            ([{"objects": [{"key": "spans/x", "size": 1, "sha256": SHA}]}], "from"),
            (["spans/x"], "span must be a JSON object"),
            ({"from": 2}, "must be a list"),
        ],
    )
    def test_bad_spans_refuse_the_manifest(self, spans: object, match: str) -> None:
        raw = json.loads(build(5, {0: 1000}).to_bytes())
        raw["schema"] = 4
        raw["versions"][4]["spans"] = spans
        with pytest.raises(ManifestError, match=match):
            Manifest.from_bytes(json.dumps(raw).encode())

    def test_a_span_from_before_the_oldest_listed_version_is_refused(self) -> None:
        raw = json.loads(plan_retention(build(9, {0: 100, 4: 100}), keep_anchors=1, now=0).to_bytes())
        raw["schema"] = 4
        raw["versions"][-1]["spans"] = [{"from": 2, "objects": [{"key": "spans/x", "size": 1, "sha256": SHA}]}]
        with pytest.raises(ManifestError, match="older than the oldest listed version"):
            Manifest.from_bytes(json.dumps(raw).encode())

    def test_the_cheapest_route_takes_spans_where_they_pay(self) -> None:
        m = with_spans(build(9, {0: 1000}), {2: [(0, 15)], 4: [(2, 15), (0, 25)], 8: [(6, 15), (4, 25), (0, 40)]})
        plan = plan_route(m, 0)
        assert [(s.base, s.version, s.label) for s in plan.steps] == [(0, 8, "span")] and plan.nbytes == 40
        plan = plan_route(m, 1)  # an odd start: one delta up to the next span's base, then spans
        assert [(s.base, s.version) for s in plan.steps] == [(1, 2), (2, 4), (4, 8)] and plan.nbytes == 10 + 15 + 25
        plan = plan_route(m, 5)
        assert [(s.base, s.version) for s in plan.steps] == [(5, 6), (6, 8)]
        # A span dearer than the chain is not taken; equal bytes: the route of fewer objects.
        dear = with_spans(build(5, {0: 1000}), {4: [(2, 25), (0, 40)]})
        assert [s.label for s in plan_route(dear, 2).steps] == ["delta", "delta"]
        even = with_spans(build(5, {0: 1000}), {4: [(2, 20)]})
        assert [s.label for s in plan_route(even, 2).steps] == ["span"]

    def test_an_avoided_span_leaves_the_chain(self) -> None:
        m = with_spans(build(9, {0: 1000}), {8: [(4, 25), (0, 40)]})
        plan = plan_route(m, 0, avoid={"spans/8-0"})
        assert [s.label for s in plan.steps] == ["delta"] * 4 + ["span"]
        plan = plan_route(m, 0, avoid={"spans/8-0", "spans/8-4"})
        assert [s.label for s in plan.steps] == ["delta"] * 8

    def test_a_route_to_an_older_target_uses_only_spans_that_end_by_it(self) -> None:
        m = with_spans(build(9, {0: 1000}), {4: [(0, 25)], 8: [(0, 40)]})
        plan = plan_route(m, 0, target=6)
        assert [(s.base, s.version) for s in plan.steps] == [(0, 4), (4, 5), (5, 6)]

    def test_retention_retires_spans_with_the_chain_they_start_from(self) -> None:
        m = with_spans(build(10, {0: 100, 4: 100}), {6: [(4, 15)], 8: [(6, 15), (4, 25), (0, 40)]})
        kept = plan_retention(m, keep_anchors=1, now=5.0)
        assert [v.version for v in kept.versions][0] == 4
        assert [s.base for s in kept.entry(8).spans] == [6, 4] and [s.base for s in kept.entry(6).spans] == [4]
        assert ("spans/8-0", 5.0) in kept.retired and "spans/8-4" not in {k for k, _ in kept.retired}
        assert Manifest.from_bytes(kept.to_bytes()).versions == kept.versions
