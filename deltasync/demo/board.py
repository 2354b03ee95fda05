"""The ``deltasync demo`` display: collects what the trainer and replicas report, prints it.

A :class:`Board` runs on one thread (:func:`pump_events`), fed by a multiprocessing queue: the trainer
posts each committed version (with the hash of what was committed) and its losses, each replica
posts its updates (with the hash of its weights). A version's line is printed once every live
replica holds it, so lines come out in order with each replica's lag and bit-exact check;
:func:`summary` closes the run with medians, the comparison against dense and raw payloads, and the
exactness verdict.
"""

from __future__ import annotations

import dataclasses
import queue as queue_mod
import statistics
import threading
from typing import Any

__all__ = ["Board", "Commit", "Replica", "RAW_BYTES_PER_CHANGE", "human_bytes", "pump_events", "summary"]

RAW_BYTES_PER_CHANGE = 6  # int32 index + bf16 value: the `raw` layout of the public TRL prototype


def human_bytes(n: float) -> str:
    """A byte count for the demo's tables, in decimal units: ``"512 B"``, ``"1.25 MB"``, ``"3.10 GB"``."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n:,}"


# ---------------------------------------------------------------------- bookkeeping


@dataclasses.dataclass
class Commit:
    info: dict[str, Any]
    time: float
    digest: str | None
    loss: float | None = None


@dataclasses.dataclass
class Replica:
    index: int
    process: Any
    ready: bool = False
    stopped: bool = False
    error: str | None = None
    applied: list[tuple[float, int, str]] = dataclasses.field(default_factory=list)
    """(wall time, version, weight hash) per update."""
    timings: list[tuple[tuple[str, ...], tuple[float, float, float]]] = dataclasses.field(default_factory=list)
    """(route, (fetch, decode, apply) seconds) per update."""
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.error is None

    @property
    def version(self) -> int | None:
        return self.applied[-1][1] if self.applied else None

    def reached(self, version: int) -> float | None:
        """Wall time at which this replica first held ``version`` or newer."""
        return next((t for t, v, _ in self.applied if v >= version), None)

    def held_at(self, when: float) -> int:
        """Version held at wall time ``when`` (-1: none yet)."""
        return max((v for t, v, _ in self.applied if t <= when), default=-1)

    def digest_of(self, version: int) -> str | None:
        return next((d for _, v, d in self.applied if v == version), None)


class Board:
    """Collects trainer commits and replica reports (one thread) and prints finished versions."""

    def __init__(self, replicas: list[Replica], out: Any) -> None:
        self.replicas = replicas
        self.out = out
        self.commits: dict[int, Commit] = {}
        self.losses: dict[int, float] = {}
        self.next: int | None = None
        self.final: int | None = None
        self.ready = threading.Event()
        self.printed = threading.Condition()
        self.done = threading.Event()
        self.stopped = threading.Event()

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind, rest = msg[0], msg[1:]
        if kind == "commit":
            info, when, digest = rest
            self.commits[info["version"]] = Commit(info, when, digest, self.losses.get(info["step"]))
            self.next = info["version"] if self.next is None else self.next
        elif kind == "anchor":
            version, nbytes, seconds = rest
            size = human_bytes(nbytes)
            self.say(f"      (anchor for v{version} committed too: {size}, {seconds:.2f} s, in the background)")
        elif kind == "loss":
            self.losses[rest[0]] = rest[1]
        elif kind == "final":
            self.final = rest[0]
        else:
            self._replica_event(kind, rest)
        self._flush()

    def _replica_event(self, kind: str, rest: tuple[Any, ...]) -> None:
        r = self.replicas[rest[0]]
        if kind == "ready":
            r.ready = True
            self.say(f"replica {r.index} ready (pid {rest[1]}, bf16 weights loaded in {rest[2]:.1f} s)")
        elif kind == "applied":
            r.applied.append((rest[2], rest[1], rest[5]))
            r.timings.append((tuple(rest[3]), tuple(rest[4])))
        elif kind == "stopped":
            r.stopped, r.rejected = True, rest[2]
        elif kind == "error":
            r.error = rest[1]
            self.say(f"replica {r.index} failed: {rest[1]}")

    def check_processes(self, events: Any) -> None:
        """Mark replicas whose process ended without saying so (checked only once their messages are read)."""
        exited = [r for r in self.replicas if r.live and not r.stopped and not r.process.is_alive()]
        if not events.empty():  # an exited process flushed its last messages before it ended
            return
        for r in exited:
            r.error = f"process exited with code {r.process.exitcode}"
            self.say(f"replica {r.index} lost: {r.error}")
        self._flush()

    def _flush(self) -> None:
        if all(r.ready or not r.live for r in self.replicas):
            self.ready.set()
        while self.next is not None and self.next in self.commits:
            if any(r.live and r.reached(self.next) is None for r in self.replicas):
                break
            self.say(self._line(self.next, self.commits[self.next]).rstrip())
            with self.printed:
                self.next += 1
                self.printed.notify_all()
        if self.final is not None and (self.next is None or self.next > self.final):
            self.done.set()
        if all(r.stopped or not r.live for r in self.replicas):
            self.stopped.set()

    def wait_printed(self, version: int, timeout: float) -> bool:
        """Block until the line of ``version`` is out (every live replica holds it)."""
        with self.printed:
            return self.printed.wait_for(lambda: self.next is not None and self.next > version, timeout)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def header(self) -> str:
        legend = (
            "ratio: dense bf16 bytes / shipped bytes; diff: time on the training thread; total: publish() to "
            "manifest commit;\nlag: newer versions the trainer had committed when the replica got this one (0: it "
            "kept up), seconds from commit to replica; check: replica's weight hash vs the trainer's\n\n"
        )
        cols = f"{'ver':>4} {'step':>4} {'kind':<6} {'loss':>6} {'changed':>9} {'sparsity':>9} {'shipped':>9} "
        cols += f"{'ratio':>6} {'diff':>7} {'total':>7}"
        return legend + cols + "".join(f" | {'replica ' + str(r.index) + ': lag, check':<21}" for r in self.replicas)

    def _line(self, version: int, c: Commit) -> str:
        i = c.info
        loss = f"{c.loss:.3f}" if c.loss is not None else "-"
        line = f"{version:>4} {i['step'] if i['step'] is not None else '-':>4} {i['kind']:<6} {loss:>6} "
        line += f"{_count(i['nnz']):>9} {100 * (1 - i['nnz'] / i['numel']):>7.3f} % {human_bytes(i['bytes']):>9} "
        line += f"{2 * i['numel'] / i['bytes']:>5.0f}x {1e3 * i['t_diff']:>4.0f} ms {i['t_total']:>5.2f} s"
        for r in self.replicas:
            line += f" | {self._cell(r, version, c):<21}"
        return line

    def _cell(self, r: Replica, version: int, c: Commit) -> str:
        reached = r.reached(version)
        if reached is None:
            return "lost"
        behind = max((v for v, other in self.commits.items() if other.time <= reached), default=version) - version
        mine = r.digest_of(version)
        check = "skip" if mine is None else ("exact" if mine == c.digest else "DIFF")
        return f"{behind} v {max(0.0, reached - c.time):5.2f} s {check}"


def pump_events(board: Board, events: Any) -> None:
    """The board's thread: every message goes through here, so the board needs no lock."""
    while True:
        try:
            msg = events.get(timeout=0.5)
        except queue_mod.Empty:
            board.check_processes(events)
            continue
        if msg[0] == "quit":
            return
        board.handle(msg)


