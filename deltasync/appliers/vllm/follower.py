"""Transport, node side: the vLLM follower loop, an applier the :class:`~deltasync.Subscriber` drives.

:class:`VLLMFollower` lives next to the engine: in the process that owns an ``LLM``, or beside a ``vllm
serve`` server started with the worker extension and ``VLLM_SERVER_DEV_MODE=1`` (it then talks to
``/collective_rpc``, ``/pause``, ``/resume`` and ``/update_weight_version``). Deltas are downloaded and
validated once per node, here; the workers only read and write the changed elements
(:mod:`deltasync.appliers.vllm.worker`).

How a version travels to the workers:

- A delta, to an engine of one rank: its files whole, validated here (``deltasync_apply_files``); the
  worker decodes them against its own weights, checks every value against the publisher's digests before
  it writes (:mod:`.rank_decode`), and answers with a typed refusal if any check fails. A byte or two
  per changed element, one round trip.
- An anchor, to an engine whose workers read this machine's files (a server, or an ``LLM``'s engine
  processes): the files, dropped in a private directory in ``/dev/shm`` and sent by path
  (:mod:`.file_drop`), decoded by every rank as above.
- Otherwise (several ranks, a LoRA run, an engine elsewhere), two ``collective_rpc`` round trips of
  O(changed elements): ``deltasync_lookup`` (every rank returns the current bits of the changed elements
  it holds, merged here into the bases the ``compact`` codec decodes against; a subscriber built by
  :meth:`VLLMFollower.subscriber` sees each delta as it is downloaded, so a version's lookups go in one
  call), then ``deltasync_apply`` (each rank writes what it holds).

Modes (how generation meets an update):

- ``"inflight"`` (default): requests keep running; against a server, the
  scheduler is frozen (``/pause?mode=keep``) only while the apply runs, so no
  engine step mixes versions and vLLM's per-request weight-version spans are
  exact.
- ``"pause"``: against a server, ``/pause?mode=wait`` (or ``abort``) first, so
  no request spans two versions, then apply and ``/resume``.

In process, ``collective_rpc`` already runs between engine steps; call
``subscriber.poll()`` from the thread that owns the ``LLM`` (vLLM's sync client
is not thread-safe), e.g. between ``generate`` calls of an RL loop.

Versions: after each apply the engine's weight-version label is set to :func:`version_label`
(``"7@3f1d2c4b5a6e"``: version @ run id prefix; vLLM reports, per finished request, which output tokens
each label produced: ``CompletionOutput.weight_versions``); ranks answer ``deltasync_version``; and
:attr:`VLLMFollower.history` records ``(version, wall time applied)`` so a request's start/end time maps
to versions (:meth:`VLLMFollower.version_at`).

Command line (a server replica): ``deltasync follow`` (:mod:`deltasync.cli.follow`)::

    deltasync follow --store s3://bucket/run1 --server http://127.0.0.1:8000 --model /models/policy

How the engine is reached is :mod:`.vllm_rpc`; what travels is :mod:`.wire`; the early look at downloaded
deltas is :mod:`.vllm_prefetch`; the check that every checkpoint element maps to some rank is
:func:`.mapping.uncovered_elements`.

Limitations:

- One engine per follower; every rank must answer each call (``collective_rpc``).
- The in-process ``LLM`` is not driven from a background thread (see above).
- An anchor by path needs ``/dev/shm`` (or the temp directory) to hold it once more while it is applied.
"""

from __future__ import annotations

import base64
import bisect
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ...codec import Decoded
from ...errors import ConfigError, DeltaSyncError, LayoutMismatch, TensorMismatch
from ...format import Header
from ...replica.applier import Applier
from ...replica.ranged import Fetched
from ...stores import Store, open_store
from ...tensors import fingerprint
from ...util.checks import check_int
from ..apply import check_header, merge_bits
from ..checkpoint.files import checkpoint_specs
from ..mapping import uncovered_elements
from ..verify import VERIFY_SAMPLES, check_proofs, merge_compared
from .file_drop import FileDrop
from .lora import LORA_NAME, AdapterHost
from .prefetch import TAP_KEEP, TapBuffer, TapStore, changed_indices
from .rank_decode import refusal_from_json
from .rpc import HTTP_TIMEOUT_S, InProcessEngine, ServerEngine, parse_version_label, version_label
from .wire import pack, patch_batches, specs_to_json, unpack

