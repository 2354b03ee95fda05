"""Publish and apply throughput on synthetic bf16 models from 10M to 1B parameters.

For each model size and density (fraction of elements changed) it times, on
the package's own code paths:

- publish: :func:`deltasync.publish.diff.snapshot.diff` of the live bf16 weights against a
  :class:`~deltasync.publish.diff.snapshot.Snapshot`, then :func:`deltasync.format.encode_delta`
  (index and value coding, zstd, the safetensors container) per codec;
- apply: what a subscriber does with the file: ``read_header``, the applier's
  ``validate``, ``decode`` (with the base lookup base-relative codecs need)
  and :class:`~deltasync.appliers.TorchModuleApplier`'s in-place ``apply``;

next to bare memory passes over the same tensors in the same run: ``torch.ne``
over every weight (what any exact change detection must at least read) and
``index_copy_`` and ``index_put_`` of the changed elements from ready-made
index and value tensors (what any in-place apply must at least write; the
applier picks between the two kernels by density, :func:`deltasync.tensors.write_at`).

The synthetic model is Llama-shaped (per layer: q, k, v, o of ``h x h``, gate,
up, down of ``h x 8h/3``, two norms); a changed element moves by one bf16 step
up or down, like most real RL updates. Each time is the median of several
rounds (9 up to 100M parameters, 5 above), the stages taken in turns, with the
fastest and slowest round beside it (``t_min``, ``t_max``). Keeps three model copies alive at most
(published snapshot, live weights, replica): 6 GB at 1B parameters.

Writes ``benchmarks/results/throughput.json`` with per-point times, elements
per second, and fitted per-element constants (``constants``: ns per model
element and ns per changed element of each stage) for scaling projections.

    python benchmarks/throughput.py            # 10M, 100M, 300M, 1B x 0.1, 1, 10 %
    python benchmarks/throughput.py --quick    # 10M, 30M x 0.1, 1 % (CI)
    python benchmarks/throughput.py --sizes 1B --merge   # measure one size into an existing result
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import human_bytes, machine, median, results_dir, table, timed, write_json  # noqa: E402

from deltasync.appliers import TorchModuleApplier  # noqa: E402
from deltasync.format import decode, encode_delta, read_header  # noqa: E402
from deltasync.publish.diff import Snapshot, diff
from deltasync.tensors import (
    ChangeSet,  # noqa: E402
    bits_view,  # noqa: E402
)

HIDDEN = {"10M": 512, "30M": 768, "100M": 1024, "300M": 1536, "1B": 2048}
LAYERS = {"10M": 3, "30M": 4, "100M": 8, "300M": 11, "1B": 20}
DENSITIES = (0.001, 0.01, 0.1)
CODECS = ("compact", "raw")
STAGES = ("ne", "diff", "encode", "decode", "apply", "index_copy", "index_put")


def synthetic_model(size: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Llama-shaped bf16 model (no embedding): ``LAYERS[size]`` layers of hidden ``HIDDEN[size]``."""
    h = HIDDEN[size]
    f = 8 * h // 3
    shapes = {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "gate": (f, h), "up": (f, h), "down": (h, f),
              "in_norm": (h,), "post_norm": (h,)}
    generator = torch.Generator().manual_seed(seed)
    model = {}
    for layer in range(LAYERS[size]):
        for name, shape in shapes.items():
            noise = torch.randn(shape, generator=generator)
            w = noise * 0.02 if len(shape) > 1 else 1 + 0.1 * noise  # matrices ~ N(0, 0.02), norms ~ 1
            model[f"layers.{layer}.{name}.weight"] = w.to(torch.bfloat16)
    return model


def perturb(live: dict[str, torch.Tensor], published: dict[str, torch.Tensor], density: float, seed: int) -> None:
    """Reset ``live`` to ``published``, then move a random ``density`` of elements one bf16 step up or down."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in live.items():
        bits = bits_view(tensor).view(-1)
        bits.copy_(bits_view(published[name]).view(-1))
        mask = torch.rand(bits.numel(), generator=generator) < density
        where = mask.nonzero().view(-1)
        step = torch.randint(0, 2, (where.numel(),), generator=generator, dtype=torch.int16) * 2 - 1
        bits.index_add_(0, where, step)


def bare_ne(live: dict[str, torch.Tensor], published: dict[str, torch.Tensor]) -> None:
    for name, tensor in live.items():
        torch.ne(bits_view(tensor), bits_view(published[name]))


def bare_index_copy(replica: dict[str, torch.Tensor], changes: ChangeSet) -> None:
    for change in changes.changes:
        assert change.indices is not None
        bits_view(replica[change.spec.name]).view(-1).index_copy_(0, change.indices, change.values)


def bare_index_put(replica: dict[str, torch.Tensor], changes: ChangeSet) -> None:
    for change in changes.changes:
        assert change.indices is not None
        bits_view(replica[change.spec.name]).view(-1).index_put_((change.indices,), change.values)


def receive(data: bytes, replica: TorchModuleApplier, base: TorchModuleApplier) -> tuple[Any, dict[str, Any]]:
    """A subscriber's checks and decoding: header, validation against the replica, full decode."""
    header = read_header(data)
    replica.validate(header)
    return decode(data, base=base.lookup, header=header)


