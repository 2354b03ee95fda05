"""Catch-up: what a replica joining late downloads, and how long it takes, under three anchor policies.

One trainer publishes the same weights, version for version, to three run
prefixes of a local store, one per anchor policy (all keep the default
retention, ``keep_anchors=2``):

- ``adaptive`` - deltasync's default: an anchor on the first publish, every
  ``anchor_every`` = 100 versions, and whenever the deltas since the last
  anchor add up to more than ``anchor_ratio`` = 1 anchor. A joiner then never
  downloads more than about two anchors.
- ``fixed-10`` - the public TRL prototype's cadence: an anchor every 10 syncs,
  delta chains otherwise (the ratio rule off).
- ``first-only`` - the first anchor and deltas ever after.

When the run reaches 10, 50, 150 and 200 versions, two replicas join and catch up
with one :meth:`Subscriber.update` (timed in this process, training paused):

- ``from base``: it loaded the checkpoint the run started from (version 0),
  as every replica of the end-to-end benchmark does, so it is N versions behind;
- ``empty``: it holds nothing from the run (a new node restoring no weights).

Both must end bit-identical to the trainer (SHA-256 of the bf16 bit patterns).
Reported per policy: bytes fetched, time to reach the latest version and the
route taken, and what the policy costs the trainer (bytes written, anchors) and
the store (bytes the manifest still references at the end). Every policy
writes catch-up spans (the default, ``max_span`` = 64).

Spans study (``--study spans``, part of the default run): one trainer publishes
1000 versions of the synthetic workload at ``--span-scale`` million elements
(4 by default) to three prefixes that differ only in how a replica can catch
up: ``chain`` (no spans, no anchor after v0), ``spans`` (the default spans, no
anchor after v0) and ``anchor`` (an anchor at the newest version). Replicas
``k`` = 1 to 1000 versions behind join each and are timed to the newest
version; reported per ``k``: objects, bytes and seconds by the chain, by spans
and by the anchor, and what spans cost the trainer per version (bytes written,
seconds on the publisher's worker, memory held for the next spans).

Workload: ``synthetic`` (default) is ``deltasync.demo.workload`` (random sparse
updates of 0.05-1 % of each tensor, an occasional dense tensor and special
values) at ``--scale`` million elements, 134 by default: the size of
SmolLM2-135M, without the seconds of CPU training per version. ``--workload
real`` trains SmolLM2-135M-Instruct live instead (fp32 masters, AdamW lr 3e-6,
the chat batches of :mod:`deltasync.demo.models`) and publishes every optimizer
step. ``--quick`` runs the synthetic workload at 1 M elements, joins at 5, 10
and 20 versions, and writes to a temporary directory.

    python benchmarks/catchup.py                  # synthetic 134 M elements, joins at 10, 50, 150, 200 versions
    python benchmarks/catchup.py --workload real  # real SmolLM2 training (slow on CPU: seconds per step)
    python benchmarks/catchup.py --quick          # synthetic 1 M elements, seconds
    python benchmarks/catchup.py --study spans    # the spans study alone
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import human_bytes, results_dir, shared_machine, table, write_json  # noqa: E402

from deltasync.appliers import TorchModuleApplier  # noqa: E402
from deltasync.control import rollback, weights_at  # noqa: E402
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest, plan_route, summarize  # noqa: E402
from deltasync.publish.publisher import ANCHOR_EVERY, ANCHOR_RATIO, KEEP_ANCHORS, Publisher, PublishInfo  # noqa: E402
from deltasync.publish.spans import MAX_SPAN  # noqa: E402
from deltasync.replica.subscriber import Subscriber  # noqa: E402
from deltasync.tensors import published_tensors, weights_digest  # noqa: E402

JOIN_AT = (10, 50, 150, 200)  # 150: half way between two anchors of the adaptive policy
QUICK_JOIN_AT = (5, 10, 20)
NEVER = 10**9  # an anchor_every / anchor_ratio that never fires
POLICIES: dict[str, dict[str, float]] = {
    "adaptive": {"anchor_every": ANCHOR_EVERY, "anchor_ratio": ANCHOR_RATIO},
    "fixed-10": {"anchor_every": 10, "anchor_ratio": NEVER},
    "first-only": {"anchor_every": NEVER, "anchor_ratio": NEVER},
}
LR = 3e-6
BATCH_SIZE = 4
SPAN_VERSIONS, QUICK_SPAN_VERSIONS = 1000, 64
SPAN_BEHIND = (1, 2, 3, 7, 8, 16, 31, 64, 100, 128, 250, 500, 1000)
ROUTES = ("chain", "spans", "anchor")
ROLLBACK_BY, FLEET = 10, 8


def real_workload() -> tuple[Any, Callable[[int], None]]:
    """SmolLM2-135M in fp32 and one real optimizer step per call."""
    from deltasync.demo.models import chat_batches, load_smollm2, train_step

    torch.manual_seed(0)
    model, tokenizer = load_smollm2(dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = chat_batches(tokenizer, BATCH_SIZE)
    return model, lambda step: train_step(model, optimizer, batches[step % len(batches)])


def synthetic_workload(scale: int) -> tuple[Any, Callable[[int], None]]:
    """``scale`` million elements of random sparse updates (``deltasync.demo.workload``)."""
    from deltasync.demo.workload import make_weights, train_step

    weights = make_weights(scale)
    g = torch.Generator().manual_seed(0)
    return weights, lambda step: train_step(weights, step + 1, g)


def join(url: str, buffer: dict[str, torch.Tensor], start: tuple[int, str] | None, expected: str) -> dict[str, Any]:
    """One joining replica: a single update from ``start`` (version, run id) or from nothing; timed and checked."""
    applier = TorchModuleApplier(buffer)
    version, run_id = start if start else (None, None)
    with Subscriber(url, applier, ack=False, start_version=version, run_id=run_id) as sub:
        t0 = time.perf_counter()
        info = sub.update()
        seconds = time.perf_counter() - t0
    if info is None:
        raise RuntimeError(f"{url}: the joiner found nothing to do")
    hops = Counter(info.route)
    spans = f" + {hops['span']} spans" if hops["span"] else ""
    return {
        "bytes": info.bytes,
        "seconds": seconds,
        "route": f"{'anchor + ' if hops['anchor'] else ''}{hops['delta']} deltas{spans}",
        "hops": len(info.route),
        "anchors": hops["anchor"],
        "deltas": hops["delta"],
        "spans": hops["span"],
        "apply_s": info.t_apply,
        "decode_s": info.t_decode,
        "exact": weights_digest(buffer.items()) == expected,
    }


def run(workload: str, scale: int, join_at: tuple[int, ...], root: str) -> dict[str, Any]:
    """Train/publish up to ``max(join_at)`` versions under every policy; joins at each of ``join_at``."""
    weights, step_fn = real_workload() if workload == "real" else synthetic_workload(scale)
    infos: dict[str, list[PublishInfo]] = {name: [] for name in POLICIES}
    publishers = {
        name: Publisher(
            weights, f"{root}/{name}", keep_anchors=KEEP_ANCHORS, on_publish=infos[name].append, **policy  # type: ignore[arg-type]
        )
        for name, policy in POLICIES.items()
    }
    for publisher in publishers.values():
        publisher.publish(0, block=True)  # v0: the anchor of the starting weights
    base = {name: t.detach().to(torch.bfloat16).clone() for name, t in published_tensors(weights)}
    buffer = {name: torch.empty_like(t) for name, t in base.items()}
    numel = sum(t.numel() for t in base.values())
    joins: list[dict[str, Any]] = []
    started = time.perf_counter()
    t_train = 0.0
    for step in range(1, max(join_at) + 1):
        t0 = time.perf_counter()
        step_fn(step - 1)
        t_train += time.perf_counter() - t0
        for publisher in publishers.values():
            publisher.publish(step, block=True)
        if step not in join_at:
            continue
        for publisher in publishers.values():
            publisher.flush()
        expected = weights_digest(published_tensors(weights))
        for name, publisher in publishers.items():
            if publisher.version != step:
                raise RuntimeError(f"{name} is at v{publisher.version}, expected v{step}")
            url = f"{root}/{name}"
            manifest = Manifest.from_bytes(publisher.store.get(MANIFEST_KEY))
            for kind in ("from base", "empty"):
                with torch.no_grad():
                    for key, tensor in buffer.items():
                        if kind == "from base":
                            tensor.copy_(base[key])
                        else:
                            tensor.zero_()
                start = (0, manifest.run_id) if kind == "from base" else None
                row = {"policy": name, "behind": step, "joiner": kind, **join(url, buffer, start, expected)}
                row["anchors_listed"] = [v.version for v in manifest.anchors()]
                joins.append(row)
                print(f"v{step:4} {name:10} {kind:9}: {human_bytes(row['bytes']):>9} in {row['seconds']:.2f} s "
                      f"via {row['route']}, exact={row['exact']}", flush=True)
        print(f"-- {step} versions after {time.perf_counter() - started:.0f} s (training {t_train:.0f} s)", flush=True)
    costs = {}
    for name, publisher in publishers.items():
        kept = summarize(Manifest.from_bytes(publisher.store.get(MANIFEST_KEY)))
        publisher.close()
        written = infos[name]
        costs[name] = {
            **POLICIES[name],
            "keep_anchors": KEEP_ANCHORS,
            "anchors_written": sum(1 for i in written if i.kind == "anchor"),
            "anchor_bytes_written": sum(i.bytes for i in written if i.kind == "anchor"),
            "delta_bytes_written": sum(i.bytes for i in written if i.kind == "delta"),
            "bytes_written": sum(i.bytes for i in written),
            "store_bytes_referenced": kept["delta_bytes"] + kept["anchor_bytes"] + kept["span_bytes"],
            "span_bytes_written": sum(i.bytes for i in written if i.kind == "span"),
            "anchors_kept": kept["anchors"],
        }
    anchor = next(i.bytes for i in infos["adaptive"] if i.kind == "anchor")
    deltas = sorted(i.bytes for i in infos["adaptive"] if i.kind == "delta")
    return {
        "numel": numel, "anchor_bytes": anchor, "median_delta_bytes": deltas[len(deltas) // 2],
        "joins": joins, "costs": costs, "t_train": t_train,
    }


def spans_study(scale: int, versions: int, behind: tuple[int, ...], root: str) -> dict[str, Any]:
    """Publish ``versions`` versions to the three prefixes of :data:`ROUTES`; join each ``behind`` versions back."""
    weights, step_fn = synthetic_workload(scale)
    options = {
        "chain": {"max_span": 0, "anchor_every": NEVER, "anchor_ratio": NEVER},
        "spans": {"max_span": MAX_SPAN, "anchor_every": NEVER, "anchor_ratio": NEVER},
        "anchor": {"max_span": 0, "anchor_every": versions, "anchor_ratio": NEVER},
    }
    infos: dict[str, list[PublishInfo]] = {name: [] for name in ROUTES}
    publishers = {name: Publisher(weights, f"{root}/{name}", on_publish=infos[name].append, **options[name])  # type: ignore[arg-type]
                  for name in ROUTES}
    starts = {versions - k for k in behind if k <= versions}
    held: dict[int, dict[str, torch.Tensor]] = {}
    memory = []
    started = time.perf_counter()
    for version in range(versions + 1):
        if version:
            step_fn(version - 1)
        for publisher in publishers.values():
            publisher.publish(version, block=True)
        if version in starts:
            held[version] = {n: t.detach().to(torch.bfloat16).clone() for n, t in published_tensors(weights)}
        publishers["spans"].flush()
        memory.append(publishers["spans"].writer_engine.spans.nbytes)
        if version % 100 == 0:
            print(f"-- spans study: {version} versions after {time.perf_counter() - started:.0f} s", flush=True)
    for publisher in publishers.values():
        publisher.flush()
    expected = weights_digest(published_tensors(weights))
    manifests = {name: Manifest.from_bytes(p.store.get(MANIFEST_KEY)) for name, p in publishers.items()}
    buffer = {name: torch.empty_like(t) for name, t in held[min(held)].items()}
    rows = []
    for k in sorted(k for k in behind if k <= versions):
        start = versions - k
        row: dict[str, Any] = {"behind": k}
        for name in ROUTES:
            with torch.no_grad():
                for key, tensor in buffer.items():
                    tensor.copy_(held[start][key])
            plan = plan_route(manifests[name], start if name != "anchor" else None)
            assert plan is not None
            joined = join(f"{root}/{name}", buffer, None if name == "anchor" else (start, manifests[name].run_id),
                          expected)
            objects = sum(len(s.objects) for s in plan.steps)
            if joined["bytes"] != plan.nbytes or joined["hops"] != len(plan.steps):
                raise RuntimeError(f"{name}, {k} behind: fetched {joined['bytes']} bytes in {joined['hops']} hops, "
                                   f"the planner promised {plan.nbytes} in {len(plan.steps)}")
            row[name] = {"objects": objects, "bytes": joined["bytes"], "seconds": joined["seconds"],
                         "route": joined["route"], "exact": joined["exact"]}
        rows.append(row)
        print(f"{k:5} behind: " + ", ".join(
            f"{name} {row[name]['objects']} objects {human_bytes(row[name]['bytes'])} {row[name]['seconds']:.2f} s"
            for name in ROUTES), flush=True)
    rolled = rollback_fleet(publishers["spans"], f"{root}/spans", versions, FLEET)
    span_infos = infos["spans"]
    spans = [i for i in span_infos if i.kind == "span"]
    deltas = [i for i in span_infos if i.kind == "delta"]
    listed = manifests["spans"]
    lengths = Counter(e.version - s.base for e in listed.versions for s in e.spans)
    for publisher in publishers.values():
        publisher.close()
    return {
        "numel": sum(t.numel() for t in held[min(held)].values()),
        "versions": versions,
        "max_span": MAX_SPAN,
        "anchor_bytes": manifests["anchor"].anchors()[-1].anchor_bytes,
        "median_delta_bytes": sorted(i.bytes for i in deltas)[len(deltas) // 2],
        "rows": rows,
        "rollback": rolled,
        "trainer": {
            "span_bytes_per_version": sum(i.bytes for i in spans) / len(deltas),
            "delta_bytes_per_version": sum(i.bytes for i in deltas) / len(deltas),
            "span_seconds_per_version": sum(i.t_total for i in spans) / len(deltas),
            "delta_seconds_per_version": sum(i.t_total for i in deltas) / len(deltas),
            "span_memory_max_bytes": max(memory),
            "span_memory_median_bytes": sorted(memory)[len(memory) // 2],
            "spans_listed_by_length": {str(n): c for n, c in sorted(lengths.items())},
        },
    }


def rollback_fleet(publisher: Publisher, url: str, versions: int, fleet: int) -> dict[str, Any]:
    """Roll the trainer back ``ROLLBACK_BY`` versions; time it, then one replica and ``fleet`` replicas (one thread
    each) at the newest version reaching the rolled-back weights."""
    newest = weights_at(publisher.store, versions)
    started = time.perf_counter()
    done = rollback(publisher, to=versions - ROLLBACK_BY)
    t_trainer = time.perf_counter() - started
    expected = weights_digest(done.weights.items())

    def replica() -> tuple[dict[str, torch.Tensor], Subscriber]:
        held = {n: t.clone() for n, t in newest.items()}
        return held, Subscriber(url, TorchModuleApplier(held), ack=False, start_version=versions,
                                run_id=publisher.run_id)

    held, sub = replica()
    t0 = time.perf_counter()
    info = sub.update()
    t_one = time.perf_counter() - t0
    sub.close()
    exact = weights_digest(held.items()) == expected and info is not None and info.version == done.version
    replicas = [replica() for _ in range(fleet)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=s.update) for _, s in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    t_fleet = time.perf_counter() - t0
    exact = exact and all(weights_digest(h.items()) == expected and s.version == done.version for h, s in replicas)
    for _, s in replicas:
        s.close()
    print(f"rollback of {ROLLBACK_BY} versions: trainer {t_trainer:.2f} s, one replica {t_one:.2f} s, "
          f"{fleet} replicas {t_fleet:.2f} s, {human_bytes(done.info.bytes if done.info else 0)}, exact={exact}",
          flush=True)
    return {"back_by": ROLLBACK_BY, "version": done.version, "restores": done.restores,
            "bytes": done.info.bytes if done.info else None, "nnz": done.info.nnz if done.info else None,
            "trainer_seconds": t_trainer, "replica_seconds": t_one, "fleet": fleet, "fleet_seconds": t_fleet,
            "exact": exact}


def spans_report(study: dict[str, Any]) -> str:
    rows = [[r["behind"]] + [f"{r[n]['objects']} / {human_bytes(r[n]['bytes'])} / {r[n]['seconds']:.2f} s"
                             for n in ROUTES] for r in study["rows"]]
    text = table(rows, ["behind", *(f"{n} (objects / bytes / time)" for n in ROUTES)])
    t = study["trainer"]
    cost = (f"spans cost the trainer {human_bytes(t['span_bytes_per_version'])} and "
            f"{1e3 * t['span_seconds_per_version']:.0f} ms a version on its worker (deltas: "
            f"{human_bytes(t['delta_bytes_per_version'])}, {1e3 * t['delta_seconds_per_version']:.0f} ms), and "
            f"{human_bytes(t['span_memory_max_bytes'])} of memory at most; spans listed by length: "
            f"{t['spans_listed_by_length']}")
    r = study["rollback"]
    back = (f"rollback of {r['back_by']} versions (v{r['version']} restores v{r['restores']}, "
            f"{human_bytes(r['bytes'] or 0)}): the trainer {r['trainer_seconds']:.2f} s, one replica "
            f"{r['replica_seconds']:.2f} s, {r['fleet']} replicas (threads of one process) {r['fleet_seconds']:.2f} s; "
            f"exact: {r['exact']}")
    out = f"{text}\n\n{cost}\n\n{back}\n"
    print(out)
    return out


def report(result: dict[str, Any]) -> str:
    joins = result["joins"]
    rows = []
    for behind in sorted({j["behind"] for j in joins}):
        for kind in ("from base", "empty"):
            cells = {j["policy"]: j for j in joins if j["behind"] == behind and j["joiner"] == kind}
            rows.append([behind, kind] + [
                f"{human_bytes(cells[p]['bytes'])}, {cells[p]['seconds']:.1f} s ({cells[p]['route']})" for p in POLICIES
            ])
    text = table(rows, ["versions", "joiner", *POLICIES])
    costs = table(
        [[p, c["anchors_written"], human_bytes(c["bytes_written"]), human_bytes(c["store_bytes_referenced"])]
         for p, c in result["costs"].items()],
        ["policy", "anchors written", "trainer wrote", "store holds (manifest)"],
    )
    out = f"{text}\n\n{costs}\n"
    print(out)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="synthetic workload, 1 M elements")
    parser.add_argument("--workload", choices=("real", "synthetic"), default=None)
    parser.add_argument("--scale", type=int, default=None, help="synthetic model size in millions of elements")
    parser.add_argument("--join-at", default=None, help=f"comma-separated version counts (default {JOIN_AT}; "
                        f"{QUICK_JOIN_AT} with --quick)")
    parser.add_argument("--study", choices=("all", "policies", "spans"), default="all")
    parser.add_argument("--span-scale", type=int, default=None, help="the spans study's model in millions of elements "
                        "(default 4; 1 with --quick)")
    parser.add_argument("--results-dir", default=None, help="where catchup.json goes (default benchmarks/results; "
                        "a temporary directory with --quick)")
    args = parser.parse_args(argv)
    workload = args.workload or "synthetic"
    scale = args.scale or (1 if args.quick else 134)
    join_at = tuple(sorted(int(n) for n in args.join_at.split(","))) if args.join_at else (
        QUICK_JOIN_AT if args.quick else JOIN_AT
    )
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(1)  # a shared, oversubscribed 2-core machine: two-thread regions wait on the scheduler
    started, load_before = time.perf_counter(), os.getloadavg()
    measured: dict[str, Any] = {"joins": [], "costs": {}, "numel": 0, "anchor_bytes": 0, "median_delta_bytes": 0,
                                "t_train": 0.0}
    text, study = "", None
    if args.study in ("all", "policies"):
        with tempfile.TemporaryDirectory(prefix="deltasync-catchup-") as tmp:
            measured = run(workload, scale, join_at, tmp)
        text = report(measured)
    if args.study in ("all", "spans"):
        versions = QUICK_SPAN_VERSIONS if args.quick else SPAN_VERSIONS
        with tempfile.TemporaryDirectory(prefix="deltasync-spans-") as tmp:
            study = spans_study(args.span_scale or (1 if args.quick else 4), versions, SPAN_BEHIND, tmp)
        text += "\n" + spans_report(study)
    result = {
        "benchmark": "catchup",
        "quick": args.quick,
        "workload": {
            "kind": workload,
            "model": "SmolLM2-135M-Instruct" if workload == "real" else f"deltasync.demo.workload, scale {scale}",
            "optimizer": "AdamW, lr 3e-6, fp32 masters" if workload == "real" else "random sparse updates",
            "numel": measured["numel"], "anchor_bytes": measured["anchor_bytes"],
            "median_delta_bytes": measured["median_delta_bytes"], "train_seconds": round(measured["t_train"], 1),
        },
        "params": {"join_at": join_at, "store": "local directory", "policies": list(POLICIES),
                   "keep_anchors": KEEP_ANCHORS},
        "machine": shared_machine(load_before, "shared 2-core machine: times are noisy; bytes are exact"),
        "seconds": round(time.perf_counter() - started, 1),
        "joins": measured["joins"],
        "costs": measured["costs"],
        "spans": study,
        "table": text,
    }
    path = write_json("catchup", result, results_dir(args.quick, args.results_dir))
    print(f"{result['seconds']:.0f} s; wrote {path}")
    return result


if __name__ == "__main__":
    main()
