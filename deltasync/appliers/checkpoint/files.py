"""Checkpoint directory: the safetensors files, their index, memory maps and the writer's lock.

What :class:`~.checkpoint.CheckpointDirApplier` patches, and how it finds it:

- which files: ``model.safetensors``, or the shards named by
  ``model.safetensors.index.json`` (which must name the same tensors as the
  shards hold), or else every ``*.safetensors`` file (:func:`checkpoint_files`);
- where each tensor's elements lie: parsed from each file's header, refusing
  malformed entries, byte ranges that do not fit the shape or the file, and
  tensors that overlap (:func:`read_layout`);
- :class:`MappedCheckpoint`: every file memory-mapped shared and writable, a
  bit-pattern view per tensor, and ``msync`` of just the pages a patch wrote;
- :func:`lock_directory`: one writer per directory (``flock``);
- :func:`write_empty_checkpoint`: a new all-zero file for a given layout.

Limitations:

- Every tensor must be in the published dtype (BF16, F16 or F32 when the
  applier accepts each tensor's own): files are patched in place, never
  converted.
- Headers are read up to ``MAX_HEADER_BYTES``; larger ones are refused.
- The lock is advisory (``flock``): it keeps other deltasync writers out, not
  other programs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import safetensors
import torch

from ...errors import ConflictError, DeltaFormatError, TensorMismatch
from ...format import MAX_HEADER_BYTES, raw_header
from ...tensors import DTYPE_BY_NAME, NUMPY_BITS_BY_SIZE, TensorSpec, dtype_name
from ...tensors.fp8 import view_names

__all__ = [
    "checkpoint_reader",
    "checkpoint_specs",
    "INDEX_FILE",
    "SINGLE_FILE",
    "LOCK_FILE",
    "MappedCheckpoint",
    "has_checkpoint",
    "checkpoint_files",
    "check_index",
    "read_layout",
    "lock_directory",
    "write_empty_checkpoint",
]

LOCK_FILE = ".deltasync-lock"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def has_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a safetensors checkpoint (an index or ``*.safetensors`` files)."""
    path = Path(directory)
    return path.is_dir() and ((path / INDEX_FILE).is_file() or any(path.glob("*.safetensors")))


class MappedCheckpoint:
    """A checkpoint's tensors, memory-mapped shared and writable: element writes land in the files.

    Args:
        directory (`Path`): the checkpoint directory (named in errors).
        files (`list[Path]`): its safetensors files, from :func:`checkpoint_files`.
        dtype (`torch.dtype`, *optional*): the dtype every tensor must have; ``None``: each its own.

    Raises:
        `DeltaFormatError`: a file or the index is malformed.
        `TensorMismatch`: a tensor is not in ``dtype``, or is stored twice.
    """

    def __init__(self, directory: Path, files: list[Path], dtype: torch.dtype | None) -> None:
        self.directory = directory
        self._maps: dict[Path, mmap.mmap] = {}
        self.views: dict[str, np.ndarray] = {}
        """Tensor name -> its elements' bit patterns (int16 / int32), a view into the map."""
        self._where: dict[str, tuple[Path, int]] = {}  # name -> (file, offset of its first element)
        specs: dict[str, TensorSpec] = {}
        try:
            for path in files:
                self._map_file(path, dtype, specs)
            check_index(directory, specs)
        except BaseException:
            self.close()
            raise
        self.specs = specs

    def _map_file(self, path: Path, dtype: torch.dtype | None, specs: dict[str, TensorSpec]) -> None:
        layout, data_start = read_layout(path, dtype)
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)  # shared and writable: element writes land in the file
        self._maps[path] = mapped
        buffer = np.frombuffer(mapped, dtype=np.uint8)
        for spec, begin, end in layout:
            if spec.name in specs:
                raise TensorMismatch(f"tensor {spec.name!r} is stored twice in {self.directory}", name=spec.name)
            specs[spec.name] = spec
            bits = NUMPY_BITS_BY_SIZE[_itemsize(spec)]
            self.views[spec.name] = buffer[data_start + begin : data_start + end].view(bits)
            self._where[spec.name] = (path, data_start + begin)

    def flush(self, name: str, indices: np.ndarray | None, values: np.ndarray) -> None:
        """``msync`` the pages between the first and the last element written, not the whole file.

        Args:
            name (`str`): the tensor written.
            indices (`np.ndarray`, *optional*): sorted flat indices written; ``None``: the whole tensor.
            values (`np.ndarray`): the values written there.
        """
        if values.size == 0:
            return
        path, offset = self._where[name]
        itemsize = values.itemsize
        first, last = (0, values.size - 1) if indices is None else (indices[0], indices[-1])
        start = offset + int(first) * itemsize
        aligned = start - start % mmap.PAGESIZE
        self._maps[path].flush(aligned, offset + (int(last) + 1) * itemsize - aligned)

    def close(self) -> None:
        """Flush and unmap the files."""
        self.views.clear()
        for mapped in self._maps.values():
            mapped.flush()
            with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped when it goes
                mapped.close()
        self._maps.clear()


