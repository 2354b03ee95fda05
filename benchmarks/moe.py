"""Mixture-of-Experts weight sync, measured: what changes per step, what it costs on the wire and in vLLM.

A small random Qwen3-MoE (default: hidden 256, 4 layers, 16 experts, top-2,
expert width 88, which vLLM's CPU kernel pads to 96; SmolLM2's 49k vocabulary,
so the embeddings are most of the dense size and every figure is also given
for the expert tensors alone) is trained with real AdamW steps in transformers
(fused experts in memory, published in per-expert checkpoint names), at three
learning rates, a few steps each, on the same 4 sentences every step (so
Adam's step is about ``lr`` on every element that gets a gradient: denser
deltas than varied RL batches give). Four parts:

1. Per version: experts touched (any of its gate/up/down tensors changed, from
   the delta file header), expert elements changed, bytes with the default
   codec, with ``raw`` (a second publisher on the same weights, same run) and
   dense bf16; the header's counts are checked against a diff of bf16 snapshots.
2. A vLLM replica (in process, TP=1, default CPU weights: dense Linear layers
   stashed and re-packed, experts prepacked) follows every version through a
   ``Subscriber``: worker apply time and verification cost per version with the
   default ``verify`` and with ``verify=0``; start-up (index map, proof); the
   expert tensors of one version applied alone, and one element per expert
   tensor (the fixed cost per tensor). After each pass the engine is read back
   in checkpoint coordinates and its packed expert bytes are hashed against a
   fresh pack of the trainer's weights. Last, as time references, vLLM's own
   whole-model paths in the same worker: ``model.load_weights`` (refused where
   the CPU backend emptied packed Linear weights; then again with their plain
   weights attached, which writes unpacked layouts into the packed experts, so
   it is not exact) and ``reload_weights`` from disk.
3. The two exact ways to patch packed experts, in the benchmark process on one
   torch thread, on the model's padded expert shapes: in place through the
   probed permutation (deltasync: ``index_copy_`` at ``perm``-translated
   positions) vs a plain copy patched and the touched experts re-packed with
   vLLM's ``cpu_prepack_moe_weight``; both are checked bit-identical to packing
   the new weights from scratch.
4. Per-element constants (bytes and apply ns per changed expert element, fixed
   cost per touched tensor) and a projection of the expert tensors of
   Qwen3-30B-A3B and Qwen3-235B-A22B at each measured changed fraction.

Writes ``benchmarks/results/moe.json`` and prints tables (about 75 s on a
2-core CPU machine; one vLLM engine at a time).

    python benchmarks/moe.py
    python benchmarks/moe.py --steps 2 --lrs 1e-4      # shorter
    python benchmarks/moe.py --experts 32 --layers 2   # another shape
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))  # the vLLM worker imports tests.vllm_helpers by name

import torch  # noqa: E402
from _common import human_bytes, median, shared_machine, table, write_json  # noqa: E402

EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
PACKED_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(?:\w+\.)*(w13|w2)_weight$")  # vLLM's runtime name
NO_SIZE_ANCHORS = 1e6  # anchor_ratio: only the version-0 anchor, so every replica route is anchor + deltas

# Published configurations (config.json of each model) used by the projection.
TARGETS: dict[str, dict[str, int]] = {
    "Qwen3-30B-A3B": dict(layers=48, experts=128, top_k=8, hidden=2048, expert_width=768,
                          heads=32, kv_heads=4, head_dim=128, vocab=151936),
    "Qwen3-235B-A22B": dict(layers=94, experts=128, top_k=8, hidden=4096, expert_width=1536,
                            heads=64, kv_heads=4, head_dim=128, vocab=151936),
}


# ---------------------------------------------------------------------- the model


def build_moe(target: Path, tokenizer_dir: Path, args: argparse.Namespace) -> Path:
    """The benchmark's random Qwen3-MoE, saved as a bf16 checkpoint (per-expert names)."""
    from tests.vllm_helpers import tiny_qwen3_moe

    return tiny_qwen3_moe(
        target, tokenizer_dir, hidden=args.hidden, experts=args.experts, top_k=args.top_k, width=args.expert_width,
        layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, seed=args.seed,
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The int16 bit patterns of a bf16 tensor (compared exactly, NaN and -0 included)."""
    return t.contiguous().view(torch.int16)


def padded_width(width: int) -> int:
    """The expert width vLLM's CPU MoE kernel pads to on this machine (its own alignment rule)."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    kind = cpu_moe.X86CPUUnquantizedExperts if torch.cpu._is_amx_tile_supported() else cpu_moe.CPUUnquantizedExperts
    align = kind._intermediate_alignment()
    return -(-width // align) * align


def isa() -> str:
    """The ISA vLLM's CPU MoE kernel packs for here."""
    return "amx" if torch.cpu._is_amx_tile_supported() else "vec"


def runtime_plain(weights: Mapping[str, torch.Tensor], layer: int, experts: int, pad: int) -> dict[str, torch.Tensor]:
    """One layer's ``w13 [E, 2*pad, H]`` and ``w2 [E, H, pad]`` before packing, as vLLM lays them out.

    gate rows at ``[0, I)``, up rows at ``[pad, pad + I)``, down columns at ``[0, I)``; padding is zero.
    """
    gate = weights[f"model.layers.{layer}.mlp.experts.0.gate_proj.weight"]
    width, hidden = gate.shape
    w13 = torch.zeros(experts, 2 * pad, hidden, dtype=torch.bfloat16)
    w2 = torch.zeros(experts, hidden, pad, dtype=torch.bfloat16)
    for e in range(experts):
        prefix = f"model.layers.{layer}.mlp.experts.{e}"
        w13[e, :width] = weights[f"{prefix}.gate_proj.weight"]
        w13[e, pad : pad + width] = weights[f"{prefix}.up_proj.weight"]
        w2[e, :, :width] = weights[f"{prefix}.down_proj.weight"]
    return {"w13": w13, "w2": w2}


# ---------------------------------------------------------------------- part 1: training and publishing


@dataclass
class Run:
    """One learning rate's training run: its stores, per-version figures and the weights of every version."""

    lr: float
    store: str
    raw_store: str
    versions: list[dict[str, Any]]
    experts: list[dict[str, torch.Tensor]]
    """Expert tensors (bf16) of versions 0..steps."""
    final: dict[str, torch.Tensor]
    """Every published tensor (bf16) of the last version."""


def entry_bytes(blob: bytes) -> dict[str, int]:
    """Payload bytes per tensor in a delta file (its ``T::part`` entries; the JSON header is not counted)."""
    from deltasync.format import raw_header

    out: dict[str, int] = {}
    for key, entry in raw_header(blob).items():
        if key == "__metadata__":
            continue
        start, stop = entry["data_offsets"]
        name = key.rsplit("::", 1)[0]
        out[name] = out.get(name, 0) + stop - start
    return out


def delta_blob(store: Any, version: int) -> bytes:
    """The delta object of ``version`` in a store, found through its manifest."""
    from deltasync.protocol.manifest import MANIFEST_KEY, Manifest

    entry = Manifest.from_bytes(store.get(MANIFEST_KEY)).entry(version)
    assert entry is not None and len(entry.delta) == 1, f"v{version}: expected one delta object"
    return store.get(entry.delta[0].key)


def version_figures(
    version: int, loss: float, blob: bytes, raw_blob: bytes, before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor], experts_total: int,
) -> dict[str, Any]:
    """What one version changed and cost, read from its delta headers and checked against the snapshots."""
    from deltasync.format import read_header

    header, raw_header_ = read_header(blob), read_header(raw_blob)
    nnz = {name: e.nnz for name, e in header.tensors.items()}
    diffed = {name: int((bits(before[name]) != bits(after[name])).sum()) for name in after}
    mismatched = sorted(n for n in after if diffed[n] != nnz.get(n, 0))
    raw_nnz = {name: e.nnz for name, e in raw_header_.tensors.items()}
    sizes, raw_sizes = entry_bytes(blob), entry_bytes(raw_blob)
    expert_names = [n for n in after if EXPERT_NAME.match(n)]
    touched = {EXPERT_NAME.match(n).group(1, 2) for n in expert_names if nnz.get(n, 0)}  # type: ignore[union-attr]
    expert_numel = sum(after[n].numel() for n in expert_names)
    expert_nnz = sum(nnz.get(n, 0) for n in expert_names)
    return {
        "version": version,
        "loss": loss,
        "nnz": header.nnz,
        "numel": header.numel,
        "changed_fraction": header.nnz / header.numel,
        "experts_touched": len(touched),
        "experts_total": experts_total,
        "experts_touched_fraction": len(touched) / experts_total,
        "expert_tensors_changed": sum(1 for n in expert_names if nnz.get(n, 0)),
        "expert_nnz": expert_nnz,
        "expert_numel": expert_numel,
        "expert_changed_fraction": expert_nnz / expert_numel,
        "tensors_carried_whole": sorted(n for n, e in header.tensors.items() if e.codec == "dense"),
        "bytes": {
            "compact": len(blob),
            "raw": len(raw_blob),
            "dense_bf16": 2 * header.numel,
            "expert_compact": sum(sizes.get(n, 0) for n in expert_names),
            "expert_raw": sum(raw_sizes.get(n, 0) for n in expert_names),
            "expert_dense_bf16": 2 * expert_numel,
        },
        "header_nnz_equals_snapshot_diff": not mismatched and raw_nnz == nnz,
        "header_nnz_mismatches": mismatched,
    }


def train_and_publish(model_dir: Path, lr: float, steps: int, seed: int, work: Path, experts_total: int) -> Run:
    """``steps`` AdamW steps at ``lr``, each published by a default-codec and a ``raw`` publisher."""
    from deltasync.codec import DEFAULT_CODEC
    from deltasync.publish.publisher import Publisher
    from tests.vllm_helpers import Trainer

    trainer = Trainer(model_dir, lr=lr, seed=seed)
    store, raw_store = str(work / f"lr{lr:g}-{DEFAULT_CODEC}"), str(work / f"lr{lr:g}-raw")
    before = trainer.bf16()
    experts = [{n: t for n, t in before.items() if EXPERT_NAME.match(n)}]
    versions = []
    with (
        Publisher(trainer.model, store, anchor_ratio=NO_SIZE_ANCHORS) as pub,
        Publisher(trainer.model, raw_store, codec="raw", anchor_ratio=NO_SIZE_ANCHORS) as raw,
    ):
        for publisher in (pub, raw):
            publisher.publish(0, block=True)
            publisher.flush()
        for step in range(1, steps + 1):
            loss = trainer.step()
            for publisher in (pub, raw):
                assert publisher.publish(step, block=True), f"lr {lr:g} step {step}: nothing changed"
                publisher.flush()
            after = trainer.bf16()
            versions.append(version_figures(
                step, loss, delta_blob(pub.store, step), delta_blob(raw.store, step), before, after, experts_total
            ))
            experts.append({n: t for n, t in after.items() if EXPERT_NAME.match(n)})
            before = after
    return Run(lr, store, raw_store, versions, experts, before)


# ---------------------------------------------------------------------- part 4: expert-parallel range reads


def ep_wanted(rank: int, ranks: int, experts: int) -> Callable[[str], bool]:
    """An expert-parallel rank's tensors under vLLM's linear placement: its experts, and every shared tensor."""
    per = experts // ranks

    def wanted(name: str) -> bool:
        match = EXPERT_NAME.match(name)
        return match is None or rank * per <= int(match.group(2)) < (rank + 1) * per

    return wanted


def expert_entry_bytes(store: Any, ref: Any) -> dict[str, int]:
    """Bytes of each expert tensor's entries in one object, from its header's ``data_offsets``."""
    from deltasync.format import raw_header

    layout = raw_header(store.get_range(ref.key, 0, ref.header[0]))
    out: dict[str, int] = {}
    for key, info in layout.items():
        name = key.rpartition("::")[0] or key
        if key != "__metadata__" and EXPERT_NAME.match(name):
            start, stop = info["data_offsets"]
            out[name] = out.get(name, 0) + stop - start
    return out


def expert_parallel_reads(runs: list[Run], experts: int) -> dict[str, list[dict[str, Any]]]:
    """Per version, bytes each EP rank range-reads (``deltasync.replica.ranged``, default gap) vs the whole object."""
    from deltasync.protocol.keys import MANIFEST_KEY
    from deltasync.protocol.manifest import Manifest
    from deltasync.replica.ranged import fetch_tensors
    from deltasync.stores import open_store

    out: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        store = open_store(run.store)
        manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
        rows = []
        for ranks in [r for r in (2, 4, 8) if experts % r == 0]:
            for entry in manifest.versions:
                refs = entry.anchor if entry.version == 0 else entry.delta
                reads = [[fetch_tensors(store, ref, ep_wanted(rank, ranks, experts)) for ref in refs]
                         for rank in range(ranks)]
                exact = [[fetch_tensors(store, ref, ep_wanted(rank, ranks, experts), gap=0) for ref in refs]
                         for rank in range(ranks)]
                sizes = [expert_entry_bytes(store, ref) for ref in refs]
                all_experts = sum(n for size in sizes for n in size.values())
                rows.append({
                    "ep": ranks, "version": entry.version, "kind": "anchor" if entry.version == 0 else "delta",
                    "whole_bytes": sum(r.size for r in refs),
                    "rank_bytes": [sum(f.bytes_read for f in fs) for fs in reads],
                    "rank_bytes_gap0": [sum(f.bytes_read for f in fs) for fs in exact],
                    "expert_bytes": all_experts,
                    "rank_expert_share": [
                        sum(n for size in sizes for name, n in size.items() if ep_wanted(rank, ranks, experts)(name))
                        / all_experts if all_experts else 0.0
                        for rank in range(ranks)
                    ],
                    "requests_max": max(sum(f.requests for f in fs) for fs in reads),
                })
        out[f"{run.lr:g}"] = rows
    return out


# ---------------------------------------------------------------------- part 3: packed experts, two exact ways


def elapsed_ms(fn: Callable[[], Any]) -> float:
    """Wall time of one call of ``fn``, in ms."""
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def patch_packed(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], layers: int, experts: int, pad: int,
    repeats: int,
) -> dict[str, Any]:
    """One version's expert changes written into packed tensors in place vs by re-packing the touched experts.

    Both start from the packed old weights; each must end bit-identical to a
    fresh pack of the new ones. Repeats rewrite the same values (idempotent).
    """
    import vllm._custom_ops as ops

    from deltasync.appliers.vllm.cpu_experts import prepack_permutation

    kernel_isa = isa()
    cases = []  # one per packed tensor: everything the three ways need, prepared outside the timing
    for layer in range(layers):
        plain_old, plain_new = runtime_plain(old, layer, experts, pad), runtime_plain(new, layer, experts, pad)
        for kind in ("w13", "w2"):
            before, after = plain_old[kind], plain_new[kind]
            _, n, k = before.shape
            size = n * k
            changed = torch.nonzero(bits(before).view(-1) != bits(after).view(-1)).view(-1)
            perm = prepack_permutation((n, k), torch.bfloat16, kernel_isa)
            cases.append({
                "runtime": changed,
                "values": bits(after).view(-1)[changed].clone(),
                "size": size,
                "perm": perm,
                "positions": changed - changed % size + perm[changed % size],
                "touched": torch.unique(changed // size),
                "packed": ops.cpu_prepack_moe_weight(before, kernel_isa),
                "repacked": ops.cpu_prepack_moe_weight(before, kernel_isa),
                "plain": before.clone(),
                "fresh": ops.cpu_prepack_moe_weight(after, kernel_isa),
            })

    def in_place() -> None:  # what deltasync does: translate through the permutation, scatter
        for c in cases:
            r = c["runtime"]
            positions = r - r % c["size"] + c["perm"][r % c["size"]]
            bits(c["packed"]).view(-1).index_copy_(0, positions, c["values"])

    def bare_index_copy() -> None:  # the scatter alone, positions already translated
        for c in cases:
            bits(c["packed"]).view(-1).index_copy_(0, c["positions"], c["values"])

    def repack() -> None:  # keep a plain copy, patch it, re-pack every touched expert
        for c in cases:
            bits(c["plain"]).view(-1).index_copy_(0, c["runtime"], c["values"])
            if c["touched"].numel():
                chosen = c["plain"].index_select(0, c["touched"])
                c["repacked"].index_copy_(0, c["touched"], ops.cpu_prepack_moe_weight(chosen, kernel_isa))

    def patch_plain() -> None:  # the first half of ``repack`` alone
        for c in cases:
            bits(c["plain"]).view(-1).index_copy_(0, c["runtime"], c["values"])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a descheduled OpenMP thread stalls its whole team on a shared machine
    try:
        in_place()  # from the packed old weights: the real patch, checked before any repeat
        repack()
        exact_in_place = all(torch.equal(bits(c["packed"]), bits(c["fresh"])) for c in cases)
        exact_repack = all(torch.equal(bits(c["repacked"]), bits(c["fresh"])) for c in cases)
        ms: dict[str, list[float]] = {"in_place": [], "bare_index_copy": [], "repack": [], "patch_plain": []}
        for _ in range(repeats):  # in turns, so load bursts hit every way alike
            ms["in_place"].append(elapsed_ms(in_place))
            ms["bare_index_copy"].append(elapsed_ms(bare_index_copy))
            ms["repack"].append(elapsed_ms(repack))
            ms["patch_plain"].append(elapsed_ms(patch_plain))
        exact_in_place &= all(torch.equal(bits(c["packed"]), bits(c["fresh"])) for c in cases)
        exact_repack &= all(torch.equal(bits(c["repacked"]), bits(c["fresh"])) for c in cases)
    finally:
        torch.set_num_threads(threads)
    nnz = sum(int(c["runtime"].numel()) for c in cases)
    touched_elements = sum(int(c["touched"].numel()) * c["size"] for c in cases)
    out = {k: median(v) for k, v in ms.items()}
    return {
        "isa": kernel_isa,
        "changed_elements": nnz,
        "touched_expert_tensors": sum(int(c["touched"].numel()) for c in cases),
        "touched_expert_elements": touched_elements,
        "ms": out | {"repack_prepack_only": out["repack"] - out["patch_plain"]},
        "ns_per_changed_element": {
            "in_place": 1e6 * out["in_place"] / max(nnz, 1),
            "bare_index_copy": 1e6 * out["bare_index_copy"] / max(nnz, 1),
        },
        "repack_ns_per_touched_element": 1e6 * out["repack"] / max(touched_elements, 1),
        "exact_in_place": exact_in_place,
        "exact_repack": exact_repack,
        "samples_ms": ms,
    }


# ---------------------------------------------------------------------- part 2: a vLLM replica


def packed_digests(weights: Mapping[str, torch.Tensor], layers: int, experts: int, pad: int) -> dict[str, str]:
    """SHA-256 of each layer's packed ``w13`` / ``w2`` as a fresh engine would hold ``weights``, by ``"layer/kind"``."""
    import vllm._custom_ops as ops

    out = {}
    for layer in range(layers):
        for kind, tensor in runtime_plain(weights, layer, experts, pad).items():
            packed = ops.cpu_prepack_moe_weight(tensor, isa())
            out[f"{layer}/{kind}"] = hashlib.sha256(bits(packed).view(-1).view(torch.uint8).numpy()).hexdigest()
    return out


def held_digests(llm: Any) -> dict[str, str]:
    """SHA-256 of the packed expert tensors the engine computes with, by ``"layer/kind"``."""
    from tests.vllm_helpers import runtime_digests

    out = {}
    for name, digest in llm.collective_rpc(runtime_digests)[0].items():
        found = PACKED_NAME.match(name)
        if found:
            out[f"{found.group(1)}/{found.group(2)}"] = digest
    return out


def make_follower(llm: Any, model_dir: Path) -> Any:
    """A :class:`VLLMFollower` that keeps the worker figures of every apply (one per version of a route)."""
    from deltasync.appliers.vllm.follower import VLLMFollower

    class RecordingFollower(VLLMFollower):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.applies: list[dict[str, float]] = []
            super().__init__(*args, **kwargs)

        def apply(self, decoded: Any) -> None:
            super().apply(decoded)
            self.applies.append(dict(self.last_apply))

    return RecordingFollower(llm, model=model_dir)


def engine_checks(follower: Any, llm: Any, run: Run, layers: int, experts: int, pad: int) -> dict[str, Any]:
    """The engine holds ``run.final`` exactly: read back in checkpoint coordinates, and packed bytes hashed."""
    from tests.vllm_helpers import assert_engine_exact

    try:
        assert_engine_exact(follower, run.final)
        readback, why = True, None
    except AssertionError as exc:
        readback, why = False, str(exc)
    held = held_digests(llm)
    fresh = packed_digests(run.final, layers, experts, pad)
    differ = sorted(n for n in fresh if held.get(n) != fresh[n])
    return {
        "readback_exact": readback,
        "readback_error": why,
        "packed_bytes_equal_fresh_pack": bool(held) and not differ,
        "packed_tensors_differing": differ,
        "packed_tensors_compared": len(fresh),
    }


def expert_payload(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``{name: {"idx", "val"}}`` of the expert elements that changed between two versions (absolute bits)."""
    out = {}
    for name, new in after.items():
        changed = torch.nonzero(bits(before[name]).view(-1) != bits(new).view(-1)).view(-1)
        if changed.numel():
            out[name] = {"idx": changed.numpy(), "val": bits(new).view(-1)[changed].numpy()}
    return out


def worker_apply(follower: Any, payload: dict[str, Any], verify: int, repeats: int) -> dict[str, Any]:
    """Median worker figures of ``deltasync_apply`` with ``payload`` (already held, so repeats are idempotent)."""
    from deltasync.appliers.vllm.wire import pack

    blob = pack(payload, text=False)
    answers = [follower._rpc("deltasync_apply", blob, None, verify)[0] for _ in range(repeats)]
    wrong = [line for a in answers for line in a.get("wrong", [])]
    assert not wrong, f"read back wrong: {wrong[:3]}"
    return {"ms": median([a["ms"] for a in answers]), "verify_ms": median([a["verify_ms"] for a in answers]),
            "repacked_layers": answers[-1]["repacked"], "samples_ms": [a["ms"] for a in answers]}


def replica(model_dir: Path, runs: list[Run], args: argparse.Namespace, pad: int) -> dict[str, Any]:
    """Follow every run in one engine (default ``verify``, then ``verify=0``), then time the references."""
    from deltasync.appliers.verify import VERIFY_SAMPLES
    from tests.vllm_helpers import BENCH_EXTENSION, engine

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # runtime_digests travels to the worker by value
    out: dict[str, Any] = {"verify_default": VERIFY_SAMPLES, "runs": {}}
    started = time.perf_counter()
    with engine(model_dir, plain=False, extension=BENCH_EXTENSION) as llm:
        out["engine_start_s"] = time.perf_counter() - started
        start = time.perf_counter()
        follower = make_follower(llm, model_dir)
        rank = follower.ranks[0]
        out["startup"] = {
            "follower_s": time.perf_counter() - start,
            "map_ms": rank["map_ms"],
            "proof_ms": rank["ms"] - rank["map_ms"],
            "proof": rank["proof"],
            "layouts": sorted(set(rank["layouts"].values())),
            "repacked_layers": len(rank["repacked_layers"]),
        }
        for run in runs:
            figures: dict[str, Any] = {}
            for verify in (VERIFY_SAMPLES, 0):
                follower.verify, follower.applies = verify, []
                with follower.subscriber(run.store, ack=False) as sub:
                    info = sub.update()
                assert info is not None and len(info.route) == len(follower.applies), "one apply per route step"
                steps = list(zip(info.route, follower.applies))
                assert steps[0][0] == "anchor" and all(kind == "delta" for kind, _ in steps[1:]), info.route
                figures[f"verify_{verify}"] = {
                    "anchor": steps[0][1],
                    "deltas": [a for _, a in steps[1:]],
                    "checks": engine_checks(follower, llm, run, args.layers, args.experts, pad),
                }
            # The expert tensors of the last version alone (the engine holds it: idempotent), then one
            # element per expert tensor: the fixed cost of a touched tensor.
            last = expert_payload(run.experts[-2], run.experts[-1])
            single = {name: {"idx": torch.zeros(1, dtype=torch.int64).numpy(), "val": bits(t).view(-1)[:1].numpy()}
                      for name, t in run.experts[-1].items()}
            figures["experts_only"] = {
                "changed": int(sum(p["idx"].size for p in last.values())),
                "tensors": len(last),
                f"verify_{VERIFY_SAMPLES}": worker_apply(follower, last, VERIFY_SAMPLES, args.repeats),
                "verify_0": worker_apply(follower, last, 0, args.repeats),
            }
            figures["one_element_per_expert_tensor"] = {
                "tensors": len(single), "verify_0": worker_apply(follower, single, 0, args.repeats),
            }
            out["runs"][f"{run.lr:g}"] = figures
        out["references"] = references(llm, model_dir, args, pad)
    return out


def load_full_with_plain_weights(worker: Any, checkpoint: str, repeats: int) -> list[float]:
    """In a worker: ``model.load_weights`` of every tensor (in memory) with the stashed plain Linear weights
    put back where the loaders look; ms per repeat. The packed copies are not refreshed: a time reference."""
    import safetensors.torch

    from deltasync.appliers.vllm.cpu_hooks import plain_weights_attached

    tensors = safetensors.torch.load_file(str(Path(checkpoint) / "model.safetensors"))
    model = worker.get_model()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad(), plain_weights_attached(model):
            model.load_weights(iter(tensors.items()))
        out.append(1e3 * (time.perf_counter() - start))
    return out


def worker_error(exc: BaseException) -> str:
    """The worker's own message inside vLLM's wrapped ``collective_rpc`` error."""
    found = re.search(r"with error '(.*?)', please", str(exc), re.S)
    return (found.group(1) if found else str(exc)).splitlines()[0][:300]


def references(llm: Any, model_dir: Path, args: argparse.Namespace, pad: int) -> dict[str, Any]:
    """vLLM's own whole-model paths in the same worker, after every deltasync measurement (they break exactness).

    ``bench_load_full`` (``model.load_weights``) as on a dense model; where the stashed Linear layers refuse
    it, the same with their plain weights attached; then ``reload_weights`` from disk, which re-runs vLLM's
    post-load processing (padding, packing), and a hash of its packed experts against a fresh pack.
    """
    import safetensors.torch

    out: dict[str, Any] = {}
    try:
        out["load_weights_ms"] = llm.collective_rpc("bench_load_full", args=(str(model_dir), args.repeats))[0]
    except Exception as exc:  # vLLM's loader meets the emptied (packed) Linear weights
        out["load_weights_error"] = worker_error(exc)
    this = sys.modules.get("moe") or __import__("moe")  # by importable name, so the worker can unpickle it
    out["load_weights_plain_attached_ms"] = llm.collective_rpc(
        this.load_full_with_plain_weights, args=(str(model_dir), args.repeats)
    )[0]
    reload_ms = []
    try:
        for _ in range(min(args.repeats, 3)):
            start = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
            reload_ms.append(1e3 * (time.perf_counter() - start))
    except Exception as exc:  # vLLM's reload meets the padded expert width
        out["reload_weights_error"] = worker_error(exc)
    out["reload_weights_ms"] = reload_ms
    if reload_ms:
        base = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
        held = held_digests(llm)
        fresh = packed_digests(base, args.layers, args.experts, pad)
        out["reload_packed_experts_equal_fresh_pack"] = bool(held) and all(held.get(n) == d for n, d in fresh.items())
    return out


# ---------------------------------------------------------------------- part 4: projection


def expert_params(c: Mapping[str, int]) -> int:
    return c["layers"] * c["experts"] * 3 * c["hidden"] * c["expert_width"]


def total_params(c: Mapping[str, int]) -> int:
    """Parameters of a Qwen3-MoE config: attention, norms, router, experts, untied embeddings."""
    q, kv = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    attention = c["hidden"] * (2 * q + 2 * kv) + 2 * c["head_dim"]
    per_layer = attention + 2 * c["hidden"] + c["experts"] * c["hidden"]
    return c["layers"] * per_layer + expert_params(c) + 2 * c["vocab"] * c["hidden"] + c["hidden"]


def projection(constants: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Expert tensors of the target models at the measured changed fraction and per-element costs."""
    rows = []
    for name, config in TARGETS.items():
        n_exp, tensors = expert_params(config), config["layers"] * config["experts"] * 3
        for lr, k in constants.items():
            changed = n_exp * k["expert_changed_fraction"]
            touched = round(tensors * k["expert_tensors_changed_fraction"])
            rows.append({
                "model": name,
                "lr": lr,
                "params": total_params(config),
                "expert_params": n_exp,
                "expert_tensors": tensors,
                "changed_expert_elements": changed,
                "bytes_compact": changed * k["bytes_per_changed_compact"],
                "bytes_raw": changed * k["bytes_per_changed_raw"],
                "bytes_dense_bf16_experts": 2 * n_exp,
                "bytes_dense_bf16_model": 2 * total_params(config),
                "apply_in_place_bare_s": changed * k["in_place_ns"] * 1e-9,
                "apply_engine_s": (changed * k["engine_ns_per_changed"] + touched * k["engine_ms_per_tensor"] * 1e6)
                * 1e-9,
                "repack_touched_s": n_exp * k["experts_touched_fraction"] * k["repack_ns_per_touched_element"] * 1e-9,
            })
    return rows


def constants_for(run: Run, packing: list[dict[str, Any]], engine_figures: Mapping[str, Any]) -> dict[str, Any]:
    """The per-element constants of one learning rate (medians over its versions)."""
    v = run.versions
    only = engine_figures["experts_only"]
    per_tensor_ms = engine_figures["one_element_per_expert_tensor"]["verify_0"]["ms"] / (
        engine_figures["one_element_per_expert_tensor"]["tensors"]
    )
    engine_ns = 1e6 * (only["verify_0"]["ms"] - only["tensors"] * per_tensor_ms) / max(only["changed"], 1)
    return {
        "expert_changed_fraction": median([x["expert_changed_fraction"] for x in v]),
        "experts_touched_fraction": median([x["experts_touched_fraction"] for x in v]),
        "expert_tensors_changed_fraction": median([x["expert_tensors_changed"] / (3 * x["experts_total"]) for x in v]),
        "bytes_per_changed_compact": median([x["bytes"]["expert_compact"] / x["expert_nnz"] for x in v]),
        "bytes_per_changed_raw": median([x["bytes"]["expert_raw"] / x["expert_nnz"] for x in v]),
        "in_place_ns": median([p["ns_per_changed_element"]["in_place"] for p in packing]),
        "bare_index_copy_ns": median([p["ns_per_changed_element"]["bare_index_copy"] for p in packing]),
        "repack_ns_per_touched_element": median([p["repack_ns_per_touched_element"] for p in packing]),
        "engine_ms_per_tensor": per_tensor_ms,
        "engine_ns_per_changed": max(engine_ns, 0.0),
    }


# ---------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=88, help="moe_intermediate_size (vLLM pads it)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32, help="the CPU attention needs >= 32")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    parser.add_argument("--steps", type=int, default=4, help="AdamW steps (versions) per learning rate")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default=None, help="directory for moe.json (default benchmarks/results)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    began, load_before = time.perf_counter(), os.getloadavg()

    from deltasync.appliers.vllm.cpu_experts import install_expert_hooks
    from deltasync.demo.models import smollm2_checkpoint

    if not install_expert_hooks():
        raise SystemExit("vLLM's CPU MoE prepack op is not available (pip install vllm, CPU build)")
    work = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    model_dir = build_moe(work / "qwen3-moe", smollm2_checkpoint(), args)
    pad = padded_width(args.expert_width)
    experts_total = args.layers * args.experts

    runs = [train_and_publish(model_dir, lr, args.steps, args.seed, work, experts_total) for lr in args.lrs]
    t_train = time.perf_counter() - began
    packing = {
        f"{run.lr:g}": [patch_packed(run.experts[i - 1], run.experts[i], args.layers, args.experts, pad, args.repeats)
                        for i in range(1, len(run.experts))]
        for run in runs
    }
    vllm = replica(model_dir, runs, args, pad)
    ep_reads = expert_parallel_reads(runs, args.experts)
    constants = {f"{r.lr:g}": constants_for(r, packing[f"{r.lr:g}"], vllm["runs"][f"{r.lr:g}"]) for r in runs}
    projected = projection(constants)

    first = runs[0].versions[0]
    result = {
        "machine": shared_machine(load_before, "2-core machine shared with other jobs: compare times taken in "
                                  "turns within this run; part 3 runs on one torch thread"),
        "model": {
            "kind": "random Qwen3-MoE, SmolLM2 tokenizer (vLLM CPU, TP=1, default CPU weights)",
            "hidden": args.hidden, "layers": args.layers, "experts": args.experts, "top_k": args.top_k,
            "expert_width": args.expert_width, "expert_width_padded_by_vllm": pad, "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "params": first["numel"],
            "expert_params": first["expert_numel"], "batch": "4 fixed sentences (tests.vllm_helpers.TEXTS), 88 tokens",
        },
        "lrs": args.lrs,
        "steps": args.steps,
        "repeats": args.repeats,
        "versions": {f"{r.lr:g}": r.versions for r in runs},
        "packing": packing,
        "vllm": vllm,
        "expert_parallel_reads": {
            "how": "each simulated EP rank holds experts [rank*E/ep, (rank+1)*E/ep) of every layer (vLLM's linear "
                   "placement, as the EP=2 engine in tests/test_moe.py shows) and every non-expert tensor; it "
                   "range-reads just those tensors, verified per tensor (deltasync.replica.ranged, 256 KiB gap)",
            "runs": ep_reads,
        },
        "constants": constants,
        "projection": {
            "assumes": "expert tensors only, at each lr's measured expert changed fraction, bytes per changed "
                       "element and per-element apply cost of this CPU; engine apply = touched tensors x fixed "
                       "cost per tensor + changed elements x cost per element; re-pack = the measured touched-"
                       "expert fraction of every expert re-packed",
            "targets": TARGETS,
            "rows": projected,
        },
        "runtime_s": {"training_and_publishing": t_train, "total": time.perf_counter() - began},
    }
    path = write_json("moe", result, args.results)
    report(result, runs, packing, vllm, constants, projected)
    report_ep(ep_reads)
    print(f"\nwrote {path} in {result['runtime_s']['total']:.0f} s")
    shutil.rmtree(work, ignore_errors=True)
    os._exit(0)  # vLLM's engine processes are already shut down; skip slow interpreter teardown


def report(result: dict[str, Any], runs: list[Run], packing: dict[str, Any], vllm: dict[str, Any],
           constants: dict[str, Any], projected: list[dict[str, Any]]) -> None:
    """Print the tables."""
    m = result["model"]
    print(f"\nQwen3-MoE, {m['layers']} layers x {m['experts']} experts (top-{m['top_k']}), hidden {m['hidden']}, "
          f"expert width {m['expert_width']} (vLLM pads to {m['expert_width_padded_by_vllm']}): "
          f"{m['params']:,} parameters, {m['expert_params']:,} in experts\n")
    rows = []
    for run in runs:
        for v in run.versions:
            b = v["bytes"]
            rows.append([
                f"{run.lr:g}", v["version"], f"{v['experts_touched']}/{v['experts_total']}",
                f"{v['expert_changed_fraction']:.2%}", f"{v['changed_fraction']:.2%}",
                human_bytes(b["compact"]), human_bytes(b["raw"]), human_bytes(b["dense_bf16"]),
                f"{human_bytes(b['expert_compact'])} / {human_bytes(b['expert_raw'])} / "
                f"{human_bytes(b['expert_dense_bf16'])}",
                "yes" if v["header_nnz_equals_snapshot_diff"] else "NO",
            ])
    print(table(rows, ["lr", "version", "experts touched", "expert elems changed", "all elems changed",
                       "delta (compact)", "raw", "dense bf16", "experts only: compact / raw / dense",
                       "header = diff"]))

    print(f"\nvLLM replica, worker side, ms per version (median over versions; verify default "
          f"{vllm['verify_default']} samples per tensor vs 0)\n")
    rows = []
    refs = vllm["references"]
    for run in runs:
        f = vllm["runs"][f"{run.lr:g}"]
        on, off = f[f"verify_{vllm['verify_default']}"], f["verify_0"]
        only = f["experts_only"]
        rows.append([
            f"{run.lr:g}",
            f"{median([d['ms'] for d in on['deltas']]):.1f}",
            f"{median([d['verify_ms'] for d in on['deltas']]):.1f}",
            f"{median([d['ms'] for d in off['deltas']]):.1f}",
            f"{median([d['verify_ms'] for d in off['deltas']]):.1f}",
            f"{only['verify_0']['ms']:.1f} ({only['changed']:,} elems, {only['tensors']} tensors)",
            f"{on['anchor']['ms']:.0f}",
            "yes" if all(x["checks"]["readback_exact"] and x["checks"]["packed_bytes_equal_fresh_pack"]
                         for x in (on, off)) else "NO",
        ])
    print(table(rows, ["lr", "delta apply (verify on)", "of which verify", "delta apply (verify=0)",
                       "of which verify (whole tensors)", "experts only, verify=0", "anchor apply",
                       "exact (read back + packed bytes)"]))
    s = vllm["startup"]
    print(f"\nstart-up: index map {s['map_ms']:.0f} ms, proof {s['proof_ms']:.0f} ms "
          f"({s['proof']['elements']:,} elements, {len(s['proof']['failed'])} failed)")
    loaded, attached = refs.get("load_weights_ms"), median(refs["load_weights_plain_attached_ms"])
    print("vLLM's own whole-model paths in the same worker (time references): load_weights "
          + (f"{median(loaded):.0f} ms" if loaded else f"refused ({refs['load_weights_error'][:90]})")
          + f"; load_weights with the plain Linear weights attached {attached:.0f}"
          " ms (not exact on packed experts); reload_weights from disk "
          + (f"{median(refs['reload_weights_ms']):.0f} ms (packed experts equal a fresh pack: "
             f"{'yes' if refs['reload_packed_experts_equal_fresh_pack'] else 'NO'})" if refs["reload_weights_ms"]
             else f"failed ({refs['reload_weights_error'][:120]})"))

    print("\npacked experts, one version's changes, in this process (median over versions, ms)\n")
    rows = []
    for lr, items in packing.items():
        rows.append([
            lr, f"{median([p['changed_elements'] for p in items]):,.0f}",
            f"{median([p['touched_expert_tensors'] for p in items]):.0f}",
            f"{median([p['ms']['in_place'] for p in items]):.2f}",
            f"{median([p['ms']['bare_index_copy'] for p in items]):.2f}",
            f"{median([p['ms']['repack'] for p in items]):.2f}",
            "yes" if all(p["exact_in_place"] for p in items) else "NO",
            "yes" if all(p["exact_repack"] for p in items) else "NO",
        ])
    print(table(rows, ["lr", "changed elems", "touched experts (w13+w2)", "in place via perm",
                       "bare index_copy_", "re-pack touched", "in place exact", "re-pack exact"]))

    print("\nper-element constants\n")
    rows = [[lr, f"{k['expert_changed_fraction']:.2%}", f"{k['experts_touched_fraction']:.0%}",
             f"{k['bytes_per_changed_compact']:.2f}", f"{k['bytes_per_changed_raw']:.2f}",
             f"{k['in_place_ns']:.1f}", f"{k['engine_ns_per_changed']:.1f}", f"{1e3 * k['engine_ms_per_tensor']:.0f}",
             f"{k['repack_ns_per_touched_element']:.2f}"] for lr, k in constants.items()]
    print(table(rows, ["lr", "expert elems changed", "experts touched", "B / changed (compact)", "B / changed (raw)",
                       "in place ns / changed", "engine ns / changed", "engine us / tensor",
                       "re-pack ns / touched elem"]))

    print("\nprojection, expert tensors only (this CPU's per-element costs; not measured at this size)\n")
    rows = [[r["model"], r["lr"], f"{r['expert_params'] / 1e9:.1f}B of {r['params'] / 1e9:.1f}B",
             f"{r['changed_expert_elements'] / 1e9:.2f}B", human_bytes(r["bytes_compact"]), human_bytes(r["bytes_raw"]),
             human_bytes(r["bytes_dense_bf16_experts"]), f"{r['apply_engine_s']:.1f} s",
             f"{r['apply_in_place_bare_s']:.1f} s", f"{r['repack_touched_s']:.1f} s"] for r in projected]
    print(table(rows, ["model", "lr", "expert params", "changed", "delta (compact)", "raw", "dense bf16",
                       "apply in vLLM worker", "in place, 1 thread", "re-pack touched experts, 1 thread"]))



def report_ep(ep_reads: Mapping[str, list[dict[str, Any]]]) -> None:
    print("\nexpert-parallel ranks, bytes range-read per version vs the whole object (median over deltas)\n")
    rows = []
    for lr, items in ep_reads.items():
        for ranks in sorted({i["ep"] for i in items}):
            mine = [i for i in items if i["ep"] == ranks]
            anchor = next(i for i in mine if i["kind"] == "anchor")
            deltas = [i for i in mine if i["kind"] == "delta"]
            rows.append([
                lr, ranks,
                f"{max(anchor['rank_bytes']) / anchor['whole_bytes']:.0%} of {human_bytes(anchor['whole_bytes'])}",
                f"{max(anchor['rank_expert_share']):.0%}",
                f"{median([max(d['rank_bytes']) / d['whole_bytes'] for d in deltas]):.0%}",
                f"{median([max(d['rank_bytes_gap0']) / d['whole_bytes'] for d in deltas]):.0%}",
                f"{median([max(d['rank_expert_share']) for d in deltas]):.0%}",
                f"{median([d['whole_bytes'] for d in deltas]) / 1e6:.2f} MB",
                max(i["requests_max"] for i in mine),
            ])
    print(table(rows, ["lr", "EP ranks", "anchor: busiest rank", "anchor: its share of expert bytes",
                       "delta: busiest rank", "same, no gap merging", "its share of expert bytes", "delta size",
                       "requests (max)"]))
    print("(this model's embeddings are 25M of its 29.9M parameters, and every rank reads them: the expert "
          "share is what carries over to models whose experts are 95 % of the parameters)")


if __name__ == "__main__":
    main()
