"""Exact change detection: bit patterns, chunking, ties, dense capture, snapshots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deltasync.publish.diff.snapshot as diff_module
from deltasync.errors import TensorMismatch
from deltasync.publish.diff.snapshot import Snapshot, _sparse_nonzero, diff
from deltasync.tensors import SCATTERED, bits_view, fingerprint, positions, scattered_positions, write_at
from tests.dispatch_helpers import (
    host_wait_ops,
    recorded_ops,
    recorded_shapes,
    scans_along_rows,
    without_static_nonzero,
)

BF16 = torch.bfloat16


def bf16_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int16).view(BF16)


class TestBitExactness:
    def test_negative_zero_is_a_change(self) -> None:
        weights = {"w": bf16_from_bits([0x0000, 0x0001, 0x0002, 0x0003])}
        snap = Snapshot.capture(weights)
        weights["w"].view(torch.int16)[0] = -0x8000  # -0.0 == +0.0 as floats
        changes = diff(snap, weights)
        assert changes.nnz == 1
        assert changes.changes[0].indices.tolist() == [0]

    def test_same_nan_is_not_a_change_other_payload_is(self) -> None:
        weights = {"w": bf16_from_bits([0x7FC1, 0x7FC1, 0x0000, 0x0000])}
        snap = Snapshot.capture(weights)
        assert diff(snap, weights).nnz == 0  # NaN != NaN as floats, but the bits agree
        weights["w"].view(torch.int16)[1] = 0x7FC2
        assert diff(snap, weights).changes[0].indices.tolist() == [1]

    def test_fp32_master_changes_below_bf16_resolution_are_invisible(self) -> None:
        master = {"w": torch.ones(1000)}
        snap = Snapshot.capture(master)
        master["w"] += 1e-4  # far below one bf16 ulp at 1.0 (2**-7)
        assert diff(snap, master).nnz == 0
        master["w"][10] += 0.01
        change = diff(snap, master).changes[0]
        assert change.indices.tolist() == [10]
        assert change.values.view(BF16).item() == torch.tensor(1.0101, dtype=BF16).item()

    def test_values_and_base_are_bit_patterns(self) -> None:
        weights = {"w": torch.zeros(4, 4, dtype=BF16)}
        snap = Snapshot.capture(weights)
        weights["w"][1, 2] = 3.0
        change = diff(snap, weights).changes[0]
        assert change.indices.tolist() == [6]
        assert change.values.dtype == torch.int16 and change.base.tolist() == [0]
        assert change.values.tolist() == bits_view(torch.tensor([3.0], dtype=BF16)).tolist()


class TestChunking:
    @pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 22])
    def test_chunk_size_does_not_change_the_result(self, chunk: int) -> None:
        gen = torch.Generator().manual_seed(0)
        weights = {"a": torch.randn(50, 37, generator=gen), "b": torch.randn(3, generator=gen)}
        snap = Snapshot.capture(weights)
        weights["a"].view(-1)[torch.randperm(1850, generator=gen)[:40]] += 1.0
        weights["b"][2] = -5.0
        reference = diff(snap, weights)
        got = diff(snap, weights, chunk=chunk)
        assert [c.spec for c in got.changes] == [c.spec for c in reference.changes]
        for a, b in zip(got.changes, reference.changes):
            assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)

    def test_indices_sorted_and_global(self) -> None:
        weights = {"w": torch.zeros(100)}
        snap = Snapshot.capture(weights)
        weights["w"][[3, 50, 99]] = 1.0
        assert diff(snap, weights, chunk=10).changes[0].indices.tolist() == [3, 50, 99]


PUBLISHED = {"BF16": (torch.bfloat16, torch.int16), "F16": (torch.float16, torch.int16), "F32": (torch.float32, torch.int32)}


def at_offset(tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of 1-D ``tensor`` that starts ``offset`` elements into its storage."""
    storage = torch.zeros(tensor.numel() + offset, dtype=tensor.dtype)
    view = storage[offset:]
    view.copy_(tensor)
    return view


