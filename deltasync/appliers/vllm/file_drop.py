"""Transport: large files handed to an engine on the same machine through a shared directory.

A server's ``/collective_rpc`` carries JSON only, so a file sent to its workers
travels as base64 text: a third larger, and encoded, parsed and decoded on the
way. For a delta of a few MB that costs milliseconds. For an anchor it is
nearly all of a replica's update: many times what loading the same anchor into
weights held in process costs (``benchmarks/vllm_anchor.py``). An in-process ``LLM``
runs its engine in processes of its own too, and its calls pickle what they
carry. Where the engine runs on the follower's machine, the follower instead
writes each file once into a private directory (in ``/dev/shm`` where there is
one: memory, never a disk) and sends its path, size and digest. Every worker
maps the file, checks both (:func:`read_dropped`), and decodes it where it lies.
The digest of a file whose header lists a BLAKE3 of every tensor (an anchor
as the publisher writes it) is its header's, as in the manifest (docs/PROTOCOL.md,
"Object integrity"): the follower hashes a few KB instead of the whole file,
and the worker's check by the header's entries still covers every byte once.

Whether the workers see the follower's files is asked once, with a small probe
file (:meth:`FileDrop.readable`): a worker on another machine or in another
container cannot read it, and anchors then travel as text. A drop
that fails later (the directory full, a worker that no longer reads it) is
given up for good; the failed update is retried as text.

Nothing is left behind: each call's files are removed when it returns, the
directory when the follower closes, and a directory whose follower was killed
by the next follower on the machine (its process id is in the name).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import stat
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import IntegrityError
from ...format import digests
from ...format.check import covered_by_entries, intact_by_entries
from ...format.encode import encode_anchor

__all__ = ["DROP_PREFIX", "FileDrop", "drop_parent", "read_dropped", "sweep"]

logger = logging.getLogger("deltasync.vllm")

DROP_PREFIX = "deltasync-drop-"
"""A drop directory's name: this prefix, the follower's process id, a dash, a random suffix."""
PROBE_BYTES = 4096
WRITERS = 4  # threads writing a call's files
SHARED_MEMORY = Path("/dev/shm")


def drop_parent() -> Path:
    """Where drop directories go: ``/dev/shm`` (memory) where it is a writable directory, else the temp dir."""
    if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK | os.X_OK):
        return SHARED_MEMORY
    return Path(tempfile.gettempdir())


class FileDrop:
    """A follower's drop directory and whether the engine's workers read it.

    It holds no reference to its follower (whose RPC :meth:`readable` is given), so a dropped follower is
    freed at once, with what it holds.

    Args:
        parent: where the directory is made; :func:`drop_parent` by default.
        enabled: ``False``: never used (:meth:`readable` is ``False``).
    """

    def __init__(self, parent: Path | None = None, *, enabled: bool = True) -> None:
        self._parent = parent
        self._dir: Path | None = None
        self._usable: bool | None = None if enabled else False
        self._count = 0
        self._removal: Callable[[], Any] = lambda: None

    def readable(self, rpc: Callable[..., list[Any]]) -> bool:
        """Whether every worker reads files written here (asked once through ``rpc``, which calls a worker
        method on every rank and returns their answers, with a probe file; ``False`` for good after a drop
        failed)."""
        if self._usable is None:
            self._usable = self._probe(rpc)
        return self._usable

    @contextlib.contextmanager
    def files(self, blobs: Iterable[bytes | memoryview]) -> Iterator[list[dict[str, Any]]]:
        """Write ``blobs`` here and yield their references (what :func:`read_dropped` takes); they are removed
        afterwards. Any failure in the block gives the drop up: later files travel as text.

        Files are written side by side on up to :data:`WRITERS` threads: more threads do not write one file
        into ``/dev/shm`` faster, but an anchor's parts side by side go faster than one after another."""
        paths: list[Path] = []
        try:
            views = [memoryview(blob).cast("B") for blob in blobs]
            paths = [self._path() for _ in views]
            with ThreadPoolExecutor(max(1, min(WRITERS, len(views))), thread_name_prefix="deltasync-drop") as pool:
                refs = list(pool.map(_put, paths, views))
            yield refs
        except BaseException as exc:
            self._usable = False
            logger.warning("deltasync: handing files to the engine through %s failed (%s: %s); they travel as "
                           "text from now on", self._dir, type(exc).__name__, exc)
            raise
        finally:
            for path in paths:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def close(self) -> None:
        """Remove the directory and anything in it (also done when the drop is garbage-collected, or at exit)."""
        if self._dir is not None:
            self._removal()
            self._dir = None

    def _probe(self, rpc: Callable[..., list[Any]]) -> bool:
        ref: dict[str, Any] | None = None
        try:
            ref = _put(self._path(), memoryview(_probe_file()))
            answers = rpc("deltasync_read_dropped", ref)
        except Exception as exc:  # an older worker extension, an engine that cannot take the call, no space
            logger.info("deltasync: anchors go to the engine as text (%s: %s)", type(exc).__name__, exc)
            return False
        finally:
            if ref is not None:
                with contextlib.suppress(OSError):
                    os.unlink(ref["path"])
        why = [str(a.get("why")) for a in answers if not a.get("ok")]
        if why:
            logger.info("deltasync: the engine's workers cannot read %s (%s); anchors go to them as text",
                        self._dir, why[0])
            return False
        logger.info("deltasync: anchors go to the engine's workers as files in %s", self._dir)
        return True

    def _path(self) -> Path:
        """A new file's path in the directory, made (and the parent swept) on first use."""
        if self._dir is None:
            parent = self._parent or drop_parent()
            sweep(parent)
            self._dir = Path(tempfile.mkdtemp(prefix=f"{DROP_PREFIX}{os.getpid()}-", dir=parent))
            self._removal = weakref.finalize(self, shutil.rmtree, str(self._dir), True)
        self._count += 1
        return self._dir / f"{self._count:08d}.safetensors"


