"""LoRA training on SmolLM2-135M: bytes per version of merged-weight deltas vs the adapter itself, and auto.

SmolLM2-135M-Instruct with fp32 masters, wrapped in a PEFT LoRA adapter on every
linear layer of the decoder (``target_modules="all-linear"``: q, k, v, o, gate,
up, down; the tied ``lm_head`` is left alone), ``lora_alpha = 2 * r`` (the same
scale at every rank), B initialised to zero as PEFT does. AdamW on the adapter
only, a few steps on four short texts, one version published per step. For
every learning rate and rank, the bytes of one version as:

- (i) ``merged``: the sparse delta deltasync publishes from
  :class:`deltasync.publish.peft.MergedWeights` (default codec), which a replica that
  loaded the *base* checkpoint applies in place;
- (ii) ``adapter``: every LoRA A and B matrix in bf16, what shipping the
  adapter itself as a vLLM LoRA costs per version;
- (iii) ``adapter delta``: a deltasync delta of those A/B tensors against the
  previous version (same codec);
- (iv) ``dense``: the whole model in bf16;
- (v) ``auto``: the delta deltasync publishes from :class:`deltasync.publish.lora.LoraWeights`
  in ``mode="auto"``, which diffs both exact forms at every publish and sends
  the one estimated smaller: the merged weights' sparse delta (as (i), factors
  zero) or the adapter form (frozen base weights, the live factors in fp32, so
  a larger per-element cost than (iii), which casts them to bf16); the form it
  chose is recorded per version.

Medians over the versions after the first (the first step moves B away from
zero; it is reported separately) and the last version: a merged delta grows as
B does (``delta W = s * (dB A + B dA + dB dA)``), so it is measured early in a
run here. The publisher's anchor policy may add anchors; they are counted, not
added to the bytes. Each configuration ends with a replica (a
bf16 copy of the base model, no PEFT) caught up from the store and compared bit
for bit with PEFT's own ``merge_and_unload()``, and with a replica of the auto
run's tensors (base names in bf16, factors in fp32) that followed its store and
is compared bit for bit with the form of the last version. Writes
``benchmarks/results/peft.json`` and prints a table.

    python benchmarks/lora.py                # lr 1e-5, 1e-4, 1e-3 x rank 8, 16, 64; 8 steps each (3-8 min)
    python benchmarks/lora.py --quick        # lr 1e-4, rank 8, 2 steps (results in a temp dir)
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# This file is named like the peft package: keep its folder behind site-packages on the import path.
ROOT = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT] + [str(ROOT)]
sys.path.insert(0, str(ROOT.parent))  # tests.vllm_helpers (the texts)

import torch  # noqa: E402
from _common import human_bytes, median, results_dir, shared_machine, table, write_json  # noqa: E402

LRS = (1e-5, 1e-4, 1e-3)
RANKS = (8, 16, 64)
STEPS = 8


def run(lr: float, rank: int, steps: int) -> dict[str, Any]:
    """Train one LoRA configuration, publishing merged weights, the adapter and auto; return bytes per version."""
    import peft

    from deltasync import Publisher, Subscriber
    from deltasync.appliers import TorchModuleApplier
    from deltasync.demo.models import load_smollm2
    from deltasync.publish.lora import LoraWeights
    from deltasync.publish.peft import MergedWeights
    from deltasync.stores import MemoryStore
    from deltasync.tensors import published_tensors
    from tests.vllm_helpers import TEXTS

    torch.manual_seed(0)
    base, tokenizer = load_smollm2(dtype=torch.float32)
    replica = copy.deepcopy(base).to(torch.bfloat16)  # loaded the base checkpoint, knows nothing of LoRA
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    model = peft.get_peft_model(base, config)
    adapter = {n: p for n, p in model.named_parameters() if "lora_" in n}
    opt = torch.optim.AdamW(list(adapter.values()), lr=lr)
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)

    merged_store, adapter_store = MemoryStore(f"merged-{lr}-{rank}"), MemoryStore(f"adapter-{lr}-{rank}")
    auto_store = MemoryStore(f"auto-{lr}-{rank}")
    merged = MergedWeights(model)
    lora = LoraWeights(model, mode="auto")
    # A replica of the auto run's tensors, taken before the first publish: its first form (merged, B = 0).
    auto_replica = {
        n: t.detach().clone().to(t.dtype if n in lora.own_dtype else torch.bfloat16) for n, t in lora.items()
    }
    adapted = sum(p.numel() for n, p in model.named_parameters() if n.endswith("base_layer.weight"))
    versions: list[dict[str, Any]] = []
    infos: dict[str, list[Any]] = {"merged": [], "adapter_delta": [], "auto": []}
    with Publisher(merged, merged_store, on_publish=infos["merged"].append) as pub, Publisher(
        adapter, adapter_store, on_publish=infos["adapter_delta"].append
    ) as pub_adapter, Publisher(lora, auto_store, on_publish=infos["auto"].append) as pub_auto:
        pub.publish(0, block=True)
        pub_adapter.publish(0, block=True)
        pub_auto.publish(0, block=True)
        for step in range(1, steps + 1):
            model.train()
            model(**batch, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
            row: dict[str, Any] = {"step": step}
            for what, publisher in (("merged", pub), ("adapter_delta", pub_adapter), ("auto", pub_auto)):
                moved = publisher.publish(step, block=True)  # False: no published bit changed, nothing to send
                publisher.flush()
                # The version's delta; the publisher may also have written an anchor after it (its policy).
                delta = [i for i in infos[what] if i.kind == "delta" and i.version == publisher.version]
                info = delta[0] if moved else None
                row[f"{what}_bytes"], row[f"{what}_changed"] = (info.bytes, info.nnz) if info else (0, 0)
                row[f"{what}_diff_s"] = info.t_diff if info else None
                if what == "auto":
                    row["auto_form"] = info.form if info else None  # the form it chose ("merged" or "adapter")
            row["merged_changed_of_adapted"] = row["merged_changed"] / adapted
            versions.append(row)
    started = time.perf_counter()
    Subscriber(merged_store, TorchModuleApplier(replica)).update()
    catch_up_s = time.perf_counter() - started
    reference = dict(published_tensors(copy.deepcopy(model).merge_and_unload()))
    exact = all(
        torch.equal(t.view(torch.int16), reference[n].detach().to(torch.bfloat16).view(torch.int16))
        for n, t in published_tensors(replica)
    )
    numel = sum(t.numel() for _, t in published_tensors(replica))
    Subscriber(auto_store, TorchModuleApplier(auto_replica, dtype=None)).update()
    last_form = [i.form for i in infos["auto"] if i.form][-1]  # the newest version's (anchors carry it too)
    auto_exact = all(
        torch.equal(auto_replica[n].view(ints), t.detach().to(auto_replica[n].dtype).view(ints))
        for n, t in lora.forms()[last_form].items()
        for ints in [torch.int16 if auto_replica[n].element_size() == 2 else torch.int32]
    )
    return {
        "lr": lr,
        "rank": rank,
        "lora_alpha": 2 * rank,
        "adapted_elements": adapted,
        "adapter_elements": sum(p.numel() for p in adapter.values()),
        "adapter_bytes": 2 * sum(p.numel() for p in adapter.values()),
        "dense_bytes": 2 * numel,
        "versions": versions,
        "first": versions[0],
        "median_merged_bytes": median([v["merged_bytes"] for v in versions[1:]] or [versions[0]["merged_bytes"]]),
        "median_adapter_delta_bytes": median(
            [v["adapter_delta_bytes"] for v in versions[1:]] or [versions[0]["adapter_delta_bytes"]]
        ),
        "median_auto_bytes": median([v["auto_bytes"] for v in versions[1:]] or [versions[0]["auto_bytes"]]),
        "auto_forms": [v["auto_form"] for v in versions],
        "median_changed_of_adapted": median([v["merged_changed_of_adapted"] for v in versions[1:]] or [0.0]),
        "anchors_after_v0": sum(i.kind == "anchor" and i.version > 0 for i in infos["merged"]),
        "median_merged_diff_s": median([v["merged_diff_s"] for v in versions if v["merged_diff_s"] is not None] or [0]),
        "replica_catch_up_s": catch_up_s,
        "replica_exact": exact,
        "auto_last_form": last_form,
        "auto_exact": auto_exact,
    }


def _forms(forms: list[str | None]) -> str:
    """The auto run's forms per version, run-length coded: ``merged x3, adapter x5`` (``-``: nothing moved)."""
    runs: list[list[Any]] = []
    for form in forms:
        if runs and runs[-1][0] == form:
            runs[-1][1] += 1
        else:
            runs.append([form, 1])
    return ", ".join(f"{form or '-'} x{count}" for form, count in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="lr 1e-4, rank 8, 2 steps; results in a temp dir")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", help="results directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    lrs, ranks, steps = ((1e-4,), (8,), 2) if args.quick else (LRS, RANKS, args.steps)
    load = os.getloadavg()
    started = time.perf_counter()
    results = []
    for lr in lrs:
        for rank in ranks:
            t0 = time.perf_counter()
            results.append(run(lr, rank, steps))
            r = results[-1]
            print(f"lr {lr:g} rank {rank}: merged {human_bytes(r['median_merged_bytes'])}, adapter "
                  f"{human_bytes(r['adapter_bytes'])}, auto {human_bytes(r['median_auto_bytes'])} "
                  f"({'/'.join(str(f) for f in r['auto_forms'])}), exact {r['replica_exact']}/{r['auto_exact']} "
                  f"({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    payload = {
        "benchmark": "peft",
        "model": "SmolLM2-135M-Instruct (fp32 masters), LoRA all-linear, lora_alpha = 2r, AdamW on the adapter",
        "steps": steps,
        "seconds": time.perf_counter() - started,
        "machine": shared_machine(load, "bytes do not depend on load; diff times do"),
        "results": results,
    }
    path = write_json("peft", payload, results_dir(args.quick, args.out))
    rows = [
        [
            f"{r['lr']:g}", r["rank"], human_bytes(r["median_merged_bytes"]),
            human_bytes(r["versions"][-1]["merged_bytes"]), f"{100 * r['median_changed_of_adapted']:.1f} %",
            human_bytes(r["adapter_bytes"]), human_bytes(r["median_adapter_delta_bytes"]),
            human_bytes(r["dense_bytes"]), human_bytes(r["median_auto_bytes"]), _forms(r["auto_forms"]),
            f"{r['median_merged_bytes'] / r['adapter_bytes']:.2f}", r["anchors_after_v0"],
            f"{1000 * r['median_merged_diff_s']:.0f} ms", "yes" if r["replica_exact"] else "NO",
            "yes" if r["auto_exact"] else "NO",
        ]
        for r in results
    ]
    header = ["lr", "rank", "(i) merged delta", "last version", "adapted elements changed", "(ii) adapter bf16",
              "(iii) adapter delta", "(iv) dense bf16", "(v) auto", "auto forms", "(i) / (ii)", "anchors",
              "merge + diff", "replica exact", "auto exact"]
    print(table(rows, header))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
