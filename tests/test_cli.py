"""The ``deltasync`` command line, run as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from queue import Empty, Queue
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltasync.appliers import TorchModuleApplier
from deltasync.cli import main
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest
from deltasync.publish.publisher import Publisher
from deltasync.replica.subscriber import Subscriber
from deltasync.stores import LocalStore

GOLDEN = Path(__file__).parent / "golden"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deltasync.cli", *args], capture_output=True, text=True, timeout=120)


class TestInspect:
    def test_table(self) -> None:
        result = run("inspect", str(GOLDEN / "delta_v1_compact.safetensors"))
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert "delta version 2 (base 1), format v1" in out
        assert "5 of 104 changed" in out and "embed.weight" in out and "compact" in out

    def test_a_directory_a_manifest_and_an_anchor(self, trainer: Any) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(1))
        for target, says in ((url, "is a directory"), (f"{url}/manifest.json", "is JSON, not a delta")):
            result = run("inspect", target)
            assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr
        anchor = next(Path(url).glob("anchors/*.safetensors"))
        result = run("inspect", str(anchor))
        assert "(whole tensors)" in result.stdout and "sparsity" not in result.stdout
        result = run("inspect", "--json", str(anchor))
        info = json.loads(result.stdout)
        assert info["sparsity"] is None and info["dense_bytes"] > 0

    def test_json(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["inspect", "--json", str(GOLDEN / "delta_v1_raw.safetensors")]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["kind"] == "delta" and info["nnz"] == 5
        assert {t["name"]: t["codec"] for t in info["tensors"]} == {"embed.weight": "raw", "norm.weight": "raw"}
        assert sum(t["bytes"] for t in info["tensors"]) == 5 * 6
        assert info["dense_bytes"] == 2 * sum(t["shape"][0] * (t["shape"][1] if len(t["shape"]) > 1 else 1)
                                              for t in info["tensors"])

    def test_a_packed_delta_shows_its_streams_and_header(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        from deltasync.format import encode_delta
        from deltasync.publish.diff import Snapshot, diff

        base = {"embed.weight": torch.zeros(12, 8, dtype=torch.bfloat16), "norm.weight": torch.ones(8, dtype=torch.bfloat16)}
        target = {k: v.clone() for k, v in base.items()}
        target["embed.weight"].view(-1)[[0, 5, 77]] += 1
        path = tmp_path / "delta.safetensors"
        path.write_bytes(data := encode_delta(diff(Snapshot.capture(base), target), version=2, base_version=1))
        assert main(["inspect", "--json", str(path)]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["format_version"] == 4 and info["header_bytes"] == 8 + int.from_bytes(data[:8], "little")
        assert [t["name"] for t in info["tensors"]] == ["embed.weight"]
        assert 0 < info["tensors"][0]["bytes"] == len(data) - info["header_bytes"]  # its streams, not "streams"
        assert main(["inspect", str(path)]) == 0
        assert "(packed, format 4)" in capsys.readouterr().out

    def test_refused_file_is_a_clear_error(self, tmp_path: Path) -> None:
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
        result = run("inspect", str(bad))
        assert result.returncode == 2
        assert "DeltaFormatError" in result.stderr and "JSON" in result.stderr

    @pytest.mark.parametrize("offsets", [None, [0], "0-9", [9, 0], [0, 1 << 40]], ids=["none", "one", "text", "reversed", "past-end"])
    def test_an_entry_with_impossible_offsets_is_a_clear_error(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], offsets: Any
    ) -> None:
        """The sizes per tensor come from each entry's byte range: one that is missing, malformed or past the
        file is the typed refusal a replica would give, not a traceback."""
        from tests.format_helpers import with_header

        def edit(header: dict[str, Any]) -> None:
            entry = header[next(k for k in header if k != "__metadata__")]
            if offsets is None:
                del entry["data_offsets"]
            else:
                entry["data_offsets"] = offsets

        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(with_header((GOLDEN / "delta_v1_compact.safetensors").read_bytes(), edit))
        assert main(["inspect", str(bad)]) == 2
        assert "DeltaFormatError" in capsys.readouterr().err

    def test_missing_file(self, tmp_path: Path) -> None:
        result = run("inspect", str(tmp_path / "nope"))
        assert result.returncode == 2 and "No such file" in result.stderr

    def test_store_url(self, servers, capsys: pytest.CaptureFixture[str]) -> None:
        from deltasync.stores import open_store

        server = servers["get"]("s3")
        with open_store(server.store_url("cli"), **server.store_options()) as store:
            store.put("deltas/000002.safetensors", (GOLDEN / "delta_v1_compact.safetensors").read_bytes())
        # Credentials and endpoint come from the environment, as a user's shell would provide them.
        env = {
            "AWS_ENDPOINT_URL": server.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": server.region,
            "AWS_ACCESS_KEY_ID": server.access_key_id, "AWS_SECRET_ACCESS_KEY": server.secret_access_key,
        }
        result = subprocess.run(
            [sys.executable, "-m", "deltasync.cli", "inspect", "--json", server.store_url("cli") + "/deltas/000002.safetensors"],
            capture_output=True, text=True, timeout=120, env={**os.environ, **env},
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["version"] == 2


# ---------------------------------------------------------------------- status, gc, watch

# Never let a publish coalesce or add an anchor unless a test asks: versions stay predictable.
NO_EXTRA_ANCHORS = {"anchor_every": 1000, "anchor_ratio": 1000.0}


class Tiny(torch.nn.Module):
    """A small model with a tied head (published once, as ``embed.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight


def train_step(model: torch.nn.Module, gen: torch.Generator, fraction: float = 0.03) -> None:
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=gen) < fraction
            p.add_(mask * torch.randn(p.shape, generator=gen) * 0.05)


