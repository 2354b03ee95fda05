"""Files handed to an engine's workers on the same machine (``deltasync.appliers.vllm.file_drop``).

The follower side and the worker side run here in one process, as they do in two
on one machine; ``tests/test_vllm.py`` and ``tests/test_trl.py`` run them in a real
engine and a real server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from deltasync.appliers.vllm.file_drop import DROP_PREFIX, FileDrop, drop_parent, read_dropped, sweep
from deltasync.errors import IntegrityError
from deltasync.format import digests
from deltasync.format.encode import encode_anchor


def _anchor() -> bytes:
    """An anchor file as a publisher writes it: its header lists a BLAKE3 of every tensor."""
    g = torch.Generator().manual_seed(0)
    return encode_anchor({"a.weight": torch.randn(64, 32, generator=g).bfloat16(),
                          "b.bias": torch.randn(17, generator=g).bfloat16()}, version=3)


def _worker(answers: list[dict[str, Any]]) -> Any:
    """A worker on this machine: reads what it is handed, as ``deltasync_read_dropped`` does."""

    def rpc(method: str, ref: dict[str, Any]) -> list[dict[str, Any]]:
        assert method == "deltasync_read_dropped"
        try:
            read_dropped(ref).release()
        except (OSError, IntegrityError) as exc:
            answers.append({"ok": False, "why": str(exc)})
        else:
            answers.append({"ok": True})
        return answers[-1:]

    return rpc


def test_files_are_read_back_exactly_and_removed_after_the_call(tmp_path: Path) -> None:
    answers: list[dict[str, Any]] = []
    drop, rpc = FileDrop(parent=tmp_path), _worker(answers)
    assert drop.readable(rpc) and answers == [{"ok": True}]
    assert drop.readable(rpc) and len(answers) == 1  # asked once
    blobs = [os.urandom(100_000), memoryview(bytearray(b"\x01" * 4096)), b""]
    with drop.files(blobs) as refs:
        assert [r["size"] for r in refs] == [100_000, 4096, 0]
        for ref, blob in zip(refs, blobs):
            assert ref["blake3"] == digests.hexdigest([blob], "blake3")
            got = read_dropped(ref)
            assert bytes(got) == bytes(blob)
            if ref["size"]:
                got[0] ^= 0xFF  # a private mapping: a decoder may write into it, the file stays as it was
                assert bytes(read_dropped(ref)) == bytes(blob)
        (folder,) = tmp_path.iterdir()
        assert folder.name.startswith(f"{DROP_PREFIX}{os.getpid()}-") and (folder.stat().st_mode & 0o777) == 0o700
    assert not any(folder.iterdir())  # removed as the call returned
    drop.close()
    assert not any(tmp_path.iterdir())


def test_a_failed_call_gives_the_drop_up_and_leaves_nothing(tmp_path: Path) -> None:
    drop = FileDrop(parent=tmp_path)
    assert drop.readable(_worker([]))
    with pytest.raises(RuntimeError, match="the engine went away"), drop.files([b"x" * 10]):
        raise RuntimeError("the engine went away")
    assert not drop.readable(_worker([]))  # later files travel as text
    assert not any(p for d in tmp_path.iterdir() for p in d.iterdir())
    drop.close()


def test_workers_that_cannot_read_the_drop_or_do_not_know_it_get_text(tmp_path: Path) -> None:
    def elsewhere(method: str, ref: dict[str, Any]) -> list[Any]:  # one rank on another machine
        return [{"ok": True}, {"ok": False, "why": "FileNotFoundError: no such file"}]

    assert not FileDrop(parent=tmp_path).readable(elsewhere)

    def older(method: str, ref: dict[str, Any]) -> list[Any]:
        raise RuntimeError(f"the worker extension has no method {method}")

    assert not FileDrop(parent=tmp_path).readable(older)
    # Each probe file was removed after its answer.
    assert not any(p for d in tmp_path.iterdir() for p in d.iterdir())


def test_an_anchor_is_referenced_by_its_header_and_checked_by_its_entries(tmp_path: Path) -> None:
    anchor, plain = _anchor(), safetensors.torch.save({"w": torch.ones(8, dtype=torch.bfloat16)})
    drop = FileDrop(parent=tmp_path)
    with drop.files([anchor, plain]) as (by_header, whole):
        size = 8 + int.from_bytes(anchor[:8], "little")
        assert by_header == {"path": by_header["path"], "size": len(anchor),
                             "header": [size, digests.hexdigest([anchor[:size]], "blake3")]}
        assert bytes(read_dropped(by_header)) == anchor
        # A safetensors file without per-tensor digests is referenced, and checked, whole.
        assert whole["blake3"] == digests.hexdigest([plain], "blake3") and "header" not in whole
        assert bytes(read_dropped(whole)) == plain
    drop.close()


def test_an_older_worker_that_checks_files_whole_answers_no_to_the_probe(tmp_path: Path) -> None:
    def older(method: str, ref: dict[str, Any]) -> list[Any]:  # an earlier release's check
        ok = isinstance(ref.get("blake3"), str)
        return [{"ok": ok} if ok else {"ok": False, "why": f"IntegrityError: malformed file reference {ref}"}]

    assert not FileDrop(parent=tmp_path).readable(older)


@pytest.mark.parametrize("kind", ["whole", "anchor"])
@pytest.mark.parametrize("change", ["size", "bytes", "header", "malformed", "relative", "missing", "link",
                                    "directory"])
def test_a_file_that_is_not_the_followers_is_refused(tmp_path: Path, change: str, kind: str) -> None:
    drop = FileDrop(parent=tmp_path)
    with drop.files([_anchor() if kind == "anchor" else b"weights" * 1000]) as (ref,):
        assert ("header" in ref) == (kind == "anchor")
        path = Path(ref["path"])
        expected: type[Exception] = IntegrityError
        if change == "size":
            path.write_bytes(path.read_bytes() + b"\0")
        elif change == "bytes":  # the same size, other bytes: another machine's file of the same name
            data = bytearray(path.read_bytes())
            data[-1] ^= 1  # an anchor's last tensor: covered by its entry's digest, not the header's
            path.write_bytes(bytes(data))
        elif change == "header":  # a byte of the header (a digest or a name), the tensors as they were
            data = bytearray(path.read_bytes())
            data[20] ^= 1
            path.write_bytes(bytes(data))
        elif change == "malformed":
            ref = {**ref, "blake3": "not a digest"} if kind == "whole" else {**ref, "header": [8, "not a digest"]}
        elif change == "relative":
            ref = {**ref, "path": path.name}
        elif change == "missing":
            path.unlink()
            expected = FileNotFoundError
        elif change == "link":
            target = path.with_suffix(".real")
            path.rename(target)
            path.symlink_to(target)
            expected = OSError
        else:
            path.unlink()
            path.mkdir()
        with pytest.raises(expected):
            read_dropped(ref)
        if change == "directory":
            path.rmdir()
    drop.close()


def test_a_killed_followers_directory_is_removed_by_the_next(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    left = tmp_path / f"{DROP_PREFIX}{dead}-abc123"
    left.mkdir()
    (left / "00000001.safetensors").write_bytes(b"x" * 1000)
    alive = tmp_path / f"{DROP_PREFIX}{os.getpid()}-def456"
    alive.mkdir()
    other = tmp_path / "deltasync-drop-notapid"
    other.mkdir()
    drop = FileDrop(parent=tmp_path)
    assert drop.readable(_worker([]))  # its first file sweeps the parent
    assert not left.exists() and alive.exists() and other.exists()
    assert sweep(tmp_path) == 0
    drop.close()


def test_the_drop_is_in_memory_where_the_machine_has_it() -> None:
    parent = drop_parent()
    assert parent.is_dir() and os.access(parent, os.W_OK)
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        assert parent == Path("/dev/shm")


def test_a_drop_switched_off_is_never_asked(tmp_path: Path) -> None:
    asked: list[Any] = []
    drop = FileDrop(parent=tmp_path, enabled=False)
    assert not drop.readable(lambda *call: asked.append(call) or [{"ok": True}])
    assert asked == [] and not any(tmp_path.iterdir())


def test_a_drop_never_closed_is_removed_when_collected(tmp_path: Path) -> None:
    import gc

    drop = FileDrop(parent=tmp_path)
    assert drop.readable(_worker([])) and len(list(tmp_path.iterdir())) == 1
    del drop
    gc.collect()
    assert not any(tmp_path.iterdir())