def _itemsize(spec: TensorSpec) -> int:
    return spec.torch_dtype.itemsize


def lock_directory(directory: Path) -> IO[bytes]:
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


def checkpoint_files(directory: Path) -> list[Path]:
    """The shards named by the index, else every ``*.safetensors`` file.

    Raises:
        `FileNotFoundError`: no checkpoint in ``directory``. `DeltaFormatError`: a malformed index.
    """
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


def check_index(directory: Path, specs: Mapping[str, TensorSpec]) -> None:
    """Refuse an index that names other tensors than the shards hold (no index: nothing to check).

    Raises:
        `DeltaFormatError`: the index and the shards disagree.
    """
    index = directory / INDEX_FILE
    if not index.is_file():
        return
    differ = sorted(set(_load_index(index)) ^ set(specs))
    if differ:
        missing = differ[:5]
        raise DeltaFormatError(f"{index} and its shards disagree on the tensors (e.g. {missing})")


def read_layout(path: Path, dtype: torch.dtype | None) -> tuple[list[tuple[TensorSpec, int, int]], int]:
    """Each tensor's spec and byte range in the data section, and where that section starts.

    Raises:
        `DeltaFormatError`: a malformed header or entry, or overlapping tensors.
        `TensorMismatch`: a tensor is not in ``dtype`` (nor part of a block-fp8 view).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        try:
            header = raw_header(prefix + f.read(min(length, MAX_HEADER_BYTES + 1, max(0, size - 8))))
        except DeltaFormatError as exc:
            raise DeltaFormatError(f"{path}: {exc}") from None
    data_start, data_size = 8 + length, size - 8 - length
    # A block-fp8 view's tensors (e4m3 weights and their scales) are held in their own dtypes whatever ``dtype``.
    own = view_names((n for n, e in header.items() if isinstance(e, dict) and e.get("dtype") == "F8_E4M3"), header)
    layout = [_parse_tensor(path, n, e, None if n in own else dtype, data_size)
              for n, e in header.items() if n != "__metadata__"]
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


def checkpoint_specs(directory: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """Names and shapes of a safetensors checkpoint directory, as published in ``dtype``; the tensors of a
    block-fp8 checkpoint's fp8 view (e4m3 weights and their ``_scale_inv`` scales) in their own dtypes.

    Tied duplicates are absent from checkpoints written by ``save_pretrained``,
    as from a trainer's ``named_parameters()``, so the fingerprints agree.
    """
    path = Path(directory)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {path}")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        with safetensors.safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                found[name] = (tuple(part.get_shape()), part.get_dtype())
    own = view_names((name for name, (_, kind) in found.items() if kind == "F8_E4M3"), found)
    return [
        TensorSpec(name, shape, kind if name in own else dtype_name(dtype)) for name, (shape, kind) in found.items()
    ]


class checkpoint_reader:
    """``name -> tensor`` over a safetensors checkpoint directory, files opened lazily and closed on exit."""

    def __init__(self, directory: str) -> None:
        self.files = sorted(Path(directory).glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no *.safetensors checkpoint in {directory} to prove the map against")
        self.stack = contextlib.ExitStack()
        self.where: dict[str, Any] = {}

    def __enter__(self) -> Callable[[str], torch.Tensor | None]:
        for file in self.files:
            handle = self.stack.enter_context(safetensors.safe_open(str(file), framework="pt"))
            self.where.update(dict.fromkeys(handle.keys(), handle))
        return lambda name: self.where[name].get_tensor(name) if name in self.where else None

    def __exit__(self, *exc: object) -> None:
        self.stack.close()