def _round(r: int, snapshot: Snapshot, live: dict[str, torch.Tensor], published: dict[str, torch.Tensor],
           replica: dict[str, torch.Tensor], target: TorchModuleApplier, base: TorchModuleApplier,
           times: dict[str, list[float]], sizes: dict[str, int]) -> tuple[int, int, bool]:
    """One round of every stage, in turns; returns (changed, parameters, replica bit-exact after its first apply)."""
    times["ne"].append(timed(lambda: bare_ne(live, published))[0])
    t, changes = timed(lambda: diff(snapshot, live))
    times["diff"].append(t)
    exact = True
    for codec in CODECS:
        t, data = timed(lambda: encode_delta(changes, version=1, base_version=0, codec=codec))  # noqa: B023
        times[f"encode_{codec}"].append(t)
        sizes[codec] = len(data)
        t, (_, decoded) = timed(lambda: receive(data, target, base))  # noqa: B023
        times[f"decode_{codec}"].append(t)
        if codec == CODECS[0]:  # apply the default codec's patches; the next codec's replace them in memory
            times["apply"].append(timed(lambda: target.apply(decoded))[0])  # noqa: B023
            if r == 0:  # the replica started at the published weights: it must now equal the live ones
                exact = all(torch.equal(bits_view(replica[n]), bits_view(live[n])) for n in live)
            times["index_copy"].append(timed(lambda: bare_index_copy(replica, changes))[0])
            times["index_put"].append(timed(lambda: bare_index_put(replica, changes))[0])
        decoded = data = None  # type: ignore[assignment]  # free before the next codec allocates
    return changes.nnz, changes.numel, exact


def measure(size: str, published: dict[str, torch.Tensor], live: dict[str, torch.Tensor],
            replica: dict[str, torch.Tensor], density: float, rounds: int) -> dict[str, Any]:
    """Median stage times at one (size, density) point, the stages taken in turns each round."""
    perturb(live, published, density, seed=int(density * 1e6))
    for name, tensor in replica.items():
        tensor.copy_(published[name])
    snapshot = Snapshot(published)
    target, base = TorchModuleApplier(replica), TorchModuleApplier(published)
    times: dict[str, list[float]] = {k: [] for k in ("ne", "diff", "index_copy", "index_put", "apply")}
    times.update({f"{stage}_{c}": [] for stage in ("encode", "decode") for c in CODECS})
    sizes: dict[str, int] = {}
    exact = True
    for r in range(rounds):
        nnz, numel, ok = _round(r, snapshot, live, published, replica, target, base, times, sizes)
        exact = exact and ok
        gc.collect()
    med = {k: median(v) for k, v in times.items()}
    return {"size": size, "numel": numel, "tensors": len(published), "density": density, "nnz": nnz,
            "exact": exact, "bytes": sizes, "t": med, "t_min": {k: min(v) for k, v in times.items()},
            "t_max": {k: max(v) for k, v in times.items()},
            "rounds": rounds, **_rates(med, numel, nnz)}


def _rates(t: dict[str, float], numel: int, nnz: int) -> dict[str, Any]:
    c = CODECS[0]
    publish, apply = t["diff"] + t[f"encode_{c}"], t[f"decode_{c}"] + t["apply"]
    return {
        "publish_s": publish,
        "receive_s": apply,
        "publish_elems_per_s": numel / publish,
        "receive_elems_per_s": numel / apply,
        "ne_elems_per_s": numel / t["ne"],
        "diff_elems_per_s": numel / t["diff"],
        "encode_changed_per_s": {k: nnz / t[f"encode_{k}"] for k in CODECS},
        "decode_changed_per_s": {k: nnz / t[f"decode_{k}"] for k in CODECS},
        "apply_changed_per_s": nnz / t["apply"],
        "index_copy_changed_per_s": nnz / t["index_copy"],
        "index_put_changed_per_s": nnz / t["index_put"],
        "publish_vs_ne": t["ne"] / publish,
        "apply_vs_index_copy": t["index_copy"] / t["apply"],
        "apply_vs_index_put": t["index_put"] / t["apply"],
    }


