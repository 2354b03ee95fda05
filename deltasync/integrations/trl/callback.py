"""Trainer side of deltasync for transformers / TRL: a ``TrainerCallback`` that publishes every step.

:class:`DeltaSyncCallback` owns one :class:`~deltasync.Publisher`. It publishes
an anchor when training begins and a version after every optimizer step (or
every ``every`` steps), from ``on_step_end``: the Trainer runs
``on_pre_optimizer_step``, ``optimizer.step()``, ``on_optimizer_step``,
``lr_scheduler.step()``, ``global_step += 1``, ``on_step_end``, so at
``on_step_end`` the weights are final for the step *and* ``state.global_step``
already names it. A version therefore carries the same step number as a
checkpoint saved at that step, and as the ``global_step`` a GRPOTrainer syncs
at before its next generation (publishing from ``on_optimizer_step`` would need
``global_step + 1`` and would mislabel an optimizer step the scaler skipped).
The publish diffs on the training thread (``benchmarks/device_sync.py`` times
the diff); encoding and upload overlap the next step.

Sync policy (what :meth:`DeltaSyncCallback.sync` does, called by
:class:`~deltasync.integrations.DeltaSyncGRPOTrainer` before each generation):

- ``sync="async"`` (default): never wait, unless ``max_staleness=k`` is set:
  then wait only while the watched replicas are more than ``k`` versions behind
  the newest committed version.
- ``sync="on_policy"``: publish the current weights if they are not yet, wait
  for the commit, then wait until the watched replicas report that version.

Replicas are watched through their vLLM server's ``GET /weight_info`` (the
label the follower sets after each apply; the GRPO trainer watches the server
it generates from) or through the store's ``acks/<replica>.json``.

Metrics: every committed version's :class:`~deltasync.publish.publisher.PublishInfo`
is accumulated and added to the next ``on_log`` as ``deltasync/*`` keys
(bytes, sparsity, compression, diff and publish seconds, wait seconds), so they
reach wandb / tensorboard like any other metric, provided this callback runs
before the reporting callbacks: use :meth:`DeltaSyncCallback.attach` (the GRPO
trainer does) rather than ``callbacks=[...]``, where transformers puts
reporting integrations first.

Limitations (stated, not hidden):

Distributed training:

- Under accelerate / DDP only the world's main process publishes and waits;
  the other ranks skip.
- FSDP2 (DTensor parameters): every rank publishes its own shard of each
  version through :class:`~deltasync.publish.sharded.ShardedPublisher`, with no gather
  of the full model; rank 0 commits the manifest and waits for replicas. The
  hooks run on every rank in lockstep, as the publisher's collectives need.
  Tested with real FSDP2 on 2 gloo ranks driving these hooks, and through a
  GRPO run under ``accelerate launch`` (``tests/test_accelerate.py``).
- FSDP1: for each publish every rank takes part in gathering the full
  parameters to rank 0 (``summon_full_params``, to its CPU memory), one FSDP
  unit at a time, and the main process diffs each unit's tensors as they come
  (a stream, :func:`~deltasync.integrations.distributed.fsdp1_units`): rank 0
  holds the snapshot plus one unit, never a second copy of the model. Costs
  one gather of every unit per published version, and such a publish is never
  coalesced: the main process first waits for the previous upload (which had a
  training step to finish). Tested with real FSDP1 (a unit per Linear) on 2
  gloo ranks.
- DeepSpeed ZeRO-3: as FSDP2, every rank publishes the flat parameter slices
  it holds (``ds_tensor``) through :class:`~deltasync.publish.sharded.ShardedPublisher`,
  with no gather. Tested with a real ZeRO-3 engine on 2 gloo ranks publishing
  directly, and through this callback in a GRPO run under ``accelerate launch``
  followed by a vLLM server replica (``tests/test_accelerate.py``).
- PEFT LoRA models publish their merged weights in the base checkpoint's names
  (:mod:`deltasync.publish.peft`), computed without writing the trainer's, or with
  ``lora="auto"`` / ``"adapter"`` the adapter itself when that is smaller
  (:mod:`deltasync.publish.lora`). Under DeepSpeed ZeRO-3 such a model is gathered
  as under FSDP1 (merging needs whole factors and base rows; every rank holds
  the full weights during the gather, as in TRL's own sync of such a model),
  and the main process publishes. Not under FSDP (refused with ``ConfigError``).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, Literal

from ...errors import ConfigError, DeltaSyncError, ReplicaTimeout, require
from ...protocol.manifest import MANIFEST_KEY, MAX_MANIFEST_BYTES, Manifest
from ...protocol.resume import last_committed
from ...publish.fp8 import BlockFp8View, fp8_rule
from ...publish.lora import LORA_NAME, LoraMode, LoraWeights, publishable
from ...publish.peft import is_peft_model
from ...publish.publisher import Publisher, PublishInfo
from ...replica.subscriber import read_acks
from ...stores import Store
from ...tensors.fp8 import BlockFp8
from ...util.checks import check_int, check_number
from ..distributed import Gathered, NotGathered, fsdp1_gathered, sharding_of, zero3_gathered
from .metrics import publish_metrics

transformers = require("transformers", "trl")

__all__ = ["DeltaSyncCallback", "ReplicaTimeout"]

logger = logging.getLogger("deltasync.trl")

WAIT_TIMEOUT_S = 600.0  # an engine start plus an anchor apply fit well inside; a dead follower does not hang a run
POLL_FIRST_S = 0.05  # about when a replica of a small model has applied a delta: the first re-check
POLL_MAX_S = 0.5  # cap: at most two reads a second of /weight_info or the acks while waiting
HTTP_TIMEOUT_S = 10.0
MAX_INFO_BYTES = 1 << 20  # a server's /weight_info answer is a few dozen bytes

Sync = Literal["async", "on_policy"]


class DeltaSyncCallback(transformers.TrainerCallback):
    """Publishes a Trainer's weights to a deltasync store: an anchor at train begin, a version per step.

    Args:
        store (`str` or `Store`): run prefix, e.g. ``"./run1"`` or ``"s3://bucket/run1"``.
        every (`int`, *optional*, defaults to 1): publish every this many optimizer steps.
        sync (`str`, *optional*, defaults to ``"async"``): ``"async"`` or ``"on_policy"`` (see the module doc).
        max_staleness (`int`, *optional*): with ``"async"``, wait in :meth:`sync` while replicas are more
            than this many versions behind; ``None`` never waits.
        replicas (`int` or `Sequence[str]`, *optional*): which replicas to wait for, through the store's acks:
            at least this many, or these replica ids. ``None``: the vLLM server(s) registered with
            :meth:`watch_server` (the GRPO trainer registers its own), else every replica that acked this run.
        wait_timeout (`float`, *optional*, defaults to 600): seconds before a wait raises :class:`ReplicaTimeout`.
        lora (`str`, *optional*, defaults to ``"merged"``): for a PEFT LoRA model, ``"merged"`` publishes the
            merged weights (any replica of the base model follows), ``"auto"`` whichever of merged weights
            and the adapter is smaller per version, ``"adapter"`` the adapter (:mod:`deltasync.publish.lora`; replicas
            are given the adapter's config). ``deltasync/adapter_form`` logs the share of adapter versions.
        fp8 (`bool` or `BlockFp8`, *optional*): publish the model's block-fp8 view (:mod:`deltasync.publish.fp8`)
            for replicas that serve an fp8 checkpoint: ``True`` for 128x128 blocks, or a rule. For a model
            trained unsharded (a PEFT model with ``lora="merged"`` included).
        publisher_options: passed to :class:`~deltasync.Publisher` (``codec``, ``anchor_every``, store options
            such as ``endpoint``...).

    Example:
        ```python
        >>> callback = DeltaSyncCallback("s3://bucket/run1")
        >>> trainer = Trainer(model, args, train_dataset=data)
        >>> callback.attach(trainer)          # first in line, so deltasync/* metrics reach report_to
        >>> trainer.train()                   # v0 anchor at begin, one version per optimizer step
        ```
    """

    def __init__(
        self,
        store: str | Store,
        *,
        every: int = 1,
        sync: Sync = "async",
        max_staleness: int | None = None,
        replicas: int | Sequence[str] | None = None,
        wait_timeout: float = WAIT_TIMEOUT_S,
        lora: LoraMode = "merged",
        fp8: bool | BlockFp8 = False,
        **publisher_options: Any,
    ) -> None:
        check_int("every", every, low=1)
        self.fp8 = fp8_rule(fp8)
        if sync not in ("async", "on_policy"):
            raise ConfigError(f"sync must be 'async' or 'on_policy', not {sync!r}", argument="sync")
        if max_staleness is not None and (sync == "on_policy" or not isinstance(max_staleness, int) or max_staleness < 0):
            raise ConfigError(
                "max_staleness is a non-negative number of versions, for sync='async' only", argument="max_staleness"
            )
        if isinstance(replicas, (str, bool)) or (isinstance(replicas, int) and replicas < 1):
            raise ConfigError("replicas is a positive count or a list of replica ids", argument="replicas")
        check_number("wait_timeout", wait_timeout)
        self.store, self.every, self.sync_mode = store, every, sync
        self.max_staleness, self.wait_timeout = max_staleness, wait_timeout
        self.replicas = None if replicas is None or isinstance(replicas, int) else list(replicas)
        self.min_replicas = replicas if isinstance(replicas, int) else None
        self.publisher_options, self.lora = publisher_options, lora
        self.serves_adapter = False
        """The run carries a LoRA adapter that replicas serve under :data:`LORA_NAME` (``lora`` not merged)."""
        self.lora_name = LORA_NAME
        self.publisher: Publisher | None = None
        self.history: list[PublishInfo] = []
        """Every committed version's cost, oldest first (main process only)."""
        self.servers: list[str] = []
        self._state: Any = None
        self._published_step: int | None = None
        self._lock = threading.Lock()
        self._unlogged: list[PublishInfo] = []
        self._waited_s, self._waits, self._replica_version = 0.0, 0, None
        self._run_id: str | None = None
        self._gathered: Gathered | None = None  # FSDP1, or PEFT under ZeRO-3: every rank gathers to publish

    # ------------------------------------------------------------------ wiring

    def attach(self, trainer: Any) -> DeltaSyncCallback:
        """Add this callback to ``trainer`` ahead of the reporting integrations (wandb, tensorboard...)."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def watch_server(self, url: str) -> None:
        """Wait for this vLLM server's ``/weight_info`` label (set by the follower) when ``replicas`` is None."""
        if url.rstrip("/") not in self.servers:
            self.servers.append(url.rstrip("/"))

    @property
    def version(self) -> int | None:
        """Newest committed version (``None`` before the first commit or off the main process)."""
        return self.publisher.version if self.publisher is not None else None

    # ------------------------------------------------------------------ Trainer hooks

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._state = state
        if model is None:
            raise ValueError("DeltaSyncCallback needs the model: use it from a transformers Trainer")
        kind = sharding_of(model)
        if self.fp8 is not None and kind is not None:
            self._fp8_view(model, kind)  # refused before anything is published: block scales need whole matrices
        if kind == "zero3" and is_peft_model(model):
            # Merged weights need whole LoRA factors and whole base rows: every rank gathers around each
            # publish and the main process publishes; what it publishes is built inside the first gather.
            self.serves_adapter = self.lora != "merged"
            self._gathered = zero3_gathered(model, functools.cache(
                lambda: publishable(model, options=self.publisher_options, lora=self.lora)))
        elif kind == "fsdp1":  # every rank takes part in each gather; the main process publishes
            self._gathered = fsdp1_gathered(model)  # the publisher is made inside the first gather (full shapes)
        else:
            weights = publishable(model, sharded=kind is not None, options=self.publisher_options, lora=self.lora)
            self.serves_adapter = isinstance(weights, LoraWeights)
            if self.fp8 is not None:
                weights = self._fp8_view(weights, kind)
            if kind is not None:  # FSDP2, ZeRO-3: every rank publishes its shard (collectives: all take part)
                if self.publisher is None:
                    from ...publish.sharded import ShardedPublisher

                    self.publisher = ShardedPublisher(
                        model, self.store, on_publish=self._collect, **self.publisher_options
                    )
            elif not state.is_world_process_zero:
                return  # one writer per run prefix: the world's main process
            elif self.publisher is None:
                self.publisher = Publisher(weights, self.store, on_publish=self._collect, **self.publisher_options)
        if state.global_step and self.publisher is not None and state.is_world_process_zero:
            self._note_resume(state.global_step)
        self._publish(state.global_step)  # the anchor every replica can start from

    def _fp8_view(self, weights: Any, kind: str | None) -> BlockFp8View:
        """The block-fp8 view of what this run publishes.

        Raises:
            `ConfigError`: sharded weights (block scales need whole blocks), or a LoRA adapter form.
        """
        if kind is not None:
            raise ConfigError(
                f"fp8=True publishes the block-fp8 view of whole weight matrices, and this model is sharded "
                f"({kind}); train it unsharded, or publish bf16 and quantize on the replicas", argument="fp8",
            )
        if isinstance(weights, LoraWeights):
            raise ConfigError("fp8=True publishes the merged weights' block-fp8 view: use lora='merged'",
                              argument="fp8")
        assert self.fp8 is not None
        return BlockFp8View(weights, self.fp8)

    def _note_resume(self, step: int) -> None:
        """A resumed run: say where the store stands; the first version is an anchor of the restored weights."""
        try:
            committed = last_committed(self.publisher.store)
        except DeltaSyncError:
            return
        if committed is None or committed.step is None:
            return
        logger.info(
            "deltasync: resuming at step %d; %s holds v%d from step %d, and replicas follow this run's anchor "
            "of the restored weights (v%d)%s", step, self.publisher.store.url, committed.version, committed.step,
            committed.version + 1,
            f": they go back {committed.step - step} steps" if committed.step > step else "",
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._state = state
        if self._publishing and state.global_step % self.every == 0:
            self._publish(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.publisher is None or logs is None:
            return
        metrics = self.metrics()
        logs.update(metrics)
        # Trainer.log stored a copy of ``logs`` before calling back: keep the history complete too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._state = state
        if not self._publishing:
            return
        try:
            # The final weights, whatever ``every`` is; for a model gathered whole always (a coalesced publish
            # could not be redone by close(): the gathered weights are gone by then). A stream is never coalesced.
            gathered_whole = self._gathered is not None and self._gathered.stream is None
            if self._published_step != state.global_step or gathered_whole:
                self._publish(state.global_step, block=True)
            if self.publisher is not None:
                self.publisher.close()  # flush: raises what failed in the background
        except DeltaSyncError:
            logger.exception("deltasync: the final weights may not be published")
            raise
        finally:
            self._release()

    # ------------------------------------------------------------------ sync

    def sync(self, step: int | None = None) -> int | None:
        """Apply the sync policy before generation: publish if needed, then wait if asked.

        Args:
            step (`int`, *optional*): the trainer step the weights belong to; defaults to ``state.global_step``.

        Returns:
            `int` or `None`: the newest committed version (``None`` off the main process).

        Raises:
            `ReplicaTimeout`: the watched replicas did not get there within ``wait_timeout``.
        """
        if self._state is None:
            raise RuntimeError("the callback has not started: Trainer.train() calls on_train_begin() first")
        if not self._publishing:
            return None  # a data-parallel rank that does not publish
        step = self._state.global_step if step is None else step
        if self.sync_mode == "on_policy":
            if self._published_step != step:
                self._publish(step, block=True)
            if self.publisher is None:
                return None  # a rank of a gathered model: it took part in the gather
            self.publisher.flush()  # commits a coalesced publish too: the newest weights are a version now
            if not self._state.is_world_process_zero:
                return None  # a sharded rank: its shard is in; the main process waits for replicas
            target = self.publisher.version
        elif self.publisher is None:
            return None
        elif self.max_staleness is None:
            return self.publisher.version
        else:
            newest = self.publisher.version
            target = None if newest is None else newest - self.max_staleness
        if target is not None and target >= 0:
            self.wait_for(target)
        return self.publisher.version

    def wait_for(self, version: int, timeout: float | None = None) -> None:
        """Block until every watched replica holds ``version`` or newer.

        Raises:
            `ReplicaTimeout`: not reached within ``timeout`` (defaults to ``wait_timeout``).
        """
        started = time.monotonic()
        deadline = started + (self.wait_timeout if timeout is None else timeout)
        interval = POLL_FIRST_S
        while True:
            seen = self.replica_versions()
            lowest = _lowest(seen, self.min_replicas)
            if lowest is not None and lowest >= version:
                break
            if time.monotonic() >= deadline:
                empty = [r for r, v in seen.items() if v is None]
                hint = (
                    f" {', '.join(empty)} applied nothing of this run: a replica of another model refuses it "
                    "(FingerprintMismatch in its log), one that reads another store never sees it."
                    if empty else ""
                )
                raise ReplicaTimeout(
                    f"waited {time.monotonic() - started:.0f} s for replicas to reach v{version}; they report "
                    f"{seen or 'nothing'}.{hint} Is the follower running against {self._store_url()} "
                    "(deltasync follow --store ... --server ...)?",
                    version=version,
                    seen=seen,
                )
            time.sleep(interval)
            interval = min(POLL_MAX_S, interval * 2)
        with self._lock:
            self._waited_s += time.monotonic() - started
            self._waits += 1
            self._replica_version = lowest

    def replica_versions(self) -> dict[str, int | None]:
        """Version each watched replica reports now: ``{"server:URL" or replica id: version or None}``."""
        if self.replicas is None and self.min_replicas is None and self.servers:
            run_id = self._current_run_id()
            return {f"server:{url}": _server_version(url, run_id) for url in self.servers}
        assert self.publisher is not None
        run_id = self._current_run_id()
        acks = {  # fields checked: replicas write them
            str(a.get("replica")): a.get("version")
            for a in read_acks(self.publisher.store)
            if a.get("run_id") == run_id and type(a.get("version")) is int
        }
        if self.replicas is not None:
            return {rid: acks.get(rid) for rid in self.replicas}
        return acks

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, float]:
        """``deltasync/*`` metrics since the previous call (what ``on_log`` adds)."""
        with self._lock:
            infos, self._unlogged = self._unlogged, []
            waited, waits, replica = self._waited_s, self._waits, self._replica_version
            self._waited_s, self._waits = 0.0, 0
        out = publish_metrics(infos, self.version)
        if waits:
            out["deltasync/wait_s"] = waited
        if replica is not None:
            out["deltasync/replica_version"] = replica
        return out

    # ------------------------------------------------------------------ internals

    @property
    def _publishing(self) -> bool:
        """Whether this process takes part in publishing (the writer, a shard owner, or a gathering rank)."""
        return self.publisher is not None or self._gathered is not None

    def _publish(self, step: int, *, block: bool = False) -> None:
        """Publish (coalesced if the previous upload still runs: flush() covers it); for a gathered model
        (FSDP1, PEFT under ZeRO-3) every rank gathers the full weights first and the main process diffs them."""
        if self._gathered is None:
            assert self.publisher is not None
            self.publisher.publish(step, block=block)
        elif self._gathered.stream is not None:  # a layer at a time, on every rank; the main process publishes
            stream = self._gathered.stream()
            if self._state.is_world_process_zero:
                if self.publisher is None:
                    self.publisher = Publisher(None, self.store, on_publish=self._collect, **self.publisher_options)
                self.publisher.publish(step, tensors=stream)
            else:
                for _ in stream:  # this rank's part in each layer's gather
                    pass
        else:
            with self._gathered.gather():
                if self._state.is_world_process_zero:
                    full = self._gathered.weights()
                    if self.publisher is None:
                        self.publisher = Publisher(full, self.store, on_publish=self._collect, **self.publisher_options)
                    self.publisher.model = full
                    try:
                        # Never coalesced: a coalesced publish is redone later by flush() or close(),
                        # outside this gather, where the full parameters are freed. So wait for the
                        # previous upload (it had a whole training step to finish) and diff now.
                        self.publisher.publish(step, block=True)  # only copies leave the context
                    finally:
                        self.publisher.model = NotGathered()
        self._published_step = step

    def _release(self) -> None:
        """Drop what ties this callback to the model and the publisher to this callback, so both can
        be freed (and a sharded model's process groups destroyed) before the interpreter exits."""
        self._gathered = None
        if self.publisher is not None:
            self.publisher.on_publish = None  # the publisher stays readable: version, stats
            self.publisher.model = {}

    def _collect(self, info: PublishInfo) -> None:  # publisher worker thread
        with self._lock:
            self.history.append(info)
            self._unlogged.append(info)

    def _current_run_id(self) -> str | None:
        if self._run_id is None and self.publisher is not None:
            try:
                self._run_id = Manifest.from_bytes(self.publisher.store.get(MANIFEST_KEY, max_bytes=MAX_MANIFEST_BYTES)).run_id
            except DeltaSyncError:
                return None
        return self._run_id

    def _store_url(self) -> str:
        return self.publisher.store.url if self.publisher is not None else str(self.store)


def _lowest(seen: dict[str, int | None], at_least: int | None) -> int | None:
    """The version all watched replicas hold (the ``at_least`` newest, if a count is asked for)."""
    versions = sorted((v for v in seen.values() if v is not None), reverse=True)
    if at_least is not None:
        return versions[at_least - 1] if len(versions) >= at_least else None
    if not seen or len(versions) < len(seen):
        return None
    return versions[-1]


def _server_version(url: str, run_id: str | None) -> int | None:
    """The version a vLLM server holds of run ``run_id``, from the label the follower sets; ``None`` for an
    answer that says none (or is not the object a server sends: the trainer waits on, never fails on, it)."""
    from ...appliers.vllm.follower import parse_version_label

    try:
        with urllib.request.urlopen(f"{url}/weight_info", timeout=HTTP_TIMEOUT_S) as response:
            info = json.loads(response.read(MAX_INFO_BYTES + 1))  # longer than any answer: cut, so not JSON
    except (urllib.error.URLError, OSError, ValueError, RecursionError):  # RecursionError: nested too deep
        return None
    label = info.get("weight_version") if isinstance(info, dict) else None
    return parse_version_label(label, run_id)  # None: nothing applied yet, or another run's version
