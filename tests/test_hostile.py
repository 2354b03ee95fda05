"""Hostile input through the public API: each case ends in exact success or a typed error, replica untouched.

Classes covered here: impossible manifests (absurd, backwards, skipping,
inconsistent versions) and their recovery, numeric fields (huge, NaN,
infinite; a lease that must fail closed), tensors the publisher cannot carry
exactly (integer, bool, complex, float64 kept as is), non-contiguous tensors on
both sides, endless and special files in a local store, a full disk under the
publisher, and constructor arguments. Store URL forms and bounded reads per
backend are in ``tests/test_store_hostile.py``; property tests in
``tests/test_properties.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import DeltaSyncError, Publisher, Subscriber, TorchModuleApplier
from deltasync.errors import (
    ConfigError,
    ConflictError,
    FingerprintMismatch,
    ManifestError,
    StoreError,
    VersionError,
)
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest

SHAPES = {"w": (32, 24), "b": (24,)}


def trainer_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def replica_weights(seed: int = 1) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in trainer_weights(seed).items()}


def step(weights: dict[str, torch.Tensor], seed: int) -> None:
    """A sparse update: about 5 % of the elements move."""
    g = torch.Generator().manual_seed(seed)
    for t in weights.values():
        t.add_(torch.randn(t.shape, generator=g) * (torch.rand(t.shape, generator=g) < 0.05))


def bits(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16).view(torch.int16).clone() for n, t in weights.items()}


def assert_exact(trainer: dict[str, torch.Tensor], replica: dict[str, torch.Tensor]) -> None:
    for name, want in bits(trainer).items():
        assert torch.equal(replica[name].view(torch.int16), want), name


def publish(publisher: Publisher, step_: int) -> None:
    publisher.publish(step_, block=True)
    publisher.flush()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[str, dict[str, torch.Tensor], Publisher]]:
    """A store with versions 0 (anchor), 1 and 2, and the publisher still open (no span: every route takes the
    deltas these tests tamper with)."""
    url = str(tmp_path / "store")
    weights = trainer_weights()
    with Publisher(weights, url, max_span=0) as publisher:
        for v in range(3):
            if v:
                step(weights, v)
            publish(publisher, v)
        yield url, weights, publisher


def open_store_of(url: str) -> Any:
    from deltasync.stores import open_store

    return open_store(url)


def edit_manifest(url: str, edit: Any) -> bytes:
    """Rewrite the stored manifest with ``edit(raw_dict)``; returns the original bytes."""
    path = Path(url, MANIFEST_KEY)
    original = path.read_bytes()
    raw = json.loads(original)
    edit(raw)
    path.write_text(json.dumps(raw))
    return original


class TestImpossibleManifests:
    @pytest.mark.parametrize(
        ("edit", "match"),
        [
            (lambda r: r["versions"][-1].update(version=10**18), "non-negative integer below"),
            (lambda r: r["versions"][-1].update(version=2**45), "bad version"),
            (lambda r: r.update(latest=10**18), "says latest"),
            (lambda r: r["versions"].pop(1), "skips versions"),
            (lambda r: r["versions"][2].update(version=7), "skips versions"),
            (lambda r: r["versions"][1].update(nnz=10**9), "changed elements"),
            (lambda r: r["versions"][2]["delta"][0].update(key=r["versions"][1]["delta"][0]["key"]), "twice"),
            (lambda r: r.update(retired=[[r["versions"][1]["delta"][0]["key"], 1.0]]), "retired and in use"),
        ],
    )
    def test_refused_replica_untouched_then_recovers(self, run: Any, edit: Any, match: str) -> None:
        url, weights, publisher = run
        replica = replica_weights()
        sub = Subscriber(url, TorchModuleApplier(replica), ack=False)
        original = edit_manifest(url, edit)
        before = bits(replica)
        with pytest.raises(ManifestError, match=match):
            sub.update()
        assert sub.poll() is None and "ManifestError" in (sub.stats.last_error or "")
        assert all(torch.equal(replica[n].view(torch.int16), b) for n, b in before.items())
        Path(url, MANIFEST_KEY).write_bytes(original)  # the store is repaired
        assert sub.update() is not None and sub.version == 2
        assert_exact(weights, replica)

    def test_absurd_version_with_a_valid_shape_does_not_wedge(self, run: Any) -> None:
        """A forged manifest whose only version is v10^12, pointing at a real object: refused, and
        once the store is repaired the replica catches up (it never measures against the forgery)."""
        url, weights, publisher = run
        replica = replica_weights()
        sub = Subscriber(url, TorchModuleApplier(replica), ack=False)

        def forge(raw: dict[str, Any]) -> None:
            anchor = raw["versions"][0]
            raw["versions"] = [{**anchor, "version": 10**12}]
            raw["latest"] = 10**12

        original = edit_manifest(url, forge)
        with pytest.raises(VersionError):
            sub.update()  # the anchor file says v0, the manifest v10^12: refused before any write
        assert sub.version is None
        Path(url, MANIFEST_KEY).write_bytes(original)
        assert sub.update() is not None and sub.version == 2  # the same anchor, honestly listed, is usable
        assert_exact(weights, replica)

    def test_backwards_manifest_keeps_the_held_version(self, run: Any) -> None:
        url, weights, publisher = run
        replica = replica_weights()
        sub = Subscriber(url, TorchModuleApplier(replica), ack=False)
        assert sub.update() is not None and sub.version == 2
        original = edit_manifest(url, lambda r: (r["versions"].pop(), r.update(latest=1)))
        with pytest.raises(VersionError, match="went backwards"):
            sub.update()
        assert sub.version == 2
        assert_exact(weights, replica)
        Path(url, MANIFEST_KEY).write_bytes(original)
        step(weights, 3)
        publish(publisher, 3)
        assert sub.update() is not None and sub.version == 3
        assert_exact(weights, replica)


class TestNumericFields:
    @pytest.mark.parametrize("field", ["lease_until", "updated"])
    @pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400", "10" * 400, "-1", "true", '"1"'])
    def test_times(self, field: str, value: str) -> None:
        raw = Manifest("r", "f", 10, "w", 1.0).to_bytes().decode()
        text = raw.replace(f'"{field}": ', f'"{field}": {value}, "x_{field}": ')
        with pytest.raises(ManifestError):
            Manifest.from_bytes(text.encode())

    @pytest.mark.parametrize("value", [10**30, -1, 1.5, True, None, "NaN"])
    def test_version_numbers(self, run: Any, value: Any) -> None:
        url, _, _ = run
        edit_manifest(url, lambda r: r["versions"][0].update(version=value))
        with pytest.raises(ManifestError):
            Manifest.from_bytes(Path(url, MANIFEST_KEY).read_bytes())

    def test_duplicate_json_keys_are_refused(self) -> None:
        raw = Manifest("r", "f", 10, "w", 1.0).to_bytes().decode()
        with pytest.raises(ManifestError, match="twice"):
            Manifest.from_bytes(raw.replace('"writer": "w"', '"writer": "w", "writer": "x"').encode())

    def test_nan_lease_never_lets_a_second_publisher_in(self, tmp_path: Path) -> None:
        """The single-writer lease fails closed: a manifest whose lease is NaN is corrupt, and the
        second trainer is refused instead of taking over a prefix a live run owns."""
        url = str(tmp_path / "store")
        weights = trainer_weights()
        with Publisher(weights, url) as first:
            publish(first, 0)
            text = Path(url, MANIFEST_KEY).read_text()
            lease = json.loads(text)["lease_until"]
            Path(url, MANIFEST_KEY).write_text(text.replace(f'"lease_until": {lease}', '"lease_until": NaN'))
            second = Publisher(trainer_weights(5), url, lease_s=60)
            with pytest.raises((ManifestError, ConflictError)):
                second.publish(0)  # the first publish opens the prefix; a corrupt manifest fails it
                second.flush()
            second_manifest = Path(url, MANIFEST_KEY).read_text()
            assert "NaN" in second_manifest  # nothing was written over it
            with contextlib.suppress(DeltaSyncError):
                second.close()

    def test_conflict_error_says_how_long_and_what_to_pass(self, tmp_path: Path) -> None:
        url = str(tmp_path / "store")
        with Publisher(trainer_weights(), url) as first:
            publish(first, 0)
            second = Publisher(trainer_weights(), url)
            with pytest.raises(ConflictError, match=r"lease runs \d+ s more .*UTC.*takeover=True") as caught:
                second.publish(0)
            assert 0 < caught.value.lease_left_s <= 600
            with contextlib.suppress(DeltaSyncError):
                second.close()


class TestDtypeContract:
    @pytest.mark.parametrize(
        "tensor",
        [torch.tensor([1001, 123457]), torch.tensor([True, False]), torch.zeros(3, dtype=torch.complex64),
         torch.tensor([1, 2], dtype=torch.int8)],
        ids=["int64", "bool", "complex", "int8"],
    )
    def test_non_float_tensors_are_refused_when_the_publisher_is_built(self, tmp_path: Path, tensor: Any) -> None:
        with pytest.raises(ConfigError, match="'step_count'.*floating-point weights only") as caught:
            Publisher({"w": torch.randn(4), "step_count": tensor}, str(tmp_path / "s"))
        assert caught.value.argument == "step_count"
        assert not (tmp_path / "s" / MANIFEST_KEY).exists()

    def test_replica_side_refuses_them_too(self) -> None:
        with pytest.raises(ConfigError, match="floating-point"):
            TorchModuleApplier({"n": torch.tensor([1, 2])})

    def test_float64_without_a_published_dtype_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="'w'.*float64.*dtype=torch.bfloat16"):
            Publisher({"w": torch.randn(4, dtype=torch.float64)}, str(tmp_path / "s"), dtype=None)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
    def test_own_dtype_publishing_is_exact(self, tmp_path: Path, dtype: torch.dtype) -> None:
        url = str(tmp_path / "s")
        weights = {n: t.to(dtype) for n, t in trainer_weights().items()}
        replica = {n: torch.zeros_like(t) for n, t in weights.items()}
        with Publisher(weights, url, dtype=None) as publisher:
            sub = Subscriber(url, TorchModuleApplier(replica, dtype=None), ack=False)
            for v in range(3):
                if v:
                    step(weights, v)
                publish(publisher, v)
                assert sub.update() is not None
                for name, t in weights.items():
                    assert torch.equal(replica[name].view(torch.int8), t.view(torch.int8)), name

    def test_float64_is_published_as_its_bf16_cast(self, tmp_path: Path) -> None:
        url = str(tmp_path / "s")
        weights = {n: t.double() for n, t in trainer_weights().items()}
        replica = replica_weights()
        with Publisher(weights, url) as publisher:
            publish(publisher, 0)
            step(weights, 1)
            publish(publisher, 1)
        assert Subscriber(url, TorchModuleApplier(replica), ack=False).update() is not None
        assert_exact(weights, replica)


class TestNonContiguous:
    def test_transposed_and_strided_views_on_both_sides(self, tmp_path: Path) -> None:
        url = str(tmp_path / "s")
        storage = torch.randn(24, 32)
        long = torch.randn(48)
        weights = {"w": storage.t(), "b": long[::2]}  # trainer: views, not contiguous
        held_w = torch.zeros(24, 32, dtype=torch.bfloat16)
        held_b = torch.zeros(48, dtype=torch.bfloat16)
        replica = {"w": held_w.t(), "b": held_b[::2]}  # replica: views too, written in place
        with Publisher(weights, url) as publisher:
            sub = Subscriber(url, TorchModuleApplier(replica), ack=False)
            for v in range(4):
                if v:
                    step(weights, v)
                publish(publisher, v)
                assert sub.update() is not None
                assert_exact(weights, replica)
        assert torch.equal(held_b[1::2], torch.zeros(24, dtype=torch.bfloat16))  # the gaps stay untouched

    def test_expanded_views_are_refused_up_front(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="stride 0"):
            TorchModuleApplier({"w": torch.zeros(1, 8, dtype=torch.bfloat16).expand(4, 8)})


class TestSpecialFiles:
    def test_endless_object_is_refused_without_reading_it(self, run: Any) -> None:
        url, weights, _ = run
        delta = json.loads(Path(url, MANIFEST_KEY).read_text())["versions"][2]["delta"][0]["key"]
        Path(url, delta).unlink()
        Path(url, delta).symlink_to("/dev/zero")
        replica = replica_weights()
        sub = Subscriber(url, TorchModuleApplier(replica), ack=False)
        with pytest.raises(DeltaSyncError):
            sub.update()  # the route uses the anchor and v1.. then v2's delta, which is refused
        assert sub.version in (None, 1)

    def test_manifest_that_is_a_fifo_never_blocks(self, tmp_path: Path) -> None:
        url = tmp_path / "store"
        url.mkdir()
        os.mkfifo(url / MANIFEST_KEY)
        sub = Subscriber(str(url), TorchModuleApplier(replica_weights()), ack=False)
        outcome: list[BaseException | None] = []

        def update() -> None:
            try:
                sub.update()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=update, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "update() blocked on a FIFO"
        assert isinstance(outcome[0], StoreError)


    def test_oversized_ack_is_never_read_whole_and_gc_removes_it(self, run: Any, capsys: Any) -> None:
        from deltasync.cli import main
        from deltasync.protocol.acks import MAX_ACK_BYTES, read_acks

        url, _, _ = run
        Path(url, "acks").mkdir(exist_ok=True)
        Path(url, "acks", "huge.json").write_bytes(b'{"replica": "huge", "pad": "' + b"x" * (4 * MAX_ACK_BYTES) + b'"}')
        assert read_acks(open_store_of(url)) == []  # skipped: larger than any ack
        assert main(["gc", url, "--grace", "0"]) == 0
        assert "acks/huge.json" in capsys.readouterr().out
        assert not Path(url, "acks", "huge.json").exists()

    def test_oversized_manifest_is_refused_by_trainer_replica_and_cli(self, tmp_path: Path, capsys: Any) -> None:
        from deltasync.cli import main
        from deltasync.errors import IntegrityError
        from deltasync.protocol.manifest import MAX_MANIFEST_BYTES

        url = tmp_path / "store"
        url.mkdir()
        with open(url / MANIFEST_KEY, "wb") as f:
            f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: no disk used, but larger than any manifest
        with pytest.raises(IntegrityError):
            Subscriber(str(url), TorchModuleApplier(replica_weights()), ack=False).update()
        publisher = Publisher(trainer_weights(), str(url))
        with pytest.raises(IntegrityError):
            publisher.publish(0)  # the first publish opens the prefix
            publisher.flush()
        with contextlib.suppress(DeltaSyncError):
            publisher.close()
        assert main(["status", str(url)]) == 2
        assert "IntegrityError" in capsys.readouterr().err

    @pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
    def test_inspect_refuses_special_files(self, tmp_path: Path, special: str, capsys: Any) -> None:
        from deltasync.cli import main

        path = tmp_path / "x.safetensors"
        if special == "fifo":
            os.mkfifo(path)
        else:
            path = Path(special)
        done: list[int] = []
        thread = threading.Thread(target=lambda: done.append(main(["inspect", str(path)])), daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert done == [2], "inspect blocked or read forever"
        assert "not a regular file" in capsys.readouterr().err


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``path`` (root only)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class TestFullDisk:
    def test_trainer_keeps_training_nothing_partial_and_publishing_resumes(self, tmp_path: Path) -> None:
        """A real 1 MiB filesystem: the anchor fits, then ballast fills the disk. Publishes fail on the
        error channel (never in publish()), no version becomes visible, no temp file stays, and once
        space returns the next publish commits a version the replica applies exactly."""
        with small_filesystem(tmp_path / "disk", "1m") as disk:
            url = str(disk / "store")
            weights = {"w": torch.randn(256, 256)}  # a 128 KiB anchor
            replica = {"w": torch.zeros(256, 256, dtype=torch.bfloat16)}
            with Publisher(weights, url) as publisher:
                publish(publisher, 0)
                sub = Subscriber(url, TorchModuleApplier(replica), ack=False)
                assert sub.update() is not None
                ballast = disk / "ballast"
                with open(ballast, "wb") as f, contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 65536)
                manifest = Path(url, MANIFEST_KEY).read_bytes()
                for v in range(1, 4):
                    weights["w"].add_(torch.randn(256, 256) * 0.5)  # dense changes: large deltas
                    publisher.publish(v, block=True)  # the trainer is never interrupted
                with pytest.raises(StoreError, match="(?i)no space|full"):
                    publisher.flush()
                assert publisher.stats.failed >= 1
                assert Path(url, MANIFEST_KEY).read_bytes() == manifest  # nothing partial is visible
                assert sub.update() is None and sub.version == 0
                assert not [p for p in Path(url).rglob("*") if p.name.startswith(".tmp-")]
                ballast.unlink()  # space returns
                publisher.publish(4, block=True)
                publisher.flush()
                time.sleep(0)  # nothing to wait for: flush() returned after the commit
                assert sub.update() is not None
                assert_exact(weights, replica)


class TestConstructorArguments:
    @pytest.mark.parametrize(
        ("options", "argument"),
        [
            ({"anchor_every": 0}, "anchor_every"),
            ({"anchor_every": -3}, "anchor_every"),
            ({"anchor_ratio": float("nan")}, "anchor_ratio"),
            ({"lease_s": 0}, "lease_s"),
            ({"lease_s": -1.0}, "lease_s"),
            ({"retire_grace_s": float("inf")}, "retire_grace_s"),
            ({"codec": "nope"}, "codec"),
            ({"codec": "dense"}, "codec"),
            ({"level": 99}, "level"),
            ({"chunk": 0}, "chunk"),
            ({"part_bytes": -1}, "part_bytes"),
            ({"keep_anchors": 0}, "keep_anchors"),
            ({"dtype": torch.int8}, "dtype"),
            ({"on_publish": 3}, "on_publish"),
            ({"format_version": 2}, "format_version"),
            ({"format_version": "4"}, "format_version"),
        ],
    )
    def test_publisher(self, tmp_path: Path, options: dict[str, Any], argument: str) -> None:
        with pytest.raises(ConfigError, match=argument) as caught:
            Publisher(trainer_weights(), str(tmp_path / "s"), **options)
        assert caught.value.argument == argument
        assert not (tmp_path / "s").exists()  # refused before anything is written

    def test_publisher_model_type(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="model must be"):
            Publisher([torch.randn(3)], str(tmp_path / "s"))  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("options", "argument"),
        [
            ({"poll_interval": 0}, "poll_interval"),
            ({"poll_interval": -1}, "poll_interval"),
            ({"max_poll_interval": float("nan")}, "max_poll_interval"),
            ({"poll_interval": 5, "max_poll_interval": 1}, "max_poll_interval"),
            ({"fetch_workers": 0}, "fetch_workers"),
            ({"on_update": "x"}, "on_update"),
            ({"start_version": -1, "run_id": "r"}, "start_version"),
            ({"start_version": 3}, "start_version"),
        ],
    )
    def test_subscriber(self, tmp_path: Path, options: dict[str, Any], argument: str) -> None:
        with pytest.raises(ConfigError, match=argument) as caught:
            Subscriber(str(tmp_path / "s"), TorchModuleApplier(replica_weights()), **options)
        assert caught.value.argument == argument

    def test_subscriber_needs_an_applier(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="TorchModuleApplier"):
            Subscriber(str(tmp_path / "s"), replica_weights())  # type: ignore[arg-type]

    def test_replica_of_another_model_is_told_what_differs(self, run: Any) -> None:
        url, _, _ = run
        other = {"w": torch.zeros(32, 24, dtype=torch.bfloat16), "extra": torch.zeros(3, dtype=torch.bfloat16)}
        sub = Subscriber(url, TorchModuleApplier(other), ack=False)
        with pytest.raises(
            FingerprintMismatch, match=r"missing here: \['b'\]; not in the run: \['extra'\]"
        ):
            sub.update()
        assert torch.count_nonzero(other["w"]) == 0


class TestServerAnswers:
    """A vLLM follower's URL may point at something else (another service, a proxy's error page) or a server
    that breaks off: every answer that is not the JSON a server sends is a typed refusal naming the URL."""

    @pytest.mark.parametrize(
        ("body", "length", "match"),
        [(b"<html>502 Bad Gateway</html>", None, "other than JSON"), (b"[" * 100_000, None, "other than JSON"),
         (b'{"results": [', 4096, "broke off"), (b'{"detail": "Not Found"}', None, "without a list of results"),
         (b"[1]", None, "without a list of results")],
        ids=["html", "deep", "cut", "other-object", "list"],
    )
    def test_an_answer_that_is_not_json_is_a_typed_refusal(self, body: bytes, length: int | None, match: str) -> None:
        from deltasync.appliers.vllm.rpc import ServerEngine
        from tests.http_helpers import answering

        with answering(body, length) as url:
            with pytest.raises(DeltaSyncError, match=match) as caught:
                ServerEngine(url, timeout=5).rpc("deltasync_version")
        assert url in str(caught.value)