# Which terms each stage's time is fitted with: per model element, per changed element, fixed per delta.
_TERMS = {"ne": ("numel",), "diff": ("numel", "nnz")}
_DEFAULT_TERMS = ("nnz", "fixed")


def _fit(rows: list[dict[str, Any]], stage: str, times: str) -> dict[str, float]:
    """Least squares over :data:`_TERMS`, dropping any term whose coefficient comes out negative (noise)."""
    terms = list(_TERMS.get(stage, _DEFAULT_TERMS))
    y = np.array([r[times][stage] for r in rows])
    while True:
        x = np.array([[1.0 if t == "fixed" else float(r[t]) for t in terms] for r in rows])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        if len(terms) == 1 or (coef >= 0).all():
            break
        terms.pop(int(np.argmin(coef)))
    got = dict(zip(terms, coef))
    return {"ns_per_element": 1e9 * got.get("numel", 0.0), "ns_per_changed": 1e9 * got.get("nnz", 0.0),
            "fixed_s": got.get("fixed", 0.0)}


def fit_constants(rows: list[dict[str, Any]], times: str = "t") -> dict[str, Any]:
    """Per-stage constants: ns per model element, ns per changed element, fixed seconds per delta.

    Fitted on the points of 100M parameters and more, where fixed per-call
    costs no longer dominate. The comparison (``ne``) is fitted per element,
    the diff per element and per change, every other stage per change plus a
    fixed cost; a term that comes out negative is dropped and the rest refitted.
    ``times`` is ``"t"`` (medians) or ``"t_min"`` (minimums: the least disturbed
    by other work on a shared machine).
    """
    big = [r for r in rows if r["numel"] >= 50_000_000] or rows
    stages = ["ne", "diff", "index_copy", "index_put", "apply"]
    stages += [f"{s}_{c}" for s in ("encode", "decode") for c in CODECS]
    out: dict[str, Any] = {"fitted_on": sorted({r["size"] for r in big}, key=lambda s: HIDDEN[s])}
    out.update({stage: _fit(big, stage, times) for stage in stages})
    return out


