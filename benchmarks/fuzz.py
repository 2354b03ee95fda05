"""Fuzz the readers of untrusted bytes: only ``DeltaSyncError`` may come out.

Everything a replica downloads is hostile until proven otherwise. This runs
mutated inputs through the code that reads them, the way a replica does:

- ``decode``: :func:`deltasync.format.decode` alone (no receiver, no base);
- ``receiver``: ``read_header`` -> ``TorchModuleApplier.validate`` ->
  ``decode(base=applier.lookup)``, the subscriber's order;
- ``device``: the same for a replica on an accelerator (``TorchModuleApplier(stage=True)``: the
  device path's code, here on CPU tensors), whose ``compact`` tensors are checked, inflated and rebuilt
  with torch ops where the weights live;
- ``rank``: what the worker of a one-rank vLLM engine does with a version's files
  (``worker_decode.decode_here`` against its weights read through its index map), on the host path
  and the device path in turn, with no header check before it (the worker's own checks alone);
- ``ranged``: a rank that holds some tensors reading only those (``ranged.fetch_tensors`` of a random
  selection from a store, the header pinned by its hash as the manifest would, each tensor checked
  against its digest), then the fetcher's checks and decode of what came back;
- ``inspect``: what ``deltasync inspect`` makes of a file (``cli.inspect.describe``): anyone's file;
- ``manifest``: :meth:`deltasync.protocol.manifest.Manifest.from_bytes`, then, for a
  manifest that parses, ``plan_route`` from a random version and
  ``plan_retention`` (what a replica and a publisher do with it next);
- ``object``: the check of an object referenced by its entries
  (``blake3-entries``), with the header digest taken from the mutated file
  itself so that every check past the header is reached: it may only answer
  intact or not (refusals counted as ``IntegrityError``, as the fetcher raises).

Seeds are the golden files (``tests/golden``) and freshly encoded deltas of every
codec (sparse, dense, special values) and anchors, plus manifests of a real run.
Mutations: byte flips (anywhere, or in the tensor data only, so the codecs'
own checks are reached), truncation and extension, a forged header length,
structured edits of the safetensors header, of the deltasync metadata and of a
packed (format 4) delta's compressed table (values of other types, huge and negative numbers, deep nesting, renamed tensors, wrong
shapes, dtypes, offsets and codec params), splices of two files; for manifests,
structured JSON edits and byte flips.

Any other exception is an escape: it is counted, its input is saved under
``benchmarks/results/fuzz-escapes/`` and the exit code is 1. Counts per target
and error type go to ``benchmarks/results/fuzz.json``.

    python benchmarks/fuzz.py                    # 100000 inputs per target
    python benchmarks/fuzz.py --iterations 2000 --seed 7
    python benchmarks/fuzz.py --memory-gb 0      # no address-space limit (default 8 GiB)
"""

from __future__ import annotations

import argparse
import base64
import copy
import functools
import hashlib
import json
import random
import resource
import struct
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine, write_json  # noqa: E402

from deltasync.appliers import TorchModuleApplier  # noqa: E402
from deltasync.appliers.mapping import IndexMap  # noqa: E402
from deltasync.appliers.vllm.rank_decode import decode_here  # noqa: E402
from deltasync.cli.inspect import describe  # noqa: E402
from deltasync.errors import DeltaSyncError, IntegrityError  # noqa: E402
from deltasync.format import decode, encode_anchor, encode_delta, read_header  # noqa: E402
from deltasync.format.check import intact_by_entries  # noqa: E402
from deltasync.format.decode import decode_entries  # noqa: E402
from deltasync.format.digests import hexdigest  # noqa: E402
from deltasync.protocol.manifest import Manifest, ObjectRef, plan_retention, plan_route  # noqa: E402
from deltasync.publish.diff import Snapshot, diff  # noqa: E402
from deltasync.replica.ranged import fetch_tensors  # noqa: E402
from deltasync.stores import MemoryStore  # noqa: E402

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden"
ESCAPES = RESULTS / "fuzz-escapes"
MAX_SAVED = 20  # escaping inputs written to disk per run