class TestWordCompare:
    """The int64-word comparison, its element-wise fallbacks and the device path agree with numpy."""

    @pytest.mark.parametrize("path", ["cpu", "device"])
    @settings(max_examples=60, deadline=None)
    @given(
        n=st.sampled_from([1, 3, 4, 5, 17, 1000, 4099, 40_003]),
        density=st.sampled_from([0.0, 0.001, 0.01, 0.2, 1.0]),
        published=st.sampled_from(sorted(PUBLISHED)),
        master=st.booleans(),
        live_offset=st.integers(0, 3),
        snapshot_offset=st.integers(0, 3),
        chunk=st.sampled_from([3, 8, 64, 1 << 22]),
        seed=st.integers(0, 2**16),
    )
    def test_matches_elementwise_reference(
        self, path: str, n: int, density: float, published: str, master: bool,
        live_offset: int, snapshot_offset: int, chunk: int, seed: int,
    ) -> None:
        dtype, bits = PUBLISHED[published]
        gen = torch.Generator().manual_seed(seed)
        info = torch.iinfo(bits)
        old = torch.randint(info.min, info.max, (n,), dtype=bits, generator=gen)  # NaNs, -0.0, subnormals too
        new = old.clone()
        picked = torch.rand(n, generator=gen) < density
        new[picked] += torch.randint(1, 3, (int(picked.sum()),), dtype=bits, generator=gen)
        live = new.view(dtype)
        if master and published != "F32":
            # fp32 masters: the published value is the cast, finer changes stay invisible
            live = live.float() + torch.rand(n, generator=gen) * 1e-3 * live.float().abs() * (torch.rand(n, generator=gen) < 0.5)
            new = live.to(dtype).view(bits)
        snapshot = Snapshot({"w": at_offset(old.view(dtype), snapshot_offset)})
        got = diff(snapshot, {"w": at_offset(live, live_offset)}, chunk=chunk, dense_fraction=1.0,
                   on_device=path == "device")
        expected = np.flatnonzero(new.numpy() != old.numpy())
        if expected.size == 0:
            assert got.changes == ()
            return
        (change,) = got.changes
        assert change.indices.dtype == torch.int64 and change.values.dtype == bits == change.base.dtype
        np.testing.assert_array_equal(change.indices.numpy(), expected)
        np.testing.assert_array_equal(change.values.numpy(), new.numpy()[expected])
        np.testing.assert_array_equal(change.base.numpy(), old.numpy()[expected])

    def test_misaligned_storage_compared_element_by_element(self) -> None:
        raw = bytearray(2 + 2 * 4099)
        snapshot_bits = torch.frombuffer(raw, dtype=torch.int16, offset=2)  # address 2 mod 8
        assert snapshot_bits.data_ptr() % 8 and not diff_module._word_aligned(snapshot_bits)
        snap = Snapshot({"w": snapshot_bits.view(BF16)})
        live = torch.zeros(4099, dtype=BF16)
        live[[0, 5, 4098]] = 1.0
        change = diff(snap, {"w": live}).changes[0]
        assert change.indices.tolist() == [0, 5, 4098] and change.base.tolist() == [0, 0, 0]

    def test_change_only_past_the_last_word(self) -> None:
        weights = {"w": torch.zeros(7, dtype=BF16)}
        snap = Snapshot.capture(weights)
        weights["w"][6] = 1.0
        change = diff(snap, weights).changes[0]
        assert change.indices.tolist() == [6] and change.values.dtype == torch.int16

    def test_dense_capture_of_fp32_masters_is_the_cast(self) -> None:
        master = {"w": torch.randn(1001)}
        snap = Snapshot.capture(master)
        master["w"] += 1.0
        change = diff(snap, master, chunk=64).changes[0]
        assert change.dense
        assert torch.equal(change.values, bits_view(master["w"].to(BF16)))


class TestDense:
    def test_dense_capture_above_fraction(self) -> None:
        weights = {"w": torch.zeros(30)}
        snap = Snapshot.capture(weights)
        weights["w"][:20] = 1.0
        change = diff(snap, weights, chunk=4).changes[0]
        assert change.dense and change.nnz == 20 and change.values.numel() == 30
        assert change.base is None

    def test_sparse_below_fraction(self) -> None:
        weights = {"w": torch.zeros(30)}
        snap = Snapshot.capture(weights)
        weights["w"][:5] = 1.0
        assert not diff(snap, weights).changes[0].dense


