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
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import shutil
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch

from ..codec import Decoded
from ..errors import (
    ConflictError,
    DeltaFormatError,
    FingerprintMismatch,
    TensorMismatch,
    VersionError,
)
from ..format import MAX_HEADER_BYTES, Header, raw_header, read_header
from ..manifest import MANIFEST_KEY, Manifest
from ..tensors import DTYPE_BY_NAME, TensorSpec, dtype_name, fingerprint
from .base import check_header

if TYPE_CHECKING:
    from ..stores import Store
    from ..subscriber import Subscriber, UpdateInfo

__all__ = [
    "CheckpointDirApplier",
    "CheckpointState",
    "STATE_FILE",
    "has_checkpoint",
    "initialise_checkpoint",
    "anchor_layout",
    "write_empty_checkpoint",
]

STATE_FILE = "deltasync.json"
LOCK_FILE = ".deltasync-lock"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
STATE_FORMAT = "deltasync-checkpoint"
_BITS = {2: np.dtype("<i2"), 4: np.dtype("<i4")}


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


def has_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a safetensors checkpoint (an index or ``*.safetensors`` files)."""
    path = Path(directory)
    return path.is_dir() and ((path / INDEX_FILE).is_file() or any(path.glob("*.safetensors")))


class CheckpointDirApplier:
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
        files = _checkpoint_files(self.directory)
        self._lock: IO[bytes] | None = _lock_directory(self.directory)
        self._maps: dict[Path, mmap.mmap] = {}
        self._views: dict[str, np.ndarray] = {}
        self._where: dict[str, tuple[Path, int]] = {}  # name -> (file, offset of its first element)
        specs: dict[str, TensorSpec] = {}
        try:
            for path in files:
                self._map_file(path, dtype, specs)
            _check_index(self.directory, specs)
        except BaseException:
            self.close()
            raise
        self.specs = specs
        self.fingerprint = fingerprint(specs.values())
        self.state = read_state(self.directory)
        self._pending: tuple[int, str] | None = None

    def _map_file(self, path: Path, dtype: torch.dtype | None, specs: dict[str, TensorSpec]) -> None:
        layout, data_start = _read_layout(path, dtype)
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)  # shared and writable: element writes land in the file
        self._maps[path] = mapped
        buffer = np.frombuffer(mapped, dtype=np.uint8)
        for spec, begin, end in layout:
            if spec.name in specs:
                raise TensorMismatch(f"tensor {spec.name!r} is stored twice in {self.directory}", name=spec.name)
            specs[spec.name] = spec
            self._views[spec.name] = buffer[data_start + begin : data_start + end].view(_BITS[_itemsize(spec)])
            self._where[spec.name] = (path, data_start + begin)

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
        return np.asarray(self._views[name][indices])

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
        self._write_state(CheckpointState(run_id, version, clean=False))
        for name, patch in decoded.items():
            view = self._views[name]
            if patch.indices is None:
                view[:] = patch.values
            else:
                view[patch.indices] = patch.values
        for name, patch in decoded.items():
            self._flush(name, patch)
        self._write_state(CheckpointState(run_id, version, clean=True))
        self._pending = None

    def _flush(self, name: str, patch: Decoded) -> None:
        """``msync`` the pages between the first and the last element written, not the whole file."""
        if patch.values.size == 0:
            return
        path, offset = self._where[name]
        itemsize = patch.values.itemsize
        first, last = (0, patch.values.size - 1) if patch.indices is None else (patch.indices[0], patch.indices[-1])
        start = offset + int(first) * itemsize
        aligned = start - start % mmap.PAGESIZE
        self._maps[path].flush(aligned, offset + (int(last) + 1) * itemsize - aligned)

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
        """``start_version`` and ``run_id`` for a :class:`~deltasync.subscriber.Subscriber`.

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
        self._views.clear()
        for mapped in self._maps.values():
            mapped.flush()
            with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped when it goes
                mapped.close()
        self._maps.clear()
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the flock
            self._lock = None

    def _write_state(self, state: CheckpointState) -> None:
        _write_atomic(self.directory / STATE_FILE, json.dumps(state.to_json(), indent=1).encode())
        self.state = state


def _itemsize(spec: TensorSpec) -> int:
    return spec.torch_dtype.itemsize


def _lock_directory(directory: Path) -> IO[bytes]:
    """An exclusive ``flock`` on ``directory/.deltasync-lock``: one writer per checkpoint.

    Raises:
        `ConflictError`: another process (or applier) is writing the directory.
    """
    directory.mkdir(parents=True, exist_ok=True)
    lock = open(directory / LOCK_FILE, "a+b")  # noqa: SIM115 - held until close()
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ConflictError(f"another process is writing {directory}; stop it first", key=str(directory)) from None
    return lock