# ---------------------------------------------------------------------- seeds


def _model() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 32),
        "layers.0.norm.weight": torch.ones(32),
        "head.weight": torch.randn(16, 64).to(torch.bfloat16),
    }


def delta_seeds() -> tuple[list[bytes], TorchModuleApplier]:
    """Valid deltas and anchors of one small model, and a receiver holding its base weights."""
    weights = _model()
    published = Snapshot.capture(weights)
    receiver = {name: t.clone() for name, t in published.items()}
    applier = TorchModuleApplier(receiver)
    seeds = [encode_anchor(dict(published.items()), version=0, model=published.specs)]
    with torch.no_grad():
        weights["embed.weight"][3, :7] += 0.25
        weights["embed.weight"][40:, 5] = torch.tensor([0.0, -0.0, float("nan"), float("inf")] * 6)
        weights["head.weight"].view(-1)[::97] += 1
        weights["layers.0.norm.weight"].add_(0.5)  # every element: the dense codec
    changes = diff(published, weights)
    for codec in ("compact", "compact-abs", "compact-exp", "exp-rice", "raw"):
        seeds.append(encode_delta(changes, version=1, base_version=0, codec=codec))
    seeds += [p.read_bytes() for p in sorted(GOLDEN.glob("*.safetensors"))]
    return seeds, applier


def manifest_seeds() -> list[bytes]:
    """The golden manifest and a few of a real run (anchors, deltas, retired keys)."""
    seeds = [p.read_bytes() for p in sorted(GOLDEN.glob("manifest*.json"))]
    golden = json.loads(seeds[0])
    ref = lambda kind, v: {"key": f"{kind}/{v:010d}-0a1b2c3d.safetensors", "size": 100 + v, "sha256": "ab" * 32}  # noqa: E731
    versions = [{"version": 0, "step": 0, "time": 1.0, "nnz": 10, "anchor": [ref("anchors", 0)]}]
    for v in range(1, 12):
        entry: dict[str, Any] = {"version": v, "step": v, "time": 1.0 + v, "nnz": v, "delta": [ref("deltas", v)]}
        if v % 4 == 0:
            entry["anchor"] = [ref("anchors", v)]
        versions.append(entry)
    run = {**golden, "versions": versions, "retired": [["deltas/0000000000-ffffffff.safetensors", 5.0]]}
    seeds.append(json.dumps(run).encode())
    return seeds


# ---------------------------------------------------------------------- mutations


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any type, often a hostile one."""
    pick = rng.randrange(14)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.randint(-5, 5)
    if pick == 3:
        return rng.choice([2**31, 2**63, 2**64 + 1, -(2**63), 10**30])
    if pick == 4:
        return rng.choice([float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 0.5])
    if pick == 5:
        return rng.choice(["", "BF16", "F32", "I64", "compact", "raw", "dense", "delta", "anchor", "../x", "a" * 300])
    if pick == 6:
        return str(rng.randint(-3, 10**6))
    if pick == 7 and depth < 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 8 and depth < 3:
        return {random_text(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if pick == 9:
        return nested(rng.choice([50, 500, 5000, 100_000]))
    if pick == 10:
        return [rng.randint(0, 4) for _ in range(rng.randrange(4))]
    if pick == 11:
        return dumps(random_value(rng, depth + 1) if depth < 3 else 1)
    return rng.randint(0, 100)


def random_text(rng: random.Random) -> str:
    """A string, or any JSON value as text (metadata values are strings that hold JSON)."""
    value = random_value(rng)
    return value if isinstance(value, str) else dumps(value)


class Nested:
    """A marker serialised as ``depth`` nested lists (json.dumps cannot build them that deep)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


def nested(depth: int) -> Nested:
    return Nested(depth)


