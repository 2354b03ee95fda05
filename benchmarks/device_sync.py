"""Sync at memory speed? Each stage of a version against its floor, on the device it is given.

A synthetic model of ``--params`` bf16 parameters in ``--tensors`` equal tensors
lives on ``--device`` (``cpu`` or ``cuda``) with fp32 masters; every step moves
``--density`` of the elements by one bf16 ulp at random positions (an exact,
known change set, the shape of an RL step). Through the public API it measures,
median of ``--repeats`` runs with the spread (min, max):

| stage | deltasync | floor on the same device |
|---|---|---|
| diff on the training thread | ``diff`` of the masters against the snapshot (off the CPU: the device path) | cast + ``ne`` + ``nonzero`` over all weights |
| diff, device path | ``diff(..., on_device=True)``, and how many times it waits for the device per version | the same |
| replica decode | ``decode`` of the delta (default codec) against the replica as a ``Subscriber`` calls it, on all threads and on one | zstd-decompressing the same delta's parts and reading the replica at every changed index (``index_select``): what no base-relative decoder avoids; the one-thread row's floor also on one thread (torch's too) |
| decode, device path | the same through the path of a replica on an accelerator (``stage=True`` on a CPU): rebuilt on the weights' device, and how many times the host waits | the same |
| replica apply | ``TorchModuleApplier.apply`` of what the replica's decode gave (on an accelerator: patches already there) | the faster of ``index_copy_`` and ``index_put_`` of the same changes (indices and values already on the device; with their host-to-device copy on a GPU) |
| apply, staged | patches decoded on the host (other codecs) with ``stage=True``: every patch through one host buffer per kind and one copy each to the device | the same |
| decode, vLLM rank | what the worker of a one-rank vLLM engine does with a version's files: ``decode_here`` against its weights read through its index map, on the device path (as on a GPU; forced on a CPU), and its host waits | the decode floor |
| apply, vLLM rank | that worker's write of the patches (still on the device) through its map, and its read-back of 256 samples per tensor | the apply floor |
| whole replica update | ``Subscriber.update`` from a local store (``/dev/shm`` when there is one) | copying all weights from (pinned) host memory |
| anchor publish / periodic / load | the first ``publish`` (its snapshot allocated and captured on the way) / a periodic anchor (from the snapshot kept since: what every later anchor costs) / a new replica's ``update``, GB/s, in parts of the default size and in one part; "load, copied": the same load with the store's parts read into memory instead of mapped (``LocalStore(map_reads=False)``: the path of a network filesystem) | one ``copy_`` of all weights; and for the periodic anchor and the load, the store floor: the same parts' bytes BLAKE3-hashed and written to new files on the same filesystem, four side by side / mapped and hashed on the fetch threads, then copied into the weights (no deltasync code; the fastest round) |

Every version ends bit-exact (checked). Writes
``benchmarks/results/device_sync_<device>.json`` (``device_sync_<device>_<N>_tensors.json`` for another
``--tensors N``: a Mixture-of-Experts model's thousands of expert tensors, where each tensor's fixed cost
shows; ``..._fused_<M>.json`` with ``--fused M``, where the vLLM rank holds them ``M`` to a parameter as an
engine fuses a layer's experts, two such parameters taking turns in the file's order) and prints the table.

With ``--checkpoints``, the weights and their steps are a real run's instead: the
first checkpoint is the starting weights, and every later one replaces all
weights in turn (its changes against the one before are the step; the first step
is the one each stage is timed on, the later ones feed the whole-update rounds,
so give ``--repeats`` + 2 of them for every round). Each checkpoint is a
safetensors file or a directory of them, all with the same tensors; the results
go to ``device_sync_<device>_checkpoints.json``.

    python benchmarks/device_sync.py                      # cpu, 128M params in 64 tensors, 1 % density
    python benchmarks/device_sync.py --device cuda --params 1e9
    python benchmarks/device_sync.py --quick              # CI: 8M params, results in a temp dir
    python benchmarks/device_sync.py --tensors 4096       # the same parameters as 4096 tensors (experts)
    python benchmarks/device_sync.py --tensors 4096 --fused 64   # ... fused 64 to a parameter in the rank
    python benchmarks/device_sync.py --device cuda --checkpoints run/step-*.safetensors
    python benchmarks/device_sync.py --device cuda --params 1e9 --profile prof/   # and where the time goes

Device memory: the masters and at most four more copies of the bf16 weights at a time
(each stage makes its own and drops them after it; ``device_peak_bytes`` in the JSON
on a GPU): with fp32 masters, 6x the bf16 weights (12 GB at 1B parameters); for a
checkpoint run in bf16, 5x (70 GB for a 7B model). The stores go in ``/dev/shm`` where it has room for
3x the bf16 weights (else under ``TMPDIR``, said so: those rows then include that filesystem). A run that
its GPU or its filesystems cannot hold is refused before anything is allocated, saying what to change.

With ``--profile DIR`` one more diff, decode, apply and whole update are run under
torch's profiler (the device's kernels included on a GPU) and cProfile after the
timed runs; ``DIR/profile_<stage>.txt`` holds the tables, ``.json.gz`` the traces.
The whole update's profile takes two more steps (two more checkpoints).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import gzip
import io
import math
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import human_bytes, results_dir, shared_machine, table, write_json  # noqa: E402

from deltasync import Publisher, Subscriber  # noqa: E402
from deltasync.appliers import TorchModuleApplier  # noqa: E402
from deltasync.appliers.apply import write_patches  # noqa: E402
from deltasync.appliers.mapping import IndexMap, Target, from_start  # noqa: E402
from deltasync.appliers.verify import check_written  # noqa: E402
from deltasync.appliers.vllm.rank_decode import decode_here  # noqa: E402
from deltasync.codec import device as device_decode  # noqa: E402
from deltasync.codec._zstd import decompress  # noqa: E402
from deltasync.format import decode, encode_delta, file_entries, read_header  # noqa: E402
from deltasync.publish.diff import Snapshot, diff  # noqa: E402
from deltasync.publish.diff.device import host_waits, searched_chunks  # noqa: E402
from deltasync.publish.diff.device import phases as diff_phases  # noqa: E402
from deltasync.stores import LocalStore  # noqa: E402
from deltasync.tensors import TensorSpec, bits_view  # noqa: E402
from deltasync.tensors.device import Phases  # noqa: E402
from deltasync.util import threads as parallel  # noqa: E402

TENSORS = 64
"""The synthetic model's tensors by default (``--tensors``): 2M elements each at 128M parameters."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(fn: Callable[[], Any], repeats: int, device: torch.device) -> dict[str, float]:
    """Median, min and max wall time of ``fn`` over ``repeats`` runs (device work included)."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def per_call(phases: Phases, calls: int) -> dict[str, float]:
    """A device path's host seconds per phase (:class:`~deltasync.publish.diff.device.Phases`) since the last
    ``take()``, per call of ``calls``."""
    return {phase: seconds / calls for phase, seconds in phases.take().items()}


def spread_phases(
    fn: Callable[[], Any], repeats: int, device: torch.device, phases: Phases
) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`spread` of ``fn`` and where its device path's host time went, per run (:func:`per_call`)."""
    phases.take()
    timed = spread(fn, repeats, device)
    return timed, per_call(phases, repeats)


