"""Eight replica processes follow one store on the loopback S3 server, with and without the shared cache.

The harness is the fleet benchmark's (``benchmarks/fleet.py``): a publisher in
this process publishes an anchor and a few deltas of a small synthetic model,
one at a time, and waits until every replica holds each version. Every replica
hashes its weights after every update; each hash must be the publisher's hash
of exactly that version (no replica ever held a partial version), and all end
bit-identical to the trainer's own bf16 cast. The store is tapped below the
cache in every replica: without the cache each version object is read once per
replica, with it once for the whole fleet.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltasync.protocol.manifest import MANIFEST_KEY, Manifest
from deltasync.stores import open_store

# Appended, not inserted: a benchmark script named like an installed package must never shadow it.
sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fleet  # noqa: E402

pytestmark = pytest.mark.slow

REPLICAS = 8
VERSIONS = 3  # deltas after the anchor
SCALE = 1  # about a million elements: a 2 MB anchor


@pytest.fixture(scope="module")
def replicas() -> Iterator[fleet.Fleet]:
    """Eight replica processes, spawned once for both modes (spawning imports torch in each)."""
    pool = fleet.Fleet(REPLICAS)
    yield pool
    pool.close()


def objects_per_version(url: str, options: dict[str, Any]) -> dict[int, int]:
    """How many objects a replica following from the start reads for each version."""
    with open_store(url, **options) as store:
        manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
    return {e.version: len(e.anchor if e.version == 0 else e.delta) for e in manifest.versions}


@pytest.mark.parametrize("mode", ["direct", "cache"])
def test_fleet_follows_exactly(mode: str, replicas: fleet.Fleet, servers: dict[str, Any], tmp_path: Path) -> None:
    s3 = servers["get"]("s3")
    url, options = s3.store_url(f"fleet-{mode}-{time.time_ns()}"), s3.store_options()
    cache_dir = str(tmp_path / "cache") if mode == "cache" else None
    result = fleet.run_versions(replicas, url, options, versions=VERSIONS, scale=SCALE, cache_dir=cache_dir, check=True)

    commits = result["commits"]
    assert sorted(commits) == list(range(VERSIONS + 1))
    assert all(c.digest for c in commits.values())
    for member in result["members"]:
        assert [a[0] for a in member.applied] == list(range(VERSIONS + 1)), member.name
        for version, _, digest, _ in member.applied:
            assert digest == commits[version].digest, f"{member.name} held a partial or foreign v{version}"
        version, digest, _, cache_stats, rejected = member.final
        assert (version, digest, rejected) == (VERSIONS, result["trainer_digest"], {}), member.name
        assert (cache_stats is not None) == (mode == "cache")

    expected = objects_per_version(url, options)
    reads = {row["version"]: row["store_object_requests"] for row in result["rows"]}
    per_object = 1 if mode == "cache" else REPLICAS
    assert reads == {v: n * per_object for v, n in expected.items()}
    if mode == "cache":
        stats = [m.final[3] for m in result["members"]]
        assert sum(s["fills"] for s in stats) == sum(expected.values())
        assert sum(s["corrupt"] + s["refused"] + s["fallbacks"] for s in stats) == 0