def dumps(value: Any) -> str:
    """``json.dumps`` that expands :class:`Nested` markers."""
    markers: list[Nested] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, Nested):
            markers.append(obj)
            return f"\x00nested{len(markers) - 1}\x00"
        raise TypeError(type(obj))

    text = json.dumps(value, default=default, allow_nan=True)
    for i, marker in enumerate(markers):
        text = text.replace(json.dumps(f"\x00nested{i}\x00"), "[" * marker.depth + "]" * marker.depth)
    return text


def mutate_json(rng: random.Random, value: Any) -> Any:
    """Change, drop or add one thing somewhere in a JSON tree."""
    value = copy.deepcopy(value)
    containers: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, (dict, list)):
            containers.append(node)
            for child in node.values() if isinstance(node, dict) else node:
                walk(child)

    walk(value)
    if not containers:
        return random_value(rng)
    node = rng.choice(containers)
    if isinstance(node, dict):
        action = rng.randrange(4)
        keys = list(node)
        if action == 0 and keys:
            del node[rng.choice(keys)]
        elif action == 1 and keys:
            key = rng.choice(keys)
            edit_text = isinstance(node[key], str) and rng.random() < 0.5
            node[key] = _string_edit(rng, node[key]) if edit_text else random_value(rng)
        elif action == 2 and keys:
            key = rng.choice(keys)
            node[random_text(rng)] = node.pop(key)  # renamed
        else:
            node[rng.choice(["x", "tensors", "kind", "version", "shape", "::val", "__metadata__"])] = random_value(rng)
    else:
        action = rng.randrange(3)
        if action == 0 and node:
            node.pop(rng.randrange(len(node)))
        elif action == 1 and node:
            node[rng.randrange(len(node))] = random_value(rng)
        else:
            node.append(copy.deepcopy(rng.choice(node)) if node and rng.random() < 0.5 else random_value(rng))
    return value


def _string_edit(rng: random.Random, text: str) -> Any:
    """Edit a string in place: JSON inside metadata strings is itself parsed, so edit that too."""
    try:
        inner = json.loads(text)
    except (ValueError, RecursionError):
        inner = None
    if isinstance(inner, (dict, list)) and rng.random() < 0.8:
        try:
            return dumps(mutate_json(rng, inner))
        except RecursionError:  # nested deeply by an earlier edit: too deep to walk, replace it
            return random_text(rng)
    if text and rng.random() < 0.5:
        i = rng.randrange(len(text))
        return text[:i] + chr(rng.randrange(32, 127)) + text[i + 1 :]
    return random_text(rng)


def split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    try:
        return json.loads(data[8 : 8 + n]), data[8 + n :]
    except (ValueError, RecursionError):
        return None


def join_safetensors(header: Any, body: bytes) -> bytes:
    text = dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _packed_table(header: Any) -> Any:
    """The inflated table of a packed header, or ``None`` for any other header."""
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors_zstd"), str):
        return None
    try:
        return json.loads(zstandard.ZstdDecompressor().decompressobj().decompress(base64.b64decode(meta["tensors_zstd"])))
    except (ValueError, zstandard.ZstdError):
        return None


def mutate_file(rng: random.Random, seeds: list[bytes]) -> tuple[str, bytes]:
    """One mutated delta/anchor file and the name of the mutation."""
    data = bytearray(rng.choice(seeds))
    kind = rng.choice(["flip", "body", "body", "truncate", "extend", "length", "header", "header", "header", "splice",
                       "table", "table"])
    if kind == "body":  # the header stays valid: the codecs' own checks must catch it
        (n,) = struct.unpack("<Q", data[:8])
        if len(data) > 8 + n:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(8 + n, len(data))] = rng.randrange(256)
    elif kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind == "extend":
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == "length":
        data[:8] = struct.pack("<Q", rng.choice([0, 1, len(data), len(data) - 7, 2**31, 2**63, rng.randrange(2**16)]))
    elif kind == "table":  # inside a packed (format 4) header's compressed table, where byte flips seldom reach
        parts = split_safetensors(bytes(data))
        table = _packed_table(parts[0]) if parts is not None else None
        if table is not None:
            header, body = parts
            for _ in range(rng.randint(1, 3)):
                table = mutate_json(rng, table)
            frame = zstandard.ZstdCompressor().compress(dumps(table).encode())
            header["__metadata__"]["tensors_zstd"] = base64.b64encode(frame).decode()
            data = bytearray(join_safetensors(header, body))
    elif kind == "splice":
        other = split_safetensors(rng.choice(seeds))
        mine = split_safetensors(bytes(data))
        if other and mine:
            data = bytearray(join_safetensors(mine[0], other[1]))
    else:
        parts = split_safetensors(bytes(data))
        if parts is not None:
            header, body = parts
            for _ in range(rng.randint(1, 3)):
                meta = header.get("__metadata__") if isinstance(header, dict) else None
                if isinstance(meta, dict) and meta and rng.random() < 0.6:
                    key = rng.choice(list(meta))
                    meta[key] = _string_edit(rng, meta[key]) if isinstance(meta[key], str) else random_text(rng)
                else:
                    header = mutate_json(rng, header)
            data = bytearray(join_safetensors(header, body))
    return kind, bytes(data)


