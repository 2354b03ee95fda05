"""Payload and codec speed on real deltas: SmolLM2-135M fine-tuned with AdamW at an RL learning rate.

For every optimizer step it measures, on the same change set:

- sparsity, and bytes for dense bf16, for ``raw`` (int32 + bf16, the public TRL
  prototype's layout) and for each compact codec;
- detection + encoding time next to a bare ``torch.ne`` pass over the same
  bf16 tensors (and a bare cast + ``torch.ne`` from the fp32 masters), for the
  fp32 masters (``t_diff``) and for a trainer that already holds bf16 weights
  (``t_diff_bf16``: the very tensors ``torch.ne`` sees, no cast);
- decode (+ validate) and in-place apply time per codec;
- a bit-exact check of a replica that applied every delta (in the default codec), and that every
  other codec's delta of the step decodes to the same new weights;
- the entropy floors of the change set (``_entropy.py``): positions at random
  with the tensor's density plus the steps' order-0 entropy (``floor iid``), and
  the same conditioned on each element's base exponent, which the receiver
  holds (``floor | exponent``), in bytes per changed element next to the codec's.

Every time is the best of several runs on the same inputs (the machine is
shared and noisy); the detection times and their baselines are taken in turns. Writes ``benchmarks/results/payload.json`` and prints a
markdown table.

    python benchmarks/payload.py            # 40 steps at lr 3e-6 (steady state: the last 10)
    python benchmarks/payload.py --quick    # 3 steps
    python benchmarks/payload.py --save-checkpoints /dev/shm/smollm2 --save-from 30   # also keep steps 30-40

``--save-checkpoints`` writes the published (bf16) weights after each step from
``--save-from`` on as ``step-NNNN.safetensors``: real steps for
``device_sync.py --checkpoints``.

Sweeps (``benchmarks/_sweep.py``) compare every layout, the public prototype
layouts and dense baselines included, on the same deltas, against learning
rate (1e-7 ... 1e-4) or optimizer steps between publishes (1, 2, 4, 8), and
write ``payload_lr.json`` / ``payload_interval.json``::

    python benchmarks/payload.py --sweep lr          # 5 learning rates x 4 steps
    python benchmarks/payload.py --sweep interval    # 8 steps, publishing every 1, 2, 4, 8
    python benchmarks/payload.py --sweep lr --quick  # CI: 2-layer model, 1 step per lr (temp dir)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    best_interleaved,
    best_timed,
    human_bytes,
    machine,
    median,
    results_dir,
    table,
    timed,
    write_json,
)
from _entropy import entropy_floors  # noqa: E402

from deltasync.appliers import TorchModuleApplier  # noqa: E402
from deltasync.demo.models import chat_batches, load_smollm2, train_step  # noqa: E402
from deltasync.format import decode, encode_delta  # noqa: E402
from deltasync.publish.diff import Snapshot, diff  # noqa: E402
from deltasync.tensors import bits_view, published_tensors  # noqa: E402

# compact-exp and exp-rice code positions per base exponent: an O(numel) pass per version on both sides (slow links).
CODECS = ["raw", "compact-abs", "compact", "compact-exp", "exp-rice"]
PER_CHANGE = ["compact", "compact-exp", "exp-rice"]  # bytes per changed element, per step
DEFAULT_CODEC = "compact"
REPEATS = 3  # runs per encode / decode timing; the minimum is kept
DETECT_REPEATS = 5  # rounds of the detection timings (ne, cast + ne, diff fp32, diff bf16), taken in turns


def bare_ne(current: dict[str, torch.Tensor], snapshot: Snapshot) -> None:
    for name, tensor in current.items():
        torch.ne(bits_view(tensor), bits_view(snapshot[name]))


def cast_ne(model: torch.nn.Module, snapshot: Snapshot) -> None:
    for name, param in model.named_parameters():
        torch.ne(bits_view(param.detach().to(torch.bfloat16)), bits_view(snapshot[name]))


def measure_step(model: torch.nn.Module, snapshot: Snapshot, applier: TorchModuleApplier, version: int) -> dict[str, Any]:
    """Everything measured for one published version."""
    current = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    times, results = best_interleaved(
        {
            "t_ne": lambda: bare_ne(current, snapshot),
            "t_cast_ne": lambda: cast_ne(model, snapshot),
            "t_diff": lambda: diff(snapshot, model),
            "t_diff_bf16": lambda: diff(snapshot, current),
        },
        DETECT_REPEATS,
    )
    t_ne, t_cast_ne, t_diff, t_diff_bf16 = (times[k] for k in ("t_ne", "t_cast_ne", "t_diff", "t_diff_bf16"))
    changes, changes_bf16 = results["t_diff"], results["t_diff_bf16"]
    if [(c.spec.name, c.nnz) for c in changes_bf16.changes] != [(c.spec.name, c.nnz) for c in changes.changes]:
        raise AssertionError("diff over bf16 weights disagrees with diff over their fp32 masters")
    row: dict[str, Any] = {
        "version": version,
        "numel": changes.numel,
        "nnz": changes.nnz,
        "sparsity": 1 - changes.density,
        "dense_bytes": 2 * changes.numel,
        "t_ne": t_ne,
        "t_cast_ne": t_cast_ne,
        "t_diff": t_diff,
        "t_diff_bf16": t_diff_bf16,
        "codecs": {},
    }
    files = {}
    for codec in CODECS:
        t_enc, data = best_timed(
            lambda: encode_delta(changes, version=version, base_version=version - 1, codec=codec), REPEATS
        )
        t_dec, (header, patches) = best_timed(lambda: decode(data, base=applier.lookup), REPEATS)
        files[codec] = (header, patches)
        row["codecs"][codec] = {"bytes": len(data), "t_encode": t_enc, "t_decode": t_dec}
    header, patches = files[DEFAULT_CODEC]
    agree = all(same_weights(applier, patches, other) for _, other in files.values())
    applier.validate(header)
    row["t_apply"], _ = timed(lambda: applier.apply(patches))
    row["entropy"] = entropy_floors(changes, snapshot)  # against the receiver's base: before advancing
    snapshot.advance(changes)
    row["exact"] = agree and all(
        torch.equal(bits_view(t), bits_view(current[n])) for n, t in applier.state().items()
    )
    return row


def same_weights(applier: TorchModuleApplier, patches: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two decoded deltas of one step give the same new weights (one may carry a tensor whole, the
    other as changes)."""
    if patches.keys() != other.keys():
        return False
    state = applier.state()

    def new_bits(name: str, patch: Any) -> torch.Tensor:
        if patch.indices is None:
            return torch.as_tensor(patch.values).reshape(-1)
        out = bits_view(state[name]).reshape(-1).clone()
        out[torch.as_tensor(patch.indices)] = torch.as_tensor(patch.values)
        return out

    return all(torch.equal(new_bits(n, patches[n]), new_bits(n, other[n])) for n in patches)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    raw = median([r["codecs"]["raw"]["bytes"] for r in rows])
    out: dict[str, Any] = {
        "sparsity": median([r["sparsity"] for r in rows]),
        "dense_bytes": rows[0]["dense_bytes"],
        "t_ne": median([r["t_ne"] for r in rows]),
        "t_cast_ne": median([r["t_cast_ne"] for r in rows]),
        "t_diff": median([r["t_diff"] for r in rows]),
        "t_diff_bf16": median([r["t_diff_bf16"] for r in rows]),
        "t_apply": median([r["t_apply"] for r in rows]),
        "all_exact": all(r["exact"] for r in rows),
        "bytes_per_change": median([r["codecs"][DEFAULT_CODEC]["bytes"] / r["nnz"] for r in rows]),
        "floor_iid_per_change": median([r["entropy"]["iid_per_change"] for r in rows]),
        "floor_exponent_per_change": median([r["entropy"]["exponent_per_change"] for r in rows]),
        "codecs": {},
    }
    # Steady state: the last quarter of the run (steps 31-40 of 40), next to the whole run's medians.
    late = rows[len(rows) - max(1, len(rows) // 4) :]
    out["steady_steps"] = [late[0]["version"], late[-1]["version"]]
    out["steady_bytes_per_change"] = {
        codec: median([r["codecs"][codec]["bytes"] / r["nnz"] for r in late]) for codec in CODECS
    }
    out["steady_floor_exponent_per_change"] = median([r["entropy"]["exponent_per_change"] for r in late])
    for codec in CODECS:
        size = median([r["codecs"][codec]["bytes"] for r in rows])
        t_enc = median([r["codecs"][codec]["t_encode"] for r in rows])
        t_dec = median([r["codecs"][codec]["t_decode"] for r in rows])
        detect_encode = median([r["t_diff"] + r["codecs"][codec]["t_encode"] for r in rows])
        detect_encode_bf16 = median([r["t_diff_bf16"] + r["codecs"][codec]["t_encode"] for r in rows])
        out["codecs"][codec] = {
            "bytes": size,
            "bytes_per_change": median([r["codecs"][codec]["bytes"] / r["nnz"] for r in rows]),
            "vs_raw": size / raw,
            "dense_over": rows[0]["dense_bytes"] / size,
            "t_encode": t_enc,
            "t_decode": t_dec,
            "detect_encode_elems_per_s": rows[0]["numel"] / detect_encode,
            "encode_changed_per_s": median([r["nnz"] for r in rows]) / t_enc,
            "decode_changed_per_s": median([r["nnz"] for r in rows]) / t_dec,
            "speed_vs_ne": out["t_ne"] / detect_encode,
            "speed_vs_cast_ne": out["t_cast_ne"] / detect_encode,
            "speed_vs_ne_bf16": out["t_ne"] / detect_encode_bf16,
        }
    return out


def print_report(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    per_step = table(
        [
            [r["version"], f"{100 * r['sparsity']:.3f} %", human_bytes(r["dense_bytes"]),
             *(human_bytes(r["codecs"][c]["bytes"]) for c in CODECS),
             *(f"{r['codecs'][c]['bytes'] / r['nnz']:.2f}" for c in PER_CHANGE),
             f"{r['entropy']['iid_per_change']:.2f}", f"{r['entropy']['exponent_per_change']:.2f}",
             "yes" if r["exact"] else "NO"]
            for r in rows
        ],
        ["step", "sparsity", "dense bf16", *CODECS, *(f"{c} B/change" for c in PER_CHANGE), "floor iid",
         "floor | exponent", "bit-exact"],
    )
    codecs = table(
        [
            [c, human_bytes(s["bytes"]), f"{s['bytes_per_change']:.2f}",
             f"{summary['steady_bytes_per_change'][c]:.2f}", f"{100 * s['vs_raw']:.1f} %", f"{s['dense_over']:.0f}x",
             f"{s['detect_encode_elems_per_s'] / 1e6:.0f} M/s", f"{s['speed_vs_ne']:.2f}",
             f"{s['speed_vs_cast_ne']:.2f}", f"{s['speed_vs_ne_bf16']:.2f}",
             f"{s['decode_changed_per_s'] / 1e6:.1f} M/s"]
            for c, s in summary["codecs"].items()
        ],
        ["codec", "median bytes", "B/change",
         f"B/change, steps {summary['steady_steps'][0]}-{summary['steady_steps'][1]}", "vs raw", "dense / codec",
         "detect+encode", "speed vs ne",
         "vs cast+ne", "bf16 weights vs ne", "decode (changed/s)"],
    )
    times = table(
        [[f"{1e3 * summary[k]:.1f} ms" for k in ("t_ne", "t_cast_ne", "t_diff", "t_diff_bf16")]
         + [f"{1e3 * summary['codecs'][DEFAULT_CODEC][k]:.1f} ms" for k in ("t_encode", "t_decode")]],
        ["torch.ne (bf16)", "cast + ne", "diff (fp32 masters)", "diff (bf16 weights)",
         f"encode {DEFAULT_CODEC}", f"decode {DEFAULT_CODEC}"],
    )
    report = f"{per_step}\n\n{codecs}\n\n{times}\n"
    print(report)
    return report


def save(args: argparse.Namespace, step: int, model: torch.nn.Module) -> None:
    """With ``--save-checkpoints``: the weights as published after ``step``, from ``--save-from`` on."""
    if args.save_checkpoints and step >= args.save_from:
        from safetensors.torch import save_file

        Path(args.save_checkpoints).mkdir(parents=True, exist_ok=True)
        published = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in published_tensors(model)}
        save_file(published, str(Path(args.save_checkpoints) / f"step-{step:04d}.safetensors"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="3 steps (sweeps: a 2-layer model, fewer points)")
    parser.add_argument("--out", default="payload", help="results file name (without .json)")
    parser.add_argument("--sweep", choices=["lr", "interval"], help="run a payload sweep instead")
    parser.add_argument("--results-dir", help="where to write the JSON (default: results/, quick: a temp dir)")
    parser.add_argument("--save-checkpoints", metavar="DIR", help="write each step's bf16 weights here")
    parser.add_argument("--save-from", type=int, default=0, help="the first step saved (0: the weights before training)")
    args = parser.parse_args(argv)
    if args.sweep:
        import _sweep

        return _sweep.run(args.sweep, quick=args.quick, directory=results_dir(args.quick, args.results_dir))
    steps = 3 if args.quick else args.steps
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)

    print(f"loading SmolLM2-135M-Instruct (fp32 masters), AdamW lr={args.lr}, {steps} steps ...", flush=True)
    model, tokenizer = load_smollm2(dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    batches = chat_batches(tokenizer, args.batch_size)
    snapshot = Snapshot.capture(model)
    replica = {name: t.clone() for name, t in snapshot.items()}
    applier = TorchModuleApplier(replica)

    rows = []
    save(args, 0, model)
    for step in range(1, steps + 1):
        t_train, loss = timed(lambda: train_step(model, optimizer, batches[(step - 1) % len(batches)]))
        row = measure_step(model, snapshot, applier, step)
        row.update(loss=loss, t_train=t_train)
        rows.append(row)
        save(args, step, model)
        c = row["codecs"]
        print(
            f"step {step}/{steps}: loss {loss:.3f}, sparsity {100 * row['sparsity']:.3f} %, "
            f"raw {human_bytes(c['raw']['bytes'])}, compact {human_bytes(c['compact']['bytes'])}, "
            f"diff {1e3 * row['t_diff']:.0f} ms (bf16 weights {1e3 * row['t_diff_bf16']:.0f} ms) "
            f"vs ne {1e3 * row['t_ne']:.0f} ms, exact={row['exact']}",
            flush=True,
        )
    summary = summarize(rows)
    report = print_report(summary, rows)
    path = write_json(args.out, {
        "benchmark": "payload", "model": "SmolLM2-135M-Instruct", "lr": args.lr, "optimizer": "AdamW",
        "master_dtype": "float32", "steps": steps, "machine": machine(), "summary": summary, "rows": rows,
        "table": report,
    }, results_dir(args.quick, args.results_dir))
    print(f"wrote {path}")
    return summary


if __name__ == "__main__":
    main()
