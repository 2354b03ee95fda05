"""Hostile input to the stores: special files and symlinks in a local root, oversized objects,
full disks, and network calls that must not wait forever.

The URL cases and the ``max_bytes`` cases every backend runs live in ``tests/test_stores.py``
(the conformance suite); this file holds what needs a real filesystem trick or one backend's
internals. Full disks are tested twice: on a real tiny tmpfs where this machine lets the tests
mount one (root), and with ``ENOSPC`` injected into ``os.write`` / ``os.fsync`` everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import stat
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from deltasync.errors import IntegrityError, ObjectNotFound, StoreError
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest, ObjectRef
from deltasync.replica.cache import CachedStore
from deltasync.stores import LocalStore, open_store
from deltasync.stores.local import MAP_BYTES
from deltasync.stores.mounts import filesystem_of, mappable, mount_of

from .conftest import make_store

JOIN_S = 10.0  # liveness bound: a read that has not returned by then is blocked
FAST_S = 5.0  # a refusal takes microseconds; this only catches reading an endless file
MEMORY_BOUND = 1 << 20  # bytes a refused read may allocate (Python heap, tracemalloc)
TINY_FS_BYTES = 256 << 10  # size of the tmpfs the full-disk tests fill
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def tmp_files(root: Path) -> list[Path]:
    """Temporary files a write left behind."""
    return sorted(root.rglob(".tmp-*"))


def lock_files(cached: CachedStore) -> list[Path]:
    """Fill locks a cache left behind."""
    return [path for path in (cached.root / "locks").rglob("*") if not path.is_dir()]


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """Assert the block takes under :data:`FAST_S` and allocates under :data:`MEMORY_BOUND`."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - start < FAST_S
    assert peak < MEMORY_BOUND, f"refusing allocated {peak} bytes"


def every_read(store: LocalStore, key: str) -> dict[str, Callable[[], Any]]:
    """Each read operation of ``store`` on ``key``."""
    return {
        "get": lambda: store.get(key),
        "get max_bytes": lambda: store.get(key, max_bytes=10),
        "get_range": lambda: store.get_range(key, 0, 10),
        "get_if_changed": lambda: store.get_if_changed(key, None),
        "head": lambda: store.head(key),
    }


def assert_refused(store: LocalStore, key: str, what: str) -> None:
    """Every read of ``key`` raises the typed refusal naming ``what`` is there."""
    for op, read in every_read(store, key).items():
        refusal = rf"is not a regular file inside the store root \({what}\); refused"
        with pytest.raises(StoreError, match=refusal) as info:
            read()
        assert not isinstance(info.value, ObjectNotFound), op  # something is there, and it is refused
        assert (info.value.key, info.value.backend) == (key, "file"), op


@pytest.fixture
def local(tmp_path: Path) -> LocalStore:
    (tmp_path / "root").mkdir()  # the store creates its root on its first write; these tests plant files first
    return LocalStore(tmp_path / "root")


# ---------------------------------------------------------------------- large objects, mapped


def mapped(buffer: Any) -> bool:
    return isinstance(memoryview(buffer).obj, mmap.mmap)


