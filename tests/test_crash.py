"""A trainer SIGKILLed at random moments, restarted as README says, on a local store and on S3.

A trainer subprocess publishes every step through the public API; the test
kills it at random moments (mid-anchor, mid-delta, mid-manifest, between upload
and commit...) at least 10 times, including during a takeover's own first
anchor, and restarts it as README's "When a trainer dies" says: from the step
``deltasync.last_committed`` reports, or from an older checkpoint, with
``takeover=True`` (the old trainer is known dead). A replica subprocess follows
throughout and records a digest of every version it applies; each must equal
the weights recomputed for that version's step. At the end nothing lies in the
store that the manifest does not name (temporary files included), and a late
joiner reaches the last version exactly.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import Subscriber, TorchModuleApplier, last_committed, open_store
from deltasync.protocol.keys import VERSION_PREFIXES
from tests.crash_helpers import SHAPES, digest, weights

ROOT = Path(__file__).resolve().parents[1]
KILLS = 10
STEPS_PER_LIFE = 6


def launch(kind: str, store: str, options: dict[str, Any], *args: Any, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.crash_helpers", kind, store, json.dumps(options), *map(str, args)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_killed_trainers_restart_and_leave_nothing_behind(backend: str, servers: Any, tmp_path: Path) -> None:
    rng = random.Random(1234 if backend == "local" else 4321)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if backend == "local":
        store, options = str(tmp_path / "run"), {}
    else:
        s3 = servers["get"]("s3")
        store, options = s3.store_url(f"crash-{time.monotonic_ns()}"), s3.store_options()
    progress, log, stop = tmp_path / "progress", tmp_path / "replica.jsonl", tmp_path / "stop"
    follower = launch("replica", store, options, log, stop, env=env)
    restarts: list[dict[str, Any]] = []
    left: list[int] = []
    try:
        step = 0
        for life in range(KILLS):
            started = time.time()
            slow = {"slow_put_s": 1.0} if life < 2 else {}  # the first anchors upload slowly: killed mid-way
            trainer = launch("trainer", store, options | slow, step, STEPS_PER_LIFE, progress, env=env)
            if life < 2:  # during the takeover's own first anchor: once its first part is in the store
                _wait(lambda: _anchor_parts_since(store, options, started) > 0 or trainer.poll() is not None)
            else:  # anywhere in a later publish: a few committed steps in, then a moment into the next
                seen = _progress(progress)
                target = seen + rng.randint(1, 3)
                _wait(lambda: _progress(progress) >= target or trainer.poll() is not None)
                time.sleep(rng.uniform(0.0, 0.05))
            kill(trainer)
            left.append(_leftovers(store, options))  # what this kill left: the next takeover reclaims it
            committed = last_committed(store, **options)
            own = max(_progress(progress), 0)
            # README: restart from the store's last committed step, or from any older checkpoint of your own.
            step = committed.step if committed is not None and life % 3 else max(0, own - rng.randint(0, 2))
            restarts.append({"life": life, "committed": committed and committed.version, "restart_step": step})
        final = launch("trainer", store, options, step, 3, progress, env=env)
        assert final.wait(timeout=300) == 0, final.stderr.read().decode()[-3000:] if final.stderr else ""
        committed = last_committed(store, **options)
        assert committed is not None and committed.step == step + 2 and committed.lease_left_s == 0
        stop.touch()
        assert follower.wait(timeout=120) == 0, follower.stderr.read().decode()[-3000:] if follower.stderr else ""
    finally:
        stop.touch()
        kill(follower)

    # Every version the replica applied carried exactly the weights of its step.
    applied = [json.loads(line) for line in log.read_text().splitlines()]
    assert applied and applied[-1]["version"] == committed.version, (applied[-3:], committed)
    expected: dict[int, str] = {}
    for row in applied:
        if row["step"] not in expected:
            expected[row["step"]] = digest({n: t.to(torch.bfloat16) for n, t in weights(row["step"]).items()})
        assert row["digest"] == expected[row["step"]], (row, restarts)

    # Nothing lies in the store that the manifest (or its retired list) does not name: no orphans, no
    # unfinished writes.
    opened = open_store(store, **options)
    from deltasync.protocol.manifest import MANIFEST_KEY, Manifest

    manifest = Manifest.from_bytes(opened.get(MANIFEST_KEY))
    from deltasync.protocol.retired import named_keys

    named = named_keys(opened, manifest)  # retired ones wait out their grace, listed beside the manifest
    stray = [i.key for p in VERSION_PREFIXES for i in opened.list(p) if i.key not in named]
    stray += [i.key for i in opened.temporaries("")]
    assert not stray, stray

    # A late joiner reaches the last version exactly.
    late = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in SHAPES.items()}
    sub = Subscriber(opened, TorchModuleApplier(late), ack=False)
    sub.update()
    assert sub.version == committed.version
    assert digest(late) == digest({n: t.to(torch.bfloat16) for n, t in weights(committed.step).items()})
    print(f"\n[{backend}] {KILLS} kills, restarts {restarts}, {len(applied)} versions applied by the replica, "
          f"objects left by each kill {left}")
    assert left[0] and left[1], "the kills aimed at the first anchors missed them: the sweep went untested"


def _wait(condition: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the trainer made no progress"
        time.sleep(0.005)


def _progress(path: Path) -> int:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return -1


def _anchor_parts_since(store: str, options: dict[str, Any], since: float) -> int:
    opened = open_store(store, **options)
    try:
        return sum(1 for info in opened.list("anchors/") if info.modified is not None and info.modified >= since - 1)
    finally:
        opened.close()


def _leftovers(store: str, options: dict[str, Any]) -> int:
    from deltasync.errors import ObjectNotFound
    from deltasync.protocol.commit import classify_orphans
    from deltasync.protocol.manifest import MANIFEST_KEY, Manifest, new_manifest

    opened = open_store(store, **options)
    try:
        manifest = Manifest.from_bytes(opened.get(MANIFEST_KEY))
    except ObjectNotFound:  # nothing committed yet: everything in the prefix is left over
        manifest = new_manifest(run_id="none", fingerprint="none", numel=0, writer="none", lease_s=0.0)
    due, kept = classify_orphans(opened, manifest, now=time.time())
    return len(due) + len(kept)