class TestSnapshot:
    def test_costs_two_bytes_per_parameter(self) -> None:
        model = torch.nn.Linear(64, 32)
        snap = Snapshot.capture(model)
        assert snap.nbytes == 2 * sum(p.numel() for p in model.parameters())

    def test_advance_catches_up(self) -> None:
        model = torch.nn.Linear(16, 16)
        snap = Snapshot.capture(model)
        with torch.no_grad():
            model.weight[0] += 1.0
            model.bias.zero_()
        changes = diff(snap, model)
        assert changes.nnz > 0
        snap.advance(changes)
        assert diff(snap, model).nnz == 0

    def test_tied_parameters_published_once(self) -> None:
        emb = torch.nn.Embedding(10, 4)
        head = torch.nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        model = torch.nn.ModuleDict({"emb": emb, "head": head})
        snap = Snapshot.capture(model)
        assert [s.name for s in snap.specs] == ["emb.weight"]

    def test_tensors_are_told_apart_by_what_they_are_not_by_their_address(self, tmp_path: Path) -> None:
        """A zero-element tensor shares its address with the next one in a loaded checkpoint; both are published.
        A tied weight (same storage, offset, shape, strides) is published once; a view of another shape is not tied."""
        import safetensors.torch

        from deltasync.appliers import TorchModuleApplier
        from deltasync.tensors import published_tensors

        path = tmp_path / "w.safetensors"
        safetensors.torch.save_file(
            {"a.empty": torch.empty(0, 3, dtype=torch.bfloat16), "b": torch.ones(10, dtype=torch.bfloat16)}, path
        )
        loaded = safetensors.torch.load_file(path)
        assert loaded["a.empty"].untyped_storage().data_ptr() == loaded["b"].untyped_storage().data_ptr()
        assert [n for n, _ in published_tensors(loaded)] == ["a.empty", "b"]
        assert set(TorchModuleApplier(loaded).specs) == {"a.empty", "b"}
        w = torch.zeros(4, 4)
        names = [n for n, _ in published_tensors({"w": w, "tied": w.view(4, 4), "row": w[0], "flat": w.view(16)})]
        assert names == ["w", "row", "flat"]

    def test_other_dtypes_keep_their_width(self) -> None:
        weights = {"h": torch.zeros(8, dtype=torch.float16), "f": torch.zeros(8)}
        snap = Snapshot.capture(weights, dtype=None)
        assert [s.dtype for s in snap.specs] == ["F16", "F32"]
        weights["f"][3] = 1e-30  # below bf16 resolution near 1, exact in fp32
        change = diff(snap, weights).changes[0]
        assert change.values.dtype == torch.int32 and change.indices.tolist() == [3]

    def test_changed_layout_refused(self) -> None:
        snap = Snapshot.capture({"w": torch.zeros(4)})
        with pytest.raises(TensorMismatch, match="shape"):
            diff(snap, {"w": torch.zeros(5)})
        with pytest.raises(TensorMismatch, match="anchor"):
            diff(snap, {"v": torch.zeros(4)})

    def test_fingerprint_covers_names_shapes_dtypes(self) -> None:
        a = Snapshot.capture({"w": torch.zeros(4)}).specs
        assert fingerprint(a) == fingerprint(Snapshot.capture({"w": torch.ones(4)}).specs)
        assert fingerprint(a) != fingerprint(Snapshot.capture({"w": torch.zeros(2, 2)}).specs)
        assert fingerprint(a) != fingerprint(Snapshot.capture({"v": torch.zeros(4)}).specs)
        assert fingerprint(a) != fingerprint(Snapshot.capture({"w": torch.zeros(4)}, dtype=None).specs)


