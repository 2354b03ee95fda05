"""The Space's logic, without the browser: a trainer thread, a replica thread, and what the page shows.

:class:`Session` runs one training run at a time. Its trainer thread fine-tunes the policy
(:mod:`policy`: REINFORCE on a toy reward at an RL learning rate) and publishes a deltasync
version after every step with :class:`~deltasync.Publisher`, into a fresh local directory or, given
a bucket and a token, under a fresh prefix of a Hugging Face bucket. A replica in the same process,
a bf16 copy of the policy loaded from the checkpoint, follows that store with a
:class:`~deltasync.Subscriber` and a :class:`~deltasync.TorchModuleApplier`, and answers prompts.

Bit-exactness is checked per version: when a version is committed, the trainer hashes the weights it
published (the publisher's bf16 snapshot, with the same hook ``deltasync demo`` uses); after each
update the replica hashes its own weights; both with :func:`~deltasync.tensors.weights_digest`.
A version the replica skipped (its route jumped over it) has no replica hash and says so.

:meth:`Session.view` is a consistent copy of everything for the page; the Gradio layout lives in
``app.py``. Limits: one run per process (a second Start while a run is live is refused), CPU only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from deltasync import Publisher, Subscriber, TorchModuleApplier
from deltasync.codec import DEFAULT_CODEC, codec_names
from deltasync.demo import DEFAULT_LR, MAX_POLL_S, POLL_S, CommitHasher, quiet_transformers
from deltasync.demo.board import RAW_BYTES_PER_CHANGE
from deltasync.demo.models import CHAT_PAIRS
from deltasync.format import Header
from deltasync.publish.publisher import PublishInfo
from deltasync.tensors import weights_digest

if __package__:  # imported as spaces_demo.engine (the tests)
    from .policy import FULL_LAYERS, answer, load_policy, reinforce_step
else:  # app.py's directory is on sys.path (a Space, scripts/spaces)
    from policy import FULL_LAYERS, answer, load_policy, reinforce_step

__all__ = ["Settings", "Row", "View", "Session", "store_target", "ANCHOR_EVERY", "STEPS"]

logger = logging.getLogger("deltasync.spaces")

ANCHOR_EVERY = 10  # versions between anchors: the public TRL prototype's choice, small enough to watch happen
STEPS = 50  # a run ends by itself: a free CPU Space should not train forever
PROMPTS_PER_STEP = 2  # x (3 samples + 1 reference) = 8 sequences per step
Loader = Callable[[int, torch.dtype], tuple[Any, Any]]


@dataclass(frozen=True, slots=True)
class Settings:
    """The page's controls, validated."""

    layers: int = FULL_LAYERS
    """Transformer blocks kept (30: the whole SmolLM2-135M)."""
    lr: float = DEFAULT_LR
    """AdamW learning rate."""
    anchor_every: int = ANCHOR_EVERY
    """``Publisher(anchor_every=...)``."""
    codec: str = DEFAULT_CODEC
    """A registered codec name."""
    steps: int = STEPS
    """Optimizer steps before the run ends by itself (0: until stopped)."""
    hf_bucket: str = ""
    """``namespace/name[/prefix]`` of a Hugging Face bucket; empty: a local temporary directory."""
    hf_token: str = field(default="", repr=False)
    """Token for the bucket; empty: ``HF_TOKEN`` or the logged-in token. Never in ``repr``."""

    def __post_init__(self) -> None:
        if not 1 <= self.layers <= FULL_LAYERS:
            raise ValueError(f"layers must be between 1 and {FULL_LAYERS}, got {self.layers}")
        if not 0 < self.lr < 1:
            raise ValueError(f"learning rate must be in (0, 1), got {self.lr:g}")
        if self.anchor_every < 1:
            raise ValueError(f"anchor interval must be at least 1 version, got {self.anchor_every}")
        if self.codec not in codec_names():
            raise ValueError(f"unknown codec {self.codec!r}; registered: {codec_names()}")
        if self.steps < 0:
            raise ValueError(f"steps must be 0 (until stopped) or more, got {self.steps}")
        if self.hf_bucket.strip().strip("/").count("/") == 0 and self.hf_bucket.strip():
            raise ValueError(f"bucket must be 'namespace/name' (optionally '/prefix'), got {self.hf_bucket!r}")