def mutate_manifest(rng: random.Random, seeds: list[bytes]) -> tuple[str, bytes]:
    data = rng.choice(seeds)
    kind = rng.choice(["json", "json", "json", "json", "flip", "truncate", "bytes"])
    if kind == "json":
        tree = json.loads(data)
        for _ in range(rng.randint(1, 3)):
            tree = mutate_json(rng, tree)
        return kind, dumps(tree).encode()
    if kind == "flip":
        buf = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        return kind, bytes(buf)
    if kind == "truncate":
        return kind, data[: rng.randrange(len(data))]
    return kind, bytes(rng.randrange(256) for _ in range(rng.randrange(200)))


# ---------------------------------------------------------------------- targets


def run_decode(data: bytes, applier: TorchModuleApplier, rng: random.Random) -> None:
    decode(data)


def run_receiver(data: bytes, applier: TorchModuleApplier, rng: random.Random) -> None:
    header = read_header(data)
    applier.validate(header)
    decode(data, base=applier.lookup, header=header)


@functools.cache
def staged_of(applier: TorchModuleApplier) -> TorchModuleApplier:
    """The same weights, taken by the device path (it only reads them here)."""
    return TorchModuleApplier(applier.state(), stage=True)


@functools.cache
def rank_of(applier: TorchModuleApplier) -> IndexMap:
    """A rank that holds a copy of the same weights, each in a parameter of its own."""
    return IndexMap.whole({n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in applier.state().items()})


def run_device(data: bytes, applier: TorchModuleApplier, rng: random.Random) -> None:
    staged = staged_of(applier)
    header = read_header(data)
    staged.validate(header)
    decode(data, base=staged.lookup, header=header, on_device=staged.on_device)


def run_rank(data: bytes, applier: TorchModuleApplier, rng: random.Random) -> None:
    decode_here(rank_of(applier), [data], whole=read_header(data).kind == "anchor", on_device=rng.random() < 0.5)


_RANGED = MemoryStore("fuzz-ranged")


def run_ranged(data: bytes, applier: TorchModuleApplier, rng: random.Random) -> None:
    length = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    size = min(8 + length, len(data))  # the header's bytes, pinned as a writer would (reached past the hash)
    key = "deltas/0000000001-0a1b2c3d.safetensors"
    _RANGED.put(key, data)
    ref = ObjectRef(key, len(data), hexdigest([data], "blake3"), header=(size, hexdigest([data[:size]], "blake3")))
    fetched = fetch_tensors(_RANGED, ref, lambda name: rng.random() < 0.5, gap=rng.choice([0, 64, 1 << 20]))
    applier.validate(fetched.header)
    decode_entries(fetched.header, fetched.entries, base=applier.lookup, names=fetched.names)


def run_inspect(data: bytes, applier: Any, rng: random.Random) -> None:
    describe(read_header(data), data)


def run_object(data: bytes, applier: Any, rng: random.Random) -> None:
    length = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    size = min(8 + length, len(data))
    if not intact_by_entries(data, (size, hexdigest([data[:size]], "blake3"))):
        raise IntegrityError("not intact")