class TestDevicePath:
    """``device_diff``: the same change sets as the CPU path, with two host waits per version."""

    @staticmethod
    def model(tensors: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], Snapshot]:
        gen = torch.Generator().manual_seed(seed)
        live: dict[str, torch.Tensor] = {}
        for i in range(tensors):
            kind = i % 4
            shape = [(0, 3), (5,), (64, 33), (1000,)][kind]
            live[f"t{i}"] = torch.randn(shape, generator=gen, dtype=[torch.float32, BF16, torch.float16, BF16][kind])
        live["fp32"] = torch.randn(300, generator=gen)
        snap = Snapshot.capture(live, dtype=None)
        live["fp32"][::2] += 1.0  # dense at the default fraction
        for i, t in enumerate(live.values()):
            if t.numel() and i % 3:
                flat = t.view(-1)
                flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen)] += 0.5
        return live, snap

    @pytest.mark.parametrize("chunk", [7, 100, 1 << 22])
    def test_same_changes_as_the_cpu_path(self, chunk: int) -> None:
        live, snap = self.model(13)
        cpu, device = diff(snap, live, chunk=chunk), diff(snap, live, chunk=chunk, on_device=True)
        assert [c.spec for c in cpu.changes] == [c.spec for c in device.changes] and cpu.nnz == device.nnz > 0
        assert any(c.dense for c in device.changes) and any(not c.dense for c in device.changes)
        for a, b in zip(cpu.changes, device.changes):
            assert a.nnz == b.nnz and a.dense == b.dense and torch.equal(a.values, b.values)
            assert a.dense or (torch.equal(a.indices, b.indices) and torch.equal(a.base, b.base))
            assert torch.equal(a.whole_base, b.whole_base)
        assert diff(snap, {n: t.clone() for n, t in snap.items()}, on_device=True).changes == ()

    @pytest.mark.parametrize("tensors", [3, 300])
    def test_two_host_waits_whatever_the_tensor_count(self, tensors: int) -> None:
        """No per-tensor or per-chunk waits: no ``nonzero`` or scalar reads, and two transfers to the host."""
        from deltasync.publish.diff.device import host_waits

        live, snap = self.model(tensors)
        before = host_waits()
        with recorded_ops() as ops:
            changes = diff(snap, live, chunk=64, on_device=True)
        assert changes.nnz > 0 and host_waits() - before == 2
        assert not host_wait_ops(ops) and "aten.nonzero_static" in ops
        with recorded_shapes() as calls:  # the next version searches: every prefix sum one device-wide scan
            diff(snap, live, chunk=64, on_device=True)
        assert any(name.endswith("cumsum") for name, _ in calls) and not scans_along_rows(calls)


    def test_the_device_path_takes_larger_chunks_by_default(self) -> None:
        """Each chunk costs host calls that a GPU waits on: the device path compares DEVICE_CHUNK elements a
        step unless told otherwise (one compare per pass here, where the CPU path's chunk would take two)."""
        from deltasync.publish.diff.snapshot import DEFAULT_CHUNK, DEVICE_CHUNK

        assert DEVICE_CHUNK > DEFAULT_CHUNK
        for chunk, chunks in ((None, 1), (DEFAULT_CHUNK, 2)):
            live = {"w": torch.zeros(2 * DEFAULT_CHUNK)}
            snap = Snapshot.capture(live)
            live["w"][[3, DEFAULT_CHUNK + 5]] = 1.0
            diff(snap, live, chunk=chunk, on_device=True)  # the first diff counts; the next ones search
            with recorded_ops() as ops:
                change = diff(snap, live, chunk=chunk, on_device=True).changes[0]
            # A search compares each chunk's words, then the elements of the words that changed, all at once.
            assert ops.count("aten.ne") == chunks + 1 and change.indices.tolist() == [3, DEFAULT_CHUNK + 5]

    @staticmethod
    def assert_same(cpu: Any, device: Any) -> None:
        assert [c.spec for c in cpu.changes] == [c.spec for c in device.changes] and cpu.nnz == device.nnz
        for a, b in zip(cpu.changes, device.changes):
            assert a.nnz == b.nnz and a.dense == b.dense and torch.equal(a.values, b.values)
            assert a.dense or (torch.equal(a.indices, b.indices) and torch.equal(a.base, b.base))

    @pytest.mark.parametrize("slack", [8, 1024])
    @pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
    def test_versions_in_a_row_search_within_the_last_counts(self, monkeypatch: pytest.MonkeyPatch,
                                                             slack: int, device: str) -> None:
        """Version after version the bounded searches find what the CPU path finds: through quiet steps,
        a step that changes far more than the last (its searches overflow: one more wait), clustered
        changes (every element of a word), a tensor turning dense and back, and one going quiet."""
        from deltasync.publish.diff import device as device_diff

        monkeypatch.setattr(device_diff, "SLACK", slack)
        gen = torch.Generator().manual_seed(3)
        live = {"a": torch.randn(4096, generator=gen), "b": torch.randn(1003, generator=gen),
                "c": torch.randn(64, 32, generator=gen).to(BF16), "d": torch.randn(600, generator=gen)}
        snap = Snapshot.capture(live)
        there = Snapshot.capture({n: t.to(device) for n, t in live.items()})
        # Per version: fraction of each tensor's elements moved, and whether in whole 4-element words.
        steps = [(0.01, False), (0.01, False), (0.2, False), (0.02, True), (0.5, False), (0.01, False),
                 (0.0, False), (0.03, True)]
        waits = []
        for fraction, clustered in steps:
            for name, tensor in live.items():
                flat = tensor.view(-1)
                if name == "d" and fraction == 0.5:
                    flat += 0.25  # every element: dense
                    continue
                k = int(fraction * flat.numel())
                if clustered:  # k // 4 whole words
                    where = torch.randperm(flat.numel() // 4, generator=gen)[: k // 4] * 4
                    where = (where[:, None] + torch.arange(4)).view(-1)
                else:
                    where = torch.randperm(flat.numel(), generator=gen)[:k]
                flat[where] += 0.25
            before = device_diff.host_waits()
            found = diff(there, {n: t.to(device) for n, t in live.items()}, chunk=1000, on_device=True)
            waits.append(device_diff.host_waits() - before)
            cpu = diff(snap, live, chunk=1000)
            self.assert_same(cpu, found)
            assert any(c.dense for c in found.changes) == (fraction == 0.5)
            snap.advance(cpu)
            there.advance(cpu)
        assert diff(there, {n: t.to(device) for n, t in live.items()}, on_device=True).changes == ()
        assert waits[0] == 2  # counted first, then searched
        if slack == 1024:
            assert waits[1:3] == [2, 2]  # searched within the last counts, 20x them included
        else:
            assert waits[2] == 3  # 20x the last count overflows a tight bound: those chunks counted again

    def test_changes_cut_by_a_group_bound_are_searched_again_without_a_wait(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Whole words changing (4 elements each) can hold more changes than a group has room for, though
        every changed word was found: those chunks are searched again with their exact counts, no wait."""
        from deltasync.publish.diff import device as device_diff

        monkeypatch.setattr(device_diff, "SLACK", 8)
        monkeypatch.setattr(device_diff, "GROUP", 100)  # about a chunk per group
        gen = torch.Generator().manual_seed(5)
        live = {"w": torch.randn(16000, generator=gen)}
        snap = Snapshot.capture(live)
        flat = live["w"]
        for clustered in (False, True, False):
            if clustered:  # 30 whole words in every chunk of 4000: 120 changes where about 40 changed last time
                words = torch.cat([torch.randperm(1000, generator=gen)[:30] + 1000 * c for c in range(4)])
                flat[(words[:, None] * 4 + torch.arange(4)).view(-1)] += 0.25
            else:
                flat[torch.randperm(16000, generator=gen)[:160]] += 0.25
            before = device_diff.host_waits()
            found = diff(snap, live, chunk=4000, on_device=True)
            assert device_diff.host_waits() - before == 2
            cpu = diff(snap, live, chunk=4000)
            self.assert_same(cpu, found)
            snap.advance(cpu)

    def test_tensors_of_odd_sizes_search_their_tails_together(self) -> None:
        """A tensor whose size is not a whole number of words leaves a tail of a few elements, searched
        element by element: every tensor's tail shares one group, every tensor's words another (each group
        costs a dozen ops; a group per tensor cost 6500 ops here against 1900)."""
        gen = torch.Generator().manual_seed(9)
        live = {f"t{i}": torch.randn(40003, generator=gen) for i in range(40)}
        snap = Snapshot({name: t.to(BF16) for name, t in live.items()})  # allocated one by one
        for _ in range(2):  # the first version counts; the second searches
            for t in live.values():
                t[torch.randint(0, 40003, (400,), generator=gen)] += 0.5
            with recorded_ops() as ops:
                device = diff(snap, live, on_device=True)
            self.assert_same(diff(snap, live), device)
            snap.advance(device)
        assert ops.count("aten.cumsum") <= 12 and ops.count("aten.nonzero_static") <= 2 * 40 + 4

    @pytest.mark.parametrize("chunk", [None, 5000, 300])
    @pytest.mark.parametrize("slack", [8, 1024])
    @pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
    def test_small_tensors_are_compared_a_block_at_a_time(self, monkeypatch: pytest.MonkeyPatch,
                                                          chunk: int | None, slack: int, device: str) -> None:
        """A snapshot keeps small tensors side by side in shared blocks (each at an 8-byte boundary); the
        device path compares a run of them as one chunk (a few ops a block, not a few a tensor) and finds
        what the CPU path finds, version after version: quiet steps, a step with far more changes (bounds
        overflow), whole words changing, a tensor turning dense inside a run, odd sizes, empty tensors."""
        from deltasync.publish.diff import device as device_diff

        monkeypatch.setattr(device_diff, "SLACK", slack)
        gen = torch.Generator().manual_seed(11)
        sizes = [int(n) for n in torch.randint(0, 700, (120,), generator=gen)] + [0, 1, 3, 4096]
        live = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}
        live["bf16"] = torch.randn(333, generator=gen).to(BF16)  # published as it is: bits copied, not cast
        snap = Snapshot.capture(live)
        there = Snapshot.capture({name: t.to(device) for name, t in live.items()})
        storages = {t.untyped_storage().data_ptr() for _, t in there.items() if t.numel()}
        assert len(storages) == 1 and all(t.data_ptr() % 8 == 0 for _, t in there.items())
        steps = [(0.01, False), (0.01, False), (0.2, False), (0.02, True), (0.01, False), (0.0, False)]
        waits = []
        for number, (fraction, clustered) in enumerate(steps):
            for name, tensor in live.items():
                flat = tensor.view(-1)
                k = int(fraction * flat.numel()) + (number % 2 and flat.numel() > 0)
                if clustered and flat.numel() >= 8:
                    where = torch.randperm(flat.numel() // 4, generator=gen)[: max(k // 4, 1)] * 4
                    where = (where[:, None] + torch.arange(4)).view(-1)
                else:
                    where = torch.randperm(flat.numel(), generator=gen)[:k]
                flat[where] += 0.25
            if number == 4:
                live["t7"] += 1.0  # every element of one tensor in the middle of the run: dense
            before_chunks, before_waits = device_diff.searched_chunks(), device_diff.host_waits()
            with recorded_ops() as ops:
                found = diff(there, {name: t.to(device) for name, t in live.items()}, chunk=chunk, on_device=True)
            cpu = diff(snap, live, chunk=chunk)
            self.assert_same(cpu, found)
            assert any(c.dense and c.spec.name == "t7" for c in found.changes) == (number == 4)
            if chunk is None:  # the whole model is one run and its last few elements (2 chunks, not 125)
                assert device_diff.searched_chunks() - before_chunks == 2
                assert ops.count("aten.nonzero_static") <= 6 and ops.count("aten.ne") <= 8
            waits.append(device_diff.host_waits() - before_waits)
            snap.advance(cpu)
            there.advance(found)
        assert diff(there, {name: t.to(device) for name, t in live.items()}, on_device=True).changes == ()
        assert set(waits) <= {2, 3} and (3 in waits or slack > 8)  # a tight bound overflows: one more wait

    def test_a_snapshot_keeps_large_tensors_apart_and_small_ones_in_blocks(self) -> None:
        from deltasync.publish.diff.snapshot import DEVICE_CHUNK

        live = {"a": torch.randn(3), "b": torch.randn(5), "big": torch.zeros(DEVICE_CHUNK + 1, dtype=BF16),
                "c": torch.randn(2).to(torch.float16), "d": torch.randn(7)}
        snap = Snapshot.capture(live, dtype=None)
        storage = {name: t.untyped_storage().data_ptr() for name, t in snap.items()}
        assert storage["a"] == storage["b"] and len(set(storage.values())) == 4  # dtypes split blocks too
        assert snap["b"].storage_offset() == 4 and snap.nbytes == 4 * 15 + 2 * (DEVICE_CHUNK + 3)
        for name, tensor in live.items():
            assert snap[name].is_contiguous() and torch.equal(snap[name], tensor)

    def test_blocks_on_an_accelerator_take_tensors_up_to_the_run_size(self) -> None:
        """On a GPU, small tensors share blocks up to a chunk; one above RUN_TENSOR (compared alone, in place)
        has a block of its own and closes the one before; an 8-byte boundary for each tensor."""
        from deltasync.publish.diff.chunks import RUN_TENSOR, blocks
        from deltasync.publish.diff.snapshot import DEVICE_CHUNK

        gpu = torch.device("cuda")
        sizes = [3, 5, RUN_TENSOR + 1, 7, 9, RUN_TENSOR, DEVICE_CHUNK - RUN_TENSOR]
        placed = blocks([(n, BF16, gpu) for n in sizes], DEVICE_CHUNK)
        assert placed == [[(0, 0), (1, 4)], [(2, 0)], [(3, 0), (4, 8), (5, 20)], [(6, 0)]]
        assert blocks([(3, BF16, gpu), (3, torch.float32, gpu), (3, torch.float32, torch.device("cpu"))],
                      DEVICE_CHUNK) == [[(0, 0)], [(1, 0)], [(2, 0)]]

    def test_weights_that_cannot_be_viewed_as_words(self) -> None:
        """bf16 live weights at an odd offset (a view into a flat buffer): compared element by element."""
        flat = torch.randn(4001).to(BF16)
        live = {"w": flat[1:], "v": flat[:3]}
        snap = Snapshot.capture(live)
        for _ in range(3):
            live["w"][torch.randperm(4000)[:40]] += 1.0
            device = diff(snap, live, chunk=1 << 20, on_device=True)
            cpu = diff(snap, live)
            self.assert_same(cpu, device)
            snap.advance(cpu)

    def test_same_changes_where_the_device_has_no_static_nonzero(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A backend without ``nonzero_static`` (CUDA before torch 2.6): the scatter fallback, still two waits."""
        from deltasync.publish.diff.device import host_waits
        from deltasync.tensors import device as tensor_device

        without_static_nonzero(monkeypatch)
        live, snap = self.model(13)
        before = host_waits()
        with recorded_ops() as ops:
            device = diff(snap, live, chunk=100, on_device=True)
        assert host_waits() - before == 2 and not host_wait_ops(ops) and "aten.scatter_" in ops
        assert tensor_device._NO_STATIC_KERNEL == {"cpu"}  # tried once, then remembered
        cpu = diff(snap, live, chunk=100)
        assert [c.spec for c in cpu.changes] == [c.spec for c in device.changes] and cpu.nnz == device.nnz > 0
        for a, b in zip(cpu.changes, device.changes):
            assert torch.equal(a.values, b.values) and (a.dense or torch.equal(a.indices, b.indices))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 3000), density=st.floats(0, 1), extra=st.integers(-5, 5), seed=st.integers(0, 2**16))