def per_element(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Plain ratios at the largest model, per density: the passes over every weight per parameter, the rest per change.

    The cost of a changed element depends on the density (at 10 % every cache
    line holds a few changes, at 0.1 % each change is a miss of its own), so
    projections should take the ratios at the density they assume.
    """
    top = max(r["numel"] for r in rows)
    out: dict[str, Any] = {"size": next(r["size"] for r in rows if r["numel"] == top), "by_density": {}}
    for r in sorted((r for r in rows if r["numel"] == top), key=lambda r: r["density"]):
        for kind, times in (("median", r["t"]), ("min", r["t_min"])):
            ratios = {"ne_ns_per_element": 1e9 * times["ne"] / r["numel"],
                      "diff_ns_per_element": 1e9 * times["diff"] / r["numel"],
                      "apply_ns_per_changed": 1e9 * times["apply"] / r["nnz"],
                      "index_copy_ns_per_changed": 1e9 * times["index_copy"] / r["nnz"],
                      "index_put_ns_per_changed": 1e9 * times["index_put"] / r["nnz"]}
            for c in CODECS:
                ratios[f"encode_{c}_ns_per_changed"] = 1e9 * times[f"encode_{c}"] / r["nnz"]
                ratios[f"decode_{c}_ns_per_changed"] = 1e9 * times[f"decode_{c}"] / r["nnz"]
            out["by_density"].setdefault(str(r["density"]), {})[kind] = ratios
    return out


def report(rows: list[dict[str, Any]]) -> str:
    c = CODECS[0]
    text = table(
        [[r["size"], f"{100 * r['density']:g} %", f"{1e3 * r['t']['ne']:.0f}", f"{1e3 * r['t']['diff']:.0f}",
          f"{1e3 * r['t'][f'encode_{c}']:.0f}", f"{1e3 * r['t'][f'decode_{c}']:.0f}", f"{1e3 * r['t']['apply']:.0f}",
          f"{1e3 * r['t']['index_copy']:.0f}", f"{1e3 * r['t']['index_put']:.0f}",
          f"{r['publish_elems_per_s'] / 1e6:.0f} M/s",
          f"{r['receive_elems_per_s'] / 1e6:.0f} M/s", human_bytes(r["bytes"][c]), "yes" if r["exact"] else "NO"]
         for r in rows],
        ["model", "changed", "torch.ne ms", "diff ms", f"encode {c} ms", f"decode {c} ms", "apply ms",
         "index_copy_ ms", "index_put_ ms", "publish (elems/s)", "receive (elems/s)", f"{c} bytes", "bit-exact"],
    )
    print(text)
    return text


def run_size(size: str, densities: tuple[float, ...], rounds: int, done: Callable[[dict[str, Any]], None]) -> None:
    """Measure one model size at every density, handing each finished row to ``done``."""
    published = synthetic_model(size)
    live = {n: t.clone() for n, t in published.items()}
    replica = {n: t.clone() for n, t in published.items()}
    for density in densities:
        t, row = timed(lambda: measure(size, published, live, replica, density, rounds))
        print(f"{size} ({row['numel'] / 1e6:.0f}M) at {100 * density:g} %: diff {1e3 * row['t']['diff']:.0f} ms, "
              f"encode {1e3 * row['t']['encode_compact']:.0f} ms, decode {1e3 * row['t']['decode_compact']:.0f} ms, "
              f"apply {1e3 * row['t']['apply']:.0f} ms, ne {1e3 * row['t']['ne']:.0f} ms, "
              f"index_copy {1e3 * row['t']['index_copy']:.0f} ms, index_put {1e3 * row['t']['index_put']:.0f} ms "
              f"({t:.0f} s)", flush=True)
        done(row)


def summarize(rows: list[dict[str, Any]], quick: bool, partial: bool) -> dict[str, Any]:
    """The JSON document: rows, fitted constants, machine, table."""
    constants = {
        "about": "fit: per stage, t = ns_per_element * parameters + ns_per_changed * changed elements + fixed_s "
                 "(seconds), fitted on the median times of the models of 100M parameters and more; fit_min: the "
                 "same over the minimum times (least disturbed by other load); largest_model: plain ratios at the "
                 "largest model for each density (ne and diff per parameter, the rest per changed element), from "
                 "median and from minimum times; the cost per change depends on density. Stages: ne = bare "
                 "torch.ne, diff = deltasync.publish.diff.snapshot.diff, encode_<codec> = "
                 "encode_delta, decode_<codec> = read_header + validate + decode, apply = TorchModuleApplier.apply, "
                 "index_copy = bare index_copy_, index_put = bare index_put_.",
        "fit": fit_constants(rows),
        "fit_min": fit_constants(rows, "t_min"),
        "largest_model": per_element(rows),
    }
    return {"benchmark": "throughput", "quick": quick, "partial": partial, "codecs": list(CODECS),
            "densities": sorted({r["density"] for r in rows}), "value_change": "+-1 bf16 step",
            "threads": torch.get_num_threads(), "machine": machine(), "constants": constants, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(HIDDEN), default=["10M", "100M", "300M", "1B"])
    parser.add_argument("--densities", nargs="+", type=float, default=list(DENSITIES), help="fractions changed")
    parser.add_argument("--quick", action="store_true", help="10M and 30M, densities 0.1 and 1 %%, 2 rounds")
    parser.add_argument("--results-dir", help="where to write throughput.json (default: results/, quick: a temp dir)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of other sizes already in throughput.json (sizes measured in another run)")
    args = parser.parse_args(argv)
    sizes, densities = (["10M", "30M"], DENSITIES[:2]) if args.quick else (args.sizes, tuple(args.densities))
    folder = results_dir(args.quick, args.results_dir)
    rows: list[dict[str, Any]] = []
    if args.merge and (folder / "throughput.json").exists():
        rows = [r for r in json.loads((folder / "throughput.json").read_text())["rows"] if r["size"] not in sizes]

    def done(row: dict[str, Any]) -> None:  # rewrite the JSON after every point: a run that dies keeps its data
        row["run"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        rows.append(row)
        rows.sort(key=lambda r: (r["numel"], r["density"]))
        write_json("throughput", summarize(rows, args.quick, partial=True), folder)

    t_total, _ = timed(lambda: [
        run_size(size, densities, 2 if args.quick else (5 if HIDDEN[size] >= 1536 else 9), done) for size in sizes
    ])
    result = summarize(rows, args.quick, partial=False)
    result.update(table=report(rows), t_total_s=round(t_total, 1))
    path = write_json("throughput", result, folder)
    print(f"wrote {path} in {t_total:.0f} s")
    return result


if __name__ == "__main__":
    main()
