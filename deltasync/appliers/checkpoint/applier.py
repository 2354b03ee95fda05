"""Apply deltas in place into a safetensors checkpoint directory on disk.

:class:`CheckpointDirApplier` is the applier for consumers without a live model
(evaluation jobs, servers that reload from disk, backups). It memory-maps the
directory's checkpoint (``model.safetensors``, or the shards named by
``model.safetensors.index.json``, or else every ``*.safetensors`` file) and
writes each changed element where it lies in its file: applying a delta is
O(changed elements), the files keep their layout and stay valid safetensors
files, and the written pages are flushed (``msync``) before a version counts
as applied.

``deltasync.json`` in the directory records what the files hold, so a restarted
follower resumes with deltas instead of downloading an anchor::

    {"format": "deltasync-checkpoint", "run_id": "...", "version": 12, "clean": true, "updated": ...}

``clean`` is false from just before the first element of a version is written
until the files are flushed; a process killed in between leaves a torn
checkpoint, and the next follower repairs it from an anchor (which rewrites
every element).

Limitations:

- Every tensor in the files must be in the published dtype (bf16 by default):
  files are patched in place, never converted. Anything else is refused with
  :class:`~deltasync.errors.TensorMismatch`.
- The files must hold exactly the published tensors (the fingerprint covers
  names, shapes and dtypes): a tied parameter under its first name only, no
  buffers. A checkpoint written by ``deltasync watch`` always qualifies.
- Readers see elements change in place while a version is applied; load the
  files while ``deltasync.json`` says ``clean`` (or copy them first).

This module holds the applier and :func:`initialise_checkpoint`; the files,
their index, memory maps and lock are :mod:`.files`, and the state file is
:mod:`.state` (their public names are importable from here too).
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch

from ...codec import Decoded
from ...errors import DeltaFormatError, FingerprintMismatch, VersionError
from ...format import MAX_HEADER_BYTES, Header, read_header
from ...protocol.manifest import MANIFEST_KEY, MAX_MANIFEST_BYTES, Manifest
from ...replica.applier import Applier
from ...tensors import TensorSpec, fingerprint
from ..apply import check_header
from .files import (
    INDEX_FILE,
    LOCK_FILE,
    SINGLE_FILE,
    MappedCheckpoint,
    checkpoint_files,
    has_checkpoint,
    lock_directory,
    write_empty_checkpoint,
)
from .state import STATE_FILE, STATE_FORMAT, CheckpointState, read_state, write_state

if TYPE_CHECKING:
    from ...replica.subscriber import Subscriber, UpdateInfo
    from ...stores import Store

__all__ = [
    "CheckpointDirApplier",
    "CheckpointState",
    "STATE_FILE",
    "has_checkpoint",
    "initialise_checkpoint",
    "anchor_layout",
    "write_empty_checkpoint",
    # Defined in the modules of the files and the state file; importable from here too.
    "STATE_FORMAT",
    "LOCK_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "read_state",
]


class CheckpointDirApplier(Applier):
    """Applies decoded deltas and anchors in place into a checkpoint directory.

    Args:
        directory (`str` or `os.PathLike`): holds ``model.safetensors`` or a sharded
            checkpoint with ``model.safetensors.index.json``.
        dtype (`torch.dtype`, *optional*, defaults to `torch.bfloat16`): the published
            dtype every tensor in the files must have; ``None`` accepts each tensor's own
            (BF16, F16 or F32).

    Raises:
        `FileNotFoundError`: no checkpoint in ``directory``.
        `DeltaFormatError`: a file or the index is malformed.
        `TensorMismatch`: a tensor is not in the published dtype, or is stored twice.

    Example:
        ```python
        >>> applier = CheckpointDirApplier("./policy")
        >>> sub = Subscriber("s3://bucket/run1", applier, **applier.resume_options())
        >>> sub.add_hook(applier.recorder(sub))   # so the next start resumes after an anchor, too
        >>> sub.update()
        ```
    """

    def __init__(self, directory: str | os.PathLike[str], *, dtype: torch.dtype | None = torch.bfloat16) -> None:
        self.directory = Path(directory)
        files = checkpoint_files(self.directory)
        self._lock: IO[bytes] | None = lock_directory(self.directory)
        try:
            self._files = MappedCheckpoint(self.directory, files, dtype)
        except BaseException:
            self._unlock()
            raise
        self.specs = self._files.specs
        self.fingerprint = fingerprint(self.specs.values())
        self.state = read_state(self.directory)
        self._pending: tuple[int, str] | None = None

    # ------------------------------------------------------------------ applier protocol

    def validate(self, header: Header) -> None:
        """Refuse a file that does not fit these tensors, and note the version it produces.

        Raises:
            `FingerprintMismatch`: made for another model.
            `TensorMismatch`: a carried tensor is unknown here or laid out differently.
        """
        check_header(header, self.specs, self.fingerprint, holder=f"checkpoint in {self.directory}")
        self._pending = (header.version, header.kind)

    def lookup(self, name: str, indices: np.ndarray) -> np.ndarray:
        """Current bit patterns at ``indices`` of tensor ``name`` (a copy; reads the files)."""
        return np.asarray(self._files.views[name][indices])

    def apply(self, decoded: Mapping[str, Decoded]) -> None:
        """Write validated patches into the files, flush them, then record the version.

        Call :meth:`validate` on every file of the version first.

        Raises:
            `RuntimeError`: :meth:`validate` was not called. `VersionError`: a delta onto a torn checkpoint.
        """
        if self._pending is None:
            raise RuntimeError("call validate() on the version's files before apply()")
        version, kind = self._pending
        if kind == "delta" and self.state is not None and not self.state.clean:
            raise VersionError(
                f"{self.directory} was left mid-update (torn); it needs an anchor, not a delta", version=version
            )
        # An anchor may start another run: the run is recorded by record_run() once known.
        run_id = self.state.run_id if kind == "delta" and self.state is not None else None
        self._write(decoded, run_id, version)

    def restore(self, patches: Mapping[str, Decoded], run_id: str | None, version: int | None) -> None:
        """Write back what an interrupted or undone apply overwrote, and record ``version`` of ``run_id``."""
        self._write(patches, run_id, version)

    def _write(self, decoded: Mapping[str, Decoded], run_id: str | None, version: int | None) -> None:
        """Write patches into the files and flush them, the state marked torn until the last one is down."""
        self._write_state(CheckpointState(run_id, version, clean=False))
        for name, patch in decoded.items():
            view = self._files.views[name]
            if patch.indices is None:
                view[:] = patch.values
            else:
                view[patch.indices] = patch.values
        for name, patch in decoded.items():
            self._files.flush(name, patch.indices, patch.values)
        self._write_state(CheckpointState(run_id, version, clean=True))
        self._pending = None

    # ------------------------------------------------------------------ state

    def record_run(self, run_id: str, version: int) -> None:
        """Record that the files hold ``version`` of run ``run_id`` (after an anchor, the run is not in the file).

        Raises:
            `VersionError`: the files do not cleanly hold ``version``.
        """
        if self.state is None or not self.state.clean or self.state.version != version:
            raise VersionError(f"{self.directory} does not hold a clean version {version}", version=version)
        if self.state.run_id != run_id:
            self._write_state(CheckpointState(run_id, version, clean=True))

    def resume_options(self) -> dict[str, Any]:
        """``start_version`` and ``run_id`` for a :class:`~deltasync.replica.subscriber.Subscriber`.

        Empty when the files cannot be continued with deltas (no state, a torn
        checkpoint, or an anchor whose run was never recorded): the subscriber
        then starts from an anchor, which rewrites every element.
        """
        state = self.state
        if state is None or not state.resumable:
            return {}
        return {"start_version": state.version, "run_id": state.run_id}

    def recorder(self, subscriber: Subscriber) -> Callable[[UpdateInfo], None]:
        """A subscriber hook recording the run of each version reached (add it with ``add_hook``)."""

        def record(info: UpdateInfo) -> None:
            assert subscriber.run_id is not None
            self.record_run(subscriber.run_id, info.version)

        return record

    def close(self) -> None:
        """Flush and unmap the files, and let another process write the directory."""
        self._files.close()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the flock
            self._lock = None

    def _write_state(self, state: CheckpointState) -> None:
        write_state(self.directory, state)
        self.state = state


def initialise_checkpoint(
    directory: str | os.PathLike[str],
    store: str,
    *,
    on_update: Callable[[UpdateInfo], None] | None = None,
    **subscriber_options: Any,
) -> UpdateInfo:
    """Create ``directory/model.safetensors`` at the latest version of ``store``.

    The layout comes from the newest anchor's headers (range reads); the weights
    then arrive through the usual verified subscriber route (anchor, then deltas).
    Everything is built in ``directory/.deltasync-init`` and moved into place
    only when complete, so ``directory`` never holds a partial checkpoint.

    Args:
        directory (`str` or `os.PathLike`): created if missing; must not hold a checkpoint yet.
        store (`str`): the run prefix URL.
        on_update (`Callable[[UpdateInfo], None]`, *optional*): called once the weights are in.
        **subscriber_options: passed to :class:`~deltasync.replica.subscriber.Subscriber` (``replica_id``,
            ``ack``, ...).

    Raises:
        `FileExistsError`: ``directory`` already holds a checkpoint. `ConflictError`: another process
            is writing it. `ObjectNotFound` / `VersionError`: nothing (or no anchor) published yet.
    """
    from ...stores import open_store

    target = Path(directory)
    with lock_directory(target):
        if has_checkpoint(target):
            raise FileExistsError(f"{target} already holds a checkpoint; follow it instead of initialising it")
        with open_store(store) as opened:
            specs = anchor_layout(opened, Manifest.from_bytes(opened.get(MANIFEST_KEY, max_bytes=MAX_MANIFEST_BYTES)))
        staging = target / ".deltasync-init"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            info = _fill(staging, specs, store, subscriber_options)
            os.replace(staging / SINGLE_FILE, target / SINGLE_FILE)
            os.replace(staging / STATE_FILE, target / STATE_FILE)  # last: the state names a complete checkpoint
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if on_update is not None:
        on_update(info)
    return info


def _fill(staging: Path, specs: list[TensorSpec], store: str, subscriber_options: dict[str, Any]) -> UpdateInfo:
    """Write an empty checkpoint in ``staging`` and bring it to the latest version."""
    from ...replica.subscriber import Subscriber

    write_empty_checkpoint(staging / SINGLE_FILE, specs)
    applier = CheckpointDirApplier(staging)
    try:
        with Subscriber(store, applier, **subscriber_options) as sub:
            sub.add_hook(applier.recorder(sub))
            info = sub.update()
    finally:
        applier.close()
    if info is None:  # the manifest vanished between reading its anchor and following it
        raise VersionError(f"nothing published at {sub.store.url} to initialise a checkpoint from")
    return info


def anchor_layout(store: Store, manifest: Manifest) -> list[TensorSpec]:
    """Every tensor's spec, from the headers of the newest anchor's parts (range reads only).

    Raises:
        `VersionError`: no anchor listed. `DeltaFormatError`: a part is not an anchor of this model.
        `FingerprintMismatch`: the parts do not add up to the manifest's model.
    """
    anchors = manifest.anchors()
    if not anchors:
        raise VersionError(f"no anchor listed in {store.url}")
    specs: dict[str, TensorSpec] = {}
    for ref in anchors[-1].anchor:
        prefix = store.get_range(ref.key, 0, 8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, ref.size - 8):
            raise DeltaFormatError(f"{ref.key}: not a safetensors file of {ref.size} bytes", key=ref.key)
        header = read_header(prefix + store.get_range(ref.key, 8, 8 + length))
        if header.kind != "anchor" or header.fingerprint != manifest.fingerprint:
            raise DeltaFormatError(f"{ref.key}: not an anchor of model {manifest.fingerprint}", key=ref.key)
        for name, entry in header.tensors.items():
            if name in specs:
                raise DeltaFormatError(f"{ref.key}: tensor {name!r} is in two anchor parts", key=ref.key)
            specs[name] = entry.spec
    found = fingerprint(specs.values())
    if found != manifest.fingerprint:
        raise FingerprintMismatch(
            f"the anchor parts describe model {found}, the manifest {manifest.fingerprint}",
            expected=manifest.fingerprint,
            found=found,
        )
    return list(specs.values())
