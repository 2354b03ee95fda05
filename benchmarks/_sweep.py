"""Payload sweeps on real training: bytes per published version against learning rate and publish interval.

Both sweeps fine-tune SmolLM2-135M-Instruct (fp32 masters, AdamW, no weight
decay) on the same batches and measure every layout on the very same change
set at every point: dense bf16 (plain, zstd 1 and 3, XOR against the snapshot
+ zstd 1), the two public prototype layouts of :mod:`_baselines`, and every
registered deltasync codec (through :func:`deltasync.format.encode_delta`,
whole-tensor fallback included). Sizes are the lengths of the encoded bytes;
each sparse layout is decoded again and compared with the change set, so a
size is only reported for a layout that carried the delta exactly.

- ``lr``: for each learning rate, the model restarts from the checkpoint and
  publishes after every step. Also records, on a fixed sample of elements, a
  histogram of ``|fp32 update| / bf16 spacing`` and how many elements of each
  bin changed their bf16 value (notebook 01 plots them).
- ``interval``: one run of 8 steps at lr 3e-6; a separate published snapshot
  per interval ``k`` is diffed against the weights every ``k`` optimizer steps.

The JSON is rewritten after every point (``"partial": true`` until the run
ends), so a run stopped early still leaves what it measured.

Quick mode (for CI) keeps the first 2 of the 30 decoder layers (35M of 135M
parameters, the embedding included), batches of 2, one step at each of the
learning rates 1e-6, 1e-5, 1e-4, and intervals 1, 2, 4 over 4 steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _baselines import (
    check_roundtrip,
    dense_file,
    dense_zstd,
    gap16_decode,
    gap16_file,
    rowcol_decode,
    rowcol_zstd,
    xor_zstd,
)
from _common import human_bytes, machine, median, table, timed, write_json

from deltasync.appliers import TorchModuleApplier
from deltasync.codec import codec_names
from deltasync.demo.models import chat_batches, load_smollm2, train_step
from deltasync.format import decode, encode_delta
from deltasync.publish.diff import Snapshot, diff
from deltasync.tensors import ChangeSet, bits_view

LRS = (1e-7, 1e-6, 3e-6, 1e-5, 1e-4)
INTERVAL_LR = 3e-6  # the learning rate of the interval sweep (and of the default payload run)
CODECS = [name for name in codec_names() if name != "dense"]  # "dense" is the automatic whole-tensor fallback
DENSE_LEVELS = (1, 3)
RATIO_EDGES = [x / 2 for x in range(-40, 13)]  # log2(|update| / spacing), bins of half an octave
BF16_MANTISSA = 7

LAYOUTS: dict[str, str] = {
    "dense": "dense bf16 (safetensors checkpoint of every tensor)",
    "dense_zstd1": "dense bf16 + zstd-1 (one frame)",
    "dense_zstd3": "dense bf16 + zstd-3 (one frame)",
    "xor_zstd1": "bits XOR published snapshot, zstd-1 (one frame)",
    "gap16": "uint16 index gaps (escape for gaps >= 65535) + bf16 values, uncompressed (later TRL prototype)",
    "rowcol_zstd1": "row/column delta-coded indices + bf16 values, zstd-1 (PULSE)",
    "raw": "deltasync codec raw: int32 indices + bf16 values (public TRL prototype layout)",
    "compact-abs": "deltasync codec compact-abs: gap-coded indices, absolute values, byte planes, zstd-1",
    "compact": "deltasync codec compact (default): gap-coded indices, base-relative values, byte planes, zstd-1",
}
SHORT = {"dense": "dense", "dense_zstd1": "dense+zstd1", "dense_zstd3": "dense+zstd3", "xor_zstd1": "xor+zstd1",
         "gap16": "u16 gaps", "rowcol_zstd1": "row/col+zstd1", "raw": "raw", "compact-abs": "compact-abs",
         "compact": "compact"}


@dataclass(frozen=True, slots=True)
class Plan:
    """How much of the sweep to run."""

    lrs: tuple[float, ...]
    """Learning rates of the lr sweep."""
    steps_per_lr: int
    """Published versions (one per optimizer step) per learning rate."""
    intervals: tuple[int, ...]
    """Optimizer steps between publishes, for the interval sweep."""
    interval_steps: int
    """Optimizer steps of the interval sweep's single run."""
    layers: int | None
    """Decoder layers kept (``None``: all 30)."""
    batch_size: int
    """Chat pairs per batch."""
    sample: int
    """Elements sampled for the update / spacing histogram."""