def publish_steps(publisher: Publisher, model: torch.nn.Module, gen: torch.Generator, steps: range) -> None:
    for step in steps:
        if step:
            train_step(model, gen)
        publisher.publish(step, block=True)
    publisher.flush()


def published_bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).view(torch.int16) for n, p in model.named_parameters()}


def checkpoint_bits(directory: Path) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16) for n, t in load_file(directory / "model.safetensors").items()}


def assert_bit_exact(directory: Path, model: torch.nn.Module) -> None:
    got, want = checkpoint_bits(directory), published_bits(model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def state_of(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "deltasync.json").read_text())


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[tuple[str, Tiny, Publisher, torch.Generator]]:
    torch.manual_seed(0)
    model, url = Tiny(), str(tmp_path / "run")
    publisher = Publisher(model, url, **NO_EXTRA_ANCHORS)
    yield url, model, publisher, torch.Generator().manual_seed(1)
    publisher.close()


class TestWatch:
    def test_the_model_files_are_copied_or_their_absence_said(self, trainer: Any, tmp_path: Path) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(2))
        base = tmp_path / "base"
        base.mkdir()
        for name in ("config.json", "tokenizer.json", "generation_config.json"):
            (base / name).write_text("{}")
        (base / "model.safetensors").write_bytes(b"not copied")
        bare = run("watch", url, "--model", str(tmp_path / "bare"), "--once", "--no-ack")
        assert bare.returncode == 0 and "holds the weights only" in bare.stdout and "from nothing" in bare.stdout
        full = run("watch", url, "--model", str(tmp_path / "full"), "--once", "--no-ack", "--copy-config", str(base))
        assert full.returncode == 0, full.stderr
        assert "copied config.json, generation_config.json, tokenizer.json" in full.stdout
        assert "weights only" not in full.stdout and (tmp_path / "full" / "tokenizer.json").exists()
        assert_bit_exact(tmp_path / "full", model)

    def test_initialise_then_resume_with_deltas_only(self, trainer: Any, tmp_path: Path) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(3))
        ckpt = tmp_path / "ckpt"
        first = run("watch", url, "--model", str(ckpt), "--once", "--no-ack")
        assert first.returncode == 0, first.stderr
        assert "initialised" in first.stdout and "v2" in first.stdout
        assert_bit_exact(ckpt, model)
        assert state_of(ckpt)["version"] == 2 and state_of(ckpt)["clean"] is True
        assert not (ckpt / ".deltasync-init").exists()

        publish_steps(publisher, model, gen, range(3, 5))
        # Without its anchor objects the store can only serve deltas: a resume must not need one.
        for anchor in (Path(url) / "anchors").iterdir():
            anchor.unlink()
        second = run("watch", url, "--model", str(ckpt), "--once", "--no-ack")
        assert second.returncode == 0, second.stderr
        assert "v2 of run" in second.stdout and "from v2 via span" in second.stdout
        assert "anchor" not in second.stdout
        assert_bit_exact(ckpt, model)
        assert state_of(ckpt)["version"] == 4

        third = run("watch", url, "--model", str(ckpt), "--once", "--no-ack")
        assert third.returncode == 0 and "up to date at v4" in third.stdout

    def test_a_pinned_checkpoint_goes_back_exactly_and_follows_at_most(self, trainer: Any, tmp_path: Path) -> None:
        url, model, publisher, gen = trainer
        bits = []
        for step in range(5):
            publish_steps(publisher, model, gen, range(step, step + 1))
            bits.append(published_bits(model))
        ckpt = tmp_path / "ckpt"
        assert run("watch", url, "--model", str(ckpt), "--once", "--no-ack").returncode == 0
        back = run("watch", url, "--model", str(ckpt), "--once", "--no-ack", "--version", "1")
        assert back.returncode == 0, back.stderr
        assert "v1 (step 1) from v4 via anchor" in back.stdout and state_of(ckpt)["version"] == 1
        assert all(torch.equal(checkpoint_bits(ckpt)[n], t) for n, t in bits[1].items())
        capped = run("watch", url, "--model", str(ckpt), "--once", "--no-ack", "--at-most", "3")
        assert capped.returncode == 0 and "v3 (step 3) from v1" in capped.stdout and "anchor" not in capped.stdout
        assert all(torch.equal(checkpoint_bits(ckpt)[n], t) for n, t in bits[3].items())
        stays = run("watch", url, "--model", str(ckpt), "--once", "--no-ack", "--at-most", "2")
        assert stays.returncode == 0 and "up to date at v3" in stays.stdout
        both = run("watch", url, "--model", str(ckpt), "--once", "--version", "1", "--at-most", "2")
        assert both.returncode == 2 and "not allowed with" in both.stderr

    def test_through_a_shared_cache(self, trainer: Any, tmp_path: Path) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(3))
        cache = tmp_path / "cache"
        for name in ("a", "b"):  # two replicas on one machine: the second reads the first's downloads
            done = run("watch", url, "--model", str(tmp_path / name), "--once", "--no-ack", "--cache-dir", str(cache))
            assert done.returncode == 0, done.stderr
            assert_bit_exact(tmp_path / name, model)
        assert any(p.suffix == ".safetensors" for p in cache.rglob("*"))

    def test_corrupt_delta_leaves_checkpoint_unchanged(self, trainer: Any, tmp_path: Path) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(2))
        ckpt = tmp_path / "ckpt"
        assert run("watch", url, "--model", str(ckpt), "--once", "--no-ack").returncode == 0
        before = (ckpt / "model.safetensors").read_bytes(), state_of(ckpt)["version"]
        publish_steps(publisher, model, gen, range(2, 4))
        manifest = Manifest.from_bytes((Path(url) / MANIFEST_KEY).read_bytes())
        delta = Path(url) / manifest.entry(2).delta[0].key  # type: ignore[union-attr]
        data = bytearray(delta.read_bytes())
        data[-1] ^= 0xFF
        delta.write_bytes(bytes(data))

        result = run("watch", url, "--model", str(ckpt), "--once", "--no-ack")
        assert result.returncode == 2
        assert "IntegrityError" in result.stderr and "Traceback" not in result.stderr
        assert ((ckpt / "model.safetensors").read_bytes(), state_of(ckpt)["version"]) == before
        assert state_of(ckpt)["clean"] is True

    def test_torn_checkpoint_is_repaired_from_an_anchor(self, trainer: Any, tmp_path: Path) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(3))
        ckpt = tmp_path / "ckpt"
        assert run("watch", url, "--model", str(ckpt), "--once", "--no-ack").returncode == 0
        # As if killed mid-apply: half-written elements, state not clean.
        state = state_of(ckpt) | {"clean": False}
        (ckpt / "deltasync.json").write_text(json.dumps(state))
        with open(ckpt / "model.safetensors", "r+b") as f:
            f.seek(-64, os.SEEK_END)
            f.write(b"\x7f" * 64)
        publish_steps(publisher, model, gen, range(3, 4))
        result = run("watch", url, "--model", str(ckpt), "--once", "--no-ack")
        assert result.returncode == 0, result.stderr
        assert "no resumable version" in result.stdout and "via anchor" in result.stdout
        assert_bit_exact(ckpt, model)
        assert state_of(ckpt)["clean"] is True and state_of(ckpt)["version"] == 3

    def test_follows_until_ctrl_c(self, trainer: Any, tmp_path: Path) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(2))
        ckpt = tmp_path / "ckpt"
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltasync.cli", "watch", url, "--model", str(ckpt), "--interval", "0.1",
             "--replica-id", "follower"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # a hang is diagnosed, not just timed out
        )
        lines: Queue[str] = Queue()
        errors: list[str] = []  # drained as it comes: a full stderr pipe would block the watcher
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)  # type: ignore[union-attr]
        reader.start()
        drain = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        drain.start()

        def wait_for(text: str) -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if text in lines.get(timeout=1):
                        return
                except Empty:
                    continue
            proc.kill()
            drain.join(timeout=10)
            raise AssertionError(f"watch never printed {text!r}: {''.join(errors)}")

        try:
            wait_for("watching")
            publish_steps(publisher, model, gen, range(2, 4))
            wait_for("v3 (step 3)")
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
                proc.wait(timeout=10)
                drain.join(timeout=10)
                raise AssertionError(f"watch did not stop on SIGINT: {''.join(errors)}") from None
        finally:
            proc.kill()
        reader.join(timeout=10)
        drain.join(timeout=10)
        out, err = "".join(lines.queue), "".join(errors)
        assert proc.returncode == 0, err
        assert "stopped at v3" in out and "Traceback" not in err
        assert_bit_exact(ckpt, model)
        ack = json.loads((Path(url) / "acks" / "follower.json").read_text())
        assert ack["version"] == 3

    def test_nothing_published(self, tmp_path: Path) -> None:
        result = run("watch", str(tmp_path / "empty"), "--model", str(tmp_path / "ckpt"), "--once")
        assert result.returncode == 2 and "nothing published" in result.stderr
        assert not (tmp_path / "ckpt" / "model.safetensors").exists()

    def test_checkpoint_in_another_dtype_is_refused(self, trainer: Any, tmp_path: Path) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(1))
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        save_file({n: p.detach().float().contiguous() for n, p in model.named_parameters()}, ckpt / "model.safetensors")
        result = run("watch", url, "--model", str(ckpt), "--once")
        assert result.returncode == 2
        assert "TensorMismatch" in result.stderr and "F32" in result.stderr and "BF16" in result.stderr


