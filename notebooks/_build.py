"""Build the benchmark notebooks from the cells below, and execute them in place (full mode).

    python notebooks/_build.py            # write and execute the notebooks below (outputs committed)
    python notebooks/_build.py --only 04  # write and execute one of them
    python notebooks/_build.py --no-run   # write them without outputs

Notebooks 01, 02 and 04 are built here; 03 (end to end) is edited and executed as a notebook.

Each notebook reads ``DELTASYNC_NOTEBOOK_QUICK``: ``1`` keeps it under a minute
(it loads the committed results and runs only small live computations), ``0``
(the default) runs the full live computations and writes the README figures.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''\
import json, os, tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

QUICK = os.environ.get("DELTASYNC_NOTEBOOK_QUICK", "0") == "1"
ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "benchmarks" / "results").is_dir())
RESULTS = Path(os.environ.get("DELTASYNC_RESULTS", ROOT / "benchmarks" / "results"))  # another results dir
# Figures for the README are written by full runs only; quick runs (CI) write to a scratch directory.
FIGURES = Path(tempfile.mkdtemp()) if QUICK else ROOT / "docs" / "img"
FIGURES.mkdir(parents=True, exist_ok=True)

def load(name):
    return json.loads((RESULTS / f"{name}.json").read_text())

plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3})
print("quick mode" if QUICK else "full mode", "- results from", RESULTS)'''

NB01 = [
    ("md", """\
# Why bf16 updates are sparse

An RL trainer keeps fp32 master weights and publishes them in bf16. After one optimizer step at an RL learning
rate, about 99 % of the published bf16 values are **bit-identical** to the previous version. This notebook shows
why, with a small live computation and the measurements of `benchmarks/payload.py --sweep lr` (SmolLM2-135M,
fp32 masters, AdamW, real batches).

Set `DELTASYNC_NOTEBOOK_QUICK=1` for a run under a minute (smaller simulation); the measured results are loaded
from `benchmarks/results/` in both modes."""),
    ("code", SETUP),
    ("md", """\
## 1. bf16 has 8 significant bits

bf16 keeps 8 bits of precision (7 stored mantissa bits), so adjacent bf16 values around `x` are
`2**(floor(log2|x|) - 7)` apart: between `|x|/256` and `|x|/128`. A weight of 0.05 sits on a grid of spacing
2**-12 = 2.4e-4.