FULL = Plan(LRS, steps_per_lr=4, intervals=(1, 2, 4, 8), interval_steps=8, layers=None, batch_size=4, sample=1 << 21)
QUICK = Plan((1e-6, 1e-5, 1e-4), steps_per_lr=1, intervals=(1, 2, 4), interval_steps=4, layers=2, batch_size=2,
             sample=1 << 18)


def load_model(plan: Plan) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]], str]:
    """SmolLM2 with fp32 masters (truncated to ``plan.layers``), its batches and a label."""
    model, tokenizer = load_smollm2(dtype=torch.float32)
    label = "SmolLM2-135M-Instruct"
    if plan.layers is not None:
        total = len(model.model.layers)
        model.model.layers = model.model.layers[: plan.layers]
        model.config.num_hidden_layers = plan.layers
        label += f" (first {plan.layers} of {total} layers)"
    model.train()
    return model, chat_batches(tokenizer, plan.batch_size), label


def bf16_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The published cast of every parameter."""
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def dense_sizes(current: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Dense layouts of the current weights (they do not depend on the base version)."""
    dense = dense_file(current)
    sizes = {"dense": len(dense)}
    for level in DENSE_LEVELS:
        sizes[f"dense_zstd{level}"] = dense_zstd(dense, level)
    return sizes


def check_codec(codec: str, data: bytes, snapshot: Snapshot, changes: ChangeSet) -> None:
    """Decode a delta against the snapshot and require exactly the change set back."""
    base = TorchModuleApplier(dict(snapshot.items()))
    _, patches = decode(data, base=base.lookup)
    if patches.keys() != {c.spec.name for c in changes.changes}:
        raise AssertionError(f"{codec}: decoded tensors differ from the change set")
    for change in changes.changes:
        patch = patches[change.spec.name]
        if change.dense and patch.indices is not None:  # densely changed, carried sparsely where that is smaller
            change = change.as_sparse()
        same_idx = (patch.indices is None) if change.indices is None else (
            patch.indices is not None and np.array_equal(patch.indices, change.indices.numpy()))
        if not (same_idx and np.array_equal(patch.values, change.values.numpy())):
            raise AssertionError(f"{codec}: {change.spec.name} does not round-trip")


def measure(
    snapshot: Snapshot, current: Mapping[str, torch.Tensor], version: int, dense: dict[str, int]
) -> tuple[dict[str, Any], ChangeSet]:
    """Every layout's bytes for the delta snapshot -> ``current``, and the change set (to advance the snapshot)."""
    changes = diff(snapshot, current)
    sizes: dict[str, int] = dict(dense)
    sizes["xor_zstd1"] = xor_zstd(snapshot, current)
    for codec in CODECS:
        data = encode_delta(changes, version=version, base_version=version - 1, codec=codec)
        check_codec(codec, data, snapshot, changes)
        sizes[codec] = len(data)
    dense_tensors = sum(c.dense for c in changes.changes)
    sparse = diff(snapshot, current, dense_fraction=1.0) if dense_tensors else changes
    gap16 = gap16_file(sparse)
    check_roundtrip("gap16", gap16_decode(gap16), sparse)
    rowcol = rowcol_zstd(sparse)
    check_roundtrip("rowcol_zstd1", rowcol_decode(rowcol), sparse)
    sizes["gap16"], sizes["rowcol_zstd1"] = len(gap16), len(rowcol)
    del sparse, gap16, rowcol
    point = {
        "version": version,
        "numel": changes.numel,
        "nnz": changes.nnz,
        "sparsity": 1 - changes.density,
        "dense_tensors": dense_tensors,
        "bytes": {key: sizes[key] for key in LAYOUTS},
    }
    return point, changes