def test_scattered_positions_match_nonzero_static(n: int, density: float, extra: int, seed: int) -> None:
    """The fallback gives nonzero_static's answer for any count: exact, fewer (cut), more (0-filled)."""
    mask = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < density
    count = max(0, int(mask.sum()) + extra)
    expected = torch.nonzero_static(mask, size=count, fill_value=0).view(-1)
    assert torch.equal(scattered_positions(mask, count), expected)
    assert torch.equal(positions(mask, count), expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_path_on_cuda_matches_the_cpu_path() -> None:
    live, snap = TestDevicePath.model(40)
    on_cuda = Snapshot({n: t.cuda() for n, t in snap.items()})
    cpu = diff(snap, live)
    cuda = diff(on_cuda, {n: t.cuda() for n, t in live.items()})  # taken by default off the CPU
    assert [c.spec for c in cpu.changes] == [c.spec for c in cuda.changes]
    for a, b in zip(cpu.changes, cuda.changes):
        assert a.nnz == b.nnz and torch.equal(a.values, b.values) and b.values.device.type == "cpu"
        assert a.dense or (torch.equal(a.indices, b.indices) and torch.equal(a.base, b.base))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_diff_on_cuda_device() -> None:
    weights = {"w": torch.zeros(1 << 20, device="cuda")}
    snap = Snapshot.capture(weights)
    assert snap["w"].device.type == "cuda"
    weights["w"][[1, 1 << 19]] = 2.0
    change = diff(snap, weights).changes[0]
    assert change.indices.tolist() == [1, 1 << 19] and change.indices.device.type == "cpu"


@settings(max_examples=60, deadline=None)
@given(n=st.one_of(st.integers(0, 300), st.integers(4090, 20_000)), density=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_sparse_nonzero_matches_flatnonzero(n: int, density: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, generator=gen) < density
    assert np.array_equal(_sparse_nonzero(mask.numpy()), np.flatnonzero(mask.numpy()))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    count=st.one_of(st.integers(0, 8), st.integers(0, 5000)),
    width=st.sampled_from([torch.int16, torch.int32]),
    seed=st.integers(0, 2**16),
)
def test_write_at_is_exact_on_both_sides_of_its_kernel_switch(
    n: int, count: int, width: torch.dtype, seed: int
) -> None:
    """Scattered writes take index_put_, denser ones index_copy_: both leave exactly the written bit patterns."""
    gen = torch.Generator().manual_seed(seed)
    count = min(count, n)
    info = torch.iinfo(width)
    flat = torch.randint(info.min, info.max, (n,), dtype=width, generator=gen)
    index = torch.randperm(n, generator=gen)[:count].sort().values
    values = torch.randint(info.min, info.max, (count,), dtype=width, generator=gen)
    expected = flat.numpy().copy()
    expected[index.numpy()] = values.numpy()
    write_at(flat, index, values)
    assert np.array_equal(flat.numpy(), expected)


def test_write_at_switches_kernel_by_density() -> None:
    flat = torch.zeros(SCATTERED * 100, dtype=torch.int16)
    for count, kernel in ((1, "index_put_"), (99, "index_put_"), (100, "index_copy_"), (len(flat), "index_copy_")):
        index = torch.arange(count) * (len(flat) // count)
        values = torch.arange(1, count + 1, dtype=torch.int16)
        flat.zero_()
        with recorded_ops() as ops:
            write_at(flat, index, values)
        assert f"aten.{kernel}" in ops, (count, ops)
        assert torch.equal(flat[index], values) and int(torch.count_nonzero(flat)) == count


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_write_at_on_cuda_keeps_index_copy_and_is_exact() -> None:
    flat = torch.zeros(SCATTERED * 100, dtype=torch.int16, device="cuda")
    index = torch.arange(0, len(flat), SCATTERED * 4, device="cuda")  # scattered: index_put_ on a CPU
    values = torch.arange(1, len(index) + 1, dtype=torch.int16, device="cuda")
    with recorded_ops() as ops:
        write_at(flat, index, values)
    assert "aten.index_copy_" in ops
    assert torch.equal(flat[index], values) and int(torch.count_nonzero(flat)) == len(index)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=24),
    kinds=st.lists(st.sampled_from(["f32", "bf16", "f16"]), min_size=24, max_size=24),
    chunk=st.sampled_from([3, 64, 700, 1 << 20]),
    fractions=st.lists(st.floats(0, 0.6), min_size=2, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_device_path_finds_what_the_cpu_path_finds_in_runs_of_any_layout(
    sizes: list[int], kinds: list[str], chunk: int, fractions: list[float], seed: int
) -> None:
    """Runs of small tensors of any sizes (odd ones padded to 8 bytes), published dtypes side by side or
    apart, any chunk size, several versions: the device path's indices and bits are the CPU path's."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = {"f32": torch.float32, "bf16": BF16, "f16": torch.float16}
    live = {f"t{i}": torch.randn(n, generator=gen).to(dtypes[kind]) for i, (n, kind) in enumerate(zip(sizes, kinds))}
    snap, there = Snapshot.capture(live, dtype=None), Snapshot.capture(live, dtype=None)
    for fraction in fractions:
        for tensor in live.values():
            flat = tensor.view(-1)
            flat[torch.rand(flat.numel(), generator=gen) < fraction] += 1.0
        found, cpu = diff(there, live, chunk=chunk, on_device=True), diff(snap, live, chunk=chunk)
        TestDevicePath.assert_same(cpu, found)
        snap.advance(cpu)
        there.advance(found)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_stage_moves_tensors_in_one_copy_per_dtype(device: str) -> None:
    """Many host tensors reach a device through one buffer per dtype and one copy each (a copy per tensor
    makes a GPU's host wait each time); the results come back in order, shaped and valued as given."""
    from deltasync.tensors import stage

    gen = torch.Generator().manual_seed(2)
    tensors = []
    for k in range(30):
        tensors += [torch.randint(0, 1 << 40, (k,), generator=gen), torch.randint(-9, 9, (k % 4, 3), dtype=torch.int16)]
    with recorded_ops() as ops:
        moved = stage(tensors, torch.device(device))
    # Per tensor one copy into its buffer on the host; then each of the two buffers moves in one copy.
    assert ops.count("aten._to_copy") + ops.count("aten.copy_") - len(tensors) <= 2 * 2
    assert [t.shape for t in moved] == [t.shape for t in tensors]
    assert all(t.device.type == device and torch.equal(t.cpu(), want) for t, want in zip(moved, tensors))
    assert len({t.untyped_storage().data_ptr() for t in moved if t.numel()}) == 2  # one buffer per dtype


def test_a_snapshot_advances_from_a_change_set_found_on_the_device_path() -> None:
    live = {f"w{i}": torch.randn(300 + i) for i in range(20)}
    live["dense"] = torch.randn(10)
    snap, there = Snapshot.capture(live), Snapshot.capture(live)
    for tensor in live.values():
        tensor[::7] += 0.5
    live["dense"] += 1.0
    found = diff(there, live, on_device=True)
    assert any(c.dense for c in found.changes)
    there.advance(found)
    snap.advance(diff(snap, live))
    assert all(torch.equal(there[name], snap[name]) for name in live) and diff(there, live).changes == ()


def test_phases_add_up_host_time_per_phase_across_threads_and_start_again_on_take() -> None:
    """The device paths' phase clock: each phase's time summed (a phase on another thread adds its own), a
    phase that raises still counted, ``take()`` returning the sums and starting again, each phase a named
    range in a profiler's trace."""
    import threading
    import time

    from deltasync.tensors.device import Phases

    phases = Phases("deltasync.test")
    with phases("a"):
        time.sleep(0.01)

    def other() -> None:
        with phases("b"):
            time.sleep(0.01)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    with pytest.raises(ValueError), phases("a"):
        raise ValueError
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phases("c"):
            torch.zeros(4).add_(1)
    taken = phases.take()
    assert set(taken) == {"a", "b", "c"} and taken["a"] >= 0.01 and taken["b"] >= 0.01
    assert phases.take() == {}
    assert "deltasync.test.c" in {event.name for event in prof.events()}