def _put(path: Path, view: memoryview) -> dict[str, Any]:
    """Write ``view`` to the new file ``path`` and return its reference."""
    with open(path, "xb") as f:  # mkdtemp's directory is the follower's alone (0700)
        f.write(view)
    header = covered_by_entries(view)
    if header is not None:  # the worker checks every byte by the header's entries
        return {"path": str(path), "size": view.nbytes, "header": list(header)}
    return {"path": str(path), "size": view.nbytes, "blake3": digests.hexdigest([view], "blake3")}


def _probe_file() -> bytes:
    """A small anchor of random values: it takes the same reference and check as a real anchor, so a
    worker extension that cannot check one answers no to the probe, not to the first anchor."""
    bits = np.frombuffer(os.urandom(PROBE_BYTES), dtype=np.int16).copy()
    return encode_anchor({"deltasync.probe": torch.from_numpy(bits).view(torch.bfloat16)}, version=0)


def read_dropped(ref: Mapping[str, Any]) -> memoryview:
    """The file a follower dropped, mapped privately: writable in memory, never written back (a decoder views
    its streams in place). ``ref`` is ``{"path", "size"}`` and either ``"blake3"`` (the whole file's) or
    ``"header": [size, blake3]`` (the header's, whose per-tensor digests cover the rest).

    Raises:
        `IntegrityError`: a malformed reference, or a file whose type, size or digests differ: not the
            follower's file (another machine's or container's under the same name).
        `OSError`: the file cannot be opened or mapped here.
    """
    path, size, digest, header = ref.get("path"), ref.get("size"), ref.get("blake3"), ref.get("header")
    by_header = (isinstance(header, list) and len(header) == 2 and isinstance(header[0], int)
                 and not isinstance(header[0], bool) and header[0] > 8 and digests.is_hex(header[1]))
    if not (isinstance(path, str) and os.path.isabs(path) and isinstance(size, int) and size >= 0
            and (by_header if header is not None else digests.is_hex(digest))):
        raise IntegrityError(f"malformed file reference {dict(ref)!r}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise IntegrityError(f"{path}: {st.st_size} bytes of mode {st.st_mode:o} here, the follower wrote "
                                 f"a file of {size} bytes")
        data = memoryview(mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                          if size else bytearray())
    finally:
        os.close(fd)
    if header is not None:
        intact = intact_by_entries(data, (header[0], str(header[1])))
    else:
        intact = digests.matches([data], "blake3", str(digest))
    if not intact:
        raise IntegrityError(f"{path} differs from the file the follower wrote there (its BLAKE3)")
    return data


def sweep(parent: Path) -> int:
    """Remove the drop directories in ``parent`` whose follower is gone (no process of its id runs on this
    machine); returns how many. Directories of other users are left alone."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            pid = entry.name[len(DROP_PREFIX):].split("-", 1)[0]
            if not entry.name.startswith(DROP_PREFIX) or not pid.isdigit() or _alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                if entry.lstat().st_uid == os.getuid() and entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                    removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
