"""Sharded publishing: does splitting a version across ranks make publishing faster?

A synthetic bf16 model (``--params``, default 200M elements in 16 tensors) is held
by every rank of a data-parallel job (gloo on CPU); each version changes
``--density`` of the elements at random, identically on every rank (as
all-reduced gradients would). Every rank publishes with
:class:`~deltasync.publish.sharded.ShardedPublisher`, so each diffs, encodes and uploads
1/world of the rows; world = 1 runs the plain :class:`~deltasync.Publisher` in
one process as the baseline. Every process uses one torch thread. Per version and world size, medians over versions:

- training-thread time of ``publish()`` (the diff), slowest rank;
- ``publish()`` to manifest commit (rank 0), with the encode and upload share;
- bytes per version, and per rank;
- a replica's decode + apply of the version (one file, or one shard per rank joined).

Ranks share this machine's cores: beyond the core count they compete, which
the table shows. Writes ``benchmarks/results/sharded.json``.

    python benchmarks/sharded.py                       # worlds 1 2 4, 200M elements, 1 %
    python benchmarks/sharded.py --quick               # 20M elements, worlds 1 2
    python benchmarks/sharded.py --zero3               # DeepSpeed ZeRO-3, 2 ranks: slices vs gathering

``--zero3`` builds the model under DeepSpeed's ``zero.Init`` on 2 ranks (each
holds a flat fp32 slice of every parameter), changes ``--density`` of every
slice per version, and publishes it two ways, each in fresh processes: every
rank diffs and uploads its own slices (:class:`~deltasync.publish.sharded.ShardedPublisher`),
or the ranks gather each parameter in turn (``GatheredParameters``) so that
rank 0 holds a bf16 copy of the whole model and publishes it with the plain
:class:`~deltasync.Publisher`. Per rank: publish time to commit (median over
versions) and peak resident memory above what the rank held before publishing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402
from _common import human_bytes, machine, median, results_dir, table, write_json  # noqa: E402

TENSORS = 16


def make_weights(params: int) -> dict[str, torch.Tensor]:
    """``params`` bf16 elements in :data:`TENSORS` matrices of 1024 columns, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, params // TENSORS // 1024)
    return {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g).to(torch.bfloat16) for i in range(TENSORS)}


def update(weights: dict[str, torch.Tensor], version: int, density: float) -> None:
    """Change ``density`` of every tensor at random (the same on every rank)."""
    g = torch.Generator().manual_seed(version)
    for tensor in weights.values():
        flat = tensor.view(-1)
        idx = torch.randint(0, flat.numel(), (int(flat.numel() * density),), generator=g).unique()  # no repeats:
        # which of two writes to one index wins is unspecified, and replicas replay these updates
        flat[idx] = (flat[idx].float() + 0.01 * torch.randn(idx.numel(), generator=g)).to(torch.bfloat16)


def _run(world: int, rank: int, args: argparse.Namespace, url: str) -> dict[str, Any]:
    """One rank's (or the single process's) publishing loop; returns its timings."""
    from deltasync.publish.publisher import Publisher, PublishInfo

    weights = make_weights(args.params)
    infos: list[PublishInfo] = []
    options = {"anchor_every": 10_000, "anchor_ratio": 1e9, "on_publish": infos.append}
    if world == 1:
        publisher: Any = Publisher(weights, url, **options)
    else:
        from deltasync.publish.sharded import ShardedPublisher

        publisher = ShardedPublisher(weights, url, **options)
    calls, commits = [], []
    with publisher:
        publisher.publish(0, block=True)
        publisher.flush()
        for version in range(1, args.versions + 1):
            update(weights, version, args.density)
            if world > 1:
                torch.distributed.barrier()
            started = time.perf_counter()
            publisher.publish(version, block=True)
            calls.append(time.perf_counter() - started)
            publisher.flush()
            commits.append(time.perf_counter() - started)
    deltas = [i for i in infos if i.kind == "delta"]
    return {
        "rank": rank,
        "publish_call_s": calls,
        "commit_s": commits,
        "own_bytes": publisher.stats.bytes,
        "bytes": [i.bytes for i in deltas],
        "encode_s": [i.t_encode for i in deltas],
        "upload_s": [i.t_upload for i in deltas],
        "nnz": [i.nnz for i in deltas],
    }