class UpdateSampler:
    """A fixed random sample of fp32 master elements, to relate update sizes to bf16 spacing."""

    def __init__(self, model: torch.nn.Module, size: int) -> None:
        params = dict(model.named_parameters())
        total = sum(p.numel() for p in params.values())
        generator = torch.Generator().manual_seed(0)
        self._picks = {
            name: torch.randint(0, p.numel(), (max(1, round(size * p.numel() / total)),), generator=generator)
            for name, p in params.items()
        }
        self._params = params

    def take(self) -> torch.Tensor:
        """Current fp32 values of the sampled elements."""
        return torch.cat([self._params[n].detach().view(-1)[i] for n, i in self._picks.items()])


def update_histogram(before: torch.Tensor, after: torch.Tensor) -> dict[str, Any]:
    """Histogram of ``log2(|update| / spacing)`` and, per bin, how many bf16 values changed.

    The spacing is the distance between adjacent bf16 values at the published
    (bf16) value before the step: ``2**(floor(log2|x|) - 7)``.
    """
    published = before.to(torch.bfloat16)
    changed = bits_view(after.to(torch.bfloat16)) != bits_view(published)
    keep = published != 0
    update = (after - before)[keep].double().abs()
    _, exponent = torch.frexp(published[keep].double())
    spacing = torch.pow(2.0, (exponent - 1 - BF16_MANTISSA).double())
    moved = update > 0
    ratio = torch.log2(update[moved] / spacing[moved]).clamp(RATIO_EDGES[0], RATIO_EDGES[-1] - 1e-9)
    bins = torch.bucketize(ratio, torch.tensor(RATIO_EDGES, dtype=torch.float64), right=True) - 1
    width = len(RATIO_EDGES) - 1
    count = torch.bincount(bins, minlength=width)
    hit = torch.bincount(bins, weights=changed[keep][moved].double(), minlength=width)
    return {
        "count": count.tolist(),
        "changed": [int(x) for x in hit.tolist()],
        "unmoved": int((~moved).sum()),
        "zero_weight": int((~keep).sum()),
        "sampled": int(before.numel()),
        "sample_changed": int(changed.sum()),
    }


def weight_histogram(model: torch.nn.Module) -> dict[str, Any]:
    """Histogram of ``log2 |w|`` over every published weight (integer octaves), and the count of exact zeros."""
    counts: dict[int, int] = {}
    zeros = 0
    for p in model.parameters():
        w = p.detach().to(torch.bfloat16).float().abs()
        zeros += int((w == 0).sum())
        _, exponent = torch.frexp(w[w > 0])
        values, n = torch.unique(exponent - 1, return_counts=True)
        for v, c in zip(values.tolist(), n.tolist()):
            counts[v] = counts.get(v, 0) + c
    octaves = sorted(counts)
    return {"log2_floor": octaves, "count": [counts[o] for o in octaves], "zeros": zeros}