class TestStatus:
    def test_versions_anchors_and_replica_lag(self, trainer: Any, capsys: pytest.CaptureFixture[str]) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(2))
        stale = Tiny()
        with Subscriber(url, TorchModuleApplier(stale), replica_id="replica-stale") as sub:
            assert sub.update() is not None
        publish_steps(publisher, model, gen, range(2, 4))
        current = Tiny()
        with Subscriber(url, TorchModuleApplier(current), replica_id="replica-current") as sub:
            assert sub.update() is not None

        assert main(["status", "--json", url]) == 0
        info = json.loads(capsys.readouterr().out)
        manifest = Manifest.from_bytes((Path(url) / MANIFEST_KEY).read_bytes())
        assert info["run_id"] == manifest.run_id and info["fingerprint"] == manifest.fingerprint
        assert info["latest"]["version"] == 3 and info["latest"]["step"] == 3 and info["lease_live"]
        assert [a["version"] for a in info["anchors"]] == [0]
        assert [v["version"] for v in info["versions"]] == [3, 2, 1, 0]
        v3 = info["versions"][0]
        assert v3["kinds"] == ["delta"] and v3["nnz"] == manifest.entry(3).nnz  # type: ignore[union-attr]
        assert v3["sparsity"] == pytest.approx(1 - v3["nnz"] / manifest.numel)
        assert info["total_bytes"] == sum(o.size for v in manifest.versions for o in v.objects())
        lag = {r["replica"]: r["lag_versions"] for r in info["replicas"]}
        assert lag == {"replica-current": 0, "replica-stale": 2}

        assert main(["status", url, "--versions", "2"]) == 0
        out = capsys.readouterr().out
        assert manifest.run_id in out and "lease live" in out and "v3 (step 3)" in out
        assert "replica-stale" in out and "delta" in out and "anchors    v0" in out

    def test_missing_manifest(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["status", str(tmp_path / "nowhere")]) == 2
        assert "nothing has been published" in capsys.readouterr().err
        assert not (tmp_path / "nowhere").exists()  # a read leaves no directory behind
        (tmp_path / "empty").mkdir()
        assert main(["status", str(tmp_path / "empty")]) == 2
        assert "no manifest.json" in capsys.readouterr().err

    def test_url_credentials_are_not_printed(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["status", "ftp://user:hunter2@host/run?token=hunter3"]) == 2
        out, err = capsys.readouterr()
        assert "ftp://host/run" in err and "hunter" not in out + err

    def test_s3_through_the_environment(self, servers: dict[str, Any]) -> None:
        server = servers["get"]("s3")
        url = server.store_url(f"status-{os.getpid()}-{time.monotonic_ns()}")
        torch.manual_seed(0)
        model = Tiny()
        with Publisher(model, url, **server.store_options(), **NO_EXTRA_ANCHORS) as publisher:
            publish_steps(publisher, model, torch.Generator().manual_seed(1), range(3))
        env = {
            "AWS_ENDPOINT_URL": server.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": server.region,
            "AWS_ACCESS_KEY_ID": server.access_key_id, "AWS_SECRET_ACCESS_KEY": server.secret_access_key,
        }
        result = subprocess.run(
            [sys.executable, "-m", "deltasync.cli", "status", "--json", url],
            capture_output=True, text=True, timeout=120, env={**os.environ, **env},
        )
        assert result.returncode == 0, result.stderr
        info = json.loads(result.stdout)
        assert info["store"] == url and info["latest"]["version"] == 2
        assert server.secret_access_key not in result.stdout + result.stderr
        assert server.access_key_id not in result.stdout + result.stderr