def _rank_main(rank: int, world: int, init: str, args: argparse.Namespace, url: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank, the single-process baseline included
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = _run(world, rank, args, url)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _time_last_hop(url: str, params: int, latest: int) -> float:
    from deltasync.appliers import TorchModuleApplier
    from deltasync.protocol.manifest import Manifest
    from deltasync.replica.subscriber import Subscriber
    from deltasync.stores import open_store

    replica = make_weights(params)
    for version in range(1, latest):
        update(replica, version, ARGS.density)
    run_id = Manifest.from_bytes(open_store(url).get("manifest.json")).run_id
    sub = Subscriber(url, TorchModuleApplier(replica), ack=False, start_version=latest - 1, run_id=run_id)
    info = sub.update()
    sub.close()
    assert info is not None and info.route == ("delta",)
    return info.t_decode + info.t_apply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=200_000_000)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--quick", action="store_true", help="20M elements, worlds 1 2, 3 versions")
    parser.add_argument("--out", default=None, help="directory for the JSON (default: benchmarks/results)")
    parser.add_argument("--zero3", action="store_true", help="DeepSpeed ZeRO-3 on 2 ranks: slices vs gathering")
    args = parser.parse_args()
    if args.zero3:
        if args.params == 200_000_000:
            args.params = 50_000_000
        zero3(args)
        return
    if args.quick:
        args.params, args.worlds, args.versions = 20_000_000, [1, 2], 3
    global ARGS
    ARGS = args
    import torch.multiprocessing as mp

    rows, results = [], {}
    base_commit = None
    for world in args.worlds:
        with tempfile.TemporaryDirectory(prefix="deltasync-sharded-") as tmp:
            url = os.path.join(tmp, "store")
            mp.start_processes(
                _rank_main, args=(world, f"file://{tmp}/rendezvous", args, url, tmp),
                nprocs=world, start_method="spawn", join=True,
            )
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
            apply_s = _time_last_hop(url, args.params, args.versions)
        lead = ranks[0]
        call = median([max(r["publish_call_s"][i] for r in ranks) for i in range(args.versions)])
        commit = median(lead["commit_s"])
        base_commit = base_commit or commit
        results[str(world)] = {
            "ranks": ranks,
            "publish_call_s": call,
            "commit_s": commit,
            "bytes": median(lead["bytes"]),
            "bytes_per_rank": [r["own_bytes"] / (args.versions + 1) for r in ranks],
            "replica_apply_s": apply_s,
            "speedup_commit": base_commit / commit,
        }
        rows.append([
            world, f"{1e3 * call:.0f} ms", f"{1e3 * commit:.0f} ms", f"{base_commit / commit:.2f}x",
            human_bytes(median(lead["bytes"])), f"{1e3 * apply_s:.0f} ms",
        ])
        print(f"world {world}: publish call {1e3 * call:.0f} ms, commit {1e3 * commit:.0f} ms", flush=True)
    payload = {
        "machine": machine(),
        "params": args.params,
        "density": args.density,
        "versions": args.versions,
        "worlds": results,
    }
    path = write_json("sharded", payload, results_dir(args.quick, args.out))
    print()
    print(f"{args.params / 1e6:.0f}M bf16 elements, {100 * args.density:g} % changed per version, medians over "
          f"{args.versions} versions ({os.cpu_count()} cores)")
    print(table(rows, ["ranks", "publish() on the training thread", "publish to commit", "vs 1 rank",
                       "bytes / version", "replica decode+apply"]))
    print(f"\nwrote {path}")


ARGS: argparse.Namespace


# ---------------------------------------------------------------------- DeepSpeed ZeRO-3