@contextmanager
def one_core() -> Iterator[None]:
    """deltasync's decode threads and torch's intra-op threads both at one: the per-core figures."""
    workers, threads = parallel.WORKERS, torch.get_num_threads()
    parallel.WORKERS = 1
    torch.set_num_threads(1)
    try:
        yield
    finally:
        parallel.WORKERS = workers
        torch.set_num_threads(threads)


class Model:
    """``numel`` fp32 masters in ``tensors`` equal tensors on ``device``; steps move ``density`` by one ulp."""

    def __init__(self, numel: int, tensors: int, device: torch.device, seed: int = 0) -> None:
        self.gen = torch.Generator(device=device).manual_seed(seed)  # drawn where the weights live: fast on a GPU
        size = max(1, numel // tensors)
        self.masters = {
            f"layers.{i}.weight": torch.randn(size, generator=self.gen, device=device) * 0.02 for i in range(tensors)
        }
        self.device = device
        self.spare = sys.maxsize  # steps left to take: any number

    def bf16(self) -> dict[str, torch.Tensor]:
        return {n: t.to(torch.bfloat16) for n, t in self.masters.items()}

    def step(self, density: float) -> int:
        """Move ``density`` of each tensor's elements by +-1 bf16 ulp (exactly); return how many moved."""
        moved = 0
        for tensor in self.masters.values():
            k = max(1, int(density * tensor.numel()))
            where = torch.randperm(tensor.numel(), generator=self.gen, device=self.device)[:k]
            bits = tensor[where].to(torch.bfloat16).view(torch.int16)
            sign = (torch.randint(0, 2, (k,), generator=self.gen, device=self.device) * 2 - 1).to(torch.int16)
            tensor[where] = (bits + sign).view(torch.bfloat16).to(torch.float32)
            moved += k
        return moved


class Checkpoints:
    """A real run's weights: the first checkpoint on ``device``; each step loads the next one in place."""

    def __init__(self, paths: list[str], device: torch.device) -> None:
        if len(paths) < 3:
            raise SystemExit("--checkpoints needs at least 3: the start, the step timed, one whole-update round")
        self.paths, self.device, self.next = paths, device, 1
        self.masters = {n: t.to(device) for n, t in load_checkpoint(paths[0]).items()}
        self.rounds = len(paths) - 2

    @property
    def spare(self) -> int:
        """Checkpoints not stepped to yet."""
        return len(self.paths) - self.next

    def step(self, density: float) -> int:
        """Replace every weight by the next checkpoint's (``density`` is the run's own); how many changed."""
        if self.next >= len(self.paths):
            raise SystemExit(f"--checkpoints: {len(self.paths)} are not enough for the rounds asked for")
        loaded = load_checkpoint(self.paths[self.next])
        if {n: (t.shape, t.dtype) for n, t in loaded.items()} != {
            n: (t.shape, t.dtype) for n, t in self.masters.items()
        }:
            raise SystemExit(f"{self.paths[self.next]}: not the tensors of {self.paths[0]} (names, shapes, dtypes)")
        moved = 0
        for name, tensor in self.masters.items():
            new = loaded[name].to(self.device)
            moved += int(torch.ne(bits_view(new.to(torch.bfloat16)), bits_view(tensor.to(torch.bfloat16))).sum())
            tensor.copy_(new)
        self.next += 1
        return moved


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of a checkpoint directory's files (its index's, else all)."""
    from safetensors.torch import load_file

    from deltasync.appliers.checkpoint.files import checkpoint_files

    try:
        files = checkpoint_files(Path(path)) if Path(path).is_dir() else [Path(path)]
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(str(file)))
    return {n: t for n, t in out.items() if t.is_floating_point()}


def store_floor(sizes: list[int], source: torch.Tensor, target: torch.Tensor, root: Path) -> dict[str, float]:
    """Seconds this machine takes, with no deltasync code, to do what no anchor in parts of ``sizes`` can skip.

    "publish": each part's bytes (from ``source``, host memory) hashed with BLAKE3 and written to a new
    fsynced file under ``root``, the parts side by side on the publisher's upload threads; "load": each file
    mapped privately and hashed on the subscriber's fetch threads, then, once every part is verified, copied
    into ``target`` (on the replica's device) part by part. What is left between a stage and this floor is
    deltasync's own: headers, per-tensor digests, the pools' hand-offs, the checks against the replica.
    """
    import mmap

    import blake3

    from deltasync.replica.subscriber import FETCH_WORKERS

    host, dest = source.view(torch.uint8).numpy(), target.view(-1).view(torch.uint8)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    scratch = Path(tempfile.mkdtemp(prefix="floor-", dir=root))

    def write(i: int) -> None:
        part = memoryview(host[starts[i] : starts[i] + sizes[i]])
        blake3.blake3(part, max_threads=blake3.blake3.AUTO).digest()
        fd = os.open(scratch / f"part-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            while part:
                part = part[os.write(fd, part) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def verify(i: int) -> mmap.mmap:
        with open(scratch / f"part-{i}", "rb") as f:
            mapped = mmap.mmap(f.fileno(), sizes[i], flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        blake3.blake3(mapped, max_threads=blake3.blake3.AUTO).digest()
        return mapped

    try:
        with ThreadPoolExecutor(4) as uploads:  # as many as a publisher's upload threads
            started = time.perf_counter()
            list(uploads.map(write, range(len(sizes))))
            publish = time.perf_counter() - started
        with ThreadPoolExecutor(FETCH_WORKERS) as fetches:
            started = time.perf_counter()
            parts = list(fetches.map(verify, range(len(sizes))))
            for start, part in zip(starts, parts):
                dest[start : start + len(part)].copy_(torch.frombuffer(part, dtype=torch.uint8))
            sync(target.device)
            load = time.perf_counter() - started
            del part
            fetches.submit(parts.clear)  # unmapped off the clock, as a subscriber does
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"publish": publish, "load": load}


def anchor_round(
    masters: dict[str, torch.Tensor], root: Path, device: torch.device,
    floor_buffers: tuple[torch.Tensor, torch.Tensor],
    **options: Any,
) -> dict[str, Any]:
    """Anchors into a fresh local store and a fresh replica: seconds to publish the first (its snapshot
    allocated and captured on the way) and a periodic one (from the snapshot kept since), to load the
    latter; bytes and files; and the :func:`store_floor` of the periodic anchor's parts."""
    store = Path(tempfile.mkdtemp(prefix="anchor-", dir=root)) / "run"
    infos: list[Any] = []
    first = next(iter(masters.values())).view(-1)
    kept = first[0].clone()  # put back after the round: the run's replica still holds the original
    try:
        started = time.perf_counter()
        with Publisher(masters, str(store), on_publish=infos.append, anchor_every=1, **options) as publisher:
            publisher.publish(0, block=True)
            publisher.flush()
            publish_s = time.perf_counter() - started
            first[0] = first[0] * 2 + 1  # one change: version 1 is a delta, then the periodic anchor
            publisher.publish(1, block=True)
            publisher.flush()
        del publisher  # and its snapshot: a copy of the weights the loads below need not share the device with
        periodic = next(i for i in infos if i.version == 1 and i.kind == "anchor")
        loads = {}
        for mapped in (True, False):  # parts mapped from the page cache (the default), and read into memory
            replica = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in masters.items()}
            started = time.perf_counter()
            Subscriber(LocalStore(store, map_reads=mapped), TorchModuleApplier(replica)).update()
            sync(device)
            loads[mapped] = time.perf_counter() - started
            assert all(torch.equal(replica[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16))
                       for n, t in masters.items())
            del replica  # before the next one is made
        parts = [p for p in (store / "anchors").iterdir() if "0000000001" in p.name]
        floor = store_floor([p.stat().st_size for p in parts], *floor_buffers, root)
    finally:
        first[0] = kept
        shutil.rmtree(store.parent, ignore_errors=True)
    return {"publish": publish_s, "periodic": periodic.t_total, "load": loads[True], "load, copied": loads[False],
            "bytes": periodic.bytes, "files": len(parts), "floor": floor}