def read_state(directory: str | os.PathLike[str]) -> CheckpointState | None:
    """The state recorded in ``directory/deltasync.json``, or ``None`` if absent or unreadable."""
    try:
        return CheckpointState.from_json(json.loads((Path(directory) / STATE_FILE).read_bytes()))
    except (OSError, ValueError):
        return None


def _checkpoint_files(directory: Path) -> list[Path]:
    """The shards named by the index, else every ``*.safetensors`` file."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _load_index(index)
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {directory}")
    return files


def _load_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DeltaFormatError(f"{index}: not a safetensors index ({exc!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise DeltaFormatError(f"{index}: 'weight_map' must map tensor names to file names")
    for name in weight_map.values():
        if Path(name).name != name or name in (".", "..") or not name.endswith(".safetensors"):
            raise DeltaFormatError(f"{index}: shard {name!r} must be a .safetensors file in the same directory")
    return weight_map


def _check_index(directory: Path, specs: Mapping[str, TensorSpec]) -> None:
    index = directory / INDEX_FILE
    if not index.is_file():
        return
    differ = sorted(set(_load_index(index)) ^ set(specs))
    if differ:
        missing = differ[:5]
        raise DeltaFormatError(f"{index} and its shards disagree on the tensors (e.g. {missing})")


def _read_layout(path: Path, dtype: torch.dtype | None) -> tuple[list[tuple[TensorSpec, int, int]], int]:
    """Each tensor's spec and byte range in the data section, and where that section starts."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        try:
            header = raw_header(prefix + f.read(min(length, MAX_HEADER_BYTES + 1, max(0, size - 8))))
        except DeltaFormatError as exc:
            raise DeltaFormatError(f"{path}: {exc}") from None
    data_start, data_size = 8 + length, size - 8 - length
    layout = [_parse_tensor(path, n, e, dtype, data_size) for n, e in header.items() if n != "__metadata__"]
    ranges = sorted((begin, end) for _, begin, end in layout if end > begin)
    if any(later[0] < earlier[1] for earlier, later in zip(ranges, ranges[1:])):
        raise DeltaFormatError(f"{path}: tensors overlap in the data section; refusing to patch it in place")
    return layout, data_start


def _parse_tensor(
    path: Path, name: str, entry: Any, dtype: torch.dtype | None, data_size: int
) -> tuple[TensorSpec, int, int]:
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise DeltaFormatError(f"{path}: malformed entry for {name!r}")
    found = entry["dtype"]
    wanted = dtype_name(dtype) if dtype is not None else found
    if found != wanted or found not in DTYPE_BY_NAME:
        raise TensorMismatch(
            f"{path.name}: tensor {name!r} is {found}; this checkpoint is patched in place in the published "
            f"dtype ({wanted if dtype is not None else sorted(DTYPE_BY_NAME)}): convert the checkpoint, "
            "or start from an empty directory",
            name=name,
        )
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    try:
        spec = TensorSpec(name, tuple(shape), found)  # type: ignore[arg-type]
        begin, end = (int(o) for o in offsets)  # type: ignore[union-attr]
    except (TypeError, ValueError) as exc:
        raise DeltaFormatError(f"{path}: malformed entry for {name!r}: {exc}") from None
    if not 0 <= begin <= end <= data_size or end - begin != spec.numel * _itemsize(spec):
        raise DeltaFormatError(f"{path}: byte range {[begin, end]} of {name!r} does not fit its shape or the file")
    return spec, begin, end


def write_empty_checkpoint(path: str | os.PathLike[str], specs: Iterable[TensorSpec]) -> None:
    """Write a safetensors file holding ``specs`` with every element zero.

    The data section is allocated (``posix_fallocate``) but not written, so this
    costs O(header) I/O on most filesystems, and a full disk fails here with
    ``OSError`` rather than as ``SIGBUS`` on a later write through a memory map.
    Wider dtypes come first, keeping every tensor aligned to its element size.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in sorted(specs, key=lambda s: (-_itemsize(s), s.name)):
        nbytes = spec.numel * _itemsize(spec)
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    target = Path(path)
    tmp = target.with_name(f".tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
            if offset and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(f.fileno(), 0, 8 + len(raw) + offset)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


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
        **subscriber_options: passed to :class:`~deltasync.subscriber.Subscriber` (``replica_id``, ``ack``, ...).

    Raises:
        `FileExistsError`: ``directory`` already holds a checkpoint. `ConflictError`: another process
            is writing it. `ObjectNotFound` / `VersionError`: nothing (or no anchor) published yet.
    """
    from ..stores import open_store

    target = Path(directory)
    with _lock_directory(target):
        if has_checkpoint(target):
            raise FileExistsError(f"{target} already holds a checkpoint; follow it instead of initialising it")
        with open_store(store) as opened:
            specs = anchor_layout(opened, Manifest.from_bytes(opened.get(MANIFEST_KEY)))
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
    from ..subscriber import Subscriber

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
