"""Sharded trainers: every rank publishes its own shard of each version, in parallel.

With FSDP2 / DTensor (parameters sharded along dim 0) each rank diffs the rows
it holds against its own published snapshot of those rows and uploads one delta
object; with DeepSpeed ZeRO-3 (each flattened parameter cut into equal flat
slices, ``param.ds_tensor``) each rank does the same with its slice, carried as
a flat element range (``elements`` in the file's header). With plain data
parallelism (every rank holds every parameter) the ranks split each tensor's
rows between them, so the diff, encode and upload work is divided too. Nothing of the model is gathered: rank 0 collects only the
object references (a few hundred bytes per rank) and commits the version, whose
manifest entry lists one object per rank (``ObjectRef.rank``); each tensor
entry in an object's header names the rows of the full tensor it carries.
Replicas fetch the shards in parallel and join them
(:func:`deltasync.format.combine`) with the same checks as any version: sizes,
hashes, fingerprint, disjoint rows, and full coverage for anchors.

Protocol. ``publish``, ``flush`` and ``close`` are collectives: every rank calls
them in the same order, as every rank of a training job runs the same loop.
Whether a publish coalesces (because some rank's upload is still running) is
decided jointly by one all-reduce of two integers, so all ranks always publish
the same versions. Each rank's background worker then runs the same short
sequence of collectives on a second gloo group that the training thread never
uses: rank 0 names the version, every rank uploads its shard, rank 0 gathers
the references and writes the manifest, and announces the outcome. A failure on
any rank aborts that version on every rank: all snapshots stay at the last
committed version and the next delta covers the changes (invariant 2).

Limits: parameters must be sharded along dim 0 (FSDP2's ``Shard(0)``),
partitioned by ZeRO-3, replicated, or on a 2-D mesh ``(Replicate, Shard(0))`` as HSDP lays them out;
tensor-parallel ``Shard(1)`` and ``Partial`` placements are refused. The
publisher's collectives run over the default process group. A rank that dies
mid-collective blocks the others until the process group's timeout, as in any
collective training job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConflictError, FingerprintMismatch, StoreError
from ..format import Elements, Window
from ..protocol.manifest import ObjectRef, VersionEntry
from ..stores import Store
from ..tensors import ChangeSet, TensorSpec, published_tensors
from .diff import Snapshot, diff
from .engine import Background, Shard, VersionWriter, close_publisher
from .options import PublishOptions
from .publisher import PublisherView

__all__ = ["ShardedPublisher", "ShardLayout", "shard_layout", "chunk_rows", "is_zero3"]

logger = logging.getLogger("deltasync.sharded")

Rows = tuple[int, int]


def chunk_rows(n: int, parts: int, index: int) -> Rows:
    """Rows ``[start, stop)`` of chunk ``index`` when ``n`` rows are cut into ``parts``
    chunks the way ``torch.chunk`` (and so FSDP2) cuts them: ``ceil(n / parts)`` rows each,
    the last ones shorter or empty."""
    size = -(-n // parts)
    start = min(index * size, n)
    return start, min(start + size, n)


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one rank publishes of a model."""

    specs: tuple[TensorSpec, ...]
    """Every tensor of the full model (names, full shapes, published dtype)."""
    rows: dict[str, Window]
    """Tensors this rank carries, with the dim-0 rows (or ZeRO-3's flat elements) of the full tensor it holds."""
    whole: frozenset[str]
    """Tensors this rank carries whole (0-d and zero-element tensors, published by rank 0)."""