def profile_stage(
    label: str, fn: Callable[[], Any], device: torch.device, out: Path, prepare: Callable[[], Any] | None = None
) -> None:
    """One more run of ``fn`` under torch's profiler (host ops on every thread, and the device's kernels on
    a GPU), then one under cProfile (the Python of the calling thread), each after ``prepare()`` if given:
    ``out/profile_<label>.txt`` holds the tables, ``out/profile_<label>.json.gz`` the trace
    (chrome://tracing, Perfetto). Neither run is timed."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if prepare is not None:
        prepare()
    sync(device)
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    stem = out / f"profile_{label.replace(' ', '_')}"
    trace = stem.with_suffix(".json")
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    averages = prof.key_averages()
    tables = [f"{label}: torch ops by self host time\n"
              + averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)]
    if device.type == "cuda":
        tables.insert(0, f"{label}: torch ops by self device time\n"
                      + averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    del prof, averages
    gc.collect()  # the profiler's event objects, freed now: a collection of them inside the run would show as its own
    if prepare is not None:
        prepare()
    sync(device)
    host = cProfile.Profile()
    host.enable()
    fn()
    sync(device)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
    tables.append(f"{label}: Python of the calling thread (cProfile, by own time)\n{text.getvalue()}")
    stem.with_suffix(".txt").write_text("\n\n".join(tables))


def copy_floor(numel: int, device: torch.device, repeats: int, *, from_host: bool) -> dict[str, float]:
    """One copy of every weight as one flat bf16 tensor onto ``device``: from another there, or from (pinned)
    host memory. The two buffers are the stage's own, dropped on return, and written before (on a CPU, memory
    never written reads as one shared page of zeros, faster than any weights)."""
    dst = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    if from_host:
        src = torch.ones(numel, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    else:
        src = torch.ones_like(dst)
    return spread(lambda: dst.copy_(src, non_blocking=from_host), repeats, device)


def diff_stage(
    model: Model | Checkpoints, density: float, repeats: int, device: torch.device, profiles: Path | None
) -> tuple[dict[str, dict[str, Any]], int, bytes]:
    """One step of ``model``, diffed on the training thread and on the device path against the floor; its
    rows, its changed elements and its delta (default codec). The snapshot is the stage's own."""
    snapshot = Snapshot.capture(model.masters)
    nnz = model.step(density)
    t_diff = spread(lambda: diff(snapshot, model.masters), repeats, device)
    t_floor = spread(lambda: floor_diff(model, snapshot), repeats, device)
    t_device, phases = spread_phases(lambda: diff(snapshot, model.masters, on_device=True), repeats, device,
                                     diff_phases)
    waits, chunks = host_waits(), searched_chunks()
    changes = diff(snapshot, model.masters, on_device=True)
    waits, chunks = host_waits() - waits, searched_chunks() - chunks  # a run of small tensors is one chunk
    assert changes.nnz == nnz, (changes.nnz, nnz)
    changes = diff(snapshot, model.masters)
    assert changes.nnz == nnz, (changes.nnz, nnz)
    data = encode_delta(changes, version=1, base_version=0)
    if profiles:
        profile_stage("diff", lambda: diff(snapshot, model.masters), device, profiles)
    rows = {
        "diff": {"deltasync": t_diff["median"], "floor": t_floor["median"], "spread": [t_diff, t_floor]},
        "diff, device path": {"deltasync": t_device["median"], "floor": t_floor["median"], "host_waits": waits,
                              "tensors": len(model.masters), "chunks": chunks, "phases": phases,
                              "spread": [t_device, t_floor]},
    }
    return rows, nnz, data


