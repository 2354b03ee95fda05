"""The ``deltasync`` weight-transfer backend for vLLM: every worker rank follows the run's store itself.

vLLM 0.32 drives weight updates through a registry of backends and a standard round trip
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``;
the same methods on ``LLM``). Installing deltasync registers this backend under the name ``deltasync``
(the ``vllm.general_plugins`` entry point, :mod:`.plugin`), so a server needs nothing of ours but::

    vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}'

Round trip:

- ``init_info`` (:class:`DeltaSyncInitInfo`): the run's store URL and what the replica needs (cache
  directory, the version it already holds). Each rank builds its index map from the engine's loaders and
  proves it against the checkpoint the engine loaded before it reports ready (invariant 8); a run of
  another model is refused here.
- ``update_info`` (:class:`DeltaSyncUpdateInfo`): the version to reach, ahead of the one served or behind it
  (the newest when absent, or the newest up to ``at_most``). Each
  rank reads the manifest, plans the cheapest route from what it holds, downloads the route's objects,
  checks every size, digest and header, decodes against its own weights (a tensor-parallel engine's ranks
  exchange the bases of the changed elements, so every rank checks every value digest), and only when
  every rank of the engine found everything in order does any of them write, in place, O(changed
  elements), reading the written elements back. An expert-parallel rank reads only the tensors it holds
  (its experts, its slices of the rest), by range where the manifest lists the objects' header hashes.
- ``start_weight_update`` and ``finish_weight_update`` are no-ops (in-place engines need none);
  ``finish_weight_update(weight_version)`` labels the served version, which ``/weight_info`` reports.

A refusal (a malformed ``update_info``, a version the store lacks, another model's run, a damaged object)
writes nothing and reaches an HTTP caller as a 4xx carrying its message (:mod:`.refusals`).

Limitations:

- A tensor-parallel engine takes deltas of codecs whose values depend only on the changed elements'
  bases (``compact``, the default, ``compact-abs``, ``raw``, ``dense``); ``compact-exp`` and ``exp-rice``
  read whole tensors of the base and are refused there, by name.
- A LoRA run published in adapter form is served through :class:`~deltasync.appliers.vllm.VLLMFollower`
  (the adapter is not a checkpoint tensor); merged versions come through here like any other.
- A write that fails on one rank after every rank validated leaves the engine reporting no version
  (its next update starts from an anchor).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...codec import Decoded, get_codec
from ...errors import (
    CodecError,
    ConfigError,
    DeltaSyncError,
    FingerprintMismatch,
    LayoutMismatch,
    ObjectNotFound,
    VersionError,
)
from ...format import Header, read_header
from ...protocol.keys import MANIFEST_KEY
from ...protocol.manifest import MAX_MANIFEST_BYTES, Manifest, Plan
from ...replica.applier import Applier
from ...replica.cache import open_cached
from ...replica.pins import Pin
from ...replica.ranged import Fetched
from ...replica.subscriber import Subscriber, UpdateInfo
from ...tensors import TensorSpec, fingerprint
from ..apply import Patch, check_header, merge_bits, read_bits, write_patches
from ..checkpoint.files import checkpoint_reader, checkpoint_specs
from ..mapping import IndexMap, uncovered_elements
from ..verify import VERIFY_SAMPLES, check_written, prove_map
from .cpu_hooks import plain_weights, plain_weights_attached, repack_touched
from .mapping import probe_index_map, runtime_params
from .quantized import check_quantization
from .prefetch import indices_of
from .rank_decode import accelerator_of, decode_here, refusal_from_json, refusal_to_json, warm_decoder
from .refusals import refusal_text
from .rpc import version_label

__all__ = ["BACKEND", "DeltaSyncInitInfo", "DeltaSyncUpdateInfo", "DeltaSyncWeightTransferEngine", "RankReplica"]

logger = logging.getLogger("deltasync.vllm")

BACKEND = "deltasync"
"""The name the backend is registered under: ``--weight-transfer-config '{"backend": "deltasync"}'``."""

# Codecs a tensor-parallel rank decodes from the gathered bases of the changed elements alone.
_BASE_AT_CHANGES = ("compact", "compact-abs", "raw", "dense")


def _require(kind: str, value: Any, types: tuple[type, ...], *, optional: bool = True) -> None:
    if (value is None and optional) or (isinstance(value, types) and not isinstance(value, bool)):
        return
    raise ConfigError(f"{kind} must be {' or '.join(t.__name__ for t in types)}, not {value!r}", argument=kind)


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    """What a replica needs to follow a run (``init_info`` of ``/init_weight_transfer_engine``)."""

    store: str = ""
    """The run prefix the trainer publishes to: a path, ``s3://bucket/prefix``, ``hf://buckets/ns/name/prefix``."""
    cache_dir: str | None = None
    """Share downloaded objects with the node's other replicas through this directory (docs/FLEET.md)."""
    start_version: int | None = None
    """The version the engine's weights already hold (a checkpoint the run published), with ``run_id``."""
    run_id: str | None = None
    """The run ``start_version`` belongs to."""
    checkpoint: str | None = None
    """The checkpoint directory to prove the map against (default: the directory the engine loaded)."""
    replica_id: str | None = None
    """The name of this replica in the run's acks (default: host, process and engine)."""
    verify: int = VERIFY_SAMPLES
    """Sparse elements per tensor read back after each write (0: whole tensors only)."""
    store_options: dict[str, Any] = field(default_factory=dict)
    """Backend options of the store (endpoint, region...); credentials come from the environment."""

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise ConfigError(f"init_info needs 'store', the run's store URL, not {self.store!r}", argument="store")
        for name in ("cache_dir", "run_id", "checkpoint", "replica_id"):
            _require(name, getattr(self, name), (str,))
        _require("start_version", self.start_version, (int,))
        if (self.start_version is None) != (self.run_id is None) or (self.start_version or 0) < 0:
            raise ConfigError("pass start_version (a version >= 0) and run_id together, or neither",
                              argument="start_version")
        _require("verify", self.verify, (int,), optional=False)
        if not isinstance(self.store_options, dict):
            raise ConfigError(f"store_options must be an object, not {self.store_options!r}", argument="store_options")


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """Which version to reach (``update_info`` of ``/update_weights``)."""

    version: int | None = None
    """The version to hold after the update, ahead of the one held or behind it (``None``: the newest)."""
    at_most: int | None = None
    """Without ``version``: the newest version up to this one (an engine past it stays where it is)."""

    def __post_init__(self) -> None:
        for name in ("version", "at_most"):
            value = getattr(self, name)
            _require(name, value, (int,))
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, not {value}", argument=name)
        if self.version is not None and self.at_most is not None:
            raise ConfigError("give version (exactly that one) or at_most (the newest up to it), not both",
                              argument="at_most")


