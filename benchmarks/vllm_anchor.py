"""An anchor into a vLLM replica: as files on the same machine, as text or patches, and vLLM's own reload.

A replica that joins late, or falls off the manifest's deltas, catches up from an
anchor. A server's ``/collective_rpc`` carries JSON only, so the follower used
to send an anchor's tensors as base64 text; an in-process ``LLM`` pickles them
to its engine's processes in 64 MB calls. Where the engine runs on the
follower's machine the follower now drops the anchor's files in ``/dev/shm``
and sends their paths (``deltasync.appliers.vllm.file_drop``). SmolLM2-135M (TP=1,
plain weights) in a vLLM CPU server and in an in-process ``LLM``, one follower
of each kind on the same engine; each round publishes a fresh anchor (every
element changed: the bit patterns of alternate rounds differ in their last bit)
into a fresh local store in ``/dev/shm`` and times the replica's update, the
kinds taking turns. The alternative without deltasync: vLLM's
``reload_weights`` from a checkpoint directory that holds the same weights
(itself a full copy written to disk first, not counted). Bit-exact checks after
the last round of each kind. Writes ``benchmarks/results/vllm_anchor.json`` and
prints a table.

    python benchmarks/vllm_anchor.py                  # both engines, 5 rounds of each kind
    python benchmarks/vllm_anchor.py --engine server --rounds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))  # examples and tests.vllm_helpers by name

from _common import machine, median, table, write_json  # noqa: E402


def reload(url: str, directory: Path) -> None:
    """vLLM's own full reload through the server's ``/collective_rpc`` (every weight from ``directory``)."""
    body = json.dumps({"method": "reload_weights", "kwargs": {"weights_path": str(directory)}, "timeout": 600})
    request = urllib.request.Request(f"{url}/collective_rpc", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


KINDS = {  # kind: (the follower's anchor_files, the row's label per engine)
    "files": (True, {"server": "deltasync, files dropped on this machine (default)",
                     "llm": "deltasync, files dropped on this machine (default)"}),
    "sent": (False, {"server": "deltasync, as text (a server elsewhere)",
                     "llm": "deltasync, as decoded patches (anchor_files=False)"}),
    "reload": (False, {"server": "vLLM reload_weights from a checkpoint on disk",
                       "llm": "vLLM reload_weights from a checkpoint on disk"}),
}


def measure(engine: Any, reload_weights: Any, model: str, weight_sets: list, dirs: list[Path], work: Path,
            rounds: int) -> tuple[dict[str, list[dict[str, float]]], int]:
    """Each kind's update per round on one engine (a server's URL or an ``LLM``), the kinds taking turns."""
    from deltasync.appliers.vllm.follower import VLLMFollower
    from deltasync.publish.publisher import Publisher
    from tests.vllm_helpers import assert_engine_exact

    samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    followers = {kind: VLLMFollower(engine, model=model, anchor_files=KINDS[kind][0]) for kind in ("files", "sent")}
    nbytes = 0
    for round_ in range(rounds):
        weights = weight_sets[round_ % 2]  # every element differs from the round before
        for kind in KINDS:
            if kind == "reload":
                started = time.perf_counter()
                reload_weights(dirs[round_ % 2])
                samples[kind].append({"total": time.perf_counter() - started})
                continue
            store = str(work / f"run-{kind}-{round_}")
            with Publisher(weights, store) as publisher:
                publisher.publish(0, block=True)
                publisher.flush()
            follower = followers[kind]
            with follower.subscriber(store, ack=False) as sub:
                started = time.perf_counter()
                info = sub.update()
                total = time.perf_counter() - started
            assert info is not None and info.route == ("anchor",)
            nbytes = info.bytes
            worker = follower.last_apply
            samples[kind].append({
                "total": total, "fetch": info.t_fetch, "decode": info.t_decode, "apply": info.t_apply,
                "worker": worker["ms"] / 1e3, "worker_decode": worker.get("decode_ms", 0.0) / 1e3,
                "verify": worker["verify_ms"] / 1e3,
            })
            shutil.rmtree(store, ignore_errors=True)
            if round_ == rounds - 1:
                assert_engine_exact(follower, weights)
    for follower in followers.values():
        follower.close()
    return samples, nbytes


def summarize(samples: dict[str, list[dict[str, float]]], nbytes: int) -> dict[str, Any]:
    stages = {kind: {stage: median([s[stage] for s in rows]) for stage in rows[0]} for kind, rows in samples.items()}
    spread = {kind: {"min": min(s["total"] for s in rows), "max": max(s["total"] for s in rows)}
              for kind, rows in samples.items()}
    return {
        "anchor_bytes": nbytes,
        "median_s": stages,
        "spread_s": spread,
        "samples_s": samples,
        "ratios": {"sent_over_files": stages["sent"]["total"] / stages["files"]["total"],
                   "reload_over_files": stages["reload"]["total"] / stages["files"]["total"]},
    }


ENGINES = {"server": "a vLLM CPU server", "llm": "an in-process vLLM LLM"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", choices=["server", "llm", "both"], default="both")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import safetensors.torch
    import torch

    from deltasync.demo.models import smollm2_checkpoint
    from tests.test_trl import _example
    from tests.vllm_helpers import engine as in_process_engine
    from tests.vllm_helpers import save_checkpoint

    example = _example()
    ckpt = smollm2_checkpoint()
    loaded: dict[str, torch.Tensor] = {}
    for file in sorted(Path(ckpt).glob("*.safetensors")):
        loaded.update(safetensors.torch.load_file(str(file)))
    base = {n: t.to(torch.bfloat16) for n, t in loaded.items() if t.is_floating_point()}
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="vllm-anchor-", dir=shm if shm.is_dir() else None))
    engines = ["server", "llm"] if args.engine == "both" else [args.engine]
    results: dict[str, Any] = {}
    try:
        # The dense alternative reloads a checkpoint directory: one per weight set, written once, before timing.
        weight_sets = [base, {n: (t.view(torch.int16) ^ 1).view(torch.bfloat16) for n, t in base.items()}]
        dirs = [save_checkpoint(w, ckpt, work / f"ckpt{i}") for i, w in enumerate(weight_sets)]
        for name in engines:
            if name == "server":
                with open(work / "server.log", "wb") as log, \
                        example.start_server(ckpt, example.free_port(), log=log) as url:
                    samples, nbytes = measure(url, lambda d, url=url: reload(url, d), ckpt, weight_sets, dirs,
                                              work, args.rounds)
            else:
                with in_process_engine(ckpt) as llm:
                    def reload_in_process(directory: Path, llm: Any = llm) -> None:
                        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(directory)})

                    samples, nbytes = measure(llm, reload_in_process, ckpt, weight_sets, dirs, work, args.rounds)
            results[name] = summarize(samples, nbytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "machine": machine(),
        "model": "SmolLM2-135M-Instruct (vLLM CPU, TP=1, plain weights)",
        "rounds": args.rounds,
        "engines": results,
    }
    path = write_json("vllm_anchor", result)
    for name, found in results.items():
        stages, spread, nbytes = found["median_s"], found["spread_s"], found["anchor_bytes"]
        rows = []
        for kind, (_, labels) in KINDS.items():
            s = stages[kind]
            parts = ", ".join(f"{k} {s[k]:.2f}" for k in ("fetch", "apply", "worker", "verify") if k in s)
            rows.append([labels[name], f"{s['total']:.2f}", f"{spread[kind]['min']:.2f}-{spread[kind]['max']:.2f}",
                         f"{nbytes / s['total'] / 1e9:.2f}", parts])
        print(f"\nSmolLM2-135M anchor, {nbytes:,} bytes, into {ENGINES[name]}; medians of {args.rounds} rounds\n")
        print(table(rows, ["path", "s", "range", "GB/s", "stages (s)"]))
        print(f"\nsent without files / as files: {found['ratios']['sent_over_files']:.1f}x; "
              f"reload / files: {found['ratios']['reload_over_files']:.1f}x")
    print(f"wrote {path}")
    os._exit(0)  # the engines are stopped; skip slow interpreter teardown


if __name__ == "__main__":
    main()