def run_manifest(data: bytes, applier: Any, rng: random.Random) -> None:
    manifest = Manifest.from_bytes(data)
    latest = manifest.latest
    current = rng.choice([None, 0, latest, (latest or 0) + 3, rng.randint(0, 20)])
    plan_route(manifest, current, avoid={rng.choice(["", "deltas/0000000003-0a1b2c3d.safetensors"])})
    plan_retention(manifest, keep_anchors=rng.randint(1, 3), now=time.time())


TARGETS: dict[str, tuple[Callable[..., None], Callable[[random.Random, list[bytes]], tuple[str, bytes]]]] = {
    "decode": (run_decode, mutate_file),
    "receiver": (run_receiver, mutate_file),
    "device": (run_device, mutate_file),
    "rank": (run_rank, mutate_file),
    "ranged": (run_ranged, mutate_file),
    "inspect": (run_inspect, mutate_file),
    "manifest": (run_manifest, mutate_manifest),
    "object": (run_object, mutate_file),
}


def fuzz(target: str, iterations: int, seed: int, seeds: list[bytes], applier: Any) -> dict[str, Any]:
    run, mutate = TARGETS[target]
    rng = random.Random(f"{target}-{seed}")
    outcomes: Counter[str] = Counter()
    mutations: Counter[str] = Counter()
    escapes: list[dict[str, Any]] = []
    started = time.perf_counter()
    for i in range(iterations):
        kind, data = mutate(rng, seeds)
        mutations[kind] += 1
        try:
            run(data, applier, rng)
            outcomes["accepted"] += 1
        except DeltaSyncError as exc:
            outcomes[type(exc).__name__] += 1
        except Exception as exc:  # an escape: the bug this script looks for
            name = f"ESCAPED {type(exc).__name__}"
            outcomes[name] += 1
            sha = hashlib.sha256(data).hexdigest()[:16]
            if len(escapes) < MAX_SAVED:
                ESCAPES.mkdir(parents=True, exist_ok=True)
                path = ESCAPES / f"{target}-{sha}.bin"
                path.write_bytes(data)
                escapes.append({
                    "iteration": i, "mutation": kind, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                    "input": str(path.relative_to(RESULTS.parent.parent)), "bytes": len(data),
                    "where": traceback.extract_tb(exc.__traceback__)[-1].filename.rsplit("/", 2)[-2:],
                })
    return {
        "iterations": iterations,
        "seconds": round(time.perf_counter() - started, 1),
        "outcomes": dict(outcomes.most_common()),
        "mutations": dict(mutations),
        "escapes": escapes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=100_000, help="inputs per target (default 100000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--output", default="fuzz", help="results/<name>.json")
    parser.add_argument("--memory-gb", type=float, default=8.0,
                        help="address space allowed (default 8): an input that needs more is an escape (0: no limit)")
    args = parser.parse_args(argv)
    if args.memory_gb:  # a MemoryError is caught and saved like any other escape; the kernel's OOM killer is not
        limit = int(args.memory_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(1)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))  # the interpreter's default: what users run
    file_seeds, applier = delta_seeds()
    results = {}
    for target in args.targets:
        seeds = manifest_seeds() if target == "manifest" else file_seeds
        results[target] = fuzz(target, args.iterations, args.seed, seeds, applier)
        r = results[target]
        print(f"{target}: {r['iterations']} inputs in {r['seconds']} s")
        for name, count in r["outcomes"].items():
            print(f"  {count:>7}  {name}")
    escaped = sum(len(r["escapes"]) for r in results.values())
    escaped_total = sum(n for r in results.values() for k, n in r["outcomes"].items() if k.startswith("ESCAPED"))
    payload = {
        "params": vars(args),
        "machine": machine(),
        "targets": results,
        "escaped": escaped_total,
        "passed": escaped_total == 0,
    }
    path = write_json(args.output, payload)
    print(f"{escaped_total} escapes ({escaped} inputs saved); wrote {path}")
    return 0 if escaped_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