class RankReplica(Applier):
    """One engine rank as a :class:`~deltasync.replica.subscriber.Subscriber` sees it: it takes every version's
    files whole, decodes them here and writes only what this rank holds, in step with the engine's other ranks.

    The ranks of a tensor-parallel engine keep in step by exchanges over the engine's tensor-parallel group,
    the same sequence on every rank: the version to reach, the route to it, then per version on the route
    that its files arrived, the bases of its changed elements (deltas), that it decoded, that it was written.
    A rank that fails between two exchanges sends its error at the next one instead, so every rank stops
    there together, and none writes what another refused.

    Args:
        index (`IndexMap`): this rank's proven map.
        specs (`list[TensorSpec]`): the checkpoint tensors the engine serves.
        group: the engine's tensor-parallel group (a ``torch.distributed`` group of CPU collectives), or
            ``None`` for an engine of one rank.
        verify (`int`): sparse elements per tensor read back after each write.
    """

    def __init__(self, index: IndexMap, specs: Sequence[TensorSpec], group: Any = None, *, verify: int) -> None:
        self.index = index
        self.specs = {s.name: s for s in specs}
        self.fingerprint = fingerprint(specs)
        self.group = group
        self.verify = verify
        self.pending = False  # the other ranks expect this rank's next exchange
        self._steps_left = 0
        self.last_apply: dict[str, float] = {}

    # ------------------------------------------------------------------ keeping the ranks in step

    def begin(self) -> None:
        """An update starts: the ranks' first exchange is ahead."""
        self.pending = self.group is not None

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order; raises the first rank's error when some rank sent one."""
        answers = self._gather({"ok": value})
        return self._settled(answers)

    def fail(self, error: BaseException) -> None:
        """This rank failed between two exchanges: send its error where the others wait, so all stop there."""
        if not self.pending:
            return
        payload = refusal_to_json(error) if isinstance(error, DeltaSyncError) else {
            "type": "DeltaSyncError", "message": f"a rank of the engine failed: {type(error).__name__}: {error}"}
        self._gather({"error": payload})
        self.pending = False

    def _settled(self, answers: list[Any]) -> list[Any]:
        errors = [a["error"] for a in answers if "error" in a]
        if errors:
            self.pending = False
            raise refusal_from_json(errors[0])
        return [a["ok"] for a in answers]

    def _gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    # ------------------------------------------------------------------ the applier protocol

    def validate(self, header: Header) -> None:
        check_header(header, self.specs, self.fingerprint, holder="vLLM engine")

    def lookup(self, name: str, indices: np.ndarray) -> np.ndarray:
        raise RuntimeError("a vLLM rank decodes whole files (takes_files); it is never asked for bases one by one")

    def apply(self, decoded: Mapping[str, Decoded]) -> None:
        raise RuntimeError("a vLLM rank decodes whole files (takes_files); it never takes decoded patches")

    def takes_files(self, kind: str) -> bool:
        return True

    def takes_ranges(self) -> bool:
        """An expert-parallel rank reads only the tensors it holds (the subscriber's ``only=``) and decodes
        those here."""
        return True

    def accept_route(self, plan: Plan) -> None:
        """The ranks take the same route, or none of them does."""
        route = [(step.version, step.kind, [o.key for o in step.objects]) for step in plan.steps]
        if len({json.dumps(r) for r in self.exchange(route)}) > 1:
            self.pending = False
            raise VersionError("the ranks of the engine planned different routes (a manifest changed between their "
                               "reads, or a rank avoids an object the others use); the next update plans again",
                               current=plan.start, latest=plan.target)
        self._steps_left = len(plan.steps)

    def apply_files(self, kind: str, blobs: list[bytes | memoryview | Fetched]) -> DeltaSyncError | None:
        """Decode and check one version's files (or this rank's tensors of them) on every rank of the engine;
        write only if every rank agrees."""
        started = time.perf_counter()
        self.exchange("fetched")  # every rank has this version's files, checked
        refused: DeltaSyncError | None = None
        patches: list[Patch] = []
        try:
            patches = self._decode(kind, blobs)
        except DeltaSyncError as exc:
            refused = exc
        decoded_at = time.perf_counter()
        outcome = self.exchange(None if refused is None else refusal_to_json(refused))
        first = next((o for o in outcome if o is not None), None)
        if first is not None:  # refused before any rank wrote anything: the engine holds what it held
            self.pending = False
            return refused if refused is not None else refusal_from_json(first)
        failure: BaseException | None = None
        checked = written = 0
        try:
            with torch.no_grad():
                written, touched = write_patches(self.index, patches)
                repack_touched(touched)
                verify_at = time.perf_counter()
                checked, wrong = check_written(self.index, patches, samples=self.verify, seed=len(patches))
            if wrong:
                lines = [f"{w['tensor']} in {w['param']}: {w['wrong']} of {w['read']} read back wrong" for w in wrong]
                failure = LayoutMismatch(
                    f"patches read back wrong right after they were written, so the engine is not exact; restart "
                    f"it: {'; '.join(lines[:5])}", name=str(wrong[0]["param"]),
                )
        except Exception as exc:  # noqa: BLE001 - every rank hears of it, then it is raised
            failure = exc
        self._steps_left -= 1
        written_by = self.exchange(None if failure is None else f"{type(failure).__name__}: {failure}")
        if self._steps_left <= 0:
            self.pending = False  # the route's last exchange: nothing more is expected of this rank
        if failure is not None:
            raise failure
        others = [w for w in written_by if w is not None]
        if others:  # this rank wrote, another did not: the engine is between versions, and knows it
            raise LayoutMismatch(f"another rank of the engine failed to write this version ({others[0]}); the engine "
                                 "holds no version now, and its next update starts from an anchor", name="engine")
        self.last_apply = {
            "decode_ms": 1e3 * (decoded_at - started), "write_ms": 1e3 * (verify_at - decoded_at),
            "verify_ms": 1e3 * (time.perf_counter() - verify_at), "written": float(written), "verified": float(checked),
        }
        return None

    def _decode(self, kind: str, blobs: list[bytes | memoryview | Fetched]) -> list[Patch]:
        if kind == "anchor" or self.group is None:  # whole tensors, or a rank that holds every element
            return decode_here(self.index, blobs, whole=kind == "anchor")
        return decode_here(self.index, blobs, whole=False, lookup=self._gathered_bases(blobs), on_device=False)

    def _gathered_bases(self, blobs: list[bytes | memoryview | Fetched]) -> Callable[[str, np.ndarray], np.ndarray]:
        """Every rank's bits at every changed element of the files, exchanged once: ``lookup(name, indices)``.
        Ranks that read different tensors (expert parallel) each ask for theirs; the holders answer."""
        headers = [b.header if isinstance(b, Fetched) else read_header(b) for b in blobs]
        for header, blob in zip(headers, blobs):
            for name in blob.names if isinstance(blob, Fetched) else header.tensors:
                entry = header.tensors[name]
                if entry.codec not in _BASE_AT_CHANGES or get_codec(entry.codec) is None:
                    raise CodecError(
                        f"{name}: codec {entry.codec!r} reads whole tensors of the base, which a rank of a "
                        f"tensor-parallel engine does not hold; publish with codec='compact' for this engine",
                        codec=entry.codec,
                    )
        wanted = indices_of(headers, blobs)
        mine = read_bits(self.index, {n: {"idx": np.concatenate(p)} for n, p in wanted.items()})
        answers = self.exchange(mine)
        bases: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        for name, pieces in wanted.items():
            merged = merge_bits(self.index.specs[name], sum(p.size for p in pieces), (a.get(name) for a in answers),
                                missing="changed elements are held by no rank of the engine")
            for idx, bits in zip(pieces, np.split(merged, np.cumsum([p.size for p in pieces[:-1]]))):
                bases[(name, int(idx[0]))] = (idx, bits)

        def lookup(name: str, indices: np.ndarray) -> np.ndarray:
            found = bases.get((name, int(indices[0]))) if indices.size else None
            if found is None or not np.array_equal(found[0], indices):
                raise CodecError(f"{name}: the decoder asked for bases the ranks did not exchange", name=name)
            return found[1]

        return lookup


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    """vLLM's worker-side engine for the ``deltasync`` backend: see the module docstring."""

    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replica: RankReplica | None = None
        self.subscriber: Subscriber | None = None
        self.last_update: UpdateInfo | None = None
        self.reads: frozenset[str] | None = None
        """The checkpoint tensors this rank reads of each version (an expert-parallel rank's share, by range);
        ``None``: every tensor (it holds some of each)."""
        self._written = False

    # ------------------------------------------------------------------ vLLM's round trip

    def parse_init_info(self, init_dict: dict[str, Any]) -> DeltaSyncInitInfo:
        return _parsed(DeltaSyncInitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaSyncUpdateInfo:
        return _parsed(DeltaSyncUpdateInfo, update_dict, "update_info")

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        """Map and prove this rank's weights, open the store, and refuse another model's run now."""
        try:
            self._init(init_info)
        except DeltaSyncError as exc:
            raise _marked(exc) from exc

    def start_weight_update(self) -> None:
        """Nothing to prepare: versions are written in place."""

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        """Reach ``update_info.version`` (the newest when absent) on every rank, or refuse it on every rank."""
        if self.subscriber is None or self.replica is None:
            raise _marked(ConfigError(
                "the deltasync backend is not initialised: call /init_weight_transfer_engine with the store first",
                argument="init_info"))
        replica = self.replica
        replica.begin()
        try:
            at_most = update_info.at_most
            target = self._agreed_target(update_info.version, newest=at_most is not None)
            if at_most is not None:  # the newest up to it: none published yet, or already there or past it
                capped = None if target is None else Pin("at-most", at_most).target(target, self.subscriber.version)
                self.last_update = None if capped is None else self.subscriber.update(version=capped)
            elif target is not None or replica.group is None:
                self.last_update = self.subscriber.update(version=target)
        except BaseException as exc:
            replica.fail(exc)  # the other ranks wait for this rank's word: they stop with it
            if isinstance(exc, DeltaSyncError):
                raise _marked(exc) from exc
            raise
        if self.last_update is not None:
            self._written = True

    def _agreed_target(self, version: int | None, *, newest: bool = False) -> int | None:
        """The version every rank goes to: ``version``, or the newest all of them saw (``None``: none published;
        an engine of one rank leaves that to its subscriber unless ``newest`` asks for it here)."""
        replica = self.replica
        assert replica is not None and self.subscriber is not None
        if version is not None:
            return version
        if replica.group is None and not newest:
            return None
        try:
            latest = Manifest.from_bytes(self.subscriber.store.get(MANIFEST_KEY, max_bytes=MAX_MANIFEST_BYTES)).latest
        except ObjectNotFound:
            latest = None
        seen = replica.exchange(latest) if replica.group is not None else [latest]
        return None if None in seen else min(seen)

    def finish_weight_update(self) -> None:
        """Nothing to finish: every write was read back in :meth:`receive_weights`."""

    def shutdown(self) -> None:
        """Close the store; the engine keeps serving the weights it holds."""
        if self.subscriber is not None:
            self.subscriber.close()
        self.subscriber = None

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> int | None:
        """The version this rank holds, or ``None`` before the first update (or after a failed write)."""
        return self.subscriber.version if self.subscriber is not None else None

    def label(self) -> str | None:
        """The engine's weight-version label for what this rank holds (``"7@3f1d2c4b5a6e"``)."""
        sub = self.subscriber
        return None if sub is None or sub.version is None else version_label(sub.version, sub.following)

    # ------------------------------------------------------------------ internals

    def _init(self, info: DeltaSyncInitInfo) -> None:
        started = time.perf_counter()
        group, rank = _tp_group(self.parallel_config)
        # Each rank maps and proves its own weights, then the ranks compare notes: a rank that failed stops all.
        found: tuple[IndexMap, list[TensorSpec], Any] | None = None
        error: DeltaSyncError | None = None
        try:
            found = self._map_and_prove(info)
        except DeltaSyncError as exc:
            error = exc
        replica = RankReplica(found[0] if found else IndexMap([]), found[1] if found else [], group,
                              verify=info.verify)
        replica.begin()
        if found is None:
            assert error is not None
            replica.fail(error)
            raise error
        index, specs, store = found
        owned = replica.exchange(index.owned())
        missing = uncovered_elements(replica.specs, owned)
        if missing:
            raise LayoutMismatch(f"checkpoint elements no rank of the engine holds: {', '.join(missing[:5])}",
                                 name=missing[0])
        replica_id = info.replica_id or f"{socket.gethostname()}-vllm-{os.getpid()}"
        # Initialised again: the engine still holds the version it reached (of its run), unless told otherwise.
        start, run = info.start_version, info.run_id
        if self.subscriber is not None:
            if start is None:
                start, run = self.subscriber.version, self.subscriber.run_id
            self.subscriber.close()
        held = frozenset(name for name, count in index.counts().items() if count)
        self.reads = held if held != set(replica.specs) else None
        self.subscriber = Subscriber(
            store, replica, replica_id=f"{replica_id}-r{rank}", ack=rank == 0, start_version=start, run_id=run,
            only=self.reads,
        )
        self.replica = replica
        logger.info("deltasync: rank %d follows %s (%d tensors mapped and proven in %.1f s)", rank, store.url,
                    len(specs), time.perf_counter() - started)

    def _map_and_prove(self, info: DeltaSyncInitInfo) -> tuple[IndexMap, list[TensorSpec], Any]:
        """This rank's map of the checkpoint's tensors, proven against what the engine loaded, and the store."""
        checkpoint = info.checkpoint or str(self.model_config.model)
        if not os.path.isdir(checkpoint):
            raise ConfigError(
                f"the checkpoint {checkpoint!r} is not a directory on this worker: pass init_info "
                "'checkpoint', the directory of safetensors files the engine loaded", argument="checkpoint",
            )
        specs = checkpoint_specs(checkpoint)
        check_quantization(getattr(self.vllm_config, "quant_config", None), specs)
        params = runtime_params(self.model, plain_weights(self.model))
        with plain_weights_attached(self.model):
            index = probe_index_map(self.model, specs, params)
        warm_decoder(accelerator_of(index))
        if not self._written:  # after a write the weights are no longer the checkpoint's: the earlier proof stands
            with checkpoint_reader(checkpoint) as loaded, torch.no_grad():
                proof = prove_map(index, loaded)
            if proof.failed:
                name, why = next(iter(proof.failed.items()))
                raise LayoutMismatch(
                    f"{len(proof.failed)} parameters of this engine do not read back as the checkpoint it loaded, "
                    f"so they cannot be patched exactly: {name} ({why})", name=name,
                )
        store = open_cached(info.store, info.cache_dir, **info.store_options)
        _refuse_another_model(store, fingerprint(specs))
        return index, specs, store


def _parsed(cls: type[Any], raw: Any, what: str) -> Any:
    """``cls(**raw)``, refused with a typed error naming what is wrong."""
    try:
        if not isinstance(raw, dict):
            raise ConfigError(f"{what} must be a JSON object, not {type(raw).__name__}", argument=what)
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if cls is DeltaSyncInitInfo and {"master_address", "world_size"} & set(raw):
            raise ConfigError(
                "this server runs the deltasync weight-transfer backend, not NCCL: train with deltasync's "
                "DeltaSyncGRPOTrainer or AsyncGRPOTrainer(weight_transfer=DeltaSyncTransfer(...)), or restart the "
                """server with --weight-transfer-config '{"backend": "nccl"}'""", argument=what,
            )
        if unknown:
            raise ConfigError(
                f"{what} has unknown keys {unknown}; it takes {sorted(f.name for f in fields(cls))}", argument=what
            )
        return cls(**raw)
    except ConfigError as exc:
        raise ConfigError(refusal_text(exc), argument=what) from None


def _marked(exc: DeltaSyncError) -> DeltaSyncError:
    """``exc`` again, its message marked for the server's 4xx (:func:`~.refusals.refusal_text`)."""
    if refusal_text(exc) == str(exc) or str(exc).startswith("deltasync refused"):
        return exc
    try:
        return type(exc)(refusal_text(exc), **exc.context)
    except TypeError:
        return DeltaSyncError(refusal_text(exc))


def _tp_group(parallel: Any) -> tuple[Any, int]:
    """This engine's tensor-parallel group for CPU collectives (``None`` with one rank) and this rank in it."""
    if int(getattr(parallel, "tensor_parallel_size", 1)) <= 1:
        return None, 0
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return tp.cpu_group, int(tp.rank_in_group)


def _refuse_another_model(store: Any, ours: str) -> None:
    """Raise :class:`FingerprintMismatch` now when the store already publishes another model."""
    try:
        data = store.get(MANIFEST_KEY, max_bytes=MAX_MANIFEST_BYTES)
    except DeltaSyncError:
        return  # nothing published yet, or the store is slow: the first update will tell
    manifest = Manifest.from_bytes(data)
    if manifest.fingerprint and manifest.fingerprint != ours:
        raise FingerprintMismatch(
            f"{store.url} publishes another model (fingerprint {manifest.fingerprint[:12]}, this engine "
            f"serves {ours[:12]}): point init_info 'store' at this model's run", expected=ours,
            found=manifest.fingerprint,
        )
