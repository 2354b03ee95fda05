"""Block-fp8 replicas of a bf16 trainer: what each version costs on the wire, on the trainer and on a replica.

A real trainer (fp32 masters, AdamW) publishes every step twice, in the same run of the same weights:
its bf16 cast (the default) and its block-fp8 view (``BlockFp8View``: e4m3 elements and a float32 scale per
128x128 block for every linear weight, the rest bf16). Per version it measures:

- bytes: the bf16 delta, the fp8 delta, and a full fp8 checkpoint (what a full-resync path ships each step);
- sparsity: the fraction of the fp8 tensors' blocks *touched* (a bf16 element changed in them) and of
  blocks whose fp8 bytes or scale changed, next to the fractions of changed bf16 and fp8 elements;
- trainer: the fp8 publisher's diff (quantize every block, compare with the fp8 snapshot) against the bf16
  publisher's diff, against quantizing the whole model alone, and against quantizing only the touched
  blocks' rows of blocks (what a trainer that knew the touched blocks would quantize); and its snapshot;
- replica: the fp8 torch replica's update (fetch, checks, decode, in-place apply) against a full fp8
  reload of the same version (parse the checkpoint, copy it into the replica's tensors), each checked bit
  for bit against the reference quantizer's output of the trainer's weights.

Two models: SmolLM2-135M-Instruct (its 576-wide layers leave edge blocks) and a Qwen3-MoE of random weights
(experts are where the bytes are). Writes ``benchmarks/results/fp8.json`` and prints tables.

    python benchmarks/fp8.py            # 6 steps of each model at lr 3e-6
    python benchmarks/fp8.py --quick    # 2 steps, a smaller MoE (temp dir)
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import human_bytes, machine, median, results_dir, table, write_json  # noqa: E402

from deltasync import Publisher, Subscriber, TorchModuleApplier  # noqa: E402
from deltasync.format import encode_anchor  # noqa: E402
from deltasync.publish.fp8 import BlockFp8View  # noqa: E402
from deltasync.tensors import bits_view, published_tensors  # noqa: E402
from deltasync.tensors.fp8 import BlockFp8, quantize_all, scale_name  # noqa: E402

NO_SIZE_ANCHORS = 1e9  # one anchor, at version 0: every later version is a delta


def bits(t: torch.Tensor) -> torch.Tensor:
    return bits_view(t.detach().contiguous()).reshape(-1)


def block_changes(before: torch.Tensor, after: torch.Tensor, rule: BlockFp8) -> torch.Tensor:
    """Per block of a matrix, whether any element's bits differ (a bool grid)."""
    changed = (bits(before) != bits(after)).view(before.shape).float()
    rows, cols = before.shape
    br, bc = rule.block
    padded = torch.nn.functional.pad(changed, (0, -cols % bc, 0, -rows % br))
    return padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc).amax(dim=(1, 3)) > 0


def touched_quantize_s(weights: dict[str, torch.Tensor], touched: dict[str, torch.Tensor], rule: BlockFp8) -> float:
    """Time to quantize only the rows of blocks that hold a touched block, each run of consecutive such rows in
    one call (all of a tensor in one call where every row is touched, as for the whole model)."""
    started = time.perf_counter()
    br = rule.block[0]
    for name, grid in touched.items():
        rows = grid.any(dim=1).tolist() + [False]
        start = None
        for row, hit in enumerate(rows):
            if hit and start is None:
                start = row
            elif not hit and start is not None:
                rule.quantize(name, weights[name][start * br : row * br])
                start = None
    return time.perf_counter() - started


def full_reload_s(blob: bytes, held: dict[str, torch.Tensor]) -> float:
    """Parse a whole fp8 checkpoint and copy it into the replica's tensors (a full resync's replica side)."""
    import safetensors.torch

    started = time.perf_counter()
    loaded = safetensors.torch.load(blob)
    with torch.no_grad():
        for name, tensor in loaded.items():
            held[name].copy_(tensor)
    return time.perf_counter() - started


