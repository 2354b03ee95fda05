"""A tensor past 2**31 elements, published and followed bit-exactly: what a large MoE's fused experts need.

A frontier MoE stores each layer's experts as one tensor: 256 experts of
7168 x 2048 are 3.8 billion elements, beyond what an int32 index reaches. This
run publishes a BF16 tensor of ``2**31 + 4096`` elements (4.3 GB) beside a
small one to a local store: an anchor, then deltas whose changes sit on both
sides of element 2**31 (the first and last elements, 2**31 - 1, 2**31, 2**31 + 1,
and random positions). Two replicas follow the run from its anchor, one
written tensor by tensor and one staged (the path of a replica on an
accelerator, here on CPU tensors); each must end equal to the trainer bit for
bit. It needs about 14 GB of memory (the trainer's tensor, its snapshot and
one replica at a time), so it is a benchmark, not a test.

    python benchmarks/large_tensor.py                   # compact (the default codec)
    python benchmarks/large_tensor.py --codec exp-rice
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import human_bytes, machine, table, write_json  # noqa: E402

from deltasync import Publisher, Subscriber  # noqa: E402
from deltasync.appliers import TorchModuleApplier  # noqa: E402

NUMEL = 2**31 + 4096
EDGES = [0, 1, 2**31 - 1, 2**31, 2**31 + 1, NUMEL - 1]


def _change(weights: dict[str, torch.Tensor], count: int, seed: int) -> None:
    """New values at the edges around 2**31 and at ``count`` random positions (and one small-tensor element)."""
    g = torch.Generator().manual_seed(seed)
    index = torch.cat([torch.tensor(EDGES), torch.randint(0, NUMEL, (count,), generator=g)])
    weights["big"][index] = (torch.randn(index.numel(), generator=g) + seed).to(torch.bfloat16)
    weights["small"][seed % 10] = float(seed)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", default="compact")
    parser.add_argument("--changes", type=int, default=1_000_000, help="random changes per delta")
    parser.add_argument("--root", default=tempfile.gettempdir(), help="where the store is written")
    parser.add_argument("--results-dir", default=None)
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="large-tensor-", dir=args.root))
    store = str(root / "run")
    weights = {"big": torch.zeros(NUMEL, dtype=torch.bfloat16), "small": torch.zeros(10, dtype=torch.bfloat16)}
    rows: list[dict[str, Any]] = []
    try:
        with Publisher(weights, store, codec=args.codec, anchor_every=1000) as publisher:
            start = time.perf_counter()
            publisher.publish(0, block=True)
            publisher.flush()
            rows.append({"stage": "anchor publish (first: snapshot captured)", "seconds": time.perf_counter() - start,
                         "bytes": publisher.stats.last.bytes if publisher.stats.last else 0})
            for version in (1, 2):
                _change(weights, args.changes, seed=version)
                start = time.perf_counter()
                publisher.publish(version, block=True)
                publisher.flush()
                last = publisher.stats.last
                rows.append({"stage": f"delta v{version} publish", "seconds": time.perf_counter() - start,
                             "bytes": last.bytes if last else 0, "nnz": last.nnz if last else 0})
        exact = {}
        for staged in (False, True):
            replica = {k: torch.full_like(v, 7.0) for k, v in weights.items()}  # nothing in common with the run
            subscriber = Subscriber(store, TorchModuleApplier(replica, stage=staged))
            path = "staged" if staged else "tensor by tensor"
            start = time.perf_counter()
            info = subscriber.update()  # the whole route at once: the anchor, then both deltas
            assert info is not None and info.version == 2, f"the replica reached {subscriber.version}, not v2"
            rows.append({"stage": f"replica {path}: {' + '.join(info.route)}", "seconds": time.perf_counter() - start,
                         "bytes": info.bytes, "decode_s": info.t_decode, "apply_s": info.t_apply})
            exact[path] = _same(weights, replica)
            subscriber.close()
            del replica, subscriber
            gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(table([[r["stage"], f"{r['seconds']:.2f} s", human_bytes(r["bytes"])] for r in rows],
                ["stage", "time", "bytes"]))
    print(f"bit-exact: {exact}")
    result = {"benchmark": "large_tensor", "numel": NUMEL, "codec": args.codec, "changes_per_delta": args.changes,
              "edges": EDGES, "machine": machine(), "rows": rows, "exact": exact, "passed": all(exact.values())}
    write_json(f"large_tensor_{args.codec}", result, args.results_dir)
    if not result["passed"]:
        raise SystemExit("a replica did not end bit-exact")
    return result


if __name__ == "__main__":
    main()