Adam normalises each coordinate's step, `lr * m / (sqrt(v) + eps)`, so an update moves a weight by at most about
`lr` whatever the gradient's scale. At `lr = 3e-6` that is 80 times smaller than the spacing at 0.05. The plot puts
the bf16 spacing next to the learning rates of the sweep, over the distribution of SmolLM2's weight magnitudes."""),
    ("code", '''\
lr_sweep = load("payload_lr")
w = lr_sweep["weight_hist"]
mag = np.logspace(-8, 1, 2000)
spacing = 2.0 ** (np.floor(np.log2(mag)) - 7)

fig, ax = plt.subplots(figsize=(8, 4.2))
ax.step(mag, spacing, where="post", color="k", label="bf16 spacing at |w|")
for lr, c in zip(lr_sweep["lrs"], plt.cm.viridis(np.linspace(0, 0.9, len(lr_sweep["lrs"])))):
    ax.axhline(lr, color=c, ls="--", lw=1, label=f"lr {lr:g}")
ax.set(xscale="log", yscale="log", xlabel="|w|", ylabel="spacing / update size", xlim=(1e-8, 10))
ax2 = ax.twinx()
octaves = np.array(w["log2_floor"], dtype=float)
ax2.bar(2.0 ** octaves, np.array(w["count"]) / sum(w["count"]), width=2.0 ** octaves, align="edge", alpha=0.25,
        color="tab:orange", label="SmolLM2 weights (share per octave)")
ax2.set_ylabel("share of weights", color="tab:orange"); ax2.grid(False)
ax.legend(loc="upper left", fontsize=8); ax2.legend(loc="lower right", fontsize=8)
numel = sum(w["count"]) + w["zeros"]
typical = 2.0 ** octaves[np.argmax(w["count"])]
print(f"most weights have |w| in [{typical:.3g}, {2 * typical:.3g}): spacing {typical / 128:.2g}")
print(f"exact zeros: {w['zeros']:,} of {numel:,} weights ({100 * w['zeros'] / numel:.2f} %)")
plt.show()'''),
    ("md", """\
## 2. When does a bf16 value change?

The published value changes only when the fp32 master crosses a rounding midpoint of the bf16 grid.

- A master that starts **on the grid** (loaded from a bf16 checkpoint) must move by at least half a spacing.
- A master that has drifted to a **random place inside its cell** changes with probability about
  `|update| / spacing` (for updates below one spacing).

Either way, an update far below the spacing almost never shows in bf16. A small live simulation: weights with
the magnitudes of SmolLM2's non-zero weights (drawn from the histogram above, random signs, stored in bf16 like a
checkpoint), then AdamW with noisy gradients around a fixed per-coordinate signal, as a stand-in for RL gradients.
We count the fraction of bf16 values that change at each step."""),
    ("code", '''\
import torch

def checkpoint_like(n, g):
    """n weights whose magnitudes follow SmolLM2's octave histogram (uniform in log2 within an octave)."""
    share = torch.tensor(w["count"], dtype=torch.float64)
    octave = torch.tensor(w["log2_floor"], dtype=torch.float64)[torch.multinomial(share, n, True, generator=g)]
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (sign * 2.0 ** (octave + torch.rand(n, generator=g, dtype=torch.float64))).float()

def simulate(lr, n, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = checkpoint_like(n, g).to(torch.bfloat16).float().requires_grad_()
    signal = torch.randn(n, generator=g)
    opt = torch.optim.AdamW([x], lr=lr, weight_decay=0.0)
    published = x.detach().to(torch.bfloat16).view(torch.int16).clone()
    changed = []
    for _ in range(steps):
        x.grad = signal + 3 * torch.randn(n, generator=g)
        opt.step()
        now = x.detach().to(torch.bfloat16).view(torch.int16)
        changed.append((now != published).float().mean().item())
        published = now.clone()
    return np.array(changed)

n, steps = (100_000, 8) if QUICK else (2_000_000, 30)
sim_lrs = np.logspace(-7, -3, 9 if QUICK else 17)
sim = np.array([simulate(lr, n, steps) for lr in sim_lrs])
print(f"{n:,} weights, {steps} AdamW steps per learning rate")
for lr, row in zip(sim_lrs, sim):
    print(f"lr {lr:8.1e}: changed at step 1 {100 * row[0]:7.3f} %, "
          f"mean of later steps {100 * row[steps // 2:].mean():7.3f} %")'''),
    ("md", """\
## 3. Fraction changed against learning rate: simulation and SmolLM2

The measured points are the per-step fractions of changed bf16 elements of SmolLM2-135M in the lr sweep (each
learning rate restarts from the checkpoint; step 1 is AdamW's first step, where every moving coordinate moves by
exactly `lr`)."""),
    ("code", '''\
fig, ax = plt.subplots(figsize=(7.5, 4.2))
ax.plot(sim_lrs, 100 * sim[:, 0], "o-", color="tab:blue", ms=3, label="simulation, step 1")
ax.plot(sim_lrs, 100 * sim[:, steps // 2:].mean(axis=1), "s-", color="tab:green", ms=3, label="simulation, later steps")
pts = lr_sweep["points"]
for points, marker, label in (([p for p in pts if p["step"] == 1], "o", "step 1"),
                              ([p for p in pts if p["step"] > 1], "x", "steps 2+")):
    ax.scatter([p["lr"] for p in points], [100 * (1 - p["sparsity"]) for p in points], color="tab:red",
               marker=marker, zorder=3, label=f"SmolLM2-135M, {label}")
zero_share = 100 * w["zeros"] / (sum(w["count"]) + w["zeros"])
ax.axhline(zero_share, color="tab:red", ls=":", lw=1, label=f"SmolLM2 exact zeros ({zero_share:.2f} %)")
ax.set(xscale="log", yscale="log", xlabel="learning rate", ylabel="bf16 elements changed per step (%)")
ax.legend(fontsize=8)
plt.show()
for s in lr_sweep["summary"]:
    print(f"lr {s['lr']:g}: SmolLM2 median sparsity {100 * s['sparsity']:.3f} %, "
          f"lowest {100 * s['min_sparsity']:.3f} %")'''),
    ("md", """\
Two regimes show up. Well below `lr ~ 1e-5` the simulated fraction falls in proportion to the learning rate (an
update of `lr` changes a weight with probability about `lr / spacing`). SmolLM2 instead flattens out near its
share of **exact zeros**: this checkpoint was converted from a 4-bit GGUF file, and bf16 spacing around 0 is
tiny, so a zero moves to a new bf16 value at any learning rate. Weights that sit at zero, or very near it, are the
floor of the change rate; a checkpoint without them has an even sparser floor.

## 4. Update size in units of bf16 spacing (SmolLM2, measured)

For a fixed sample of about two million elements (a quarter million in the quick results), the sweep recorded
`|fp32 update| / spacing` at every step and whether the bf16 value changed. Left: the distribution per learning
rate (after AdamW's first step, which moves every coordinate by exactly `lr`). Right: the share of changed values
in each bin against the two models above: at step 1 the fp32 masters still sit on the bf16 grid of the checkpoint,
so a value changes exactly when the update reaches half a spacing; later the masters have drifted inside their
cells and smaller updates start to show."""),
    ("code", '''\
edges = np.array(lr_sweep["ratio_edges"])
centers = 2.0 ** ((edges[:-1] + edges[1:]) / 2)

def pooled(points):
    count = np.sum([p["update_hist"]["count"] for p in points], axis=0)
    return count, np.sum([p["update_hist"]["changed"] for p in points], axis=0)

later = [p for p in pts if p["step"] > 1] or pts  # AdamW's first step moves every coordinate by exactly lr
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
octave_edges = edges[: len(edges) - (len(edges) - 1) % 2 : 2]  # whole octaves: spacings are powers of two
octave_centers = 2.0 ** (octave_edges[:-1] + 0.5)
for lr, c in zip(lr_sweep["lrs"], plt.cm.viridis(np.linspace(0, 0.9, len(lr_sweep["lrs"])))):
    count, _ = pooled([p for p in later if p["lr"] == lr])
    per_octave = count[: 2 * len(octave_centers)].reshape(-1, 2).sum(axis=1)
    a.step(octave_centers, per_octave / count.sum(), where="mid", color=c, label=f"lr {lr:g}")
a.axvline(1, color="k", lw=0.8)
a.set(xscale="log", xlim=(1e-6, 100), xlabel="|update| / bf16 spacing", ylabel="share of moving sampled elements",
      title="update size" + (" (steps 2+)" if later is not pts else ""))
for points, style, label in (([p for p in pts if p["step"] == 1], "o-", "step 1 (masters on the bf16 grid)"),
                             ([p for p in pts if p["step"] > 1], "s-", "steps 2+ (masters drifted)")):
    if points:
        count, hit = pooled(points)
        ok = count >= 20
        b.plot(centers[ok], hit[ok] / count[ok], style, ms=3, label=f"SmolLM2, {label}")
r = np.logspace(-3, 1, 400)
b.plot(r, np.minimum(1, r), "k--", lw=1, label="model: master anywhere in its cell, min(1, r)")
b.plot(r, (r >= 0.5).astype(float), "k:", lw=1, label="model: master on the grid, r >= 1/2")
b.set(xscale="log", xlim=(1e-3, 10), xlabel="r = |update| / bf16 spacing", ylabel="share that changed in bf16",
      title="probability of a visible change (all learning rates)")
a.legend(fontsize=7); b.legend(fontsize=7)
plt.tight_layout(); plt.show()
for lr in lr_sweep["lrs"]:
    count, _ = pooled([p for p in pts if p["lr"] == lr])
    print(f"lr {lr:g}: {100 * count[centers < 0.5].sum() / count.sum():.2f} % of the moving sampled elements "
          "moved by less than half a spacing")'''),
    ("md", """\
## Takeaways

- At RL learning rates (1e-7 to 1e-5) almost every AdamW update is a small fraction of the local bf16 spacing, so
  it rounds away: on SmolLM2 the median share of bit-identical bf16 values per step is 99.7 % at 1e-7, 99.6 % at
  1e-6, 99.1 % at 3e-6 and 97.7 % at 1e-5 (80 % at 1e-4).
- The elements that do change are mostly weights near zero (where the spacing is tiny) and coordinates whose
  master drifted to a rounding midpoint; the change is nearly always one bf16 step, which is why base-relative
  value coding (`compact`) is small.
- Sparsity falls as the learning rate grows and as versions cover more optimizer steps; notebook 02 shows what
  that does to the bytes per version, for each layout."""),
]