def rank_stage(
    weights: dict[str, torch.Tensor], data: bytes, masters: dict[str, torch.Tensor], repeats: int,
    device: torch.device, fused: int = 1,
) -> tuple[dict[str, float], dict[str, float], int, dict[str, float], bool]:
    """A vLLM engine of one rank holding a copy of ``weights`` (``fused`` tensors to a parameter: see
    :func:`rank_map`): its worker decodes the file against them, read through its map (the device path, as on a
    GPU), then writes the patches and reads a sample back. The decode's and the write's times, where the
    decode's host time went, its host waits, and whether the rank ended equal to ``masters``."""
    index = rank_map({n: t.clone() for n, t in weights.items()}, fused)
    t_decode, phases = spread_phases(lambda: decode_here(index, [data], whole=False, on_device=True), repeats,
                                     device, device_decode.phases)
    waits = device_decode.host_waits()
    patches = decode_here(index, [data], whole=False, on_device=True)
    waits = device_decode.host_waits() - waits
    t_apply = spread(lambda: (write_patches(index, patches), check_written(index, patches)), repeats, device)
    exact = all(torch.equal(from_start(index.targets[n][0].param.data, index.targets[n][0].whole_start() or 0)
                            [: t.numel()].view(torch.int16), t.to(torch.bfloat16).view(-1).view(torch.int16))
                for n, t in masters.items())
    return t_decode, phases, waits, t_apply, exact