def vm_flags(address: int) -> set[str]:
    """The kernel's flags of this process's mapping holding ``address`` (``/proc/self/smaps``' VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


class TestMapped:
    """Large objects on a local filesystem are mapped, privately; elsewhere they are read (``stores.mounts``)."""

    @pytest.fixture(autouse=True)
    def _local_filesystem(self, tmp_path: Path) -> None:
        if not mappable(tmp_path):
            pytest.skip(f"{filesystem_of(tmp_path)} is not one whose files deltasync maps")

    def test_large_object_is_mapped_privately(self, local: LocalStore) -> None:
        data = os.urandom(MAP_BYTES + 7)
        local.put("big", data)
        small = local.get_buffer(local.put("small", data[:100]).key)
        assert not mapped(small) and bytes(small) == data[:100]
        buffer = local.get_buffer("big")
        assert mapped(buffer) and not buffer.readonly and bytes(buffer) == data
        buffer[:4] = b"\0\0\0\0"  # a decoder may write into what it was handed: never into the file
        assert local.get("big") == data
        copied = LocalStore(local.root, map_reads=False).get_buffer("big")  # the switch off: read into memory
        assert not mapped(copied) and not copied.readonly and bytes(copied) == data

    def test_a_refused_mapping_is_read_instead(self, local: LocalStore) -> None:
        data = os.urandom(MAP_BYTES)
        local.put("big", data)
        with mock.patch("mmap.mmap", side_effect=OSError(errno.ENOMEM, "out of mappings")):
            buffer = local.get_buffer("big")
        assert not mapped(buffer) and bytes(buffer) == data

    def test_mappings_alive_at_once_are_bounded(self, local: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
        """Each mapping holds a file descriptor: past MAX_MAPPED alive, objects are read until some go."""
        import gc

        from deltasync.stores import local as local_module

        data = os.urandom(MAP_BYTES)
        local.put("big", data)
        gc.collect()  # mappings of earlier tests are gone
        monkeypatch.setattr(local_module, "MAX_MAPPED", local_module._live_maps[0] + 2)
        held = [local.get_buffer("big") for _ in range(3)]
        assert [mapped(b) for b in held] == [True, True, False] and all(bytes(b) == data for b in held)
        del held[0]
        gc.collect()
        assert mapped(local.get_buffer("big"))

    def test_large_reads_land_in_memory_advised_huge_pages(self, tmp_path: Path) -> None:
        """A large object read, not mapped (a network filesystem, the cache), lands in memory the kernel is
        asked to back with 2 MiB pages, so the read faults once per 2 MiB instead of once per 4 KiB."""
        import numpy as np

        from deltasync.stores.buffers import HUGE_BYTES

        store = LocalStore(tmp_path / "root", map_reads=False)
        data = os.urandom(HUGE_BYTES + 7)
        store.put("big", data)
        store.put("small", data[:MAP_BYTES])
        big, small = store.get_buffer("big"), store.get_buffer("small")
        assert bytes(big) == data and bytes(small) == data[:MAP_BYTES]
        assert not big.readonly and not small.readonly
        if not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists():
            return
        assert mapped(big) and not mapped(small)  # its own anonymous mapping; a small one is the allocator's
        address = np.frombuffer(big, dtype=np.uint8).ctypes.data
        assert "hg" in vm_flags(address)  # advised: the kernel backs it in huge pages where its mode allows

    def test_unlinked_or_replaced_object_stays_readable(self, local: LocalStore) -> None:
        first, second = os.urandom(MAP_BYTES), os.urandom(MAP_BYTES)
        local.put("a", first)
        local.put("b", first)
        held = local.get_buffer("a"), local.get_buffer("b")
        local.delete("a")  # retention
        local.put("b", second)  # a new object renamed over the name (objects are never rewritten in place)
        assert [bytes(b) for b in held] == [first, first]
        assert local.get_buffer("b").tobytes() == second

    def test_other_filesystems_are_read_not_mapped(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A network or unknown filesystem may drop a mapped file under the reader (SIGBUS): copied instead."""
        root = tmp_path / "root"
        root.mkdir()
        mount, _ = mount_of(root)
        mounts = tmp_path / "mounts"
        escaped = str(mount).replace(" ", "\\040")  # as the kernel lists a space
        mounts.write_text(f"server:/export {escaped} nfs4 rw 0 0\n")
        monkeypatch.setattr("deltasync.stores.mounts.MOUNTS", str(mounts))
        assert mount_of(root) == (mount, "nfs4") and not mappable(root / "not" / "yet")
        store = LocalStore(root)
        data = os.urandom(MAP_BYTES)
        store.put("big", data)
        buffer = store.get_buffer("big")
        assert not mapped(buffer) and not buffer.readonly and bytes(buffer) == data
        assert "the nfs4 filesystem mounted at" in filesystem_of(root)

    def test_parts_released_once_closing_are_dropped_by_the_caller(self, tmp_path: Path) -> None:
        """An update that ends while its subscriber closes keeps its result: its parts go on its own thread."""
        from deltasync.appliers import TorchModuleApplier
        from deltasync.replica.fetch import Fetcher

        fetcher = Fetcher(LocalStore(tmp_path / "run"), TorchModuleApplier({}), workers=1)
        fetcher.close()
        held: list[Any] = [bytearray(MAP_BYTES)]
        fetcher.release(held)
        assert held == []

    def test_anchor_loads_exactly_through_a_mapping(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The parts are mapped, and unmapped by a download thread after the weights are written: the
        update does not wait for the kernel to take the mappings down."""
        import gc

        import torch

        from deltasync import Publisher, Subscriber
        from deltasync.appliers import TorchModuleApplier
        from deltasync.stores import local as local_module

        weights = {f"w{i}": torch.randn(1 << 19, dtype=torch.float32) for i in range(3)}  # 1 MiB of bf16 each
        with Publisher(weights, str(tmp_path / "run"), part_bytes=MAP_BYTES) as publisher:
            publisher.publish(0, block=True)
        replica = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in weights.items()}
        gc.collect()  # mappings of earlier tests are gone
        unmapped_on: list[str] = []
        count = local_module._unmapped

        def unmapped() -> None:
            unmapped_on.append(threading.current_thread().name)
            count()

        monkeypatch.setattr(local_module, "_unmapped", unmapped)
        with mock.patch("mmap.mmap", wraps=mmap.mmap) as mapping, \
                Subscriber(str(tmp_path / "run"), TorchModuleApplier(replica)) as subscriber:
            subscriber.update()
        assert mapping.call_count >= 3  # every part of the anchor
        assert len(unmapped_on) == mapping.call_count  # none outlives the subscriber
        assert all(name.startswith("deltasync-fetch") for name in unmapped_on), unmapped_on
        for name, tensor in weights.items():
            assert torch.equal(replica[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16))


# ---------------------------------------------------------------------- special files, symlinks


class TestSpecialFiles:
    def test_symlink_to_dev_zero(self, local: LocalStore) -> None:
        os.symlink("/dev/zero", local.root / MANIFEST_KEY)
        with bounded():
            assert_refused(local, MANIFEST_KEY, "a symlink")
        assert list(local.list()) == []

    def test_character_device(self, local: LocalStore) -> None:
        try:
            os.mknod(local.root / MANIFEST_KEY, stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD, which this process lacks")
        with bounded():
            assert_refused(local, MANIFEST_KEY, "a character device")
        assert list(local.list()) == []

    def test_fifo_never_blocks(self, local: LocalStore) -> None:
        fifo = local.root / MANIFEST_KEY
        os.mkfifo(fifo)
        for op, read in every_read(local, MANIFEST_KEY).items():
            outcome: list[BaseException] = []

            def run(read: Callable[[], Any] = read) -> None:
                try:
                    read()
                except BaseException as exc:  # handed to the test thread
                    outcome.append(exc)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(JOIN_S)
            if thread.is_alive():  # release the blocked open so the thread can end, then fail
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                pytest.fail(f"{op} blocked on a FIFO")
            assert len(outcome) == 1 and isinstance(outcome[0], StoreError), op
            assert "(a FIFO); refused" in str(outcome[0]), op
        assert list(local.list()) == []

    def test_directory_at_key(self, local: LocalStore) -> None:
        (local.root / "deltas").mkdir()
        assert_refused(local, "deltas", "a directory")

    def test_file_where_a_directory_would_be(self, local: LocalStore) -> None:
        local.put("deltas", b"a file")
        with pytest.raises(ObjectNotFound):
            local.get("deltas/000001.safetensors")
        with pytest.raises(ObjectNotFound):
            local.head("deltas/000001.safetensors")

    def test_symlink_out_of_the_root(self, local: LocalStore, tmp_path: Path) -> None:
        secret = tmp_path / "secret"
        secret.write_bytes(b"not yours")
        (local.root / "deltas").mkdir()
        os.symlink(secret, local.root / "deltas" / "x")
        assert_refused(local, "deltas/x", "a symlink")
        assert list(local.list()) == []
        local.delete("deltas/x")  # removes the link, never its target
        assert not (local.root / "deltas" / "x").is_symlink() and secret.read_bytes() == b"not yours"

    def test_symlink_inside_the_root(self, local: LocalStore) -> None:
        local.put("real", b"data")
        os.symlink(local.root / "real", local.root / "alias")
        assert_refused(local, "alias", "a symlink")
        assert [info.key for info in local.list()] == ["real"]

    def test_symlinked_directory(self, local: LocalStore, tmp_path: Path) -> None:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "x").write_bytes(b"not yours")
        os.symlink(elsewhere, local.root / "deltas")
        assert_refused(local, "deltas/x", "a symlink on its path")
        assert list(local.list()) == []  # the symlinked directory is not entered
        with pytest.raises(StoreError, match="a symlink on its path"):
            local.put("deltas/y", b"escape")
        with pytest.raises(StoreError, match="a symlink on its path"):
            local.delete("deltas/x")
        assert sorted(p.name for p in elsewhere.iterdir()) == ["x"]
        assert (elsewhere / "x").read_bytes() == b"not yours"

    def test_regular_files_still_work(self, local: LocalStore) -> None:
        local.put("deltas/1", b"one")
        os.mkfifo(local.root / "deltas" / "fifo")
        os.symlink("/dev/zero", local.root / "deltas" / "zero")
        assert [info.key for info in local.list("deltas/")] == ["deltas/1"]
        assert local.get("deltas/1", max_bytes=3) == b"one"


class TestOversized:
    def test_huge_sparse_file_refused_unread(self, local: LocalStore) -> None:
        with open(local.root / "big", "wb") as f:
            f.truncate(16 << 30)  # 16 GiB of holes: reading it would exhaust memory
        with bounded():
            with pytest.raises(IntegrityError):
                local.get_buffer("big", max_bytes=100)  # large enough to be mapped: refused before mapping
            with pytest.raises(IntegrityError, match=r"'big' in .* is 17179869184 bytes, more than the 100") as info:
                local.get("big", max_bytes=100)
            with pytest.raises(IntegrityError):
                local.get_if_changed("big", None, max_bytes=100)
        assert (info.value.key, info.value.limit, info.value.size) == ("big", 100, 16 << 30)

    def test_s3_refuses_from_the_headers(self, servers: dict[str, Any], tmp_path: Path) -> None:
        store = make_store("s3", servers, tmp_path)
        store.put("big", b"x" * (1 << 20))
        with pytest.raises(IntegrityError, match=r"is 1048576 bytes, more than the 10 bytes") as info:
            store.get("big", max_bytes=10)
        assert info.value.backend == "s3" and info.value.size == 1 << 20

    def test_cache_refuses_before_reading(self, tmp_path: Path) -> None:
        run, refs = published(tmp_path)
        cached = CachedStore(open_store(run), tmp_path / "cache")
        cached.get(MANIFEST_KEY)
        ref = refs[0]
        with pytest.raises(IntegrityError, match="more than the"):
            cached.get(ref.key, max_bytes=ref.size - 1)
        assert cached.get(ref.key, max_bytes=ref.size)  # a fill
        assert cached.stats.fills == 1
        with pytest.raises(IntegrityError, match="more than the"):
            cached.get(ref.key, max_bytes=ref.size - 1)  # a hit is refused too

    def test_cache_refuses_an_oversized_cache_file(self, tmp_path: Path) -> None:
        run, refs = published(tmp_path)
        cached = CachedStore(open_store(run), tmp_path / "cache")
        cached.get(MANIFEST_KEY)
        ref = refs[0]
        good = cached.get(ref.key)
        path = cached._path(ref.key)
        path.write_bytes(good + b"\0" * (1 << 20))  # a cache file grown by someone else
        assert cached.get(ref.key) == good  # refused (corrupt), dropped and refetched
        assert cached.stats.corrupt == 1

    def test_cache_ignores_a_symlinked_cache_file(self, tmp_path: Path) -> None:
        run, refs = published(tmp_path)
        cached = CachedStore(open_store(run), tmp_path / "cache")
        cached.get(MANIFEST_KEY)
        ref = refs[0]
        path = cached._path(ref.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/dev/zero", path)
        with bounded():
            data = cached.get(ref.key)  # read from the store; the fill replaces the link
        assert len(data) == ref.size and not path.is_symlink()


# ---------------------------------------------------------------------- full disks


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of :data:`TINY_FS_BYTES`, mounted for the test (needs root)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tiny tmpfs needs root and mount(8); the injected-ENOSPC tests cover this")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TINY_FS_BYTES}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip()}); injected-ENOSPC tests cover it")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def fill_up(directory: Path) -> Path:
    """Write a file into ``directory`` until its filesystem is full; returns the file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
    return filler


class TestFullDiskReal:
    def test_put_larger_than_the_disk(self, tiny_fs: Path) -> None:
        store = LocalStore(tiny_fs / "run")
        store.put("deltas/a", b"previous")
        full = r"the disk is full: no space left on the tmpfs filesystem mounted at "
        with pytest.raises(StoreError, match=full) as info:
            store.put("deltas/a", b"x" * (2 * TINY_FS_BYTES))
        assert str(tiny_fs) in str(info.value) and info.value.errno == errno.ENOSPC
        assert (info.value.key, info.value.backend) == ("deltas/a", "file")
        assert tmp_files(tiny_fs) == []
        assert store.get("deltas/a") == b"previous"  # the key keeps its object

    def test_put_succeeds_after_space_frees(self, tiny_fs: Path) -> None:
        store = LocalStore(tiny_fs / "run")
        written = []
        with pytest.raises(StoreError, match="the disk is full"):
            for i in range(2 * TINY_FS_BYTES // (32 << 10)):
                store.put(f"fill/{i}", b"f" * (32 << 10))
                written.append(f"fill/{i}")
        assert written and tmp_files(tiny_fs) == []
        assert [info.key for info in store.list("fill/")] == sorted(written)  # nothing partial is listed
        store.delete(written[0])
        store.put("deltas/b", b"b" * (16 << 10))
        assert store.get("deltas/b") == b"b" * (16 << 10)

    def test_full_cache_serves_uncached(self, tiny_fs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        run, refs = published(tmp_path)
        inner = open_store(run)
        cached = CachedStore(inner, tiny_fs / "cache")
        cached.get(MANIFEST_KEY)
        filler = fill_up(tiny_fs)
        with caplog.at_level(logging.WARNING, logger="deltasync.stores.cache"):
            for ref in refs:
                assert cached.get(ref.key) == inner.get(ref.key)
        assert cached.stats.fills == 0 and cached.stats.misses == len(refs)
        full = [r for r in caplog.records if "is full" in r.getMessage()]
        assert len(full) == 1, [r.getMessage() for r in caplog.records]
        assert tmp_files(tiny_fs) == [] and lock_files(cached) == []
        filler.unlink()
        assert cached.get(refs[0].key) == inner.get(refs[0].key)
        assert cached.stats.fills == 1


class TestFullDiskInjected:
    """``ENOSPC`` raised by ``os.write`` (after a partial write) or ``os.fsync``: runs everywhere."""

    @staticmethod
    def write_half_then_fail() -> Callable[[int, Any], int]:
        real_write, calls = os.write, []

        def write(fd: int, data: Any) -> int:
            calls.append(fd)
            if len(calls) == 1:
                return real_write(fd, bytes(data[: max(1, len(data) // 2)]))
            raise ENOSPC

        return write

    def test_enospc_mid_write(self, local: LocalStore) -> None:
        local.put("deltas/a", b"previous")
        with mock.patch("os.write", side_effect=self.write_half_then_fail()) as write:
            full = r"writing 'deltas/a' in .* failed: the disk is full: no space left on "
            with pytest.raises(StoreError, match=full):
                local.put("deltas/a", b"new" * 1000)
        assert write.call_count == 2  # a partial write, then the failure
        assert tmp_files(local.root) == []
        assert local.get("deltas/a") == b"previous"
        local.put("deltas/a", b"later")  # space back: the next write works
        assert local.get("deltas/a") == b"later"

    def test_enospc_from_fsync(self, local: LocalStore) -> None:
        with mock.patch("os.fsync", side_effect=ENOSPC):
            with pytest.raises(StoreError, match="the disk is full") as info:
                local.put("manifest.json", b"{}", mode="create")
        assert info.value.errno == errno.ENOSPC
        assert tmp_files(local.root) == [] and not local.exists("manifest.json")

    def test_other_write_errors_keep_their_text(self, local: LocalStore) -> None:
        with mock.patch("os.write", side_effect=OSError(errno.EIO, os.strerror(errno.EIO))):
            with pytest.raises(StoreError, match="Input/output error") as info:
                local.put("k", b"v")
        assert "disk is full" not in str(info.value) and tmp_files(local.root) == []

    def test_full_cache_serves_uncached(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        run, refs = published(tmp_path)
        inner = open_store(run)
        cached = CachedStore(inner, tmp_path / "cache")
        cached.get(MANIFEST_KEY)
        with caplog.at_level(logging.WARNING, logger="deltasync.stores.cache"):
            with mock.patch("os.write", side_effect=ENOSPC):
                for ref in refs:
                    assert cached.get(ref.key) == inner.get(ref.key)
        assert cached.stats.fills == 0 and cached.stats.misses == len(refs)
        assert len([r for r in caplog.records if "is full" in r.getMessage()]) == 1
        assert tmp_files(cached.root) == [] and lock_files(cached) == []
        assert not cached._linkless  # a full disk is not a filesystem without hard links
        assert cached.get(refs[0].key) == inner.get(refs[0].key)
        assert cached.stats.fills == 1


# ---------------------------------------------------------------------- network timeouts


class TestTimeouts:
    def test_s3_requests_have_finite_timeouts(self, servers: dict[str, Any], tmp_path: Path) -> None:
        from deltasync.stores.s3 import CONNECT_TIMEOUT, REQUEST_TIMEOUT

        store = make_store("s3", servers, tmp_path)
        options = store._store.client_options  # type: ignore[attr-defined]
        assert options["connect_timeout"] == f"{int(CONNECT_TIMEOUT.total_seconds())}s"
        assert options["timeout"] == f"{int(REQUEST_TIMEOUT.total_seconds())}s"
        server = servers["get"]("s3")
        custom = open_store(server.store_url("t"), **server.store_options(client_options={"timeout": "2m"}))
        assert custom._store.client_options["timeout"] == "2m"  # type: ignore[attr-defined]

    def test_hf_requests_have_finite_timeouts(self, servers: dict[str, Any], tmp_path: Path) -> None:
        import httpx2
        from huggingface_hub.utils import get_session

        from deltasync.stores.hf import HTTP_CONNECT_TIMEOUT_S, HTTP_IO_TIMEOUT_S, _finite_timeouts

        store = make_store("hf", servers, tmp_path)
        store.put("k", b"v")  # any call installs the hook on huggingface_hub's shared client
        session = get_session()
        assert _finite_timeouts in session.event_hooks["request"]
        unbounded = session.build_request("GET", "http://127.0.0.1/x", timeout=None)  # as list_bucket_tree asks
        _finite_timeouts(unbounded)
        assert unbounded.extensions["timeout"] == {
            "connect": HTTP_CONNECT_TIMEOUT_S,
            "read": HTTP_IO_TIMEOUT_S,
            "write": HTTP_IO_TIMEOUT_S,
            "pool": HTTP_IO_TIMEOUT_S,
        }
        chosen = session.build_request("GET", "http://127.0.0.1/x", timeout=httpx2.Timeout(5.0, read=None))
        _finite_timeouts(chosen)
        assert chosen.extensions["timeout"] == {"connect": 5.0, "read": HTTP_IO_TIMEOUT_S, "write": 5.0, "pool": 5.0}
        assert store.get("k") == b"v"


# ---------------------------------------------------------------------- helpers


def published(tmp_path: Path) -> tuple[str, list[ObjectRef]]:
    """A local run holding a few versions, and the objects its manifest names."""
    from .test_store_cache import publish

    url = str(tmp_path / "run")
    publish(url, 3)
    manifest = Manifest.from_bytes(open_store(url).get(MANIFEST_KEY))
    return url, [ref for entry in manifest.versions for ref in entry.objects()]
