"""The cycle collector is held off while versions are encoded, decoded and applied, only then, and only where
the process allows it: by default deltasync never touches it."""

from __future__ import annotations

import gc
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from deltasync.appliers import TorchModuleApplier
from deltasync.codec import Decoded
from deltasync.errors import DeltaFormatError
from deltasync.format import decode, encode_anchor_parts, encode_delta
from deltasync.publish.diff import Snapshot, diff
from deltasync.publish.publisher import Publisher
from deltasync.replica.subscriber import Subscriber
from deltasync.stores import MemoryStore
from deltasync.util.collector import ENV, allow_pauses, collector_paused, pauses_allowed


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    """Every test starts with the collector on and pauses allowed, and leaves both as the process had them."""
    was = gc.isenabled()
    gc.enable()
    allow_pauses(True)
    yield
    allow_pauses(None)
    (gc.enable if was else gc.disable)()


class TestOnlyWhereAllowed:
    """A library leaves its host's collector alone unless the host asks."""

    def run_a_version(self) -> None:
        masters = weights(4, 1024)
        store = MemoryStore(f"collector-{uuid.uuid4().hex}")
        replica = {n: t.to(torch.bfloat16).clone() for n, t in masters.items()}
        with Publisher(masters, store) as publisher, Subscriber(store, TorchModuleApplier(replica), ack=False) as sub:
            publisher.publish(0, block=True)
            stepped(masters)
            publisher.publish(1, block=True)
            publisher.flush()
            sub.update()
            assert sub.version == publisher.version

    def switches(self, monkeypatch: pytest.MonkeyPatch) -> list[str]:
        calls: list[str] = []
        monkeypatch.setattr(gc, "disable", lambda: calls.append("disable"))
        monkeypatch.setattr(gc, "enable", lambda: calls.append("enable"))
        return calls

    def test_by_default_the_collector_is_never_switched(self, monkeypatch: pytest.MonkeyPatch) -> None:
        allow_pauses(None)
        monkeypatch.delenv(ENV, raising=False)
        calls = self.switches(monkeypatch)
        self.run_a_version()
        assert calls == [] and not pauses_allowed()

    def test_the_environment_allows_it(self, monkeypatch: pytest.MonkeyPatch) -> None:
        allow_pauses(None)
        monkeypatch.setenv(ENV, "1")
        calls = self.switches(monkeypatch)
        self.run_a_version()
        assert pauses_allowed() and calls and calls.count("disable") == calls.count("enable")

    def test_refused_whatever_the_environment_says(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(ENV, "1")
        allow_pauses(False)
        calls = self.switches(monkeypatch)
        self.run_a_version()
        assert calls == []

    def test_the_collector_is_back_on_after_an_error(self) -> None:
        with pytest.raises(RuntimeError), collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("boom")
        assert gc.isenabled()


def weights(tensors: int = 12, size: int = 4096, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(size, generator=gen) * 0.02 for i in range(tensors)}


def stepped(masters: dict[str, torch.Tensor], density: float = 0.02) -> None:
    """Move ``density`` of every tensor's elements by one bf16 ulp."""
    gen = torch.Generator().manual_seed(1)
    for tensor in masters.values():
        where = torch.randperm(tensor.numel(), generator=gen)[: int(density * tensor.numel())]
        bits = tensor[where].to(torch.bfloat16).view(torch.int16) + 1
        tensor[where] = bits.view(torch.bfloat16).float()


def collections_inside(run: Callable[[], Any], *files: str) -> list[str]:
    """The functions of ``files`` (path endings) running when a collection started during ``run``, with the
    collector as eager as it gets (a collection at every second object made while it is on)."""
    inside: list[str] = []

    def started(phase: str, info: dict[str, int]) -> None:
        frame = sys._getframe(1)  # the code whose allocation started this collection, and its callers
        while phase == "start" and frame is not None:
            if frame.f_code.co_filename.endswith(files):
                inside.append(frame.f_code.co_name)
                return
            frame = frame.f_back

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    gc.callbacks.append(started)
    try:
        run()
    finally:
        gc.callbacks.remove(started)
        gc.set_threshold(*threshold)
    return inside


class TestCollectorPaused:
    def test_nested_holders_turn_it_back_on_when_the_last_leaves(self) -> None:
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()

    def test_a_process_that_runs_without_the_collector_keeps_it_off(self) -> None:
        gc.disable()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()

    def test_an_error_inside_still_turns_it_back_on(self) -> None:
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("boom")
        assert gc.isenabled()

    def test_overlapping_threads_leave_it_on_after_the_last(self) -> None:
        inside, leave = threading.Barrier(4), threading.Event()
        seen: list[bool] = []

        def hold() -> None:
            with collector_paused():
                inside.wait()
                leave.wait()
                seen.append(gc.isenabled())

        threads = [threading.Thread(target=hold) for _ in range(3)]
        for t in threads:
            t.start()
        inside.wait()  # all three hold it
        assert not gc.isenabled()
        leave.set()
        for t in threads:
            t.join()
        assert seen == [False, False, False] and gc.isenabled()


class TestWhereItHolds:
    def test_decode_runs_without_the_collector_and_makes_no_cycles(self) -> None:
        masters = weights()
        replica = {n: t.to(torch.bfloat16) for n, t in masters.items()}
        snapshot = Snapshot.capture(masters)
        stepped(masters)
        data = encode_delta(diff(snapshot, masters), version=1, base_version=0)
        during: list[bool] = []
        held = {n: t.view(torch.int16).numpy() for n, t in replica.items()}

        def base(name: str, indices: np.ndarray) -> np.ndarray:  # a plain lookup: called per tensor
            during.append(gc.isenabled())
            return held[name][indices]

        decode(data, base=base)
        gc.collect()
        header, patches = decode(data, base=base)
        assert gc.collect() == 0  # what the decode made, reference counting freed
        assert header.layout is None  # parsed here, its layout died inside the pause
        assert during and not any(during) and gc.isenabled()
        applier = TorchModuleApplier(replica)
        applier.apply(patches)
        for name, tensor in masters.items():
            assert torch.equal(replica[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name

    def test_encoding_makes_no_cycles_and_leaves_the_collector_on(self) -> None:
        masters = weights()
        snapshot = Snapshot.capture(masters)
        stepped(masters)
        changes = diff(snapshot, masters)
        encode_delta(changes, version=1, base_version=0)
        encode_anchor_parts(masters, version=0)
        gc.collect()
        encode_delta(changes, version=1, base_version=0)
        encode_anchor_parts(masters, version=0)
        assert gc.collect() == 0 and gc.isenabled()

    def test_a_refused_file_leaves_the_collector_on(self) -> None:
        with pytest.raises(DeltaFormatError):
            decode(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
        assert gc.isenabled()

    def test_a_replica_applies_without_the_collector(self) -> None:
        masters = weights(tensors=4)
        replica = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in masters.items()}
        during: list[bool] = []

        class Recording(TorchModuleApplier):
            def apply(self, decoded: Mapping[str, Decoded]) -> Any:
                during.append(gc.isenabled())
                return super().apply(decoded)

        store = MemoryStore("gc")
        with Publisher(masters, store, anchor_every=10) as publisher:
            publisher.publish(0, block=True)
            stepped(masters)
            publisher.publish(1, block=True)
        subscriber = Subscriber(store, Recording(replica))
        assert subscriber.update() is not None
        assert during and not any(during) and gc.isenabled()
        for name, tensor in masters.items():
            assert torch.equal(replica[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name

    @pytest.mark.parametrize("on_device", [False, True], ids=["host", "device-path"])
    def test_a_rank_decodes_writes_and_reads_back_without_the_collector(self, on_device: bool) -> None:
        """A vLLM rank's worker: no collection starts inside its decode (whose headers die inside the pause), its
        write or its read-back; they make no cycles and leave the rank exact."""
        from deltasync.appliers.apply import write_patches
        from deltasync.appliers.mapping import IndexMap
        from deltasync.appliers.verify import check_written
        from deltasync.appliers.vllm.rank_decode import decode_here

        masters = weights(tensors=6)
        held = {n: torch.nn.Parameter(t.to(torch.bfloat16), requires_grad=False) for n, t in masters.items()}
        index = IndexMap.whole(held)
        snapshot = Snapshot.capture(masters)
        stepped(masters)
        data = encode_delta(diff(snapshot, masters), version=1, base_version=0)
        base = {n: p.data.clone() for n, p in held.items()}

        def version() -> None:  # from the base: decoded against it, written, read back
            for name, param in held.items():
                param.data.copy_(base[name])
            patches = decode_here(index, [data], whole=False, on_device=on_device)
            write_patches(index, patches)
            checked, wrong = check_written(index, patches)
            assert checked and not wrong

        version()  # the first run compiles kernels (numba leaves a type or two in cycles then)
        gc.collect()
        inside = collections_inside(version, "deltasync/appliers/vllm/rank_decode.py", "deltasync/appliers/apply.py",
                                    "deltasync/appliers/verify.py", "deltasync/appliers/mapping.py",
                                    "deltasync/format/decode.py", "deltasync/codec/device.py")
        assert inside == []
        assert gc.collect() == 0 and gc.isenabled()  # what they made, reference counting freed
        for name, tensor in masters.items():
            assert torch.equal(held[name].data.view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name

    @pytest.mark.parametrize("on_device", [False, True], ids=["host", "device-path"])
    def test_the_trainers_diff_and_the_snapshots_advance_start_no_collection(self, on_device: bool) -> None:
        """On the training thread: a collection amid the diff would walk a trainer's whole heap now and then;
        none starts inside it (or the snapshot's advance after a publish), and both make no cycles."""
        masters = weights(tensors=24)
        snapshot = Snapshot.capture(masters)
        stepped(masters)
        diff(snapshot, masters, on_device=on_device)  # compiles what the first diff needs
        gc.collect()
        found: list[Any] = []
        inside = collections_inside(lambda: found.append(diff(snapshot, masters, on_device=on_device)),
                                    "deltasync/publish/diff/snapshot.py", "deltasync/publish/diff/device.py", "deltasync/publish/diff/chunks.py")
        assert inside == [] and len(found[0].changes) == 24
        assert collections_inside(lambda: snapshot.advance(found[0]), "deltasync/publish/diff/snapshot.py") == []
        found.clear()
        assert gc.collect() == 0 and gc.isenabled()
        for name, tensor in masters.items():
            assert torch.equal(snapshot[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name

    def test_a_replica_frees_each_files_header_before_the_collector_resumes(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A header's objects (a dozen a tensor) still alive when the pause ends would be walked by the
        collection its end starts, every version: the update frees them inside the pause."""
        from deltasync.format import Header

        masters = weights(tensors=6)
        replica = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in masters.items()}
        store = MemoryStore("gc-headers")
        with Publisher(masters, store, anchor_every=10) as publisher:
            publisher.publish(0, block=True)
            publisher.flush()
            subscriber = Subscriber(store, TorchModuleApplier(replica))
            assert subscriber.update() is not None
            stepped(masters)
            publisher.publish(1, block=True)
        alive: list[int] = []
        resume = gc.enable

        def enable() -> None:  # what the collector would find as the pause ends
            alive.append(sum(type(o) is Header for o in gc.get_objects()))
            resume()

        monkeypatch.setattr(gc, "enable", enable)
        info = subscriber.update()
        assert info is not None and info.version == 1
        assert alive == [0]


class TestNoCyclesHoldWeights:
    """A trainer's publisher or a replica's subscriber and applier, once dropped, free the weights they held by
    reference counting: a GPU replica replaced after an error must not hold a second copy of the model until
    the cycle collector happens to run (and the collector is held off during every decode)."""

    @pytest.mark.parametrize("stage", [False, True], ids=["host-path", "device-path"])
    def test_dropped_publisher_subscriber_and_applier_free_their_tensors(self, stage: bool) -> None:
        import weakref

        masters = weights(tensors=4)
        store = MemoryStore("drop")
        gc.disable()  # only reference counting frees anything below
        publisher = Publisher(masters, store, anchor_every=10)
        publisher.publish(0, block=True)
        stepped(masters)
        publisher.publish(1, block=True)
        publisher.close()
        snapshot = weakref.ref(next(iter(publisher.snapshot._tensors.values())))
        del publisher
        assert snapshot() is None
        replica = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in masters.items()}
        held = weakref.ref(replica["layers.0.weight"])
        applier = TorchModuleApplier(replica, stage=stage)
        assert (applier.on_device is applier) == stage and applier.lookup.flat is not None
        with Subscriber(store, applier) as subscriber:
            assert subscriber.update() is not None
        assert torch.equal(replica["layers.0.weight"].view(torch.int16),
                           masters["layers.0.weight"].to(torch.bfloat16).view(torch.int16))
        del subscriber, applier, replica
        assert held() is None