def apply_floors(
    replica: dict[str, torch.Tensor], patches: dict[str, Any], repeats: int, device: torch.device
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Torch's two scatter kernels writing ``patches`` (decoded on the host) into a copy of ``replica``, their
    indices and values already on the device (which kernel is faster depends on the device and the density:
    ``tensors.write_at``), and ``index_copy_`` with their copy from (pinned) host memory on the way."""
    targets = {n: t.clone().view(-1).view(torch.int16) for n, t in replica.items()}
    there = {n: (torch.from_numpy(p.indices).to(device), torch.from_numpy(p.values).to(device))
             for n, p in patches.items()}
    t_copy = spread(lambda: [targets[n].index_copy_(0, i, v) for n, (i, v) in there.items()], repeats, device)
    t_put = spread(lambda: [targets[n].index_put_((i,), v) for n, (i, v) in there.items()], repeats, device)
    host = {n: (torch.from_numpy(p.indices), torch.from_numpy(p.values)) for n, p in patches.items()}
    if device.type == "cuda":
        host = {n: (i.pin_memory(), v.pin_memory()) for n, (i, v) in host.items()}
    t_with_copy = spread(
        lambda: [targets[n].index_copy_(0, i.to(device, non_blocking=True), v.to(device, non_blocking=True))
                 for n, (i, v) in host.items()], repeats, device,
    )
    return t_copy, t_put, t_with_copy


def rank_map(weights: dict[str, torch.Tensor], fused: int = 1) -> IndexMap:
    """The index map of a vLLM rank that holds every tensor whole: each in a parameter of its own, or (1-D
    tensors, ``fused`` > 1) stacked ``fused`` to a parameter, each at a flat range of its own, as an engine fuses
    a Mixture-of-Experts layer's experts. Two parameters take turns over each run of ``2 * fused`` tensors in
    the file's order, so that neither's tensors lie side by side in the file, as a checkpoint lists an
    expert's ``gate_proj`` and ``up_proj`` (one fused parameter) then its ``down_proj`` (another), expert
    after expert."""
    if fused <= 1:
        return IndexMap.whole({name: torch.nn.Parameter(t, requires_grad=False) for name, t in weights.items()})
    index = IndexMap(TensorSpec.of(name, t) for name, t in weights.items())
    groups: dict[int, list[str]] = {}
    for i, name in enumerate(weights):
        groups.setdefault(i // (2 * fused) * 2 + i % 2, []).append(name)
    for number, group in groups.items():
        param = torch.nn.Parameter(torch.cat([weights[n] for n in group]), requires_grad=False)
        at = 0
        for name in group:
            size = weights[name].numel()
            index.targets[name].append(Target(param, f"experts.{number}.weight", (size,), lo=(0,), hi=(size,),
                                              offset=(at,), flat=(0, size, at)))
            at += size
    return index


def floor_diff(model: Model, snapshot: Snapshot) -> None:
    for name, master in model.masters.items():
        torch.ne(master.to(torch.bfloat16), snapshot[name]).nonzero()


def checkpoint_bytes(path: str) -> tuple[int, int]:
    """``(bytes, elements)`` of the floating-point tensors of a checkpoint (as :func:`load_checkpoint` keeps
    them), read from its files' headers: what its masters will take, before any is loaded."""
    from safetensors import safe_open

    from deltasync.appliers.checkpoint.files import checkpoint_files
    from deltasync.format.layout import SAFETENSORS_DTYPES

    try:
        files = checkpoint_files(Path(path)) if Path(path).is_dir() else [Path(path)]
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    nbytes = elements = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                name_of = piece.get_dtype()
                dtype = SAFETENSORS_DTYPES.get(name_of, torch.uint8)  # 8-bit floats (F8_*): a byte each
                if dtype.is_floating_point or name_of.startswith("F8"):
                    numel = math.prod(piece.get_shape())
                    nbytes, elements = nbytes + numel * dtype.itemsize, elements + numel
    return nbytes, elements


def check_device_memory(device: torch.device, master_bytes: int, weight_bytes: int, what: str) -> None:
    """Refuse up front, not minutes in with an out-of-memory error, a run its GPU cannot hold: the masters
    and four more copies of the bf16 weights (see the module's docstring)."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    need = master_bytes + 4 * weight_bytes
    if need > free:
        raise SystemExit(
            f"{device}: {what} needs about {human_bytes(need)} of device memory (its masters, "
            f"{human_bytes(master_bytes)}, and four copies of its {human_bytes(weight_bytes)} of bf16 weights); "
            f"{human_bytes(free)} of {human_bytes(total)} are free: pass a smaller --params, or free the GPU")


def scratch_place(weight_bytes: int) -> Path:
    """Where the run's stores go: ``/dev/shm`` (memory: the stages then time deltasync,
    not a disk) where it has room for the largest round (two anchors and the store floor's copy of the weights:
    3x the bf16 weights), else under the temp directory (``TMPDIR``), said so; refused up front where neither
    has room (a container's ``/dev/shm`` is often 64 MB), not minutes in with a full disk."""
    need = 3 * weight_bytes + (256 << 20)
    places = [Path("/dev/shm"), Path(tempfile.gettempdir())]
    for place in places:
        if place.is_dir() and shutil.disk_usage(place).free >= need:
            if place != places[0]:
                print(f"/dev/shm cannot hold {human_bytes(need)}: the stores go under {place}, so the anchor "
                      "and whole-update rows include its filesystem", file=sys.stderr)
            return place
    free = {str(p): human_bytes(shutil.disk_usage(p).free) for p in places if p.is_dir()}
    raise SystemExit(f"the run's stores need about {human_bytes(need)} of space, more than is free in {free}: "
                     "point TMPDIR at a larger filesystem, or pass a smaller --params")


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if args.checkpoints:
        master_bytes, elements = checkpoint_bytes(args.checkpoints[0])
        what = f"a checkpoint of {elements / 1e6:,.0f}M parameters"
    else:
        elements = max(1, int(args.params) // args.tensors) * args.tensors
        master_bytes, what = 4 * elements, f"{elements / 1e6:,.0f}M parameters with fp32 masters"
    check_device_memory(device, master_bytes, 2 * elements, what)
    place = scratch_place(2 * elements)
    model: Model | Checkpoints
    if args.checkpoints:
        model = Checkpoints(args.checkpoints, device)
        update_rounds = min(args.repeats, model.rounds)  # whole updates: one checkpoint each
    else:
        model = Model(int(args.params), args.tensors, device)
        update_rounds = args.repeats
    numel = sum(t.numel() for t in model.masters.values())
    weight_bytes = 2 * numel
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    profiles = Path(args.profile) if args.profile else None
    if profiles:
        profiles.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="device-sync-", dir=place))
    rows: dict[str, dict[str, Any]] = {}
    try:
        # Every copy of the weights a stage needs is made for it and dropped after it (device memory:
        # the masters and at most four more copies of the bf16 weights; see the module's docstring).
        copy_all = copy_floor(numel, device, args.repeats, from_host=False)
        # The store floor's bytes: as many as the anchor's parts (the weights and small headers), memory touched.
        floor_bytes = weight_bytes + (16 << 20)
        floor_buffers = (torch.ones(floor_bytes, dtype=torch.uint8),
                         torch.ones(floor_bytes, dtype=torch.uint8, device=device))
        # Anchor publish and load against one copy_ of all weights, each round into a fresh store:
        # in parts of the default size, and in one part (the alternative).
        for label, options in (("", {}), (", one part", {"part_bytes": 1 << 62})):
            # One untimed round first: a fresh process pays once for thread pools and the allocator's first
            # large blocks, which a trainer or replica that runs for hours does not.
            rounds = [anchor_round(model.masters, root, device, floor_buffers, **options)
                      for _ in range(args.repeats + 1)][1:]
            nbytes = rounds[0]["bytes"]
            if not label:
                anchor_bytes = nbytes  # the default layout's, reported below
            stages = (("publish", "publish"), ("periodic", "publish, periodic"), ("load", "load"),
                      ("load, copied", "load, copied"))
            for stage, name in stages:
                times = [r[stage] for r in rounds]
                median = statistics.median(times)
                rows[f"anchor {name}{label}"] = {
                    "deltasync": median, "floor": copy_all["median"], "gb_per_s": nbytes / median / 1e9,
                    "files": rounds[0]["files"],
                    "spread": [{"median": median, "min": min(times), "max": max(times)}, copy_all],
                }
                if stage in ("periodic", "load"):  # what the machine's filesystem and the digest cost alone
                    floors = [r["floor"]["publish" if stage == "periodic" else "load"] for r in rounds]
                    # The fastest round: a floor is a bound, and a virtual machine's writes into fresh pages
                    # sometimes run several times slower in the kernel's copy, in any round of either.
                    rows[f"anchor {name}{label}"]["floor_store"] = min(floors)
                    rows[f"anchor {name}{label}"]["spread"].append(
                        {"median": statistics.median(floors), "min": min(floors), "max": max(floors)})
        del floor_buffers

        # The run the later stages use: its first version (an anchor) and a replica that holds it.
        replica = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in model.masters.items()}
        publisher = Publisher(model.masters, str(root / "run"), anchor_every=10**6)
        publisher.publish(0, block=True)
        publisher.flush()
        subscriber = Subscriber(str(root / "run"), TorchModuleApplier(replica))
        subscriber.update()
        # One step's change set: diff, encode, decode, apply, each against its floor.
        diff_rows, nnz, data = diff_stage(model, args.density, args.repeats, device, profiles)
        rows.update(diff_rows)
        header = read_header(data)
        decoder = TorchModuleApplier({n: t.clone() for n, t in replica.items()})

        def replica_decode(applier: TorchModuleApplier = decoder) -> Any:  # as a Subscriber calls it
            return decode(data, base=applier.lookup, on_device=applier.on_device)

        t_decode = spread(replica_decode, args.repeats, device)
        threads = parallel.WORKERS
        with one_core():  # the same decode on one thread: the per-core figure
            t_decode_one = spread(replica_decode, args.repeats, device)
        if profiles:
            profile_stage("decode", replica_decode, device, profiles)
        # The path of a replica on an accelerator: rebuilt where the weights live, one host wait per file.
        rebuilt = TorchModuleApplier(decoder.state(), stage=True)
        t_decode_device, device_phases = spread_phases(lambda: replica_decode(rebuilt), args.repeats, device,
                                                       device_decode.phases)
        decode_waits = device_decode.host_waits()
        replica_decode(rebuilt)
        decode_waits = device_decode.host_waits() - decode_waits
        _, patches = replica_decode()  # on an accelerator: rebuilt there, indices and values on the device
        _, host_patches = decode(data, base=decoder.lookup)  # on the host, as the host path decodes them
        entries = file_entries(bytes(data))

        def floor_decompress() -> None:
            for key, part in entries.items():
                entry = header.tensors[key.split("::")[0]]
                width = 2
                if key.endswith("::idx"):
                    expected = entry.nnz * int(entry.params["iw"]) + 8 * int(entry.params["big"])
                else:
                    expected = entry.nnz * width
                decompress(part.numpy(), expected, key)

        t_floor_decompress = spread(floor_decompress, args.repeats, device)
        # What no base-relative decoder avoids: decompressing, and reading the base at every changed index.
        held = {n: bits_view(t).view(-1) for n, t in decoder.state().items()}
        where = {n: torch.from_numpy(p.indices).to(device) for n, p in host_patches.items()}
        def floor_decode() -> None:
            floor_decompress()
            for name, index in where.items():
                held[name].index_select(0, index)

        t_floor_decode = spread(floor_decode, args.repeats, device)
        with one_core():
            t_floor_decode_one = spread(floor_decode, args.repeats, device)
        t_rank_decode, rank_phases, rank_waits, t_rank_apply, rank_exact = rank_stage(
            decoder.state(), data, model.masters, args.repeats, device, args.fused)
        t_apply = spread(lambda: decoder.apply(patches), args.repeats, device)
        if profiles:  # after its timed runs: the decode above left the replica as it was
            profile_stage("apply", lambda: decoder.apply(patches), device, profiles)
        # The path of patches decoded on the host (other codecs) into tensors on an accelerator.
        staged = TorchModuleApplier(decoder.state(), stage=True)
        t_apply_staged = spread(lambda: staged.apply(host_patches), args.repeats, device)
        t_floor_copy, t_floor_put, t_floor_h2d_apply = apply_floors(replica, host_patches, args.repeats, device)
        t_floor_apply = min(t_floor_copy, t_floor_put, key=lambda t: t["median"])
        # The whole replica update through the store, against copying every weight from host memory.
        updates, parts = [], []
        device_decode.phases.take()
        for version in range(1, update_rounds + 1):
            model.step(args.density)
            publisher.publish(version, block=True)
            publisher.flush()
            sync(device)
            started = time.perf_counter()
            info = subscriber.update()
            sync(device)
            updates.append(time.perf_counter() - started)
            parts.append((info.t_fetch, info.t_decode, info.t_apply))
            assert subscriber.version == publisher.version
        update_phases = per_call(device_decode.phases, update_rounds)  # none where the update decodes on the host
        if profiles and model.spare >= 2:  # two more versions: one for each profiler
            version = update_rounds

            def next_version() -> None:
                nonlocal version
                version += 1
                model.step(args.density)
                publisher.publish(version, block=True)
                publisher.flush()

            profile_stage("whole update", subscriber.update, device, profiles, prepare=next_version)
            assert subscriber.version == publisher.version
        t_full_copy = copy_floor(numel, device, args.repeats, from_host=True)
        exact = rank_exact and all(
            torch.equal(replica[n].view(torch.int16), model.masters[n].to(torch.bfloat16).view(torch.int16))
            for n in replica
        )
        publisher.close()
        delta_bytes = len(data)
        floors = {"floor": t_floor_decode["median"], "floor_decompress": t_floor_decompress["median"]}
        rows["decode"] = {"deltasync": t_decode["median"], **floors,
                          "changes_per_s": nnz / t_decode["median"], "threads": threads,
                          "spread": [t_decode, t_floor_decode, t_floor_decompress]}
        rows["decode, 1 thread"] = {"deltasync": t_decode_one["median"], "floor": t_floor_decode_one["median"],
                                    "floor_decompress": t_floor_decompress["median"],
                                    "changes_per_s": nnz / t_decode_one["median"], "threads": 1,
                                    "floor_changes_per_s": nnz / t_floor_decode_one["median"],
                                    "spread": [t_decode_one, t_floor_decode_one, t_floor_decompress]}

        def device_row(timed: dict[str, float], waits: int, phases: dict[str, float]) -> dict[str, Any]:
            """A decode on the device path: its rate, how many times the host waited, where its time went."""
            return {"deltasync": timed["median"], **floors, "changes_per_s": nnz / timed["median"],
                    "threads": threads, "host_waits": waits, "tensors": len(model.masters), "phases": phases,
                    "spread": [timed, t_floor_decode, t_floor_decompress]}

        rows["decode, device path"] = device_row(t_decode_device, decode_waits, device_phases)
        rows["apply"] = {"deltasync": t_apply["median"], "floor": t_floor_apply["median"],
                         "floor_with_copy": t_floor_h2d_apply["median"],
                         "floor_index_copy": t_floor_copy["median"], "floor_index_put": t_floor_put["median"],
                         "spread": [t_apply, t_floor_apply]}
        rows["apply, staged"] = {"deltasync": t_apply_staged["median"], "floor": t_floor_apply["median"],
                                 "floor_with_copy": t_floor_h2d_apply["median"],
                                 "spread": [t_apply_staged, t_floor_apply]}
        rows["decode, vLLM rank"] = device_row(t_rank_decode, rank_waits, rank_phases)
        rows["apply, vLLM rank"] = {"deltasync": t_rank_apply["median"], "floor": t_floor_apply["median"],
                                    "floor_with_copy": t_floor_h2d_apply["median"],
                                    "spread": [t_rank_apply, t_floor_apply]}
        rows["whole update"] = {"deltasync": statistics.median(updates), "floor": t_full_copy["median"],
                                "parts": {stage: statistics.median(p[k] for p in parts)
                                          for k, stage in enumerate(("fetch", "decode", "apply"))},
                                "phases": update_phases,
                                "spread": [{"median": statistics.median(updates), "min": min(updates),
                                            "max": max(updates)}, t_full_copy]}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "device": str(device),
        "params": numel,
        "tensors": len(model.masters),
        "fused": args.fused,
        "density": nnz / numel if args.checkpoints else args.density,
        "checkpoints": args.checkpoints,
        "changes": nnz,
        "delta_bytes": delta_bytes,
        "bytes_per_change": delta_bytes / nnz,
        "weight_bytes": weight_bytes,
        "anchor_bytes": anchor_bytes,
        "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "stores": str(place),
        "exact": exact,
        "stages": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--params", type=float, default=128e6)
    parser.add_argument("--tensors", type=int, default=TENSORS)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="8M params, 3 repeats, results in a temp dir")
    parser.add_argument("--out", help="results directory")
    parser.add_argument("--checkpoints", nargs="+", metavar="PATH",
                        help="a real run instead of the synthetic model: safetensors files (or directories of "
                             "them) of consecutive steps, at least --repeats + 2 for every whole-update round")
    parser.add_argument("--fused", type=int, default=1, metavar="N",
                        help="the vLLM rank's map stacks N tensors to a parameter, as an engine fuses a "
                             "Mixture-of-Experts layer's experts (default 1: a parameter each; not with "
                             "--checkpoints)")
    parser.add_argument("--profile", metavar="DIR",
                        help="also profile one more diff, decode, apply and whole update each (torch's profiler, "
                             "with the device's kernels on a GPU, and cProfile): tables and traces in DIR")
    args = parser.parse_args(argv)
    if args.fused < 1 or (args.fused > 1 and args.checkpoints):
        parser.error("--fused takes a positive N, and stacks the synthetic model's tensors (not --checkpoints)")
    if args.quick:
        args.params, args.repeats = 8e6, 3
    load = os.getloadavg()
    result = run(args)
    result["machine"] = shared_machine(load, "times are medians of --repeats runs on a shared machine")
    device = torch.device(args.device).type
    name = f"device_sync_{device}_checkpoints" if args.checkpoints else f"device_sync_{device}"
    if not args.checkpoints and args.tensors != TENSORS:  # a model of other tensors keeps results of its own
        name += f"_{args.tensors}_tensors"
    if args.fused > 1:
        name += f"_fused_{args.fused}"
    path = write_json(name, result, results_dir(args.quick, args.out))
    rows = []
    for stage, row in result["stages"].items():
        ratio = row["deltasync"] / row["floor"] if row["floor"] else float("inf")
        extra = ""
        if "gb_per_s" in row:
            extra = f"{row['gb_per_s']:.2f} GB/s, {row['files']} file(s)"
            if "floor_store" in row:
                store = row["floor_store"]
                extra += f"; store floor {1e3 * store:.1f} ms ({row['deltasync'] / store:.2f}x)"
        elif "chunks" in row:
            extra = f"{row['host_waits']} host waits for {row['tensors']} tensors in {row['chunks']} chunks"
        elif "parts" in row:
            extra = ", ".join(f"{stage} {1e3 * t:.1f} ms" for stage, t in row["parts"].items())
        elif "changes_per_s" in row:
            extra = f"{row['changes_per_s'] / 1e6:.0f} M changes/s on {row['threads']} thread(s)"
            if "floor_changes_per_s" in row:
                extra += f" (floor {row['floor_changes_per_s'] / 1e6:.0f} M)"
            if "host_waits" in row:
                extra += f"; {row['host_waits']} host wait(s) for {row['tensors']} tensors"
        rows.append([stage, f"{1e3 * row['deltasync']:.1f} ms", f"{1e3 * row['floor']:.1f} ms", f"{ratio:.1f}x", extra])
    print(f"{result['params'] / 1e6:.0f}M params in {result['tensors']} tensors on {result['device']}, "
          f"{result['changes']:,} changes ({100 * result['density']:.2f} %) "
          f"in {human_bytes(result['delta_bytes'])} ({result['bytes_per_change']:.2f} B/change), "
          f"exact: {result['exact']}")
    if result["device_peak_bytes"] is not None:
        print(f"device memory at the most: {human_bytes(result['device_peak_bytes'])} "
              f"({result['device_peak_bytes'] / result['weight_bytes']:.1f}x the bf16 weights)")
    print(table(rows, ["stage", "deltasync", "floor", "ratio", ""]))
    phased = [(stage, row) for stage, row in result["stages"].items() if row.get("phases")]
    if phased:  # where each device path's host time went: what paces a replica or trainer on an accelerator
        print("host time of the device paths by phase, per call (inflate runs on a thread of its own, beside the "
              "queueing; inflate_wait is the queueing waiting for it):")
        print(table([[stage, f"{1e3 * (row['parts']['decode'] if 'parts' in row else row['deltasync']):.1f} ms",
                      ", ".join(f"{phase} {1e3 * t:.1f}" for phase, t in row["phases"].items())]
                     for stage, row in phased], ["stage", "time", "phases (ms)"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