def store_target(settings: Settings, run: str) -> tuple[str, dict[str, Any], str | None]:
    """Where run ``run`` publishes: (URL, store options, temporary directory to delete or ``None``)."""
    bucket = settings.hf_bucket.strip().strip("/")
    if bucket:
        token = settings.hf_token.strip() or os.environ.get("HF_TOKEN") or None
        return f"hf://buckets/{bucket}/{run}", ({"token": token} if token else {}), None
    temp = tempfile.mkdtemp(prefix=f"deltasync-space-{run}-")
    return temp, {}, temp


@dataclass(slots=True)
class Row:
    """One committed version, as the trainer published it and the replica received it."""

    info: PublishInfo
    """What the publisher reported when the version was committed."""
    trainer_digest: str | None
    """Hash of the bf16 weights the trainer committed as this version."""
    loss: float | None = None
    reward: float | None = None
    anchor_bytes: int | None = None
    """An anchor committed for this version too (``anchor_every``), in the background."""
    replica_digest: str | None = None
    """Hash of the replica's weights right after it applied this version (``None``: not (yet) held)."""
    apply_s: float | None = None
    lag_s: float | None = None

    @property
    def raw_bytes(self) -> int:
        """The same change set in the ``raw`` layout (int32 index + bf16 value); an anchor is dense."""
        return RAW_BYTES_PER_CHANGE * self.info.nnz if self.info.kind == "delta" else self.info.dense_bytes

    def exact(self, replica_version: int | None) -> str:
        """``match``, ``DIFF``, ``skipped`` (the replica's route jumped over it) or ``pending``."""
        if self.replica_digest is not None:
            return "match" if self.replica_digest == self.trainer_digest else "DIFF"
        return "skipped" if replica_version is not None and replica_version > self.info.version else "pending"


@dataclass(frozen=True, slots=True)
class View:
    """A consistent copy of the session's state, for one refresh of the page."""

    status: str
    running: bool
    error: str | None
    store: str | None
    params: int | None
    rows: list[Row]
    latest: int | None
    replica_version: int | None
    replica_error: str | None
    sample: str | None
    coalesced: int
    codec: str
    publish_error: str | None = None
    """The newest failed publish (the store refused or was unreachable), while publishes keep failing."""

    @property
    def lag_versions(self) -> int | None:
        if self.latest is None or self.replica_version is None:
            return None
        return self.latest - self.replica_version

    def exact_counts(self) -> tuple[int, int, int]:
        """(versions checked, of which matched, versions skipped by the replica's route)."""
        verdicts = [r.exact(self.replica_version) for r in self.rows]
        checked = sum(v in ("match", "DIFF") for v in verdicts)
        return checked, verdicts.count("match"), verdicts.count("skipped")