def _zero3_rank(rank: int, world: int, init: str, path: str, args: argparse.Namespace, url: str, out: str) -> None:
    """One ZeRO-3 rank: build the partitioned model, then publish ``args.versions`` versions by ``path``."""
    import resource

    import psutil
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        rows = max(1, args.params // TENSORS // 1024)
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = torch.nn.Sequential(*[torch.nn.Linear(1024, rows, bias=False) for _ in range(TENSORS)])
        params = list(model.named_parameters())
        before = psutil.Process().memory_info().rss
        times = []
        publisher: Any = None
        if path == "slices":
            from deltasync.publish.sharded import ShardedPublisher

            publisher = ShardedPublisher(model, url, anchor_every=10_000, anchor_ratio=1e9)
        for version in range(args.versions + 1):
            if version:
                g = torch.Generator().manual_seed(1000 * version + rank)
                for _, p in params:  # an optimizer step: this rank's slice changes
                    flat = p.ds_tensor.data.view(-1)
                    idx = torch.randint(0, flat.numel(), (int(flat.numel() * args.density),), generator=g)
                    flat[idx] += 0.01
            dist.barrier()
            started = time.perf_counter()
            if path == "slices":
                publisher.publish(version, block=True)
                publisher.flush()
            else:
                full = {}
                for name, p in params:  # every rank takes part in each gather; rank 0 keeps a bf16 copy
                    with deepspeed.zero.GatheredParameters([p]):
                        if rank == 0:
                            full[name] = p.detach().to(torch.bfloat16).clone()
                if rank == 0:
                    if publisher is None:
                        from deltasync.publish.publisher import Publisher

                        publisher = Publisher(full, url, anchor_every=10_000, anchor_ratio=1e9)
                    else:
                        for name, t in full.items():
                            publisher.model[name].copy_(t)
                    publisher.publish(version, block=True)
                    publisher.flush()
                dist.barrier()
            times.append(time.perf_counter() - started)
        if publisher is not None:
            publisher.close()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path(out, f"{path}-rank{rank}.json").write_text(json.dumps({
            "rank": rank, "publish_s": times[1:], "anchor_s": times[0],
            "rss_before_publishing": before, "peak_rss": peak, "peak_above_before": peak - before,
        }))
    finally:
        dist.destroy_process_group()


def zero3(args: argparse.Namespace) -> None:
    """Slices vs gathering under DeepSpeed ZeRO-3 on 2 ranks; writes ``results/sharded_zero3.json``."""
    import torch.multiprocessing as mp

    world, results, rows = 2, {}, []
    for path in ("slices", "gather"):
        with tempfile.TemporaryDirectory(prefix="deltasync-zero3-") as tmp:
            mp.start_processes(
                _zero3_rank, args=(world, f"file://{tmp}/rendezvous", path, args, os.path.join(tmp, "store"), tmp),
                nprocs=world, start_method="spawn", join=True,
            )
            ranks = [json.loads(Path(tmp, f"{path}-rank{r}.json").read_text()) for r in range(world)]
        results[path] = ranks
        rows.append([
            path, f"{1e3 * median([max(r['publish_s'][i] for r in ranks) for i in range(args.versions)]):.0f} ms",
            f"{max(r['anchor_s'] for r in ranks):.2f} s",
            " / ".join(human_bytes(r["peak_above_before"]) for r in ranks),
        ])
    path = write_json("sharded_zero3", {
        "machine": machine(), "params": args.params, "density": args.density, "versions": args.versions,
        "world": world, "paths": results,
    }, results_dir(False, args.out))
    print(f"\nDeepSpeed ZeRO-3, {world} ranks, {args.params / 1e6:.0f}M fp32 parameters, "
          f"{100 * args.density:g} % of each slice changed per version (medians over {args.versions})")
    print(table(rows, ["path", "delta publish to commit (slowest rank)", "first (anchor) publish",
                       "peak memory above the model, rank 0 / rank 1"]))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
