"""Which filesystem a local store's root lives on, and whether its files may be mapped.

A large object of a :class:`~deltasync.stores.local.LocalStore` is read by mapping
the file (``mmap``) instead of copying it into fresh memory: the hash and the
replica's write then read the kernel's page cache directly, with no page of new
memory faulted in, which is faster (``benchmarks/device_sync.py``, the anchor
load rows). That is safe only where the file under the mapping cannot change or
vanish while it is mapped:

- deltasync never changes a file once it is in place: objects are written to a
  temporary file and renamed, and retention unlinks them. On a local filesystem
  an unlinked or replaced file stays readable through a mapping until it is
  unmapped; the bytes hashed are the bytes written.
- A network or user-space filesystem (NFS, SMB, Lustre, FUSE, ...) may drop a file
  that another machine deleted from under the mapping, and reading it then kills
  the process (``SIGBUS``) instead of raising an error. Those are read by copying,
  as are filesystems this module does not know.

A tool that rewrites an object's file in place on a local filesystem could
still end a reader with ``SIGBUS`` (truncating it), or change bytes between their
check and their copy into the replica; nothing of deltasync does, and nothing
else should write into a live store. The node cache
(:class:`~deltasync.replica.cache.CachedStore`), which checks its shared files against
damage done in place, never maps them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["MAPPABLE", "filesystem_of", "mount_of", "mappable"]

MOUNTS = "/proc/self/mounts"  # Linux: "device mountpoint fstype options 0 0" per line
MAPPABLE = frozenset({"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "overlay"})
"""Filesystems on one machine whose files may be mapped (see the module docstring)."""


def mount_of(path: Path) -> tuple[Path, str | None]:
    """The mount point that holds ``path`` and its filesystem type (``None`` where ``/proc/self/mounts``
    cannot be read or does not list it; the last listing of a mount point is the one on top)."""
    mount = path
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    kind = None
    with contextlib.suppress(OSError, ValueError):
        with open(MOUNTS, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[1].replace("\\040", " ") == str(mount):
                    kind = fields[2]
    return mount, kind


def mappable(path: Path) -> bool:
    """Whether files under ``path`` live on a filesystem of :data:`MAPPABLE`. A path that does not exist
    yet is judged by its nearest existing parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return mount_of(path)[1] in MAPPABLE


def filesystem_of(path: Path) -> str:
    """Where ``path`` lives, for disk-full messages.

    Returns:
        `str`: e.g. ``"the tmpfs filesystem mounted at /mnt/x (0 bytes free)"``; the type is left out
        where ``/proc/self/mounts`` cannot be read.
    """
    mount, kind = mount_of(path)
    free = ""
    with contextlib.suppress(OSError):
        vfs = os.statvfs(path)
        free = f" ({vfs.f_bavail * vfs.f_frsize} bytes free)"
    return f"the {kind + ' ' if kind else ''}filesystem mounted at {mount}{free}"