NB02 = [
    ("md", """\
# Payload and throughput

Bytes per published version for every layout on the same SmolLM2-135M deltas, against learning rate and against
optimizer steps between publishes (`benchmarks/payload.py --sweep lr|interval`), and the cost of publishing and
applying deltas on synthetic bf16 models from 10M to 1B parameters (`benchmarks/throughput.py`).

Both modes load the committed results in `benchmarks/results/`; the full mode (`DELTASYNC_NOTEBOOK_QUICK=0`, the
default) also writes the README figure `docs/img/payload_vs_lr.png`. Timings come from a shared 2-core machine:
read ratios measured in the same run, not absolute times."""),
    ("code", SETUP),
    ("code", '''\
lr_sweep, interval_sweep, throughput = load("payload_lr"), load("payload_interval"), load("throughput")
LAYOUTS = lr_sweep["layouts"]
STYLE = {  # dense baselines grey, prototype layouts dashed, deltasync codecs solid
    "dense": ("0.2", "-", "s"), "dense_zstd1": ("0.45", "-", "s"), "dense_zstd3": ("0.6", ":", "s"),
    "xor_zstd1": ("tab:brown", "-.", "x"), "gap16": ("tab:purple", "--", "^"), "rowcol_zstd1": ("tab:pink", "--", "v"),
    "raw": ("tab:orange", "-", "o"), "compact-abs": ("tab:cyan", "-", "o"), "compact": ("tab:blue", "-", "o"),
}
LABEL = {"dense": "dense bf16", "dense_zstd1": "dense + zstd-1", "dense_zstd3": "dense + zstd-3",
         "xor_zstd1": "XOR snapshot + zstd-1", "gap16": "uint16 gaps + bf16 (TRL, later)",
         "rowcol_zstd1": "row/col delta + zstd-1 (PULSE)", "raw": "raw: int32 + bf16 (TRL, public)",
         "compact-abs": "compact-abs", "compact": "compact (default)"}
for key, text in LAYOUTS.items():
    print(f"{LABEL[key]:32} {text}")
print()
print(f"{lr_sweep['model']}: {lr_sweep['numel']:,} parameters, {lr_sweep['steps_per_lr']} steps per learning rate")'''),
    ("md", """\
## Bytes per version against learning rate

Each learning rate restarts from the checkpoint and publishes after every optimizer step; the plot shows the
median over steps. Every layout encodes the same change set at every point."""),
    ("code", '''\
def plot_layouts(ax, xs, summary, per=None):
    for key in LAYOUTS:
        color, ls, marker = STYLE[key]
        ys = np.array([s["bytes"][key] for s in summary], dtype=float)
        if per is not None:
            ys = ys / np.array(per)
        ax.plot(xs, ys, ls=ls, marker=marker, color=color, ms=4, lw=1.8 if key == "compact" else 1.1, label=LABEL[key])
    ax.set_yscale("log")

lrs = [s["lr"] for s in lr_sweep["summary"]]
fig, ax = plt.subplots(figsize=(8.5, 5))
plot_layouts(ax, lrs, lr_sweep["summary"])
ax.set(xscale="log", xlabel="learning rate (AdamW)", ylabel="bytes per published version",
       title=f"{lr_sweep['model']}: bytes per version vs learning rate")
for x, s in zip(lrs, lr_sweep["summary"]):
    ax.annotate(f"{100 * s['sparsity']:.2f} %\\nunchanged", (x, lr_sweep["summary"][0]["bytes"]["dense"] * 1.6),
                ha="center", fontsize=7)
ax.set_ylim(top=lr_sweep["summary"][0]["bytes"]["dense"] * 6)
ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
fig.tight_layout()
fig.savefig(FIGURES / "payload_vs_lr.png", dpi=130, bbox_inches="tight")
plt.show()
print(lr_sweep["table"])'''),
    ("md", """\
## Bytes per version against steps between publishes

One training run at lr 3e-6; each interval `k` has its own published snapshot, diffed against the weights every `k`
optimizer steps (a slow or skipped publish makes the next delta cover more steps). Right: the same bytes divided
by `k`, the upload bandwidth per optimizer step."""),
    ("code", '''\
ks = [s["interval"] for s in interval_sweep["summary"]]
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
plot_layouts(a, ks, interval_sweep["summary"])
plot_layouts(b, ks, interval_sweep["summary"], per=ks)
for ax, title in ((a, "bytes per version"), (b, "bytes per optimizer step")):
    ax.set(xscale="log", xlabel="optimizer steps between publishes", ylabel=title, title=title)
    ax.minorticks_off()
    ax.set_xticks(ks, [str(k) for k in ks])
b.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
fig.tight_layout()
fig.savefig(FIGURES / "payload_vs_interval.png", dpi=130, bbox_inches="tight")
plt.show()
print(interval_sweep["table"])'''),
    ("md", """\
## Publish and apply cost against model size

Synthetic Llama-shaped bf16 models; a changed element moves one bf16 step. *Publish* is the diff against the
snapshot plus `encode_delta` (compact codec); *apply* is what a replica does with the file: header, validation,
decode with the base lookup, and the in-place write into its tensors. Dashed lines are the bare memory passes
measured in the same run: `torch.ne` over every weight, and `index_copy_` and `index_put_` of the changed elements
(torch's two scatter kernels; the applier takes `index_put_` for scattered writes on the CPU). Points are
medians of 9 rounds (5 from 300M parameters up); the bars reach from the fastest to the slowest round, which shows
how much of a difference between two points is the shared machine's noise."""),
    ("code", '''\
rows = throughput["rows"]
densities = throughput["densities"]
fig, axes = plt.subplots(1, len(densities), figsize=(5 * len(densities), 4.2), sharey=True)
for ax, d in zip(np.atleast_1d(axes), densities):
    at = sorted((r for r in rows if r["density"] == d), key=lambda r: r["numel"])
    n = np.array([r["numel"] for r in at], dtype=float)
    for key, label, style in (("diff", "diff", "-o"), ("encode_compact", "encode (compact)", "-o"),
                              ("decode_compact", "header+validate+decode", "-o"), ("apply", "apply in place", "-o"),
                              ("ne", "bare torch.ne", "--"), ("index_copy", "bare index_copy_", "--"),
                              ("index_put", "bare index_put_", ":")):
        med = np.array([r["t"][key] for r in at])
        low, high = np.array([r["t_min"][key] for r in at]), np.array([r["t_max"][key] for r in at])
        ax.errorbar(n, med, yerr=[med - low, high - med], fmt=style, ms=4, capsize=2, lw=1, label=label)
    ax.set(xscale="log", yscale="log", xlabel="parameters", title=f"{100 * d:g} % of elements changed")
np.atleast_1d(axes)[0].set_ylabel("seconds (median)")
np.atleast_1d(axes)[-1].legend(fontsize=7)
fig.tight_layout()
fig.savefig(FIGURES / "throughput_vs_size.png", dpi=130, bbox_inches="tight")
plt.show()
print(throughput["table"])'''),
    ("md", """\
## Per-element constants

A least-squares fit `t = a * parameters + b * changed + c` per stage over the larger models (from median times), and
the plain ratios at the largest model per density (from minimum times, the least disturbed by other work on the
machine). The diff pays per weight (it reads every element once) plus a little per change; encode, decode and
apply pay per changed element, and a change costs more when changes are sparse (each one is its own cache miss).
These constants feed the scaling projections in the docs."""),
    ("code", '''\
fit = throughput["constants"]["fit"]
print(f"fitted on: {', '.join(fit['fitted_on'])}")
print(f"{'stage':18} {'ns / parameter':>15} {'ns / changed':>13} {'fixed (ms)':>11}")
for stage, c in fit.items():
    if isinstance(c, dict):
        print(f"{stage:18} {c['ns_per_element']:15.3f} {c['ns_per_changed']:13.2f} {1e3 * c['fixed_s']:11.1f}")
print()
largest = throughput["constants"]["largest_model"]
print(f"plain ratios at {largest['size']} (minimum times), by fraction of elements changed:")
by = largest["by_density"]
keys = list(next(iter(by.values()))["min"])
print(f"{'':32}" + "".join(f"{100 * float(d):>10g} %" for d in by))
for key in keys:
    print(f"{key:32}" + "".join(f"{by[d]['min'][key]:12.2f}" for d in by))'''),
    ("md", """\
## Bytes per change against the entropy floors, step by step

The 40 versions of one SmolLM2-135M run (`benchmarks/payload.py`, AdamW, one version per optimizer step), each
codec's bytes per changed element next to two floors computed on the same change sets: *i.i.d.* (each position
drawn with its tensor's density, plus the entropy of the value steps) and *exponent-conditioned* (the same, given
the bf16 exponent that the receiver already holds at every position). `compact`, the default, reads the receiver's
weights only at the changed positions, so the i.i.d. floor is the one it can approach; `compact-exp` and
`exp-rice` condition on every element's exponent, an O(parameters) pass on both sides per version, which is why
they are opt-in for slow links. `exp-rice` codes each exponent class with its own Rice parameter (or a stream in
zstd where that is smaller), which is what brings it close to the exponent-conditioned floor."""),
    ("code", '''\
run = load("payload")
steps = [r["version"] for r in run["rows"]]
fig, ax = plt.subplots(figsize=(8, 4))
for key, color in (("raw", "tab:orange"), ("compact-abs", "tab:cyan"), ("compact", "tab:blue"),
                   ("compact-exp", "tab:green"), ("exp-rice", "tab:red")):
    per = [r["codecs"][key]["bytes"] / r["nnz"] for r in run["rows"] if key in r["codecs"]]
    if per:
        ax.plot(steps[: len(per)], per, "o-", ms=3, color=color, label=key)
ax.plot(steps, [r["entropy"]["iid_per_change"] for r in run["rows"]], "k--", label="floor, i.i.d.")
ax.plot(steps, [r["entropy"]["exponent_per_change"] for r in run["rows"]], "k:", label="floor, given the exponents")
ax.axhline(0.85, color="0.6", lw=0.8)
ax.set(yscale="log", xlabel="version (optimizer step)", ylabel="bytes per changed element",
       title=f"{run['model']}, lr {run['lr']:g}: bytes per change and their floors")
ticks = [0.4, 0.6, 0.85, 1, 1.5, 2, 3, 4, 6]
ax.minorticks_off()
ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
fig.tight_layout()
fig.savefig(FIGURES / "bytes_vs_floor.png", dpi=130, bbox_inches="tight")
plt.show()
late = run["rows"][-11:]  # steps 30-40: steady state
for key in ("compact", "compact-exp", "exp-rice"):
    if not all(key in r["codecs"] for r in run["rows"]):
        continue
    first = np.median([r["codecs"][key]["bytes"] / r["nnz"] for r in run["rows"][:8] if key in r["codecs"]])
    last = np.median([r["codecs"][key]["bytes"] / r["nnz"] for r in late if key in r["codecs"]])
    span = f"{late[0]['version']}-{late[-1]['version']}"
    print(f"{key:12} median B/change, steps 1-8: {first:.2f}, steps {span}: {last:.2f}")
for key in ("iid_per_change", "exponent_per_change"):
    print(f"floor {key[:-11]:9} steps 1-8: {np.median([r['entropy'][key] for r in run['rows'][:8]]):.2f}, "
          f"steady: {np.median([r['entropy'][key] for r in late]):.2f}")'''),
    ("md", """\
## Each stage of a version against its floor

`benchmarks/device_sync.py` times every stage of a version through the public API (128M bf16 parameters in 64
tensors, fp32 masters, 1 % changed) and, in the same run on the same device, the bare operation no exact
implementation can skip: `ne` + `nonzero` for the diff, decompressing and reading the base at every changed
index for the decode, `index_copy_` for the apply, a copy of every weight for the whole update and the anchors.
A bar is the stage's median time divided by its floor's: 1 is the floor, and below 1 the stage beat the bare
pass (the diff's chunks stay in cache where the bare pass does not). A black mark on an anchor's bar is its store
floor, where the run has one: the same parts BLAKE3-hashed and written to new files on the store's filesystem, or
mapped, hashed and copied into the weights, with no deltasync code. One panel per device with results, one
for a real run's steps (`--checkpoints`: SmolLM2-135M's published weights at steps 33 to 40 of the payload run,
272 tensors, about 1 % changed per step), and the GPU runs: 1B parameters on an H200, with this release's device
paths (`cuda`) and before them (`cuda_before`). Rows measured on code that has changed since are left out of
the plot and named under it."""),
    ("code", '''\
runs = {p.stem.split("_", 2)[-1]: json.loads(p.read_text()) for p in sorted(RESULTS.glob("device_sync_*.json"))}
columns = min(2, len(runs))
rows = -(-len(runs) // columns)
fig, axes = plt.subplots(rows, columns, figsize=(7.5 * columns, 4.6 * rows), squeeze=False)
for ax in axes.flat[len(runs):]:
    ax.axis("off")
for ax, (device, sync) in zip(axes.flat, runs.items()):
    names = [n for n, row in sync["stages"].items() if row.get("floor") and not row.get("superseded")]
    ratio = [sync["stages"][n]["deltasync"] / sync["stages"][n]["floor"] for n in names]
    colors = ["tab:green" if r <= 2 else "tab:orange" if r <= 5 else "tab:red" for r in ratio]
    ax.barh(names, ratio, color=colors)
    ax.axvline(1, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="time / floor (median; 1 = the bare pass)",
           title=f"{device}: {sync['params'] / 1e6:.0f}M params, {100 * sync['density']:.2g} % changed"
                 + (f" ({len(sync['checkpoints'])} checkpoints of a run)" if sync.get("checkpoints") else ""))
    ticks = [t for t in (0.5, 1, 2, 5, 10, 20, 50, 100, 300, 1000) if t < 2 * max(ratio)]
    ax.minorticks_off()
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    for y, (n, r) in enumerate(zip(names, ratio)):
        ax.text(r, y, f" {1e3 * sync['stages'][n]['deltasync']:.0f} ms", va="center", fontsize=7)
    # An anchor's store floor: the same parts hashed and written / mapped, hashed and copied, no deltasync code
    # (the fastest round: a bound).
    stores = [(y, sync["stages"][n]["floor_store"] / sync["stages"][n]["floor"])
              for y, n in enumerate(names) if sync["stages"][n].get("floor_store")]
    if stores:
        ax.scatter([r for _, r in stores], [y for y, _ in stores], marker="|", s=220, color="k", zorder=3,
                   label="store floor (fastest round)")
        ax.legend(fontsize=7, loc="lower right")
fig.tight_layout()
fig.savefig(FIGURES / "stages_vs_floor.png", dpi=130, bbox_inches="tight")
plt.show()
for device, sync in runs.items():
    print(device, sync["machine"]["cpu"], "; cuda:", sync["machine"].get("cuda"))
    for note in sync.get("notes", []):
        print("  note:", note)
    for name, row in sync["stages"].items():
        if row.get("superseded"):
            print(f"  {name:36} (measured on code since changed: {row['superseded']})")
            continue
        extra = f"  {row['gb_per_s']:.2f} GB/s" if "gb_per_s" in row else ""
        extra += f"  {row['changes_per_s'] / 1e6:.0f} M changes/s" if "changes_per_s" in row else ""
        extra += f"  host waits {row['host_waits']}" if "host_waits" in row else ""
        print(f"  {name:36} {1e3 * row['deltasync']:8.1f} ms  floor {1e3 * row['floor']:7.1f} ms{extra}")'''),
    ("md", """\
## fp8 replicas of a bf16 trainer

`benchmarks/fp8.py` publishes the same AdamW steps twice: the bf16 cast, and the block-fp8 view (e4m3 elements
and a float32 scale per 128x128 block for every linear weight, the rest bf16). Left: bytes per version for the
bf16 delta, the fp8 delta, and the full fp8 checkpoint a full-resync path ships every step. Right: how sparse the
fp8 tensors' changes are: nearly every 128x128 block holds a changed bf16 element (*touched*), and nearly every
block's fp8 bytes or scale move, but far fewer fp8 elements change than bf16 ones (most bf16 steps stay inside
one e4m3 rounding interval), which is what the fp8 delta carries."""),
    ("code", '''\
fp8 = load("fp8")
fig, axes = plt.subplots(len(fp8["models"]), 2, figsize=(11, 3.4 * len(fp8["models"])), squeeze=False)
for (left, right), run in zip(axes, fp8["models"]):
    rows = run["versions"]
    steps = [r["step"] for r in rows]
    for key, label, style in [("bytes_fp8_checkpoint", "full fp8 checkpoint", "k--"),
                              ("bytes_bf16_delta", "bf16 delta", "C0o-"), ("bytes_fp8_delta", "fp8 delta", "C3s-")]:
        left.plot(steps, [r[key] / 1e6 for r in rows], style, label=label)
    left.set(yscale="log", xlabel="version", ylabel="MB per version", title=run["model"])
    left.legend(fontsize=8)
    for key, label in [("blocks_touched", "blocks touched (a bf16 element changed)"),
                       ("blocks_moved", "blocks whose fp8 bytes or scale moved"),
                       ("bf16_elements_changed", "bf16 elements changed"),
                       ("fp8_elements_changed", "fp8 elements changed")]:
        right.plot(steps, [100 * r[key] for r in rows], marker="o", label=label)
    right.set(yscale="log", xlabel="version", ylabel="% of the fp8 tensors", title=f"{run['model']}: sparsity")
    right.legend(fontsize=7)
fig.tight_layout()
fig.savefig(FIGURES / "fp8_bytes.png", dpi=130, bbox_inches="tight")
plt.show()
print(fp8["table"])'''),
]

