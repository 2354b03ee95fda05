"""Projections for large models from the constants the other benchmarks measured.

Reads ``results/throughput.json`` (per-element costs of diff, encode, decode and
apply on the largest synthetic model, by density), ``results/payload.json``
(bytes per changed element of the ``compact`` codec on real SmolLM2-135M
deltas) and, when present, ``results/sharded.json`` (publish cost by rank
count). Applies the formulas of ``docs/SCALING.md`` to 7B, 70B and 1T
parameters and prints the table the document shows; ``--density``, the rank
counts and the bandwidths are assumptions, stated in the output.

    python benchmarks/scaling.py
    python benchmarks/scaling.py --density 0.02 --up-gbps 25 --down-gbps 25
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from _common import RESULTS, human_bytes, machine, table, write_json  # noqa: E402

MODELS = {"7B": (7e9, 8), "70B": (70e9, 64), "1T": (1e12, 512)}  # parameters, trainer ranks publishing
HBM_BYTES_PER_S = 2.0e12  # a current datacenter GPU's memory bandwidth, for the bandwidth-bound estimate
DIFF_BYTES_PER_PARAM = 6  # the diff reads the fp32 master (4 B) and the published bf16 snapshot (2 B)
NCCL_BYTES_PER_S = 50e9  # 400 Gb/s InfiniBand per node: a dense broadcast inside one cluster


def constants(density: float) -> dict[str, float]:
    """Measured per-element constants (ns) at the density closest to ``density``, and bytes per change."""
    throughput = json.loads((RESULTS / "throughput.json").read_text())
    by_density = throughput["constants"]["largest_model"]["by_density"]
    nearest = min(by_density, key=lambda d: abs(float(d) - density))
    measured = by_density[nearest]["min"]
    payload = json.loads((RESULTS / "payload.json").read_text())["summary"]
    changed = payload["dense_bytes"] / 2 * (1 - payload["sparsity"])
    return {
        "density_measured": float(nearest),
        "model_measured": throughput["constants"]["largest_model"]["size"],
        "diff_ns_per_param": measured["diff_ns_per_element"],
        "ne_ns_per_param": measured["ne_ns_per_element"],
        "encode_ns_per_change": measured["encode_compact_ns_per_changed"],
        "decode_ns_per_change": measured["decode_compact_ns_per_changed"],
        "apply_ns_per_change": measured["apply_ns_per_changed"],
        "bytes_per_change": payload["codecs"]["compact"]["bytes"] / changed,
        "raw_bytes_per_change": payload["codecs"]["raw"]["bytes"] / changed,
    }


def project(n: float, ranks: int, density: float, c: dict[str, float], up: float, down: float) -> dict[str, float]:
    """The formulas of docs/SCALING.md for one model."""
    changed = n * density
    delta = changed * c["bytes_per_change"]
    return {
        "params": n,
        "ranks": ranks,
        "delta_bytes": delta,
        "raw_bytes": changed * c["raw_bytes_per_change"],
        "dense_bytes": 2 * n,
        "stall_cpu_s": n / ranks * c["diff_ns_per_param"] * 1e-9,
        "stall_gpu_s": n / ranks * DIFF_BYTES_PER_PARAM / HBM_BYTES_PER_S,
        "encode_s": changed / ranks * c["encode_ns_per_change"] * 1e-9,
        "upload_s": delta / ranks / up,
        "replica_fetch_s": delta / down,
        "replica_decode_s": changed * c["decode_ns_per_change"] * 1e-9,
        "replica_pause_s": changed * c["apply_ns_per_change"] * 1e-9,
        "full_upload_s": 2 * n / ranks / up,
        "full_fetch_s": 2 * n / down,
        "nccl_dense_s": 2 * n / NCCL_BYTES_PER_S,
    }


def _s(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--density", type=float, default=0.01, help="fraction of bf16 elements changed per version")
    parser.add_argument("--up-gbps", type=float, default=10.0, help="upload bandwidth per trainer rank, Gb/s")
    parser.add_argument("--down-gbps", type=float, default=10.0, help="download bandwidth per replica node, Gb/s")
    args = parser.parse_args()
    up, down = args.up_gbps * 1e9 / 8, args.down_gbps * 1e9 / 8
    c = constants(args.density)
    rows, out = [], {}
    for name, (n, ranks) in MODELS.items():
        p = project(n, ranks, args.density, c, up, down)
        out[name] = p
        publish = p["stall_cpu_s"] + p["encode_s"] + p["upload_s"]
        replica = p["replica_fetch_s"] + p["replica_decode_s"] + p["replica_pause_s"]
        rows.append([
            name, ranks, human_bytes(p["delta_bytes"]), human_bytes(p["raw_bytes"]), human_bytes(p["dense_bytes"]),
            f"{_s(p['stall_cpu_s'])} / {_s(p['stall_gpu_s'])}", _s(publish), _s(replica), _s(p["replica_pause_s"]),
            _s(p["full_upload_s"] + p["full_fetch_s"]), _s(p["nccl_dense_s"]),
        ])
    sharded = RESULTS / "sharded.json"
    payload: dict[str, Any] = {
        "machine": machine(),
        "assumptions": {
            "density": args.density, "up_gbps_per_rank": args.up_gbps, "down_gbps_per_node": args.down_gbps,
            "hbm_bytes_per_s": HBM_BYTES_PER_S, "nccl_bytes_per_s": NCCL_BYTES_PER_S,
            "ranks": {k: v[1] for k, v in MODELS.items()},
        },
        "constants": c,
        "projections": out,
        "sharded_measured": json.loads(sharded.read_text())["worlds"] if sharded.exists() else None,
    }
    path = write_json("scaling", payload)
    print(f"density {100 * args.density:g} %, {args.up_gbps:g} Gb/s up per rank, {args.down_gbps:g} Gb/s down per node;")
    print(f"constants measured on {c['model_measured']} parameters at {100 * c['density_measured']:g} % changed "
          f"(CPU, {machine()['cores']} cores), bytes per change from real SmolLM2 deltas: "
          f"{c['bytes_per_change']:.2f} (raw {c['raw_bytes_per_change']:.0f})")
    print(table(rows, [
        "model", "trainer ranks", "delta / version", "raw layout", "dense bf16", "stall: CPU measured / GPU est.",
        "publish to committed", "replica: fetch+decode+apply", "replica pause", "full checkpoint via store",
        "NCCL dense broadcast (in-cluster)",
    ]))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