__all__ = [
    "VLLMFollower",
    "EXTENSION",
    "checkpoint_specs",
    "version_label",
    "parse_version_label",
    # Defined with the engine calls and the delta tap; importable from here too.
    "HTTP_TIMEOUT_S",
    "TAP_KEEP",
]

logger = logging.getLogger("deltasync.vllm")

EXTENSION = "deltasync.appliers.vllm.worker.DeltaSyncWorkerExtension"
RPC_BATCH_BYTES = 64 << 20  # split anchors into RPCs of about this size (JSON bodies over HTTP stay sane)

Mode = Literal["inflight", "pause"]


# ---------------------------------------------------------------------- the applier


class VLLMFollower(Applier):
    """Applies deltas to a vLLM engine in place through its worker extension.

    Args:
        engine (`LLM` or `str`): an in-process ``vllm.LLM`` started with
            ``worker_extension_cls=deltasync.appliers.vllm.worker.DeltaSyncWorkerExtension``, or the
            base URL of such a server (``"http://127.0.0.1:8000"``).
        model (`str` or `Path`): the checkpoint directory the engine loaded; names and
            shapes come from its safetensors headers.
        mode (`str`, *optional*, defaults to ``"inflight"``): ``"inflight"`` or ``"pause"``.
        pause_mode (`str`, *optional*, defaults to ``"wait"``): ``/pause`` mode in ``"pause"``
            mode (``"wait"`` or ``"abort"``).
        dtype (`torch.dtype`, *optional*, defaults to bf16): the published dtype.
        verify (`int`, *optional*, defaults to 256): after each apply, every rank reads back this many
            random positions of each changed tensor (anchors: every element) and compares them
            with what it wrote; ``0`` skips the sampled check. Its cost is in :attr:`last_apply`.
        lora (*optional*): for a LoRA run published with ``lora="auto"`` or ``"adapter"``
            (:mod:`deltasync.publish.lora`): the adapter's ``LoraConfig`` or directory. The factors are held on the
            host and served as a vLLM LoRA adapter (:mod:`.vllm_lora`): in process, generate with
            ``lora_request=follower.lora_request`` (the ``LLM`` needs ``enable_lora=True``); a server serves
            it as ``model=lora_name`` (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``).
        lora_name (`str`, *optional*, defaults to ``"deltasync"``): the adapter's name on a server.
        decode_in_worker (`bool`, *optional*, defaults to True): an engine of one rank decodes each delta's
            files against its own weights (:meth:`takes_files`); ``False`` decodes them here, as for
            several ranks.
        anchor_files (`bool`, *optional*, defaults to True): an engine whose workers read this machine's files
            gets each anchor as files dropped in ``/dev/shm`` (:mod:`.file_drop`); ``False``: as patches.

    Raises:
        `TensorMismatch`: some checkpoint elements are held by no rank (the loaders skip
            them, or transform them), so the engine could not follow every delta exactly.
        `LayoutMismatch`: some runtime parameter did not prove: read back through the map, the
            weights the engine loaded differ from its checkpoint (a kernel keeps them in a
            layout deltasync does not know). Nothing was written.

    Example:
        ```python
        >>> llm = LLM(model_dir, worker_extension_cls=EXTENSION, dtype="bfloat16")
        >>> follower = VLLMFollower(llm, model=model_dir)
        >>> sub = follower.subscriber("s3://bucket/run1")
        >>> for batch in prompts:
        ...     sub.poll()                       # apply whatever was published, between steps
        ...     outputs = llm.generate(batch, params)
        ```
    """

    def __init__(
        self,
        engine: Any,
        *,
        model: str | Path,
        mode: Mode = "inflight",
        pause_mode: str = "wait",
        dtype: torch.dtype = torch.bfloat16,
        verify: int = VERIFY_SAMPLES,
        lora: Any = None,
        lora_name: str = LORA_NAME,
        decode_in_worker: bool = True,
        anchor_files: bool = True,
    ) -> None:
        if mode not in ("inflight", "pause"):
            raise ConfigError(f"mode must be 'inflight' or 'pause', not {mode!r}", argument="mode")
        if pause_mode not in ("wait", "abort"):
            raise ConfigError(f"pause_mode must be 'wait' or 'abort', not {pause_mode!r}", argument="pause_mode")
        self._engine = ServerEngine(engine) if isinstance(engine, str) else InProcessEngine(engine)
        self.mode, self.pause_mode = mode, pause_mode
        check_int("verify", verify, low=0)
        self.verify = verify
        self.decode_in_worker = decode_in_worker
        self.model_dir = Path(model).resolve()
        self.engine_specs = {s.name: s for s in checkpoint_specs(model, dtype=dtype)}
        """The checkpoint's tensors: what the engine holds."""
        self.adapter: AdapterHost | None = None
        """A LoRA run's factors, served as a LoRA adapter (``lora=``), else ``None``."""
        if lora is not None:
            self.adapter = AdapterHost(self._engine, self.model_dir, lora, name=lora_name)
        self.specs = {**self.engine_specs, **(self.adapter.specs if self.adapter else {})}
        """Every published tensor the follower takes: the engine's, and a LoRA run's factors."""
        self.fingerprint = fingerprint(self.specs.values())
        self.history: list[tuple[int, float]] = []
        """``(version, wall-clock time its apply finished)``, oldest first."""
        self.rpc_calls = 0
        self.last_apply: dict[str, float] = {}
        """The newest apply across ranks: ``ms`` (slowest rank), ``verify_ms``, ``verified`` (elements read back)."""
        self._pending: int | None = None
        self._subscriber: Callable[[], Any] = lambda: None  # weak: the subscriber holds this follower
        self._step: list[Header] = []
        # Prefetched base bits by (tensor, first index): one entry per file that carries the tensor
        # (several when a sharded trainer wrote it in slices).
        self._bases: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._prefetched = False
        self._lookups = threading.Lock()  # decoding threads share one prefetch and one RPC at a time
        self._tapped = TapBuffer()
        self._drop = FileDrop(enabled=anchor_files)  # anchors to a server on this machine: files
        self.ranks = self._init_workers()

    # ------------------------------------------------------------------ setup

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        self.rpc_calls += 1
        return self._engine.rpc(method, *args)

    def _init_workers(self) -> list[dict[str, Any]]:
        answers = self._rpc("deltasync_init", specs_to_json(self.engine_specs.values()), str(self.model_dir))
        check_proofs(answers)
        missing = uncovered_elements(self.engine_specs, [answer["owned"] for answer in answers])
        if missing:
            raise TensorMismatch(
                f"no rank of the engine holds these checkpoint elements, so deltas to them could not be "
                f"applied: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
                name=missing[0].split(" ")[0],
            )
        repacked = sorted({layer for a in answers for layer in a.get("repacked_layers", [])})
        if repacked:
            logger.warning(
                "deltasync: %d CPU-packed layers are re-packed after each apply (O(layer), not O(changes)); "
                "start the engine with DELTASYNC_VLLM_PLAIN_WEIGHTS=1 to patch them in place",
                len(repacked),
            )
        logger.info("deltasync: vLLM engine mapped (%d ranks, %d tensors) in %.0f ms",
                    len(answers), len(self.engine_specs), max(a["ms"] for a in answers))
        return answers

    def close(self) -> None:
        """Delete what the follower wrote (a LoRA run's adapter directories, dropped files); the engine keeps
        running."""
        self._drop.close()
        if self.adapter is not None:
            self.adapter.close()

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` to generate with (``lora=`` runs), or ``None`` when the engine's weights serve alone."""
        return self.adapter.request if self.adapter is not None else None

    def rank_tensors(self) -> dict[int, frozenset[str]]:
        """Per engine rank, the checkpoint tensors it holds elements of.

        Under expert parallelism a rank holds only its experts: this is the
        selection a per-rank reader passes as ``Subscriber(..., only=...)`` or to
        :func:`deltasync.replica.ranged.fetch_tensors` to download only its share.
        """
        return {int(a["rank"]): frozenset(n for n, c in a["counts"].items() if c) for a in self.ranks}

    # ------------------------------------------------------------------ applier protocol

    def validate(self, header: Header) -> None:
        """Refuse a file that does not fit the engine's checkpoint, before anything is decoded."""
        check_header(header, self.specs, self.fingerprint, holder="vLLM engine")
        if self._prefetched:  # a new step begins
            self._step, self._bases, self._prefetched = [], {}, False
        self._step.append(header)
        self._pending = header.version

    @property
    def local_reads(self) -> bool:
        """``False``: reads are RPCs to the engine's workers, batched per version for the decoder only."""
        return False

    def lookup(self, name: str, indices: np.ndarray) -> np.ndarray:
        """Current bits at ``indices`` of checkpoint tensor ``name``, merged across ranks."""
        if self.adapter is not None and name in self.adapter.specs:
            return self.adapter.lookup(name, indices)
        with self._lookups:
            if not self._prefetched:
                self._prefetched = True
                self._bases = self._prefetch()
            cached = self._bases.pop((name, int(indices[0])), None) if indices.size else None
            if cached is not None and np.array_equal(cached[0], indices):
                return cached[1]
            return self._lookup_many({name: indices})[name]

    def apply(self, decoded: Mapping[str, Decoded]) -> None:
        """Write validated patches on every rank; then label the engine with the new version."""
        version = self._pending
        self._step, self._bases, self._prefetched = [], {}, False
        factors = {n: p for n, p in decoded.items() if n not in self.engine_specs}  # a LoRA run's adapter
        batches = list(patch_batches({n: p for n, p in decoded.items() if n in self.engine_specs}, RPC_BATCH_BYTES))
        text = self._engine.text
        self._on_ranks([("deltasync_apply", (pack(batch, text=text), version if i == len(batches) - 1 else None,
                                             self.verify)) for i, batch in enumerate(batches)], version, factors)

    def takes_files(self, kind: str) -> bool:
        """Deltas go whole to an engine of one rank (no LoRA adapter) whose worker extension reports that it
        decodes files (``decodes_files``): it decodes them against its own weights (:mod:`.rank_decode`), one RPC
        of the files instead of one for the bases and one for the patches. Anchors go whole, by path, to an
        engine whose workers read this machine's files (:mod:`.file_drop`), instead of as decoded patches."""
        if kind == "anchor":
            return self.adapter is None and self._drop.readable(self._rpc)
        one = len(self.ranks) == 1 and bool(self.ranks[0].get("decodes_files"))
        return self.decode_in_worker and kind == "delta" and one and self.adapter is None

    def apply_files(self, kind: str, blobs: list[bytes | memoryview | Fetched]) -> DeltaSyncError | None:
        """Send one version's validated files to the rank that decodes and writes them (:meth:`takes_files`;
        whole files only: the follower takes no range reads).

        Returns the typed error that rank refused them with before writing anything, else ``None``."""
        files = [b for b in blobs if not isinstance(b, Fetched)]
        if len(files) != len(blobs):
            raise TypeError("VLLMFollower.apply_files takes whole files (its takes_ranges is False)")
        version = self._pending
        self._step, self._bases, self._prefetched = [], {}, False
        if kind == "anchor":
            with self._drop.files(files) as refs:
                return self._on_ranks([("deltasync_apply_files", (refs, kind, version, self.verify))], version, {})
        text = self._engine.text
        sent = [base64.b64encode(b).decode("ascii") if text else bytes(b) for b in files]
        return self._on_ranks([("deltasync_apply_files", (sent, kind, version, self.verify))], version, {})

    def _on_ranks(
        self, calls: list[tuple[str, tuple[Any, ...]]], version: int | None, factors: Mapping[str, Decoded]
    ) -> DeltaSyncError | None:
        """Make the write ``calls`` (the engine paused where it must be), check every rank read its patches
        back right, then the adapter, the prefix cache and the version label."""
        paused = False
        try:
            if self.mode == "pause" or isinstance(self._engine, ServerEngine):
                self._engine.pause(self.pause_mode if self.mode == "pause" else "keep")
                paused = True
            totals = {"ms": 0.0, "verify_ms": 0.0, "verified": 0.0, "decode_ms": 0.0}
            for method, args in calls:
                answers = self._rpc(method, *args)
                refused = [a["refused"] for a in answers if a.get("refused")]
                if refused:  # refused before any write: the engine holds what it held
                    return refusal_from_json(refused[0])
                unreadable = [a["unreadable"] for a in answers if a.get("unreadable")]
                if unreadable:  # not the version's fault; other ranks may have written theirs
                    raise DeltaSyncError(f"version {version}: a rank could not read its files: {unreadable[0]}")
                wrong = [w for a in answers for w in a.get("wrong", [])]
                if wrong:
                    lines = [f"{w['tensor']} in {w['param']}: {w['wrong']} of {w['read']} read back wrong"
                             for w in wrong]
                    raise LayoutMismatch(
                        f"version {version}: patches read back wrong right after they were written, so the "
                        f"engine is not exact; restart it: {'; '.join(lines[:5])}",
                        name=wrong[0]["param"],
                    )
                for key in ("ms", "verify_ms", "decode_ms"):
                    totals[key] += max(a.get(key, 0.0) for a in answers)
                totals["verified"] += sum(a.get("verified", 0) for a in answers)
            self.last_apply = totals
            if self.adapter is not None:
                self.adapter.apply(factors, version)
            # Cached KV blocks were computed with the old weights: no request may reuse them.
            self._engine.reset_prefix_cache()
            if version is not None:
                self._engine.label(version_label(version, self._run_id()))
        finally:
            if paused:
                self._engine.resume()
        if version is not None:
            self.history.append((version, time.time()))
        return None

    # ------------------------------------------------------------------ versions

    def engine_version(self) -> int | None:
        """The version every rank reports; raises if ranks disagree."""
        versions = {a["version"] for a in self._rpc("deltasync_version")}
        if len(versions) != 1:
            raise DeltaSyncError(f"ranks disagree on the version they hold: {sorted(map(str, versions))}")
        return versions.pop()

    def version_at(self, when: float) -> int | None:
        """The version in force at wall-clock time ``when`` (``None`` before the first apply here)."""
        at = bisect.bisect_right([t for _, t in self.history], when)
        return self.history[at - 1][0] if at else None

    # ------------------------------------------------------------------ subscriber wiring

    def subscriber(self, store: str | Store, **options: Any) -> Any:
        """A :class:`~deltasync.Subscriber` for this engine whose downloads feed one-call lookups."""
        from ...replica.subscriber import Subscriber

        store_options = {k: options.pop(k) for k in list(options) if k not in _SUBSCRIBER_ARGS}
        subscriber = Subscriber(self.tap(open_store(store, **store_options)), self, **options)
        self._subscriber = weakref.ref(subscriber)
        return subscriber

    def _run_id(self) -> str | None:
        return getattr(self._subscriber(), "following", None)

    def tap(self, store: Store) -> Store:
        """Wrap ``store`` so the deltas a subscriber downloads are seen here (for batched lookups)."""
        return TapStore(store, self._tapped.remember)

    # ------------------------------------------------------------------ internals

    def _prefetch(self) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
        """Decode this step's changed indices from the tapped bytes; fetch every base in one call."""
        pieces = {n: p for n, p in changed_indices(self._step, self._tapped).items() if n in self.engine_specs}
        if not pieces:
            return {}
        bases = self._lookup_many({name: np.concatenate(found) for name, found in pieces.items()})
        out = {}
        for name, found in pieces.items():
            for idx, bits in zip(found, np.split(bases[name], np.cumsum([i.size for i in found[:-1]]))):
                out[(name, int(idx[0]))] = (idx, bits)
        return out

    def _lookup_many(self, wanted: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        payload = pack({n: {"idx": np.asarray(i, dtype=np.int64)} for n, i in wanted.items()}, text=self._engine.text)
        answers = [unpack(a["data"]) for a in self._rpc("deltasync_lookup", payload)]
        return {
            name: merge_bits(self.engine_specs[name], len(indices), (a.get(name) for a in answers),
                             missing="changed elements are held by no rank of the engine")
            for name, indices in wanted.items()
        }

    def compare(self, checkpoint: str | Path) -> dict[str, dict[str, int]]:
        """Whether the engine holds a checkpoint's weights, bit for bit, without moving them: ``checkpoint``
        is a directory of safetensors files on the engine's machine (a trainer's saved weights, say).

        Every rank reads back every element it holds through its map and compares it with the file's
        (cast to the published dtype). Per checkpoint tensor the directory has: ``{"read": elements read
        back on all ranks, "wrong": how many differ, "missing": elements no rank holds}``; all zero
        ``wrong`` and ``missing``: bit-exact. O(numel) on the ranks; a bit per element on the wire.
        """
        answers = self._rpc("deltasync_compare", str(checkpoint), self._engine.text)
        return merge_compared(self.engine_specs, ((a["tensors"], a["held"]) for a in answers))

    def gather(self, name: str) -> torch.Tensor:
        """Checkpoint tensor ``name`` as the engine holds it, read back through the index map (O(numel); tests)."""
        spec = self.engine_specs[name]
        answers = (unpack(a["data"])[name] for a in self._rpc("deltasync_gather", name, self._engine.text))
        bits = merge_bits(spec, spec.numel, answers, missing="elements held by no rank")
        return torch.from_numpy(bits).view(spec.torch_dtype).view(spec.shape)


_SUBSCRIBER_ARGS = {
    "replica_id", "ack", "poll_interval", "max_poll_interval", "fetch_workers", "on_update", "start_version", "run_id",
}