class _GuardedApplier(TorchModuleApplier):
    """Applies under a lock and records the version the weights hold, so an answer can name its version."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.lock = threading.Lock()
        self.held: int | None = None
        self._incoming: int | None = None

    def validate(self, header: Header) -> None:
        super().validate(header)
        self._incoming = header.version  # every part of one route step carries the same version

    def apply(self, decoded: Mapping[str, Any]) -> None:
        with self.lock:
            self.held = None  # partly written weights hold no version
            super().apply(decoded)
            self.held = self._incoming


@dataclass(slots=True)
class _Replica:
    model: Any
    tokenizer: Any
    applier: _GuardedApplier
    subscriber: Subscriber


@dataclass(slots=True)
class _State:
    phase: str = "idle: press Start"
    phase_since: float = field(default_factory=time.monotonic)
    running: bool = False
    error: str | None = None
    store: str | None = None
    params: int | None = None
    rows: dict[int, Row] = field(default_factory=dict)
    losses: dict[int, tuple[float, float]] = field(default_factory=dict)
    replica: dict[int, tuple[str, float, float]] = field(default_factory=dict)
    """version -> (weights digest, apply seconds, lag seconds)."""
    sample: str | None = None
    coalesced: int = 0
    codec: str = DEFAULT_CODEC


class Session:
    """One training run with its replica; thread-safe, driven by the page.

    Args:
        loader (`Callable[[int, torch.dtype], tuple]`, *optional*): ``(layers, dtype) -> (model, tokenizer)``;
            defaults to :func:`policy.load_policy` (SmolLM2-135M-Instruct, truncated to ``layers``).
    """

    def __init__(self, loader: Loader = load_policy) -> None:
        self._loader = loader
        self._lock = threading.Lock()
        self._state = _State()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._replica: _Replica | None = None
        self._publisher: Publisher | None = None
        self._temp: str | None = None

    # ------------------------------------------------------------------ controls

    def start(self, settings: Settings) -> None:
        """Start a run in the background; the previous run's replica and temporary store go away.

        Raises:
            `RuntimeError`: a run is still going (stop it first).
        """
        with self._lock:
            if self._state.running:
                raise RuntimeError("a run is in progress: press Stop and wait for it to end first")
            self._state = _State(phase="starting", running=True, codec=settings.codec)
        self._release()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(settings,), name="space-trainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the trainer to stop after its current step (the replica keeps serving)."""
        self._stop.set()
        self._phase("stopping after the current step")

    def close(self, timeout: float = 60) -> None:
        """Stop the run, the replica, and delete a temporary store."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._release()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the trainer thread ends; ``False`` on timeout."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def ask(self, prompt: str) -> tuple[int | None, str]:
        """The replica's greedy answer to ``prompt`` and the version whose weights produced it.

        Raises:
            `RuntimeError`: no replica yet (start a run). `ValueError`: empty prompt.
        """
        if not prompt.strip():
            raise ValueError("type a prompt first")
        replica = self._replica
        if replica is None or replica.applier.held is None:
            raise RuntimeError("no replica weights yet: start a run and wait for version 0")
        with replica.applier.lock:  # no delta lands mid-answer: the label is exact
            version = replica.applier.held
            text = answer(replica.model, replica.tokenizer, prompt)
        return version, text

    def view(self) -> View:
        """Everything the page shows, copied under the lock."""
        replica = self._replica
        publish_error = _failing(self._publisher)
        with self._lock:
            s = self._state
            rows = []
            for v in sorted(s.rows):
                row = s.rows[v]
                copy = dataclasses.replace(row)
                if row.info.step in s.losses:
                    copy.loss, copy.reward = s.losses[row.info.step]
                if v in s.replica:
                    copy.replica_digest, copy.apply_s, copy.lag_s = s.replica[v]
                rows.append(copy)
            status = f"{s.phase} ({time.monotonic() - s.phase_since:.1f} s)" if s.running else s.phase
            held = replica.subscriber.version if replica else None
            # The replica can hold a version before the trainer's hash of it is recorded.
            latest = max((v for v in (max(s.rows, default=None), held) if v is not None), default=None)
            return View(
                status=status,
                running=s.running,
                error=s.error,
                store=s.store,
                params=s.params,
                rows=rows,
                latest=latest,
                replica_version=held,
                replica_error=replica.subscriber.stats.last_error if replica else None,
                sample=s.sample,
                coalesced=s.coalesced,
                codec=s.codec,
                publish_error=publish_error,
            )

    # ------------------------------------------------------------------ trainer thread

    def _run(self, settings: Settings) -> None:
        publisher: Publisher | None = None
        steps = 0
        try:
            quiet_transformers()
            torch.manual_seed(0)
            self._phase(f"loading the trainer ({settings.layers} layers, fp32 masters)")
            model, tokenizer = self._loader(settings.layers, torch.float32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
            run = time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
            url, options, self._temp = store_target(settings, run)
            with self._lock:
                self._state.store = url
                self._state.params = sum(p.numel() for p in model.parameters())
            self._phase("loading the replica (bf16) and following the store")
            self._replica = self._follow(settings, url, options)
            hasher = CommitHasher(self)
            publisher = hasher.publisher = self._publisher = Publisher(
                model, url, codec=settings.codec, anchor_every=settings.anchor_every, on_publish=hasher, **options
            )
            self._phase("publishing version 0 (an anchor of the starting weights)")
            publisher.publish(0)
            while not self._stop.is_set() and (settings.steps == 0 or steps < settings.steps):
                steps += 1
                pairs = [CHAT_PAIRS[(steps * PROMPTS_PER_STEP + i) % len(CHAT_PAIRS)] for i in range(PROMPTS_PER_STEP)]
                result = reinforce_step(
                    model, tokenizer, optimizer, pairs, on_phase=lambda p, s=steps: self._phase(f"step {s}: {p}")
                )
                self._phase(f"step {steps}: publishing")
                with self._lock:
                    self._state.sample = result.sample
                    self._state.losses[steps] = (result.loss, result.reward)
                if not publisher.publish(steps):
                    with self._lock:
                        self._state.coalesced += 1
            self._phase(f"step {steps}: flushing the last version")
            publisher.close()
            self._finish(f"stopped after {steps} steps; the replica keeps serving v{publisher.version}")
        except BaseException as exc:  # noqa: BLE001 - shown on the page, with the traceback in the log
            logger.error("the run failed:\n%s", traceback.format_exc())
            if publisher is not None:
                try:
                    publisher.close()
                except BaseException:  # noqa: BLE001 - the first error is the one to show
                    logger.exception("closing the publisher failed too")
            self._finish(f"failed at step {steps}", error=f"{type(exc).__name__}: {exc}")

    def _follow(self, settings: Settings, url: str, options: dict[str, Any]) -> _Replica:
        model, tokenizer = self._loader(settings.layers, torch.bfloat16)
        applier = _GuardedApplier(model)

        def hashed(info: Any) -> None:
            # On the follow thread, before the next update: the weights are exactly `info.version`.
            digest = weights_digest(applier.state().items())
            with self._lock:
                self._state.replica[info.version] = (digest, info.t_apply, info.lag_s)

        subscriber = Subscriber(
            url,
            applier,
            replica_id="space-replica",
            poll_interval=POLL_S,
            max_poll_interval=MAX_POLL_S,
            on_update=hashed,
            **options,
        )
        return _Replica(model, tokenizer, applier, subscriber.start())

    def put(self, event: tuple[Any, ...]) -> None:
        """Receives the commit hasher's events (publisher worker thread)."""
        with self._lock:
            if event[0] == "commit":
                info, _, digest = event[1:]
                self._state.rows[info["version"]] = Row(PublishInfo(**info), trainer_digest=digest)
            elif event[0] == "anchor" and event[1] in self._state.rows:
                self._state.rows[event[1]].anchor_bytes = event[2]

    def _phase(self, phase: str) -> None:
        if self._stop.is_set() and not phase.startswith("stopping"):
            phase += " (stop requested: ends after this step)"
        with self._lock:
            if self._state.running:
                self._state.phase, self._state.phase_since = phase, time.monotonic()

    def _finish(self, phase: str, *, error: str | None = None) -> None:
        with self._lock:
            self._state.phase, self._state.running, self._state.error = phase, False, error

    def _release(self) -> None:
        replica, self._replica = self._replica, None
        if replica is not None:
            replica.subscriber.close()
        temp, self._temp = self._temp, None
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


def _failing(publisher: Publisher | None) -> str | None:
    """The newest publish failure while publishes are failing (none committed since), else ``None``."""
    if publisher is None or not publisher.stats.failing:
        return None
    newest = publisher.stats.errors[-1] if publisher.stats.errors else "see the log"
    return f"{publisher.stats.failed} publishes failed; newest: {newest}"
