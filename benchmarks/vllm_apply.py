"""Applying a real sparse delta inside vLLM: in place vs vLLM's own update paths.

SmolLM2-135M in vLLM (CPU build, TP=1, plain-weights option so every path can
write the Linear weights). The delta is one AdamW step at lr 3e-6 from the
checkpoint the engine loaded (about 99.3 % sparse). On the same engine and the
same patch, median over repeats (every path writes the same final weights, so
repeats are idempotent):

- (a) deltasync's in-place apply: worker time of ``deltasync_apply`` (index map
  translation + the scattered write), and the follower's end-to-end ``apply`` (RPC,
  serialization, version label): the engine pause per sync in pause mode;
- (b) ``model.load_weights`` with every full tensor already in worker memory;
- (c) vLLM's ``load_checkpoint_weight_patches`` with the same sparse patch;
- (d) a full reload, ``collective_rpc("reload_weights", weights_path=...)``:
  the engine pause per sync without deltas.

Also whole syncs through the Subscriber (fetch, validation, then the files
decoded and written in the worker, as an engine of one rank takes deltas): the
engine's first, then ``--syncs`` more, one per training step, whose medians are
what every later step costs, and as many on alternate steps decoded by the
follower instead (one RPC for the bases, one for the patches); bit-exact checks
after each part.
Writes ``benchmarks/results/vllm_apply.json`` and prints a table.

    python benchmarks/vllm_apply.py             # 7 repeats, 4 more syncs of each kind
    python benchmarks/vllm_apply.py --repeats 3 --syncs 3
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))  # the vLLM worker imports tests.vllm_helpers by name

from _common import machine, median, table, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--syncs", type=int, default=4,
                        help="whole syncs after the first, one per step, of each kind (decoded in the worker, here)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import numpy as np
    import safetensors.torch
    import torch

    from deltasync.appliers.vllm.follower import VLLMFollower
    from deltasync.appliers.vllm.wire import pack
    from deltasync.demo.models import smollm2_checkpoint
    from deltasync.format import decode
    from deltasync.publish.publisher import Publisher
    from tests.vllm_helpers import BENCH_EXTENSION, Trainer, assert_engine_exact, engine, latest, save_checkpoint

    ckpt = smollm2_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="vllm-apply-"))
    store = str(work / "run")
    trainer = Trainer(ckpt, lr=args.lr)
    pub = Publisher(trainer.model, store)
    pub.publish(0, block=True)
    pub.flush()
    run_id, v0 = latest(store)
    trainer.step()
    pub.publish(1, block=True)
    pub.flush()
    weights = trainer.bf16()
    v1_dir = save_checkpoint(weights, ckpt, work / "v1")
    delta_key = sorted(o.key for o in __import__("deltasync").open_store(store).list("deltas/"))[-1]
    blob = __import__("deltasync").open_store(store).get(delta_key)

    # The same patch in absolute form: decoded against the checkpoint the engine loaded.
    base_state = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
    header, decoded = decode(
        blob, base=lambda name, idx: base_state[name].reshape(-1).view(torch.int16).numpy()[idx]
    )
    nnz, numel = header.nnz, header.numel
    payload = pack(
        {n: {"idx": d.indices.astype(np.int64), "val": d.values} for n, d in decoded.items() if d.indices is not None},
        text=False,
    )

    with engine(ckpt, plain=True, extension=BENCH_EXTENSION) as llm:
        follower = VLLMFollower(llm, model=ckpt)
        t_init = max(r["ms"] for r in follower.ranks)
        sub = follower.subscriber(store, ack=False, start_version=v0, run_id=run_id)
        info = sub.update()
        assert info is not None
        assert_engine_exact(follower, weights)

        worker_ms, follower_ms = [], []
        for _ in range(args.repeats):
            worker_ms.append(follower._rpc("deltasync_apply", payload, None)[0]["ms"])
            start = time.perf_counter()
            follower.validate(header)
            follower.apply(decoded)
            follower_ms.append(1e3 * (time.perf_counter() - start))
        full_ms = llm.collective_rpc("bench_load_full", args=(str(v1_dir), args.repeats))[0]
        patch_ms = llm.collective_rpc("bench_checkpoint_patches", args=(payload, args.repeats))[0]
        reload_ms = []
        for _ in range(min(args.repeats, 3)):
            start = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(v1_dir)})
            reload_ms.append(1e3 * (time.perf_counter() - start))
        assert_engine_exact(follower, weights)  # every path left the same, exact weights
        # One training step, one publish, one sync each: what every later step costs, the files decoded in the
        # worker (the default for an engine of one rank) and, on alternate steps, decoded here (two RPCs).
        steady, in_worker, here = [], [], []
        for version in range(2, 2 + 2 * args.syncs):
            follower.decode_in_worker = version % 2 == 0
            trainer.step()
            pub.publish(version, block=True)
            pub.flush()
            later = sub.update()
            assert later is not None and later.version == version
            if follower.decode_in_worker:
                steady.append(later)
                in_worker.append(dict(follower.last_apply))  # the worker's own timings of this sync's apply
            else:
                here.append(later)
        sub.close()
        pub.close()
        if steady:
            assert_engine_exact(follower, trainer.bf16())

    a, b, c, d = median(worker_ms), median(full_ms), median(patch_ms), median(reload_ms)
    result = {
        "machine": machine(),
        "model": "SmolLM2-135M-Instruct (vLLM CPU, TP=1, plain weights)",
        "lr": args.lr,
        "nnz": nnz,
        "numel": numel,
        "sparsity": 1 - nnz / numel,
        "delta_bytes": len(blob),
        "repeats": args.repeats,
        "index_map_ms": t_init,
        "sync": {  # the engine's first
            "t_fetch_ms": 1e3 * info.t_fetch,
            "t_decode_ms": 1e3 * info.t_decode,
            "t_apply_ms": 1e3 * info.t_apply,
        },
        "sync_steady": {  # medians of the syncs after it, one per step
            "syncs": len(steady),
            "bytes": [i.bytes for i in steady],
            **{f"t_{part}_ms": median([1e3 * getattr(i, f"t_{part}") for i in steady]) if steady else None
               for part in ("fetch", "decode", "apply")},
            "samples_ms": {part: [1e3 * getattr(i, f"t_{part}") for i in steady]
                           for part in ("fetch", "decode", "apply")},
            # In the worker: decoding the files against its weights (an engine of one rank), then all of it.
            "worker_decode_ms": median([w.get("decode_ms", 0.0) for w in in_worker]) if in_worker else None,
            "worker_ms": median([w["ms"] for w in in_worker]) if in_worker else None,
        },
        "sync_decoded_here": {  # the alternate steps: decoded by the follower, one RPC for bases, one for patches
            "syncs": len(here),
            **{f"t_{part}_ms": median([1e3 * getattr(i, f"t_{part}") for i in here]) if here else None
               for part in ("fetch", "decode", "apply")},
            "samples_ms": {part: [1e3 * getattr(i, f"t_{part}") for i in here]
                           for part in ("fetch", "decode", "apply")},
        },
        "ms": {
            "a_inplace_worker": a,
            "a_inplace_follower_end_to_end": median(follower_ms),
            "b_load_weights_full": b,
            "c_checkpoint_weight_patches": c,
            "d_full_reload": d,
        },
        "samples_ms": {"a": worker_ms, "a_e2e": follower_ms, "b": full_ms, "c": patch_ms, "d": reload_ms},
        "ratios": {"a_over_b": a / b, "a_over_c": a / c, "pause_e2e_over_reload": median(follower_ms) / d},
    }
    path = write_json("vllm_apply", result)
    rows = [
        ["(a) deltasync in place (worker)", f"{a:.1f}", f"{a / b:.1%}"],
        ["(a) deltasync apply, follower end to end (= pause per sync)", f"{median(follower_ms):.1f}",
         f"{median(follower_ms) / b:.1%}"],
        ["(b) model.load_weights, full tensors in memory", f"{b:.1f}", "100%"],
        ["(c) load_checkpoint_weight_patches, same sparse patch", f"{c:.1f}", f"{c / b:.1%}"],
        ["(d) full reload_weights from disk (pause per sync)", f"{d:.1f}", f"{d / b:.1%}"],
    ]
    print(f"\nSmolLM2-135M, one AdamW step at lr {args.lr}: {nnz:,} of {numel:,} elements changed "
          f"(sparsity {1 - nnz / numel:.2%}), delta {len(blob):,} bytes; medians of {args.repeats}\n")
    print(table(rows, ["path", "ms", "vs (b)"]))
    print(f"\nwhole sync through the Subscriber, the engine's first: fetch {1e3 * info.t_fetch:.0f} ms, "
          f"decode+lookup {1e3 * info.t_decode:.0f} ms, apply {1e3 * info.t_apply:.0f} ms; "
          f"index map built in {t_init:.0f} ms")
    if steady:
        s = result["sync_steady"]
        print(f"the {len(steady)} after it (one per step, medians): fetch {s['t_fetch_ms']:.0f} ms, "
              f"decode+lookup {s['t_decode_ms']:.0f} ms, apply {s['t_apply_ms']:.0f} ms (in the worker: "
              f"{s['worker_ms']:.0f} ms, of which decoding {s['worker_decode_ms']:.0f} ms)")
        h = result["sync_decoded_here"]
        print(f"the {len(here)} on alternate steps, decoded by the follower (bases and patches by RPC): fetch "
              f"{h['t_fetch_ms']:.0f} ms, decode+lookup {h['t_decode_ms']:.0f} ms, apply {h['t_apply_ms']:.0f} ms")
    print(f"wrote {path}")
    os._exit(0)  # vLLM's engine processes are already shut down; skip slow interpreter teardown


if __name__ == "__main__":
    main()