def shard_layout(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    rank: int,
    world: int,
    dtype: torch.dtype | None = torch.bfloat16,
) -> tuple[ShardLayout, Callable[[], dict[str, torch.Tensor]]]:
    """The layout of ``rank``'s shard and a function returning its local tensors.

    DTensor parameters contribute the rows their placement gives this rank; plain
    tensors (replicated on every rank) are cut into ``world`` row chunks, one per rank.

    Raises:
        `ValueError`: a placement other than ``Shard(0)`` / ``Replicate``, or a local
            shard whose shape does not match its placement.
    """
    specs: list[TensorSpec] = []
    rows: dict[str, Window] = {}
    whole: set[str] = set()
    for name, tensor in published_tensors(model):
        if is_zero3(tensor):  # DeepSpeed ZeRO-3: a flat slice of the flattened parameter
            spec = TensorSpec(name, tuple(tensor.ds_shape), TensorSpec.of(name, tensor, dtype).dtype)
            specs.append(spec)
            if spec.numel == 0:  # anchors carry every tensor: rank 0 carries the empty ones
                if rank == 0:
                    whole.add(name)
                continue
            elements = _zero3_elements(tensor, rank)
            if elements.stop > elements.start:
                rows[name] = elements
            continue
        spec = TensorSpec.of(name, tensor, dtype)
        specs.append(spec)
        window = _rows_of(name, tensor, rank, world) if spec.numel else (() if rank == 0 else None)
        if window is None:
            continue
        if window == ():
            whole.add(name)
        elif window[1] > window[0]:
            rows[name] = window  # type: ignore[assignment]
    layout = ShardLayout(tuple(specs), rows, frozenset(whole))

    def local() -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in published_tensors(model):
            if name in layout.whole:
                shape = next(s.shape for s in layout.specs if s.name == name) if not tensor.numel() else None
                # An empty tensor has no elements to hold: its full shape stands for it on any rank.
                out[name] = _local(tensor) if shape is None else torch.empty(shape, dtype=tensor.dtype)
            elif name in layout.rows:
                window = layout.rows[name]
                if isinstance(window, Elements):
                    out[name] = tensor.ds_tensor.detach().view(-1)[: window.stop - window.start]
                else:
                    out[name] = _slice(name, tensor, window)
        return out

    return layout, local


