"""``deltasync inspect FILE``: a delta or anchor file's metadata, per-tensor codec, counts and sparsity.

``FILE`` is a local path, or a store URL plus a key (``s3://bucket/run1/deltas/000007.safetensors``
is read through the S3 backend). ``--json`` prints :func:`describe`'s dictionary instead of a table.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import DeltaFormatError, StoreError
from ..format import Header, entry_span, raw_header, read_header
from .common import Column, print_json, print_table

__all__ = ["describe"]


def _read(target: str) -> bytes:
    if "://" not in target or target.startswith("file://"):
        return _read_local(Path(target.removeprefix("file://")))
    from ..stores import open_store

    # The key is the last path component; everything before it is the store root.
    root, _, key = target.rpartition("/")
    with open_store(root) as store:
        return store.get(key)


def _read_local(path: Path) -> bytes:
    """A local file's bytes; a FIFO or device is refused instead of blocking or reading forever."""
    if path.is_dir():
        raise StoreError(
            f"{path} is a directory: inspect reads one delta or anchor file (a run prefix's deltas/*.safetensors "
            f"or anchors/*.safetensors); for the run itself: deltasync status {path}", key=str(path),
        )
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise StoreError(f"{path} is not a regular file (a FIFO, device or directory); refused", key=str(path))
        return f.read()


def _part_sizes(header: Header, data: bytes) -> dict[str, int]:
    """Bytes per tensor, from its entries' ranges (each checked: a file to inspect may be anyone's), as the
    header that :func:`~deltasync.format.read_header` parsed keeps them (parsed again only for one built
    without them)."""
    sizes: dict[str, int] = {}
    body = len(data) - 8 - int.from_bytes(data[:8], "little")
    layout = header.layout if header.layout is not None else raw_header(data)
    for key, entry in layout.items():
        if key == "__metadata__":
            continue
        name = key.split("::", 1)[0]
        start, end = entry_span(entry, body, key)
        sizes[name] = sizes.get(name, 0) + end - start
    return sizes


def describe(header: Header, data: bytes) -> dict[str, Any]:
    """A JSON-able description of a delta or anchor file.

    ``dense_bytes`` is what the tensors the file carries take in full (an anchor: the whole model);
    ``sparsity`` is the share of the model's elements a delta leaves unchanged (``None`` for an anchor).
    """
    sizes = _part_sizes(header, data)
    return {
        "kind": header.kind,
        "format_version": header.format_version,
        "version": header.version,
        "base_version": header.base_version,
        "fingerprint": header.fingerprint,
        "bytes": len(data),
        "header_bytes": 8 + int.from_bytes(data[:8], "little"),
        "dense_bytes": sum(e.spec.numel * e.spec.torch_dtype.itemsize for e in header.tensors.values()),
        "numel": header.numel,
        "nnz": header.nnz,
        "sparsity": header.sparsity if header.kind == "delta" else None,
        "tensors": [
            {
                "name": name,
                "codec": e.codec,
                "dtype": e.spec.dtype,
                "shape": list(e.spec.shape),
                "nnz": e.nnz,
                "density": e.nnz / e.spec.numel if e.spec.numel else 0.0,
                "bytes": sizes.get(name, 0),
            }
            for name, e in header.tensors.items()
        ],
    }


def _print_inspect(info: dict[str, Any], limit: int) -> None:
    base = f" (base {info['base_version']})" if info["base_version"] is not None else ""
    print(f"{info['kind']} version {info['version']}{base}, format v{info['format_version']}")
    print(f"model fingerprint  {info['fingerprint']}")
    print(f"file size          {info['bytes']:,} bytes")
    packed = " (packed, format 4)" if info["format_version"] >= 4 else ""
    print(f"header             {info['header_bytes']:,} bytes{packed}")
    if info["sparsity"] is None:
        print(f"elements           {info['nnz']:,} of {info['numel']:,} (whole tensors)")
    else:
        print(f"elements           {info['nnz']:,} of {info['numel']:,} changed (sparsity {100 * info['sparsity']:.4f} %)")
    codecs: dict[str, int] = {}
    for t in info["tensors"]:
        codecs[t["codec"]] = codecs.get(t["codec"], 0) + 1
    print(f"tensors            {len(info['tensors'])} ({', '.join(f'{n} {c}' for c, n in sorted(codecs.items()))})")
    rows = sorted(info["tensors"], key=lambda t: -t["bytes"])[:limit]
    if not rows:
        return
    columns = (
        Column("tensor", max(len(t["name"]) for t in rows), gap=2),
        Column("codec", 11),
        Column("dtype", 7),
        Column("shape", 14),
        Column("changed", 10, ">"),
        Column("density", 9, ">"),
        Column("bytes", 11, ">"),
    )
    print_table(columns, (_tensor_cells(t) for t in rows))
    if len(info["tensors"]) > limit:
        print(f"... {len(info['tensors']) - limit} more (use --tensors N)")


def _tensor_cells(t: dict[str, Any]) -> tuple[object, ...]:
    shape = "x".join(map(str, t["shape"])) or "scalar"
    return (t["name"], t["codec"], t["dtype"], shape, f"{t['nnz']:,}", f"{100 * t['density']:.3f}%", f"{t['bytes']:,}")


def add_parser(sub: Any) -> None:
    """Register ``inspect`` on the ``deltasync`` subcommands."""
    inspect = sub.add_parser("inspect", help="show a delta or anchor file's metadata and per-tensor contents")
    inspect.add_argument("file", help="a path, or a store URL ending in the object key")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument("--tensors", type=int, default=20, metavar="N", help="largest N tensors to list (default 20)")
    inspect.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print a file's description (a table, or JSON with ``--json``)."""
    data = _read(args.file)
    if data[:1] == b"{":
        raise DeltaFormatError(
            f"{args.file} is JSON, not a delta or anchor file (a run's manifest?): for the run, "
            "deltasync status <run prefix>"
        )
    info = describe(read_header(data), data)
    if args.json:
        print_json(info)
    else:
        _print_inspect(info, args.tensors)
    return 0