NB04 = [
    ("md", """\
# LoRA: merged deltas, the adapter, or whichever is smaller

A LoRA run serves the policy `W + s * B @ A`: frozen base weights `W`, the trained factors `A` and `B`, and the
scale `s = lora_alpha / r`. deltasync can publish it in two exact forms, as one fixed set of named tensors (the
base model's names plus the factors' names), so every version is an ordinary sparse delta from the one before:

- **merged**: the base names carry the merged weights `W + s * B @ A` rounded to bf16 and the factors are zero. A
  replica that loaded the base checkpoint applies the deltas in place, as for full fine-tuning. A version costs
  the bf16 elements of the merged weights that changed, which grows with the learning rate (and, as `B` grows,
  over the run).
- **adapter**: the base names keep the frozen base weights and the factors carry the live `A` and `B` bit for bit
  in their own dtype (fp32). A replica serves them as a LoRA adapter. A version costs the factor elements that
  changed, about all of them at LoRA learning rates: roughly the adapter's size whatever the learning rate.

`LoraWeights(model, mode="auto")` diffs both forms at every publish and sends the one whose change set is
estimated smaller on the wire. Each form is judged on what it costs per version once adopted: the tensors a form
holds constant (the merged form's zeroed factors, the adapter form's base weights) are left out of its estimate, so
the one larger delta that switches form does not keep a run in the more expensive form. A tie keeps the previous
version's form.

The numbers are from `benchmarks/lora.py` (SmolLM2-135M with fp32 masters, LoRA on every linear layer,
`lora_alpha = 2r`, AdamW on the adapter, one version per step): medians over the versions after the first. This
notebook only reads `benchmarks/results/peft.json`, in both modes; the full mode (`DELTASYNC_NOTEBOOK_QUICK=0`,
the default) also writes `docs/img/lora_bytes.png`."""),
    ("code", SETUP),
    ("code", '''\
peft_run = load("peft")
results = peft_run["results"]

def forms_of(r):
    """The forms auto chose for the versions after the first, run-length coded ("-": nothing moved)."""
    runs = []
    for form in r["auto_forms"][1:] or r["auto_forms"]:
        if runs and runs[-1][0] == form:
            runs[-1][1] += 1
        else:
            runs.append([form, 1])
    return ", ".join(f"{form or '-'} x{n}" for form, n in runs)

print(f"{peft_run['model']}; {peft_run['steps']} steps per configuration")
print()
print("MB per version (medians over versions 2+); adapter bf16 = the benchmark's delta of the factors cast to bf16,")
print("adapter fp32 = the whole factors in fp32 (what the adapter form sends when every factor element moves)")
print()
print(f"{'lr':>7} {'rank':>4} {'merged':>8} {'adapter bf16':>12} {'adapter fp32':>12} {'auto':>8} {'auto/merged':>11} "
      f"{'dense':>7} {'exact':>5}  auto's forms (versions 2+)")
for r in sorted(results, key=lambda r: (r["rank"], r["lr"])):
    print(f"{r['lr']:7g} {r['rank']:4d} {r['median_merged_bytes'] / 1e6:8.2f} "
          f"{r['median_adapter_delta_bytes'] / 1e6:12.2f} {4 * r['adapter_elements'] / 1e6:12.2f} "
          f"{r['median_auto_bytes'] / 1e6:8.2f} {r['median_auto_bytes'] / r['median_merged_bytes']:11.2f} "
          f"{r['dense_bytes'] / 1e6:7.1f} "
          f"{'yes' if r['auto_exact'] else 'NO':>5}  {forms_of(r)}")'''),
    ("md", """\
## Bytes per version against learning rate, one panel per rank

*adapter delta (bf16)* is the benchmark's delta of the factors cast to bf16 (column iii of its table). The adapter
form that auto publishes carries the factors in fp32, so where auto picks it a version costs about the whole
factors in fp32 (the thin dotted line): twice the bf16 delta. Auto's points are labelled with the forms it chose
for the versions after the first (M merged, A adapter; both letters when it switched within the run)."""),
    ("code", '''\
ranks = sorted({r["rank"] for r in results})
fig, axes = plt.subplots(1, len(ranks), figsize=(4.4 * len(ranks), 3.8), sharey=True, squeeze=False)
for ax, rank in zip(axes[0], ranks):
    rows = sorted((r for r in results if r["rank"] == rank), key=lambda r: r["lr"])
    lrs = [r["lr"] for r in rows]
    ax.plot(lrs, [r["median_merged_bytes"] for r in rows], "o-", color="tab:blue", label="merged delta")
    ax.plot(lrs, [r["median_adapter_delta_bytes"] for r in rows], "s--", color="tab:orange",
            label="adapter delta (bf16)")
    ax.axhline(4 * rows[0]["adapter_elements"], color="tab:orange", ls=":", lw=1, label="adapter, whole fp32")
    ax.plot(lrs, [r["median_auto_bytes"] for r in rows], "D-", color="tab:green", ms=7, mfc="none", lw=2,
            label="auto (LoraWeights)")
    ax.axhline(rows[0]["dense_bytes"], color="0.3", ls=":", label="dense bf16")
    for r in rows:
        chosen = {f for f in r["auto_forms"][1:] if f}
        letters = "".join(sorted(f[0].upper() for f in chosen)) or "-"
        ax.annotate(letters, (r["lr"], r["median_auto_bytes"]), textcoords="offset points", xytext=(6, 4),
                    fontsize=8, color="tab:green")
    ax.set(xscale="log", yscale="log", xlabel="learning rate (AdamW)", title=f"rank {rank}")
axes[0][0].set_ylabel("bytes per version (median)")
axes[0][-1].legend(fontsize=7, loc="lower right")
fig.tight_layout()
fig.savefig(FIGURES / "lora_bytes.png", dpi=130, bbox_inches="tight")
plt.show()'''),
    ("md", """\
## Reading the numbers

- At small learning rates few bf16 elements of the merged weights move per step and the merged delta is far below
  the adapter: auto publishes merged, and a replica of the base model follows in place.
- As the learning rate grows, more merged elements move each step, while the adapter form costs about the whole
  factors in fp32 whatever the learning rate (every factor element moves). At high learning rates the adapter
  form is the smaller one and auto publishes it.
- The adapter grows with the rank (its element count is proportional to `r`); the merged delta grows more slowly,
  so the crossover moves to higher learning rates at higher ranks.
- Auto picks a form from an estimate (`deltasync.publish.forms.wire_cost`), not from encoded sizes: per changed element,
  index bits from the density and value bits from the size of its step, modelled on the compact codec. An
  `auto/merged` ratio above 1 where both forms were open would show the estimate choosing the larger form.
- Every auto run ends with a replica, which followed the store from the first version, bit-identical to the form
  of the last version (`exact`)."""),
]


def build(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-run", action="store_true", help="write the notebooks without executing them")
    parser.add_argument("--only", choices=["01", "02", "04"], help="build one notebook")
    args = parser.parse_args()
    books = {
        "01": ("01_why_bf16_updates_are_sparse.ipynb", NB01),
        "02": ("02_payload.ipynb", NB02),
        "04": ("04_lora.ipynb", NB04),
    }
    for key, (name, cells) in books.items():
        if args.only and key != args.only:
            continue
        nb = build(cells)
        if not args.no_run:
            from nbclient import NotebookClient

            os.environ.setdefault("DELTASYNC_NOTEBOOK_QUICK", "0")
            resources = {"metadata": {"path": str(HERE)}}
            client = NotebookClient(nb, timeout=1200, kernel_name="python3", resources=resources)
            client.execute()
        nbformat.write(nb, HERE / name)
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