def is_zero3(tensor: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter: this rank holds ``ds_tensor``, a flat slice of it."""
    return hasattr(tensor, "ds_tensor") and hasattr(tensor, "ds_shape") and hasattr(tensor, "partition_numel")


def _zero3_elements(tensor: Any, rank: int) -> Elements:
    """The flat elements of ``tensor`` that ZeRO-3 gives ``rank``: equal slices, the last ones short or empty."""
    size, numel = int(tensor.partition_numel()), int(tensor.ds_numel)
    start = min(rank * size, numel)
    return Elements(start, min(start + size, numel))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(tensor, DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if _is_dtensor(tensor) else tensor).detach()


def _rows_of(name: str, tensor: torch.Tensor, rank: int, world: int) -> Rows | tuple[()] | None:
    """This rank's rows of ``tensor``; ``()`` to carry it whole; ``None`` when another rank carries it."""
    if tensor.dim() == 0:
        return () if rank == 0 else None
    n = tensor.shape[0]
    if not _is_dtensor(tensor):
        return chunk_rows(n, world, rank)
    mesh, coords = tensor.device_mesh, tensor.device_mesh.get_coordinate()
    if coords is None:
        return None
    window: Rows = (0, n)
    sharded = False
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            if coords[dim] != 0:
                return None  # an identical copy lives on the replicate group's first rank
        elif placement.is_shard(0) and not sharded:
            window, sharded = chunk_rows(n, mesh.size(dim), coords[dim]), True
        else:
            raise ValueError(
                f"{name}: placement {tuple(tensor.placements)} is not supported for sharded publishing "
                "(supported: Shard(0) as FSDP2 lays parameters out, Replicate)"
            )
    return window


def _slice(name: str, tensor: torch.Tensor, window: Rows) -> torch.Tensor:
    if not _is_dtensor(tensor):
        return tensor.detach()[window[0] : window[1]]
    local = _local(tensor)
    if tuple(local.shape) != (window[1] - window[0], *tensor.shape[1:]):
        raise ValueError(
            f"{name}: local shard is {tuple(local.shape)}, expected rows {window} of {tuple(tensor.shape)} "
            "(uneven sharding other than torch.chunk's is not supported)"
        )
    return local


class ShardedPublisher(PublisherView):
    """A :class:`~deltasync.publish.publisher.Publisher` for one rank of a sharded or data-parallel trainer.

    Every rank constructs one, with the same arguments, after
    ``torch.distributed.init_process_group``; then every rank calls ``publish``
    after each optimizer step and ``close`` at the end. Rank 0 owns the manifest;
    every rank uploads its own shard of each version. It drives the same
    :class:`~deltasync.publish.engine.VersionWriter` and
    :class:`~deltasync.publish.engine.Background` as the one-process publisher,
    through a collective protocol of its own.

    Args:
        model (`nn.Module` or `Mapping[str, Tensor]`): this rank's model (FSDP2 modules
            hold DTensor parameters; data-parallel ranks hold full replicas).
        store (`str` or `Store`): where to publish; every rank opens it.
        **options: as for :class:`~deltasync.publish.publisher.Publisher`.

    Example:
        ```python
        >>> fully_shard(model)                           # FSDP2, on every rank
        >>> publisher = ShardedPublisher(model, "s3://bucket/run1")
        >>> for step in range(steps):
        ...     train_step()
        ...     publisher.publish(step)                  # every rank; returns at once
        >>> publisher.close()                            # every rank
        ```
    """

    def __init__(self, model: torch.nn.Module | Mapping[str, torch.Tensor], store: str | Store, **options: Any) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedPublisher needs torch.distributed: call init_process_group on every rank first")
        publish_options, store_options = PublishOptions.split(options)
        rank, world = dist.get_rank(), dist.get_world_size()
        layout, local = shard_layout(model, rank=rank, world=world, dtype=publish_options.dtype)
        self.layout, self.world, self.rank = layout, world, rank
        self.dtype, self.chunk = publish_options.dtype, publish_options.chunk
        self._local = local
        self.writer_engine = VersionWriter.create(
            store, layout.specs, publish_options, shard=Shard(rank, layout.specs, dict(layout.rows)), **store_options
        )
        self.background = Background(self.writer_engine.stats)
        self._dist = dist
        # Two groups: the training thread's coalescing vote, and the workers' commit protocol.
        # Collectives of one group are issued by one thread only, so they never interleave.
        self._vote = dist.new_group(backend="gloo")
        self._sync = dist.new_group(backend="gloo")

    def close(self) -> None:
        """Flush, release the worker threads and the store, then this publisher's two process groups.

        A collective, like :meth:`publish`. The groups are destroyed here, while the
        interpreter is fully alive: a gloo group left to be collected at interpreter exit
        can abort the process (its C++ threads outlive the objects they serve).
        """
        if self.background.closed:
            return
        try:
            close_publisher(self.background, self.writer_engine, lambda step: self.publish(step, block=True))
        finally:
            self._local = dict  # no reference to the training model outlives close()
            groups, self._vote, self._sync = (self._vote, self._sync), None, None
            if all(g is not None for g in groups) and self._dist.is_initialized():
                self._dist.barrier(group=groups[0])  # every rank's last collective on them is done
                for group in groups:
                    self._dist.destroy_process_group(group)

    def __enter__(self) -> ShardedPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes the manifest (rank 0)."""
        return self.rank == 0

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the upload in flight; publish coalesced weights; raise background errors (a collective)."""
        self.background.flush(lambda step: self.publish(step, block=True), timeout)

    def publish(self, step: int | None = None, *, block: bool = False) -> bool:
        """Publish this rank's shard of the current weights as part of the next version.

        A collective: every rank must call it. Coalesces on every rank when any
        rank's previous upload is still running (unless ``block=True``).
        """
        if self.background.closed:
            raise RuntimeError("publisher is closed; create a new ShardedPublisher")
        background, writer = self.background, self.writer_engine
        busy = background.busy
        if busy and block:
            background.wait()
            busy = False
        vote = torch.tensor([int(busy), int(background.fatal is not None)], dtype=torch.int64)
        self._dist.all_reduce(vote, op=self._dist.ReduceOp.MAX, group=self._vote)
        if vote[1]:
            raise background.fatal or ConflictError("another rank's publisher lost the prefix; stop the run")
        if vote[0]:
            background.coalesce(step)
            return False
        started = time.perf_counter()
        local = self._local()
        if writer.commits.resync:
            writer.snapshot, writer.commits.resync = None, False
        if writer.snapshot is None:
            snapshot = Snapshot.capture(local, dtype=self.dtype)
            t_diff = time.perf_counter() - started
            background.submit(lambda coalesced: self._version(None, snapshot, step, started, t_diff, coalesced))
        else:
            changes = diff(writer.snapshot, local, chunk=self.chunk)
            t_diff = time.perf_counter() - started
            background.submit(lambda coalesced: self._version(changes, None, step, started, t_diff, coalesced))
        return True

    # ------------------------------------------------------------------ worker (every rank)

    def _broadcast(self, value: Any) -> Any:
        box = [value]
        self._dist.broadcast_object_list(box, src=0, group=self._sync)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, value, group=self._sync)
        return out

    def _version(
        self, changes: ChangeSet | None, snapshot: Snapshot | None, step: int | None, started: float, t_diff: float,
        coalesced: int,
    ) -> None:
        """One version, on every rank: name it, upload the shards, commit, settle."""
        writer = self.writer_engine
        named = self._broadcast(self._name_version(first=snapshot is not None) if self.is_writer else None)
        if named[0] != "ok":
            self._settle(named)
            return
        version = named[1]
        kind = "anchor" if snapshot is not None else "delta"
        mine = self._upload_shard(version, changes, snapshot)
        gathered = self._gather(mine)
        outcome = self._broadcast(self._commit_shards(gathered, version, step, kind) if self.is_writer else None)
        self._settle(outcome)
        if snapshot is not None:
            writer.snapshot = snapshot
            writer.anchored(version)
        elif changes is not None and outcome[0] == "committed":
            writer.snapshot.advance(changes)  # type: ignore[union-attr]
        self._account(mine, outcome, gathered, version, step, kind, t_diff, started, coalesced)
        if outcome[0] == "committed" and outcome[2]:
            self._anchor(version, step)

    def _name_version(self, *, first: bool) -> tuple[Any, ...]:
        """Rank 0: take the prefix (on the first version) and pick the version number."""
        writer = self.writer_engine
        try:
            if first or writer.manifest is None:
                writer.open()
            return ("ok", writer.next_version())
        except (ConflictError, FingerprintMismatch) as exc:
            return ("fatal", type(exc).__name__, str(exc))
        except Exception as exc:  # a store error: this version fails on every rank, the next retries
            return ("error", f"{type(exc).__name__}: {exc}", False)

    def _upload_shard(self, version: int, changes: ChangeSet | None, snapshot: Snapshot | None) -> tuple[Any, ...]:
        """This rank's part of the version, uploaded; what rank 0 needs to commit it."""
        writer = self.writer_engine
        try:
            t0 = time.perf_counter()
            if snapshot is not None:
                refs, t_encode = writer.upload_anchor(snapshot, version)
                nnz = sum(s.numel for s in snapshot.specs)
            elif changes is not None and changes.nnz:
                ref, t_encode = writer.upload_delta(changes, version)
                refs, nnz = (ref,), changes.nnz
            else:
                refs, nnz, t_encode = (), 0, 0.0
            upload = time.perf_counter() - t0 - t_encode
            return ("ok", [r.to_json() for r in refs], nnz, t_encode, upload)
        except Exception as exc:
            return ("error", f"rank {self.rank}: {type(exc).__name__}: {exc}")

    def _commit_shards(
        self, gathered: list[tuple[Any, ...]], version: int, step: int | None, kind: str
    ) -> tuple[Any, ...]:
        """Rank 0: write the version's manifest entry if every rank's shard is in the store."""
        writer = self.writer_engine
        refs, failed = self._collect(gathered)
        if failed is not None:
            return failed
        if not refs:
            return ("empty",)
        nnz = sum(g[2] for g in gathered)
        entry = VersionEntry(version, step=step, time=time.time(), nnz=nnz, **{kind: refs})  # type: ignore[arg-type]
        try:
            writer.commits.commit_version(entry)  # the shards stay if it fails: gc sweeps them
        except ConflictError as exc:
            return ("fatal", type(exc).__name__, str(exc))
        except Exception as exc:
            return ("error", f"manifest: {type(exc).__name__}: {exc}", writer.commits.resync)
        if kind == "delta":
            writer.since_anchor += sum(r.size for r in refs)
        return ("committed", version, kind == "delta" and writer.anchor_due(version))

    def _collect(self, gathered: list[tuple[Any, ...]]) -> tuple[tuple[ObjectRef, ...], tuple[Any, ...] | None]:
        """Rank 0: every rank's uploaded objects, and the error outcome if any rank failed (its
        partners' objects are then deleted: that version will not be committed)."""
        refs = tuple(ObjectRef.from_json(r) for g in gathered if g[0] == "ok" for r in g[1])
        errors = [g[1] for g in gathered if g[0] != "ok"]
        if not errors:
            return refs, None
        self.writer_engine.commits.discard(refs)
        return refs, ("error", "; ".join(errors), False)

    def _settle(self, outcome: tuple[Any, ...]) -> None:
        """Every rank: take a failed outcome to heart the same way."""
        if outcome[0] == "fatal":
            error = ConflictError if outcome[1] == "ConflictError" else FingerprintMismatch
            self.background.fatal = error(outcome[2])
            raise self.background.fatal
        if outcome[0] == "error":
            if outcome[2]:
                self.writer_engine.commits.resync = True  # rank 0 could not tell whether its manifest write landed
            raise StoreError(f"sharded version not committed: {outcome[1]}")

    def _account(
        self, mine: tuple[Any, ...], outcome: tuple[Any, ...], gathered: list[tuple[Any, ...]],
        version: int, step: int | None, kind: str, t_diff: float, started: float, coalesced: int,
    ) -> None:
        """Stats on every rank (its own bytes); the version's report, with totals, on rank 0."""
        if outcome[0] != "committed":
            return
        own = sum(r["size"] for r in mine[1])
        if not self.is_writer:
            self.stats.published += 1
            self.stats.bytes += own
            return
        refs = tuple(ObjectRef.from_json(r) for g in gathered for r in g[1])
        t_encode = max(g[3] for g in gathered)
        t_upload = max(g[4] for g in gathered)
        nnz = sum(g[2] for g in gathered)
        self.writer_engine.report(
            version, step, kind, nnz, refs, t_diff, t_encode, t_upload, started, coalesced=coalesced
        )

    def _anchor(self, version: int, step: int | None) -> None:
        """Every rank: add an anchor to a committed version (rank 0 decided it is due)."""
        writer = self.writer_engine
        assert writer.snapshot is not None
        t0 = time.perf_counter()
        mine = self._upload_shard(version, None, writer.snapshot)
        gathered = self._gather(mine)
        outcome: tuple[Any, ...] = ("ok",)
        if self.is_writer:
            refs, failed = self._collect(gathered)
            if failed is not None:
                outcome = failed
            else:
                try:
                    writer.commits.attach_anchor(version, refs)
                    numel = sum(s.numel for s in self.layout.specs)
                    t_encode = max(g[3] for g in gathered)
                    t_upload = time.perf_counter() - t0 - t_encode
                    writer.report(version, step, "anchor", numel, refs, 0.0, t_encode, t_upload, t0)
                except ConflictError as exc:
                    outcome = ("fatal", type(exc).__name__, str(exc))
                except Exception as exc:
                    outcome = ("error", f"anchor manifest: {type(exc).__name__}: {exc}", writer.commits.resync)
        outcome = self._broadcast(outcome)
        if outcome[0] == "ok":
            writer.anchored(version)
        self._settle(outcome)