def exact(held: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return held.keys() == want.keys() and all(torch.equal(bits(held[n]), bits(want[n])) for n in want)


def run_model(label: str, trainer: Any, steps: int) -> dict[str, Any]:
    """Publish ``steps`` AdamW steps of ``trainer`` in bf16 and in block fp8; measure every version."""
    model = trainer.model
    view = BlockFp8View(model)
    rule = view.rule
    quantized = sorted(view.quantized)
    source = dict(published_tensors(model))
    reference = quantize_all(source, quantized, rule)
    held = {n: torch.zeros_like(t) for n, t in reference.items()}
    fp8_url, bf16_url = f"memory://fp8-{uuid.uuid4().hex}", f"memory://bf16-{uuid.uuid4().hex}"
    numel = sum(t.numel() for t in source.values())
    fp8_numel = sum(source[n].numel() for n in quantized)
    blocks = sum(math.prod(rule.grid(source[n].shape)) for n in quantized)
    rows = []
    with (
        Publisher(view, fp8_url, anchor_ratio=NO_SIZE_ANCHORS, max_span=0) as fp8,
        Publisher(model, bf16_url, anchor_ratio=NO_SIZE_ANCHORS, max_span=0) as bf16,
        Subscriber(fp8_url, TorchModuleApplier(held), ack=False) as replica,
    ):
        for publisher in (fp8, bf16):
            publisher.publish(0, block=True)
            publisher.flush()
        replica.update()
        snapshot_fp8 = fp8.snapshot.nbytes
        snapshot_bf16 = bf16.snapshot.nbytes
        sizes = {n: t.numel() * t.element_size() for n, t in fp8.snapshot.items()}
        snapshot_fp8_tensors = sum(sizes[n] + sizes[scale_name(n)] for n in quantized)
        assert exact(held, reference)
        for step in range(1, steps + 1):
            before = {n: source[n].detach().to(torch.bfloat16).clone() for n in quantized}
            before_view = reference
            loss = trainer.step()
            for publisher in (fp8, bf16):
                publisher.publish(step, block=True)
                publisher.flush()
            info_fp8, info_bf16 = fp8.stats.last, bf16.stats.last
            after = {n: source[n].detach().to(torch.bfloat16) for n in quantized}
            touched = {n: block_changes(before[n], after[n], rule) for n in quantized}
            started = time.perf_counter()
            for n in quantized:  # the same tensors the touched rows come from
                rule.quantize(n, after[n])
            t_whole = time.perf_counter() - started
            reference = quantize_all(source, quantized, rule)
            t_touched = touched_quantize_s(after, touched, rule)
            moved = 0
            for n in quantized:
                element_moved = block_changes(before_view[n], reference[n], rule)
                scale_moved = (bits(before_view[scale_name(n)]) != bits(reference[scale_name(n)])).view(
                    element_moved.shape)
                moved += int((element_moved | scale_moved).sum())
            bf16_changed = sum(int((bits(before[n]) != bits(after[n])).sum()) for n in quantized)
            fp8_changed = sum(int((bits(before_view[n]) != bits(reference[n])).sum()) for n in quantized)
            started = time.perf_counter()
            replica.update()
            t_apply = time.perf_counter() - started
            assert replica.version == fp8.version and exact(held, reference), f"{label} v{step}: not exact"
            anchor = encode_anchor(reference, version=step)
            copy = {n: torch.empty_like(t) for n, t in reference.items()}
            t_reload = min(full_reload_s(anchor, copy) for _ in range(2))
            rows.append({
                "step": step, "loss": loss,
                "bytes_bf16_delta": info_bf16.bytes, "bytes_fp8_delta": info_fp8.bytes,
                "bytes_fp8_checkpoint": len(anchor),
                "blocks_touched": sum(int(t.sum()) for t in touched.values()) / blocks,
                "blocks_moved": moved / blocks,
                "bf16_elements_changed": bf16_changed / fp8_numel,
                "fp8_elements_changed": fp8_changed / fp8_numel,
                "t_diff_fp8": info_fp8.t_diff, "t_diff_bf16": info_bf16.t_diff,
                "t_quantize_whole": t_whole, "t_quantize_touched": t_touched,
                "t_apply_fp8": t_apply, "t_reload_fp8": t_reload, "exact": True,
            })
            print(f"  {label} v{step}: bf16 {human_bytes(info_bf16.bytes)}, fp8 {human_bytes(info_fp8.bytes)}, "
                  f"checkpoint {human_bytes(len(anchor))}; blocks touched {rows[-1]['blocks_touched']:.1%}, "
                  f"moved {rows[-1]['blocks_moved']:.1%}", flush=True)
    return {
        "model": label, "params": numel, "fp8_params": fp8_numel, "fp8_tensors": len(quantized), "blocks": blocks,
        "snapshot_bytes_fp8": snapshot_fp8, "snapshot_bytes_bf16": snapshot_bf16,
        "snapshot_bytes_fp8_tensors": snapshot_fp8_tensors, "snapshot_bytes_fp8_tensors_in_bf16": 2 * fp8_numel,
        "versions": rows,
        "median": {key: median([r[key] for r in rows]) for key in rows[0] if key not in ("step", "exact")},
    }


def report(results: list[dict[str, Any]]) -> str:
    lines = []
    header = ["model", "bf16 delta", "fp8 delta", "fp8 checkpoint", "fp8 delta / checkpoint", "blocks touched",
              "blocks moved", "bf16 changed", "fp8 changed"]
    body = []
    for r in results:
        m = r["median"]
        body.append([
            r["model"], human_bytes(m["bytes_bf16_delta"]), human_bytes(m["bytes_fp8_delta"]),
            human_bytes(m["bytes_fp8_checkpoint"]), f"{m['bytes_fp8_delta'] / m['bytes_fp8_checkpoint']:.3f}",
            f"{m['blocks_touched']:.1%}", f"{m['blocks_moved']:.1%}", f"{m['bf16_elements_changed']:.2%}",
            f"{m['fp8_elements_changed']:.2%}",
        ])
    lines.append("Bytes per version and sparsity (medians over the versions; fp8 tensors only for the fractions)")
    lines.append(table(body, header))
    header = ["model", "trainer: fp8 diff", "bf16 diff", "quantize fp8 tensors", "quantize touched rows",
              "snapshot of fp8 tensors", "same in bf16", "whole snapshot fp8 / bf16", "replica: fp8 update",
              "full fp8 reload (no fetch)"]
    body = []
    for r in results:
        m = r["median"]
        body.append([
            r["model"], f"{1e3 * m['t_diff_fp8']:.0f} ms", f"{1e3 * m['t_diff_bf16']:.0f} ms",
            f"{1e3 * m['t_quantize_whole']:.0f} ms", f"{1e3 * m['t_quantize_touched']:.0f} ms",
            human_bytes(r["snapshot_bytes_fp8_tensors"]), human_bytes(r["snapshot_bytes_fp8_tensors_in_bf16"]),
            f"{human_bytes(r['snapshot_bytes_fp8'])} / {human_bytes(r['snapshot_bytes_bf16'])}",
            f"{1e3 * m['t_apply_fp8']:.0f} ms", f"{1e3 * m['t_reload_fp8']:.0f} ms",
        ])
    lines.append("\nTime per version (medians) and the trainer's snapshot (a full reload also fetches the checkpoint)")
    lines.append(table(body, header))
    text = "\n".join(lines)
    print(text)
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 steps, a smaller MoE, results in a temp dir")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--results", default=None, help="directory for fp8.json (default benchmarks/results)")
    args = parser.parse_args(argv)
    steps = 2 if args.quick else args.steps
    from deltasync.demo.models import smollm2_checkpoint
    from tests.vllm_helpers import Trainer, tiny_qwen3_moe

    smollm2 = smollm2_checkpoint()
    results = []
    with tempfile.TemporaryDirectory() as work:
        moe_dir = tiny_qwen3_moe(
            Path(work) / "moe", smollm2, hidden=256, experts=8 if args.quick else 16, width=176,
            layers=2 if args.quick else 4, heads=4, kv_heads=2, head_dim=64,
        )
        models = [("Qwen3-MoE (random)", moe_dir)] + ([] if args.quick else [("SmolLM2-135M", smollm2)])
        for label, path in models:
            print(f"{label}: {steps} AdamW steps at lr {args.lr:g}, published in bf16 and in block fp8 ...", flush=True)
            results.append(run_model(label, Trainer(path, lr=args.lr, seed=0), steps))
    text = report(results)
    payload = {"benchmark": "fp8", "machine": machine(), "lr": args.lr, "steps": steps, "block": [128, 128],
               "models": results, "table": text}
    path = write_json("fp8", payload, results_dir(args.quick, args.results))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
