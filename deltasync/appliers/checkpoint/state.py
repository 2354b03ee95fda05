"""Checkpoint directory: the state file ``deltasync.json`` that says what the files hold.

::

    {"format": "deltasync-checkpoint", "run_id": "...", "version": 12, "clean": true, "updated": ...}

:class:`~.checkpoint.CheckpointDirApplier` writes it (:func:`write_state`)
before the first element of a version (``clean`` false) and after the files
are flushed (``clean`` true), so a restarted follower resumes with deltas, or,
finding a torn checkpoint, repairs it from an anchor.

Limitations:

- Written by replacing the file (tmp + fsync + rename, then the directory is
  fsynced where the platform allows); a reader never sees a partial file.
- Anything unexpected in the file reads as "no state" (:func:`read_state`
  returns ``None``): the next follower starts from an anchor.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["STATE_FILE", "STATE_FORMAT", "CheckpointState", "read_state", "write_state"]

STATE_FILE = "deltasync.json"
STATE_FORMAT = "deltasync-checkpoint"


@dataclass(frozen=True, slots=True)
class CheckpointState:
    """What ``deltasync.json`` says the files hold."""

    run_id: str | None
    """Run the version belongs to; ``None`` when not known (the next follower starts from an anchor)."""
    version: int | None
    """Version the files hold; ``None`` before the first complete version."""
    clean: bool = True
    """False while a version is being written: the files may mix two versions."""

    @property
    def resumable(self) -> bool:
        """Whether a follower can continue from here with deltas."""
        return self.clean and self.run_id is not None and self.version is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "run_id": self.run_id,
            "version": self.version,
            "clean": self.clean,
            "updated": time.time(),
        }

    @classmethod
    def from_json(cls, raw: Any) -> CheckpointState | None:
        """Parse a state file; anything unexpected yields ``None`` (resume from an anchor)."""
        if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT:
            return None
        run_id, version, clean = raw.get("run_id"), raw.get("version"), raw.get("clean")
        if run_id is not None and not isinstance(run_id, str):
            return None
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
            return None
        return cls(run_id, version, clean is True)


def read_state(directory: str | os.PathLike[str]) -> CheckpointState | None:
    """The state recorded in ``directory/deltasync.json``, or ``None`` if absent or unreadable."""
    try:
        return CheckpointState.from_json(json.loads((Path(directory) / STATE_FILE).read_bytes()))
    except (OSError, ValueError):
        return None


def write_state(directory: str | os.PathLike[str], state: CheckpointState) -> None:
    """Record ``state`` in ``directory/deltasync.json``, atomically."""
    _write_atomic(Path(directory) / STATE_FILE, json.dumps(state.to_json(), indent=1).encode())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