# ---------------------------------------------------------------------- summary


def _payload_rows(deltas: list[Commit]) -> list[tuple[str, str]]:
    med = lambda key: statistics.median(c.info[key] for c in deltas)  # noqa: E731
    size, nnz, numel = med("bytes"), med("nnz"), deltas[0].info["numel"]
    raw = RAW_BYTES_PER_CHANGE * nnz
    return [
        ("median sparsity", f"{100 * (1 - nnz / numel):.3f} % ({_count(int(nnz))} of {_count(numel)} elements changed)"),
        ("median delta", human_bytes(size)),
        ("vs dense bf16", f"{human_bytes(2 * numel)}: the delta is {2 * numel / size:.0f}x smaller"),
        (
            "vs raw layout (int32 + bf16)",
            f"{human_bytes(raw)}: the delta is {100 * size / raw:.1f} % of it ({raw / size:.1f}x smaller)",
        ),
        ("median publish cost", f"{1e3 * med('t_diff'):.0f} ms diff on the training thread, {med('t_total'):.2f} s to commit"),
    ]


def _replica_rows(board: Board, deltas: list[Commit]) -> list[tuple[str, str]]:
    rows = []
    live = [r for r in board.replicas if r.live]
    lags = [max(0.0, (r.reached(c.info["version"]) or c.time) - c.time) for c in deltas for r in live]
    if lags:
        rows.append(("replica lag (deltas)", f"median {statistics.median(lags):.2f} s, max {max(lags):.2f} s"))
    updates = [t for r in live for route, t in r.timings if route and route[0] == "delta"]
    if updates:
        fetch, dec, app = (statistics.median(u[k] for u in updates) for k in range(3))
        # On this machine the replicas share its cores with the trainer: the codec alone is faster
        # (benchmarks/device_sync.py measures it on an idle machine).
        rows.append(("replica update (deltas)", f"median fetch + digest {1e3 * fetch:.0f} ms, header checks + "
                     f"decode {1e3 * dec:.0f} ms (sharing the CPU with the trainer), apply in place {1e3 * app:.1f} ms"))
    rejected = {k: v for r in board.replicas for k, v in r.rejected.items()}
    if rejected:
        rows.append(("refused objects", str(rejected)))
    return rows


