"""Publisher and subscriber together: exactness, coalescing, ownership, bad input."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import safetensors.torch
import torch

from deltasync.appliers import TorchModuleApplier
from deltasync.errors import ConflictError, FingerprintMismatch, IntegrityError, StoreError, VersionError
from deltasync.format import raw_header, read_header
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest
from deltasync.publish.publisher import Publisher
from deltasync.replica.subscriber import Subscriber
from deltasync.stores import MemoryStore, Store
from deltasync.tensors import bits_view
from tests.faults import FaultyStore


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        m(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def assert_exact(trainer: torch.nn.Module, replica: torch.nn.Module) -> None:
    for (name, a), b in zip(trainer.named_parameters(), replica.parameters()):
        assert torch.equal(a.detach().to(torch.bfloat16).view(torch.int16), b.detach().view(torch.int16)), name


def replica() -> tuple[torch.nn.Module, TorchModuleApplier]:
    r = model(seed=99).to(torch.bfloat16)
    return r, TorchModuleApplier(r)


def _following(name: str) -> tuple[MemoryStore, torch.nn.Module, torch.optim.Optimizer, torch.nn.Module, Subscriber]:
    """A store, a trainer with its optimizer, and a replica with a subscriber to the store."""
    trainer = model()
    rep, applier = replica()
    store = MemoryStore(name)
    return store, trainer, torch.optim.AdamW(trainer.parameters(), lr=1e-4), rep, Subscriber(store, applier)


class TestEndToEnd:
    def test_every_backend_ends_bit_exact(self, store: Store) -> None:
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        rep, applier = replica()
        with Publisher(trainer, store, anchor_every=3, keep_anchors=1) as pub, Subscriber(store, applier, ack=True) as sub:
            for step in range(7):
                train(trainer, opt)
                pub.publish(step, block=True)
                pub.flush()
                assert sub.poll() is not None or sub.version == pub.version
                assert_exact(trainer, rep)
            assert sub.version == pub.version
        assert len(list(store.list("acks/"))) == 1

    def test_a_writer_pinned_to_format_3_is_followed_across_the_upgrade(self) -> None:
        """A fleet mid-upgrade: deltas of format 3 (plain header) while old replicas remain, then format 4."""
        store, trainer, opt, rep, sub = _following("pinned")
        for pinned in (3, 4):
            with Publisher(trainer, store, format_version=pinned, anchor_every=1000) as pub:
                for step in range(3):
                    train(trainer, opt)
                    pub.publish(step, block=True)
                    pub.flush()
                    assert sub.update() is not None
                    assert_exact(trainer, rep)
            entries = Manifest.from_bytes(store.get(MANIFEST_KEY)).versions
            deltas = [store.get(ref.key) for e in entries[-3:] for ref in e.delta]
            assert len(deltas) == 2 and {read_header(d).format_version for d in deltas} == {pinned}
            if pinned == 3:  # what readers before format 4 need: a plain table and an entry per stream
                assert all("tensors" in raw_header(d)["__metadata__"] for d in deltas)
                assert all(any(k.endswith("::idx") for k in safetensors.torch.load(d)) for d in deltas)

    @pytest.mark.parametrize("stage", [False, True], ids=["one-by-one", "staged"])
    @pytest.mark.parametrize("own_dtype", [False, True], ids=["bf16", "fp16-fp32"])
    def test_replica_layouts_end_bit_exact(self, stage: bool, own_dtype: bool) -> None:
        """Both write paths (tensor by tensor, and staged as on an accelerator) into every target layout:
        the published dtype, a wider dtype, a transposed view, 2- and 4-byte values, whole tensors
        and sparse changes."""
        torch.manual_seed(0)
        if own_dtype:  # each tensor published in its own dtype
            live = {"h": torch.randn(300).half(), "f": torch.randn(40, 9)}
            targets = {"h": torch.zeros(300, dtype=torch.float16), "f": torch.zeros(9, 40).t()}
        else:
            live = {"w": torch.randn(64, 33), "v": torch.randn(1000), "t": torch.randn(48, 20)}
            targets = {
                "w": torch.zeros(64, 33, dtype=torch.bfloat16),
                "v": torch.zeros(1000, dtype=torch.float32),  # held wider than published: cast up exactly
                "t": torch.zeros(20, 48, dtype=torch.bfloat16).t(),  # non-contiguous
            }
        dtype = None if own_dtype else torch.bfloat16
        store = MemoryStore(f"layouts-{stage}-{own_dtype}")
        applier = TorchModuleApplier({n: t for n, t in targets.items()}, dtype=dtype, stage=stage)
        if not own_dtype:  # the applier's specs come from the published dtype, whatever the target holds
            assert applier.specs["v"].dtype == "BF16"
        with Publisher(live, store, dtype=dtype, anchor_every=100) as pub, Subscriber(store, applier) as sub:
            for step in range(4):
                for tensor in live.values():
                    flat = tensor.view(-1)
                    flat[torch.randint(0, flat.numel(), (flat.numel() // (2 if step == 2 else 40) + 1,))] += 0.25
                pub.publish(step, block=True)
                pub.flush()
                sub.update()
                for name, tensor in live.items():
                    want = tensor if own_dtype else tensor.to(torch.bfloat16)
                    got = targets[name].to(want.dtype).contiguous()
                    assert torch.equal(bits_view(got), bits_view(want.contiguous())), name  # bit for bit
        assert sub.version == pub.version == 3

    @pytest.mark.parametrize("codec", ["compact", "compact-abs", "compact-exp", "exp-rice", "raw"])
    def test_a_staged_replica_rebuilds_compact_patches_on_its_device(self, codec: str) -> None:
        """The path a replica on an accelerator takes: ``compact`` and ``compact-abs`` tensors are rebuilt
        where the weights live (reading bases there, never through the host lookup) and written from
        there; other codecs decode on the host."""
        from deltasync.codec import device

        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        rep = model(seed=99).to(torch.bfloat16)
        lookups: list[int] = []

        class Counted(TorchModuleApplier):
            @property
            def lookup(self) -> Any:  # a plain lookup (no flat view) that counts its reads
                one = super().lookup
                return lambda name, idx: lookups.append(idx.size) or one(name, idx)

        applier = Counted(rep, stage=True)
        assert applier.on_device is applier and TorchModuleApplier(model()).on_device is None
        waits = device.host_waits()
        store = MemoryStore(f"on-device-{codec}")
        with Publisher(trainer, store, anchor_every=100, codec=codec) as pub, Subscriber(store, applier) as sub:
            for step in range(3):
                train(trainer, opt)
                pub.publish(step, block=True)
                pub.flush()
                sub.update()
                assert_exact(trainer, rep)
        waits = device.host_waits() - waits
        if codec in ("compact", "compact-abs"):
            assert lookups == [] and waits == 2  # v1 and v2 (v0 is an anchor): one wait per file
        else:
            assert waits == 0 and (codec not in ("compact-exp", "exp-rice") or lookups)

    def test_a_staged_replica_that_drifted_refuses_the_delta_untouched(self) -> None:
        """The device path checks every value digest before anything is written, and says which side is
        at fault."""
        trainer = model()
        store = MemoryStore("on-device-drift")
        rep = model(seed=99).to(torch.bfloat16)
        applier = TorchModuleApplier(rep, stage=True)
        with Publisher(trainer, store, anchor_every=100) as pub, Subscriber(store, applier) as sub:
            pub.publish(0, block=True)
            pub.flush()
            sub.update()
            with torch.no_grad():
                for p in trainer.parameters():
                    p.view(-1)[::7] += 0.5
                next(rep.parameters()).view(-1)[::7] += 1.0  # the replica's weights change outside deltasync
            before = [p.detach().clone() for p in rep.parameters()]
            pub.publish(1, block=True)
            pub.flush()
            with pytest.raises(IntegrityError, match="does not hold the delta's base"):
                sub.update()
            assert sub.version == 0
            assert all(torch.equal(a.view(torch.int16), b.detach().view(torch.int16))
                       for a, b in zip(before, rep.parameters()))

    def test_late_replica_starts_from_anchor(self) -> None:
        store = MemoryStore("late")
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        with Publisher(trainer, store, anchor_every=4) as pub:
            for step in range(10):
                train(trainer, opt)
                pub.publish(step, block=True)
        rep, applier = replica()
        info = Subscriber(store, applier).update()
        assert info.route[0] == "anchor" and info.version == pub.version
        assert_exact(trainer, rep)

    def test_background_follower_and_wait_for(self, tmp_path) -> None:
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        rep, applier = replica()
        seen = []
        sub = Subscriber(str(tmp_path), applier, poll_interval=0.01, max_poll_interval=0.05, on_update=seen.append)
        with Publisher(trainer, str(tmp_path)) as pub:
            sub.start()
            for step in range(5):
                train(trainer, opt)
                pub.publish(step, block=True)
            pub.flush()
            assert sub.wait_for(pub.version, timeout=20)
        sub.close()
        assert_exact(trainer, rep)
        assert seen and seen[-1].version == pub.version and seen[-1].lag_s >= 0

    def test_wait_for_without_a_follower_says_what_to_call(self, tmp_path) -> None:
        """A wait that nothing could end is refused at once, naming the call that was missing."""
        trainer = model()
        _, applier = replica()
        sub = Subscriber(str(tmp_path), applier, poll_interval=0.01, max_poll_interval=0.05)
        with Publisher(trainer, str(tmp_path)) as pub:
            pub.publish(0, block=True)
            pub.flush()
            started = time.monotonic()
            with pytest.raises(RuntimeError, match=r"call start\(\) first"):
                sub.wait_for(pub.version, timeout=30)
            assert time.monotonic() - started < 5  # not the timeout
            sub.update()
            assert sub.wait_for(pub.version, timeout=0)  # held already: no follower needed
            sub.start()
            assert sub.wait_for(pub.version, timeout=20)
            sub.stop()
            with pytest.raises(RuntimeError, match="not following"):
                sub.wait_for(pub.version + 1, timeout=30)
        sub.close()


class TestCoalescing:
    def test_slow_store_coalesces_instead_of_queuing(self) -> None:
        store = FaultyStore(MemoryStore("slow"))
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        pub = Publisher(trainer, store)
        assert pub.publish(0)
        pub.flush()
        store.gate = threading.Event()  # the store stalls
        train(trainer, opt)
        assert pub.publish(1) is True
        started = []
        for step in range(2, 6):
            train(trainer, opt)
            started.append(pub.publish(step))  # returns at once
        assert started == [False, False, False, False]
        store.gate.set()
        pub.close()  # publishes the coalesced newest weights
        versions = Manifest.from_bytes(store.get(MANIFEST_KEY)).versions
        assert versions[-1].version == 2 and versions[-1].step == 5  # 4 publishes became one version
        rep, applier = replica()
        Subscriber(store, applier).update()
        assert_exact(trainer, rep)

    def test_failed_upload_is_covered_by_next_delta(self) -> None:
        store = FaultyStore(MemoryStore("flaky"))
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        pub = Publisher(trainer, store)
        pub.publish(0, block=True)
        pub.flush()
        store.fail_puts["deltas/"] = 1
        train(trainer, opt)
        pub.publish(1, block=True)
        with pytest.raises(StoreError, match="injected"):
            pub.flush()  # reported, training goes on
        assert pub.stats.failed == 1
        train(trainer, opt)
        pub.publish(2, block=True)
        pub.close()
        assert Manifest.from_bytes(store.get(MANIFEST_KEY)).latest == 1  # no gap, no partial version
        rep, applier = replica()
        Subscriber(store, applier).update()
        assert_exact(trainer, rep)

    def test_manifest_never_names_missing_objects(self) -> None:
        store = FaultyStore(MemoryStore("partial"))
        trainer = model()
        pub = Publisher(trainer, store)
        store.fail_puts["anchors/"] = 1
        pub.publish(0)
        with pytest.raises(StoreError):
            pub.flush()
        # The publisher claimed the prefix (an empty manifest) but committed nothing: no version names anything.
        assert not store.exists(MANIFEST_KEY) or Manifest.from_bytes(store.get(MANIFEST_KEY)).versions == ()


class TestOwnership:
    def test_second_trainer_refused(self, store: Store) -> None:
        first = Publisher(model(), store)
        first.publish(0, block=True)
        first.flush()
        second = Publisher(model(), store)
        with pytest.raises(ConflictError, match="another trainer"):
            second.publish(0)
        first.close()

    def test_takeover_continues_the_chain(self) -> None:
        store = MemoryStore("takeover")
        first = Publisher(model(), store)
        first.publish(0, block=True)
        first.close()
        trainer = model(seed=5)
        with Publisher(trainer, store, takeover=True) as second:
            second.publish(0, block=True)
        m = Manifest.from_bytes(store.get(MANIFEST_KEY))
        assert m.latest == 1 and m.entry(1).anchor  # a fresh anchor continues the numbering
        rep, applier = replica()
        Subscriber(store, applier).update()
        assert_exact(trainer, rep)

    def test_lost_ownership_stops_the_publisher(self) -> None:
        store = MemoryStore("lost")
        trainer = model()
        first = Publisher(trainer, store)
        first.publish(0, block=True)
        first.flush()
        second = Publisher(model(), store, takeover=True)
        second.publish(0)
        second.flush()
        train(trainer, torch.optim.AdamW(trainer.parameters(), lr=1e-3))
        first.publish(1, block=True)
        first.background.wait()
        with pytest.raises(ConflictError):
            first.publish(2)

    def test_other_model_refused(self) -> None:
        store = MemoryStore("othermodel")
        with Publisher(model(), store) as pub:
            pub.publish(0)
        with pytest.raises(FingerprintMismatch, match="new prefix"):
            Publisher(torch.nn.Linear(3, 3), store, takeover=True).publish(0)


class TestReplicaRefusals:
    def _published(self, name: str) -> tuple[MemoryStore, torch.nn.Module]:
        store = MemoryStore(name)
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        with Publisher(trainer, store, anchor_every=1000, anchor_ratio=100.0) as pub:
            pub.publish(0, block=True)
            pub.flush()
            train(trainer, opt)
            pub.publish(1, block=True)
        return store, trainer

    def test_corrupt_delta_keeps_old_weights(self) -> None:
        store, trainer = self._published("corrupt")
        faulty = FaultyStore(store)
        faulty.corrupt["deltas/"] = lambda data: data[:-10] + bytes(10)
        rep, applier = replica()
        sub = Subscriber(faulty, applier)
        with pytest.raises(IntegrityError):
            sub.update()  # the anchor applied (v0), the delta was refused
        assert sub.version == 0
        before = [p.clone() for p in rep.parameters()]
        assert sub.poll() is None and sub.stats.rejected["IntegrityError"] == 1
        assert all(torch.equal(a, b) for a, b in zip(before, rep.parameters()))

    def test_wrong_model_refused_before_any_download(self) -> None:
        store, _ = self._published("wrongmodel")
        other = torch.nn.Linear(4, 4).to(torch.bfloat16)
        before = other.weight.clone()
        sub = Subscriber(store, TorchModuleApplier(other))
        with pytest.raises(FingerprintMismatch):
            sub.update()
        assert torch.equal(before, other.weight)


class TestLifecycle:
    def test_close_releases_the_lease(self) -> None:
        store = MemoryStore("release")
        with Publisher(model(), store) as first:
            first.publish(0)
        trainer = model(seed=3)
        with Publisher(trainer, store) as second:  # no takeover needed
            second.publish(0)
        assert Manifest.from_bytes(store.get(MANIFEST_KEY)).latest == 1

    def test_publisher_survives_an_operators_manifest_edit(self) -> None:
        store = MemoryStore("gc-edit")
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        pub = Publisher(trainer, store)
        pub.publish(0, block=True)
        pub.flush()
        # An operator rewrites the manifest (same writer, e.g. gc dropping retired keys).
        data, info = store.get_if_changed(MANIFEST_KEY, None)
        store.put(MANIFEST_KEY, data, if_match=info.etag)
        train(trainer, opt)
        pub.publish(1, block=True)
        pub.close()
        assert pub.stats.failed == 0 and pub.version == 1

    def test_replica_ahead_of_the_store_is_refused(self) -> None:
        store = MemoryStore("ahead")
        with Publisher(model(), store) as pub:
            pub.publish(0)
        run_id = Manifest.from_bytes(store.get(MANIFEST_KEY)).run_id
        _, applier = replica()
        sub = Subscriber(store, applier, start_version=7, run_id=run_id)
        with pytest.raises(VersionError, match="rolled back"):
            sub.update()

    def test_failed_apply_forces_an_anchor(self) -> None:
        store, trainer, opt, rep, sub = _following("apply-fails")
        applier = sub.applier
        with Publisher(trainer, store, anchor_every=1000, anchor_ratio=100.0) as pub:
            pub.publish(0, block=True)
            pub.flush()
            sub.update()
            train(trainer, opt)
            pub.publish(1, block=True)
        original = applier.apply

        def broken(decoded) -> None:
            original(dict(list(decoded.items())[:1]))  # writes part, then fails
            raise MemoryError("device out of memory")

        applier.apply = broken
        with pytest.raises(MemoryError):
            sub.update()
        assert sub.version is None  # partly written: the next route must be an anchor
        applier.apply = original
        assert sub.update().route[0] == "anchor"
        assert_exact(trainer, rep)


class TestUserCallbacks:
    def test_raising_hooks_do_not_break_sync(self) -> None:
        store = MemoryStore("hooks")
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)

        def boom(info) -> None:
            raise RuntimeError("user bug")

        rep, applier = replica()
        sub = Subscriber(store, applier, on_update=boom, poll_interval=0.01, max_poll_interval=0.05).start()
        with Publisher(trainer, store, on_publish=boom, anchor_every=1) as pub:
            for step in range(3):
                train(trainer, opt)
                pub.publish(step, block=True)
        assert pub.stats.failed == 0
        assert sub.wait_for(pub.version, timeout=20)
        sub.close()
        assert len(Manifest.from_bytes(store.get(MANIFEST_KEY)).anchors()) >= 2
        assert_exact(trainer, rep)


def test_the_manifest_does_not_grow_with_the_publish_rate() -> None:
    """Retention retires objects every few versions; with a 300 s grace they pile up in retired.json, not in
    the manifest every replica re-reads."""
    from deltasync.protocol.retired import read_retired

    store = MemoryStore("manifest-size")
    trainer = model()
    sizes = []
    with Publisher(trainer, store, anchor_every=5, keep_anchors=1) as publisher:
        for step in range(80):
            with torch.no_grad():
                next(trainer.parameters()).view(-1)[step % 7] += 0.01 * (step + 1)
            publisher.publish(step, block=True)
            publisher.flush()
            sizes.append(len(store.get(MANIFEST_KEY)))
    assert Manifest.from_bytes(store.get(MANIFEST_KEY)).retired == ()
    assert max(sizes[40:]) <= 1.05 * max(sizes[10:40])  # bounded by the live versions
    assert len(read_retired(store).entries) > 40  # what waits out its grace is listed beside it
    replica = model(seed=1)
    Subscriber(store, TorchModuleApplier(replica)).update()
    assert all(torch.equal(a.to(torch.bfloat16), b.to(torch.bfloat16))
               for a, b in zip(trainer.parameters(), replica.parameters()))


def test_waiting_on_a_run_of_another_model_raises_the_mismatch_at_once() -> None:
    import time as _time

    store = MemoryStore("other-model")
    with Publisher(model(), store) as publisher:
        publisher.publish(0, block=True)
    replica = Subscriber(store, TorchModuleApplier(torch.nn.Linear(5, 2)), poll_interval=0.05).start()
    try:
        started = _time.monotonic()
        with pytest.raises(FingerprintMismatch, match="another model"):
            replica.wait_for(0, timeout=60)
        assert _time.monotonic() - started < 30
        assert "FingerprintMismatch" in replica.stats.last_error
    finally:
        replica.close()


def test_a_replica_on_the_device_path_waits_once_per_update_whatever_the_tensor_count() -> None:
    """A whole ``Subscriber.update`` (fetch, checks, decode, apply) as a replica on an accelerator runs it,
    on CPU tensors: one host wait for the file, no scalar reads or ``nonzero`` anywhere, and bit-exact."""
    from deltasync.codec import device as device_decode
    from tests.dispatch_helpers import host_wait_ops, recorded_ops

    gen = torch.Generator().manual_seed(0)
    masters = {f"layers.{i}.weight": torch.randn(20_000, generator=gen) * 0.02 for i in range(40)}
    store = MemoryStore("one-wait")
    held = {n: torch.zeros(20_000, dtype=torch.bfloat16) for n in masters}
    with Publisher(masters, store) as pub, Subscriber(store, TorchModuleApplier(held, stage=True)) as sub:
        pub.publish(0, block=True)
        pub.flush()
        sub.update()
        for tensor in masters.values():
            tensor[torch.randperm(20_000, generator=gen)[:200]] += 0.01
        pub.publish(1, block=True)
        pub.flush()
        before = device_decode.host_waits()
        with recorded_ops() as ops:
            sub.update()
        assert sub.version == 1 and device_decode.host_waits() - before == 1
        assert not host_wait_ops(ops) and ops.count("aten.index_put_") >= len(masters)
    for name, tensor in masters.items():
        assert torch.equal(held[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_replica_is_written_through_the_staged_path_bit_exactly() -> None:
    trainer = model()
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    rep = model(seed=99).to(torch.bfloat16).cuda()
    store = MemoryStore("cuda-replica")
    with Publisher(trainer, store, anchor_every=3) as pub, Subscriber(store, TorchModuleApplier(rep)) as sub:
        for step in range(5):
            train(trainer, opt)
            pub.publish(step, block=True)
            pub.flush()
            sub.update()
            for (name, a), b in zip(trainer.named_parameters(), rep.parameters()):
                assert b.device.type == "cuda"
                assert torch.equal(a.detach().to(torch.bfloat16).view(torch.int16), b.detach().cpu().view(torch.int16)), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_trainer_stepping_on_its_own_cuda_stream_publishes_exactly() -> None:
    """The snapshot is captured and diffed on the trainer's stream and advanced on the publisher's thread:
    the hand-offs wait for the device (``device_diff.settle``), so no anchor or delta reads it half-written."""
    trainer = model().cuda()
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    rep, applier = replica()
    store = MemoryStore("side-stream")
    side = torch.cuda.Stream()
    with Publisher(trainer, store, anchor_every=4) as pub, Subscriber(store, applier) as sub:
        for step in range(9):
            with torch.cuda.stream(side):
                for _ in range(20):  # keep the stream busy, so a missing wait would show
                    trainer(torch.randn(4096, 64, device="cuda")).square().mean().backward()
                opt.step()
                opt.zero_grad()
                pub.publish(step, block=True)
            pub.flush()
            sub.update()
            for (name, a), b in zip(trainer.named_parameters(), rep.parameters()):
                assert torch.equal(a.detach().to(torch.bfloat16).cpu().view(torch.int16), b.detach().view(torch.int16)), name



class TestStreams:
    """A version given as a stream of ``(name, tensor)`` pairs, as a gathering trainer hands its weights over."""

    @staticmethod
    def stream(m: torch.nn.Module, held: list[Any] | None = None) -> Any:
        """Fresh fp32 copies of ``m``'s weights, one at a time (as a gather makes them); ``held`` records each."""
        import weakref

        for name, p in m.named_parameters():
            tensor = p.detach().clone()
            if held is not None:
                held.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    def test_a_stream_publishes_what_the_model_would(self, tmp_path) -> None:
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        rep, applier = replica()
        with Publisher(None, str(tmp_path)) as pub, Subscriber(str(tmp_path), applier, ack=False) as sub:
            for step in range(4):
                if step:
                    train(trainer, opt)
                assert pub.publish(step, tensors=self.stream(trainer))
                pub.flush()
                sub.update()
                assert sub.version == pub.version == step
                assert_exact(trainer, rep)
            assert pub.publish(4, tensors=self.stream(trainer)) is False  # nothing changed: no version

    def test_each_tensor_is_let_go_before_the_next_arrives(self, tmp_path) -> None:
        """Memory stays the snapshot plus the tensor in hand: no tensor of the stream outlives the next one's
        arrival, whether it is captured (the first version) or diffed (the others)."""
        import gc

        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        with Publisher(None, str(tmp_path)) as pub:
            for step in range(3):
                if step:
                    train(trainer, opt)
                held: list[Any] = []

                def watched(source: Any = self.stream(trainer, held)) -> Any:
                    for k, item in enumerate(source):
                        gc.collect()
                        alive = [i for i, ref in enumerate(held[:-1]) if ref() is not None]
                        assert not alive, f"tensors {alive} still held when tensor {k} arrives"
                        yield item

                pub.publish(step, tensors=watched())
                pub.flush()
                assert pub.version == step

    def test_a_stream_that_differs_from_the_model_is_refused(self, tmp_path) -> None:
        from deltasync.errors import ConfigError, TensorMismatch

        trainer = model()
        with Publisher(None, str(tmp_path)) as pub:
            with pytest.raises(ConfigError, match=r"publish\(tensors=\.\.\.\)"):
                pub.publish(0)
            pub.publish(0, tensors=self.stream(trainer))
            pub.flush()
            items = list(self.stream(trainer))
            with pytest.raises(TensorMismatch, match="left out"):
                pub.publish(1, tensors=items[:-1])
            with pytest.raises(TensorMismatch, match="twice"):
                pub.publish(1, tensors=[*items, items[0]])
            with pytest.raises(TensorMismatch, match="not in the published model"):
                pub.publish(1, tensors=[*items, ("extra.weight", torch.zeros(2))])
            assert pub.version == 0