def run_lr(plan: Plan, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Bytes per version against learning rate; every learning rate restarts from the checkpoint."""
    model, batches, label = load_model(plan)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = weight_histogram(model)  # of the checkpoint, before any step
    sampler = UpdateSampler(model, plan.sample)
    points: list[dict[str, Any]] = []

    def finish(points: list[dict[str, Any]], partial: bool = True) -> dict[str, Any]:
        done = [lr for lr in plan.lrs if any(p["lr"] == lr for p in points)]
        summary = [_summarize(lr, [p for p in points if p["lr"] == lr], "lr") for lr in done]
        result = _result("payload_lr", plan, label, points, summary, partial)
        result.update(lrs=done, steps_per_lr=plan.steps_per_lr, ratio_edges=RATIO_EDGES, weight_hist=weights)
        return result

    for lr in plan.lrs:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        snapshot = Snapshot.capture(model)
        for step in range(1, plan.steps_per_lr + 1):
            before = sampler.take()
            t_train, loss = timed(lambda: train_step(model, optimizer, batches[(step - 1) % len(batches)]))
            hist = update_histogram(before, sampler.take())
            current = bf16_weights(model)
            point, changes = measure(snapshot, current, step, dense_sizes(current))
            snapshot.advance(changes)
            points.append({"lr": lr, "step": step, "loss": loss, "t_train": t_train, **point, "update_hist": hist})
            _log(f"lr {lr:g} step {step}", point)
            save(finish(points))
    return finish(points, partial=False)


def run_interval(plan: Plan, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Bytes per version against optimizer steps between publishes, all intervals on one training run."""
    model, batches, label = load_model(plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INTERVAL_LR, weight_decay=0.0)
    snapshots = {k: Snapshot.capture(model) for k in plan.intervals}
    points: list[dict[str, Any]] = []

    def finish(points: list[dict[str, Any]], partial: bool = True) -> dict[str, Any]:
        done = [k for k in plan.intervals if any(p["interval"] == k for p in points)]
        summary = [_summarize(k, [p for p in points if p["interval"] == k], "interval") for k in done]
        result = _result("payload_interval", plan, label, points, summary, partial)
        result.update(lr=INTERVAL_LR, intervals=done, steps=plan.interval_steps)
        return result

    for step in range(1, plan.interval_steps + 1):
        t_train, loss = timed(lambda: train_step(model, optimizer, batches[(step - 1) % len(batches)]))
        due = [k for k in plan.intervals if step % k == 0]
        current = bf16_weights(model)
        dense = dense_sizes(current)  # shared by every interval publishing at this step
        for k in due:
            point, changes = measure(snapshots[k], current, step // k, dense)
            snapshots[k].advance(changes)
            points.append({"interval": k, "step": step, "loss": loss, "t_train": t_train, **point})
            _log(f"step {step} interval {k}", point)
        save(finish(points))
    return finish(points, partial=False)


def _log(where: str, point: dict[str, Any]) -> None:
    b = point["bytes"]
    print(f"{where}: sparsity {100 * point['sparsity']:.3f} %, raw {human_bytes(b['raw'])}, "
          f"compact {human_bytes(b['compact'])}, xor+zstd {human_bytes(b['xor_zstd1'])}", flush=True)


def _summarize(key: float, points: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    return {
        name: key,
        "points": len(points),
        "sparsity": median([p["sparsity"] for p in points]),
        "nnz": median([p["nnz"] for p in points]),
        "min_sparsity": min(p["sparsity"] for p in points),
        "dense_tensors": median([p["dense_tensors"] for p in points]),
        "bytes": {layout: median([p["bytes"][layout] for p in points]) for layout in LAYOUTS},
    }


def _result(name: str, plan: Plan, label: str, points: list[dict[str, Any]], summary: list[dict[str, Any]],
            partial: bool) -> dict[str, Any]:
    return {
        "benchmark": name,
        "partial": partial,
        "model": label,
        "quick": plan.layers is not None,
        "optimizer": "AdamW",
        "weight_decay": 0.0,
        "master_dtype": "float32",
        "batch_size": plan.batch_size,
        "numel": points[0]["numel"],
        "layouts": LAYOUTS,
        "machine": machine(),
        "summary": summary,
        "points": points,
    }


def report(result: dict[str, Any]) -> str:
    """Median bytes per version of every layout (rows) at every sweep value (columns)."""
    key = "lr" if result["benchmark"] == "payload_lr" else "interval"
    cols = [s[key] for s in result["summary"]]
    head = [f"lr {c:g}" if key == "lr" else f"every {c} step{'s' if c > 1 else ''}" for c in cols]
    rows = [["sparsity", *(f"{100 * s['sparsity']:.2f} %" for s in result["summary"])]]
    rows += [[SHORT[layout], *(human_bytes(s["bytes"][layout]) for s in result["summary"])] for layout in LAYOUTS]
    rows += [["compact vs raw", *(f"{s['bytes']['compact'] / s['bytes']['raw']:.2f}" for s in result["summary"])]]
    text = table(rows, ["layout (median bytes / version)", *head])
    print(text)
    return text


def run(sweep: str, *, quick: bool, directory: Path) -> dict[str, Any]:
    """Run one sweep, print its table and write ``payload_<sweep>.json`` into ``directory``."""
    plan = QUICK if quick else FULL
    torch.manual_seed(0)
    name = f"payload_{sweep}"

    def save(partial: dict[str, Any]) -> None:  # after every point: a long run that dies still leaves its data
        write_json(name, partial, directory)

    t_total, result = timed(lambda: (run_lr if sweep == "lr" else run_interval)(plan, save))
    result["t_total_s"] = round(t_total, 1)
    result["table"] = report(result)
    path = write_json(result["benchmark"], result, directory)
    print(f"wrote {path} in {t_total:.0f} s")
    return result