def _exactness(board: Board, final_ok: bool) -> tuple[bool, str]:
    """Every hash a replica reported matches the trainer's; every replica holds the final version."""
    checked = matched = 0
    for r in board.replicas:
        for _, version, digest in r.applied:
            if version in board.commits:
                checked += 1
                matched += digest == board.commits[version].digest
    at = [r.version for r in board.replicas]
    exact = final_ok and checked > 0 and matched == checked and all(r.live and v == board.final for r, v in zip(board.replicas, at))
    text = (
        f"{'yes' if exact else 'NO'}: {matched}/{checked} update hashes matched the trainer's; replicas at "
        f"{', '.join(f'v{v}' for v in at)} of v{board.final}; trainer's own bf16 cast of its final weights "
        f"{'matches' if final_ok else 'DIFFERS'}"
    )
    return exact, text


def summary(board: Board, final_ok: bool, steps: int, seconds: float) -> tuple[str, bool]:
    """The closing table, and whether every replica ended bit-identical to the trainer."""
    deltas = [c for c in board.commits.values() if c.info["kind"] == "delta"]
    rows = _payload_rows(deltas) if deltas else []
    rows += _replica_rows(board, deltas)
    coalesced = sum(c.info["coalesced"] for c in board.commits.values())
    rows.append(("versions", f"{len(board.commits)} ({len(deltas)} deltas) for {steps} optimizer steps, {coalesced} coalesced"))
    exact, verdict = _exactness(board, final_ok)
    rows += [("replicas exact", verdict), ("wall time", f"{seconds:.0f} s")]
    width = max(len(k) for k, _ in rows)
    head = [f"| {'summary':<{width}} | |", f"|{'-' * (width + 2)}|---|"]
    return "\n".join(head + [f"| {k:<{width}} | {v} |" for k, v in rows]), exact