def orphan(url: str, key: str, age_s: float) -> int:
    path = Path(url) / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"left by a crashed publish")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path.stat().st_size


class TestGc:
    def test_orphans_dry_run_then_delete(self, trainer: Any, capsys: pytest.CaptureFixture[str]) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(2))
        old = orphan(url, "deltas/0000000099-deadbeef.safetensors", age_s=7200)
        orphan(url, "anchors/0000000099-cafecafe-part0000.safetensors", age_s=10)  # maybe still uploading

        assert main(["gc", url, "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "would delete orphan   deltas/0000000099-deadbeef.safetensors" in out
        assert "cafecafe" not in out and f"would free {old} B ({old:,} bytes) in 1 objects" in out
        assert (Path(url) / "deltas/0000000099-deadbeef.safetensors").exists()

        assert main(["gc", url]) == 0
        out = capsys.readouterr().out
        assert f"freed {old} B" in out and "deleted orphan" in out
        assert not (Path(url) / "deltas/0000000099-deadbeef.safetensors").exists()
        assert (Path(url) / "anchors/0000000099-cafecafe-part0000.safetensors").exists()
        # Everything the manifest names is still there.
        manifest = Manifest.from_bytes((Path(url) / MANIFEST_KEY).read_bytes())
        assert all((Path(url) / o.key).exists() for v in manifest.versions for o in v.objects())

    def test_live_writer_protects_young_orphans(self, trainer: Any, capsys: pytest.CaptureFixture[str]) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(1))
        orphan(url, "deltas/0000000099-deadbeef.safetensors", age_s=60)
        assert main(["gc", url, "--grace", "0"]) == 0
        out = capsys.readouterr().out
        assert "lease is live" in out and "in 0 objects" in out
        assert (Path(url) / "deltas/0000000099-deadbeef.safetensors").exists()

    @staticmethod
    def _retire(url: str, *, lease_s: float) -> tuple[Manifest, list[str]]:
        """Publish so that retention retires version 0 and 1 (one anchor kept)."""
        torch.manual_seed(0)
        model, gen = Tiny(), torch.Generator().manual_seed(1)
        with Publisher(model, url, anchor_every=2, anchor_ratio=1000.0, keep_anchors=1, lease_s=lease_s) as publisher:
            publish_steps(publisher, model, gen, range(3))
        path = Path(url) / MANIFEST_KEY
        if lease_s > 1:  # close() released the lease: put back a live one, as a running trainer holds
            raw = json.loads(path.read_bytes())
            raw["lease_until"] = time.time() + lease_s
            path.write_text(json.dumps(raw))
        manifest = Manifest.from_bytes(path.read_bytes())
        from deltasync.protocol.retired import read_retired

        # Retired keys are listed beside the manifest, which replicas re-read: it stays O(live versions).
        assert manifest.retired == ()
        retired = [k for k, _ in read_retired(LocalStore(url)).entries]
        assert retired and all((Path(url) / k).exists() for k in retired)
        return manifest, retired

    def test_retired_objects_removed_with_compare_and_swap(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        url = str(tmp_path / "run")
        before, retired = self._retire(url, lease_s=0.01)
        time.sleep(0.05)  # the lease runs out

        assert main(["gc", url, "--grace", "0", "--dry-run"]) == 0
        assert all(f"would delete retired  {k}" in capsys.readouterr().out for k in retired[:1])
        assert all((Path(url) / k).exists() for k in retired)

        assert main(["gc", url, "--grace", "0"]) == 0
        out = capsys.readouterr().out
        assert all(f"deleted retired  {k}" in out for k in retired)
        assert not any((Path(url) / k).exists() for k in retired)
        after = Manifest.from_bytes((Path(url) / MANIFEST_KEY).read_bytes())
        assert after.retired == () and after.versions == before.versions and after.writer == before.writer

    def test_retired_objects_wait_for_their_grace(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        url = str(tmp_path / "run")
        _, retired = self._retire(url, lease_s=0.01)
        assert main(["gc", url]) == 0  # default grace: 300 s
        assert "in 0 objects" in capsys.readouterr().out
        assert all((Path(url) / k).exists() for k in retired)

    def test_live_lease_leaves_the_manifest_alone(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        url = str(tmp_path / "run")
        _, retired = self._retire(url, lease_s=600)
        before = (Path(url) / MANIFEST_KEY).read_bytes()
        assert main(["gc", url, "--grace", "0"]) == 0
        assert "holds the lease" in capsys.readouterr().out
        assert (Path(url) / MANIFEST_KEY).read_bytes() == before
        assert all((Path(url) / k).exists() for k in retired)

    def test_no_compare_and_swap_skips_manifest_edits(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        url = str(tmp_path / "run")
        _, retired = self._retire(url, lease_s=0.01)
        time.sleep(0.05)
        monkeypatch.setattr(LocalStore, "conditional_writes", False)
        assert main(["gc", url, "--grace", "0"]) == 0
        assert "no compare-and-swap" in capsys.readouterr().out
        assert all((Path(url) / k).exists() for k in retired)

    def test_missing_manifest(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["gc", str(tmp_path / "nowhere")]) == 2
        assert "no manifest.json" in capsys.readouterr().err

    def test_acks_of_gone_replicas_and_other_runs_are_removed(self, trainer: Any, capsys: pytest.CaptureFixture[str]) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(1))
        run_id = Manifest.from_bytes((Path(url) / MANIFEST_KEY).read_bytes()).run_id
        acks = Path(url) / "acks"
        acks.mkdir(exist_ok=True)
        now = time.time()
        (acks / "alive.json").write_text(json.dumps({"replica": "alive", "version": 0, "run_id": run_id, "time": now}))
        (acks / "gone.json").write_text(json.dumps({"replica": "gone", "version": 0, "run_id": run_id, "time": now - 90}))
        (acks / "old-run.json").write_text(json.dumps({"replica": "o", "version": 9, "run_id": "another", "time": now}))
        (acks / "garbage.json").write_text("{not json")
        assert main(["gc", url, "--ack-ttl", "60"]) == 0
        out = capsys.readouterr().out
        assert sorted(p.name for p in acks.iterdir()) == ["alive.json"]
        assert "deleted ack      acks/gone.json" in out and "acks/old-run.json" in out


class TestLeftovers:
    """What a killed trainer leaves: found by status, reclaimed by gc and at once by the next writer."""

    def test_unfinished_writes_are_counted_and_reclaimed_by_age(self, trainer: Any, capsys: Any) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(2))
        publisher.close()
        stale = orphan(url, "anchors/.tmp-0123456789abcdef", age_s=7200)
        fresh = orphan(url, ".tmp-fedcba9876543210", age_s=5)  # a manifest write in progress, maybe
        assert main(["status", url, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["leftovers"] == 2 and info["leftover_bytes"] == stale + fresh
        assert info["last_committed"] == {"version": 1, "step": 1}
        assert main(["gc", url]) == 0
        out = capsys.readouterr().out
        assert "deleted orphan   anchors/.tmp-0123456789abcdef" in out
        assert "kept 1 objects" in out and "--grace 0" in out  # says what it keeps, why, and the flag
        assert not (Path(url) / "anchors/.tmp-0123456789abcdef").exists()
        assert (Path(url) / ".tmp-fedcba9876543210").exists()

    def test_a_takeover_reclaims_a_dead_writers_uploads_and_temp_files_at_once(self, trainer: Any) -> None:
        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(2))  # the writer "dies": its lease stays live
        uploads = [orphan(url, f"deltas/0000000002-{publisher.writer[:8]}-0001.safetensors", age_s=1),
                   orphan(url, "anchors/.tmp-00000000000000000000000000000001", age_s=1)]
        assert all(uploads)
        with Publisher(model, url, takeover=True) as second:
            second.publish(2, block=True)
            second.flush()
            keys = {i.key for p in ("deltas/", "anchors/") for i in LocalStore(url).list(p)}
            assert all(k.split("/")[1].split("-")[1] in (publisher.writer[:8], second.writer[:8]) for k in keys)
        assert not (Path(url) / f"deltas/0000000002-{publisher.writer[:8]}-0001.safetensors").exists()
        assert list(LocalStore(url).temporaries()) == []

    def test_a_live_lease_is_refused_before_the_model_is_copied(self, trainer: Any, monkeypatch: Any) -> None:
        import deltasync.publish.publisher as publisher_module
        from deltasync.errors import ConflictError

        url, model, publisher, gen = trainer
        publish_steps(publisher, model, gen, range(1))
        copies = []
        monkeypatch.setattr(publisher_module.Snapshot, "capture", classmethod(lambda cls, *a, **k: copies.append(a)))
        with pytest.raises(ConflictError, match=r"lease runs \d+ s more .* UTC"):
            Publisher(Tiny(), url).publish(0)
        assert copies == []

    def test_last_committed(self, trainer: Any) -> None:
        from deltasync import last_committed

        url, model, publisher, gen = trainer
        assert last_committed(url) is None
        publish_steps(publisher, model, gen, range(3))
        got = last_committed(url)
        assert got is not None and (got.version, got.step) == (2, 2) and got.writer == publisher.writer
        assert got.lease_left_s > 0
        publisher.close()
        assert last_committed(url).lease_left_s == 0


def test_a_damaged_payload_and_a_wrong_base_are_told_apart(tmp_path: Path) -> None:
    """A delta's bytes altered after publishing (with a manifest forged to match) vs a receiver whose weights
    are not the delta's base: both refused, each error naming the side at fault."""
    from deltasync.errors import IntegrityError
    from deltasync.format import decode, encode_delta
    from deltasync.publish.diff import Snapshot, diff

    weights = {"w": torch.randn(4096) * 0.02}
    snapshot = Snapshot.capture(weights)
    weights["w"][::7] *= 1.01
    data = bytearray(encode_delta(diff(snapshot, weights), version=1, base_version=0))
    base = {"w": snapshot["w"].clone()}
    applier = TorchModuleApplier(base)
    # Alter the values part into another valid zstd frame, keeping the header (and its entry digest) as is.
    import zstandard

    from deltasync.format import file_entries, raw_header, serialize

    metadata = raw_header(bytes(data))["__metadata__"]
    entries = {k: v.clone() for k, v in file_entries(bytes(data)).items()}
    plain = bytearray(zstandard.ZstdDecompressor().decompress(entries["w::val"].numpy().tobytes()))
    plain[0] ^= 0x02
    entries["w::val"] = torch.frombuffer(bytearray(zstandard.ZstdCompressor().compress(bytes(plain))), dtype=torch.uint8)
    damaged = serialize(entries, metadata)
    with pytest.raises(IntegrityError, match="altered after it was written"):
        decode(damaged, base=applier.lookup)
    base["w"].view(torch.int16)[::7] += 1  # a receiver one step off the delta's base
    with pytest.raises(IntegrityError, match="does not hold the delta's base"):
        decode(bytes(data), base=TorchModuleApplier(base).lookup)


def test_cli_into_a_closed_pipe_exits_quietly(trainer: Any) -> None:
    """``deltasync status URL | head -1``: the reader goes away; no BrokenPipeError traceback."""
    url, model, publisher, gen = trainer
    publish_steps(publisher, model, gen, range(3))
    process = subprocess.Popen(
        [sys.executable, "-m", "deltasync.cli", "status", url, "--versions", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    process.stdout.close()  # the reader is gone before the first line
    _, err = process.communicate(timeout=60)
    assert process.returncode in (0, 141) and b"Traceback" not in err, err.decode()


def test_a_replica_of_an_empty_store_waits_visibly_and_creates_nothing(tmp_path: Path, caplog: Any) -> None:
    import logging

    from deltasync import Subscriber

    url = tmp_path / "not-yet"
    with caplog.at_level(logging.INFO, logger="deltasync.subscriber"):
        sub = Subscriber(str(url), TorchModuleApplier({"w": torch.zeros(4)}))
        assert sub.poll() is None and sub.poll() is None
    assert not url.exists()  # a store it only reads is not created
    waiting = [r for r in caplog.records if "waiting for a first version" in r.getMessage()]
    assert len(waiting) == 1 and "is the trainer publishing to this URL" in waiting[0].getMessage()


def test_the_follower_waits_for_its_server_and_fails_in_one_line(tmp_path: Path) -> None:
    """Started before its server (none comes here), the follower says it waits, then gives up in one line;
    a wrong --model is one line too. No tracebacks."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    save_file({"w": torch.zeros(4)}, str(checkpoint / "model.safetensors"))
    base = [sys.executable, "-m", "deltasync.cli", "follow", "--store", str(tmp_path / "run"),
            "--server", "http://127.0.0.1:9"]
    done = subprocess.run([*base, "--model", str(checkpoint), "--wait-for-server", "2"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "waiting for the vLLM server at http://127.0.0.1:9" in done.stderr
    assert "no vLLM server answered" in done.stderr.splitlines()[-1]
    done = subprocess.run([*base, "--model", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "not a checkpoint directory" in done.stderr
