"""Shared benchmark plumbing: machine facts, timing, JSON results, tables."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"

# A benchmark is a program of its own: deltasync may hold the cycle collector off amid its work here and in
# the processes it starts (vLLM workers inherit the environment), as in a trainer or replica that allows it.
os.environ.setdefault("DELTASYNC_PAUSE_GC", "1")


def machine() -> dict[str, Any]:
    """Facts that make a result comparable: cores, CPU model, library versions."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import deltasync

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deltasync": deltasync.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def shared_machine(load_before: tuple[float, float, float], note: str) -> dict[str, Any]:
    """:func:`machine`, the load averages before and after a run, and how to read its times (``note``)."""
    return {**machine(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "note": note}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of one call, in seconds, and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Minimum wall time over ``repeats`` calls (the least disturbed by a shared machine)."""
    return min(timed(fn)[0] for _ in range(repeats))


def best_timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """:func:`best_of` that also returns the result of the last call (for timed steps whose output is used)."""
    best, result = timed(fn)
    for _ in range(repeats - 1):
        elapsed, result = timed(fn)
        best = min(best, elapsed)
    return best, result


def best_interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Minimum wall time of each function and its last result, running them round-robin.

    Times meant to be compared with each other (a baseline and the code under
    test) are taken in turns, so a burst of load on a shared machine hits all of
    them rather than skewing one ratio.
    """
    best = {name: float("inf") for name in fns}
    results: dict[str, Any] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            elapsed, results[name] = timed(fn)
            best[name] = min(best[name], elapsed)
    return best, results


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def write_json(name: str, payload: dict[str, Any], directory: Path | str | None = None) -> Path:
    """Write ``<directory>/<name>.json`` atomically (``benchmarks/results`` unless ``directory`` is given)."""
    folder = Path(directory) if directory is not None else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in cells[1:]])


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def results_dir(quick: bool, given: str | None) -> Path:
    """Where a benchmark writes its JSON: ``given``, else ``benchmarks/results`` for full runs.

    Quick runs default to a temporary directory, so a smoke run never replaces
    the committed results of a full run.
    """
    if given:
        return Path(given)
    return Path(tempfile.gettempdir()) / "deltasync-bench-quick" if quick else RESULTS


def _serve_main(kind: str, prefix: str, conn: Any, stop: Any) -> None:
    """Child process: run ``tests/servers/<kind>.py`` and send ``(url, options)`` of ``prefix``, until ``stop``."""
    import importlib
    import logging

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs one line per request otherwise
    module = importlib.import_module(f"tests.servers.{kind}")
    with module.serve() as server:
        conn.send((server.store_url(prefix), server.store_options()))
        stop.wait()


@contextlib.contextmanager
def loopback_store(kind: str, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A store URL and its options on a loopback server of the tests (``"s3"``: moto, ``"hf"``: fake Hub).

    The server runs in its own spawned process, so its CPU time and memory (moto
    keeps every object in memory) are not charged to the trainer that is timed.
    """
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    server = ctx.Process(target=_serve_main, args=(kind, prefix, send, stop), name=f"loopback-{kind}", daemon=True)
    server.start()
    try:
        if not receive.poll(120):
            raise RuntimeError(f"the loopback {kind} server did not start")
        url, options = receive.recv()
        yield url, options
    finally:
        stop.set()
        server.join(30)
        if server.is_alive():
            server.terminate()
